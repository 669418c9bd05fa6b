"""Metric sinks: values and steps read back from what TensorBoard and W&B (offline) wrote."""

from __future__ import annotations

import json
import math
import struct
import time
from pathlib import Path

import numpy as np
import pytest

from reinforge.settings import LogConfig
from reinforge.telemetry.sinks import TensorBoardSink, WandbSink, build_sinks, scalars

MIXED = {"reward_mean": 0.25, "curation/rounds": 2, "eval/pass@1": np.float64(0.75), "note": "text",
         "short": True, "skipped": None, "loss": float("nan"), "grad": math.inf, "lengths": [1, 2]}


def test_scalars_keeps_finite_numbers_only() -> None:
    assert scalars(MIXED) == {"reward_mean": 0.25, "curation/rounds": 2.0, "eval/pass@1": 0.75}


# --- TensorBoard ------------------------------------------------------------

def read_tensorboard(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_scalars_read_back_with_their_steps(tmp_path) -> None:
    sink = TensorBoardSink(tmp_path / "tb")
    sink.log(1, MIXED)
    sink.log(2, {"reward_mean": 0.5, "eval/pass@1": 1.0})
    sink.close()
    # Values are float32 in the event file; these are exact in float32.
    assert read_tensorboard(tmp_path / "tb") == {
        "reward_mean": [(1, 0.25), (2, 0.5)],
        "curation/rounds": [(1, 2.0)],
        "eval/pass@1": [(1, 0.75), (2, 1.0)],
    }


def test_tensorboard_purge_step_drops_the_interrupted_runs_later_steps(tmp_path) -> None:
    sink = TensorBoardSink(tmp_path / "tb")
    for step in range(1, 6):
        sink.log(step, {"reward_mean": float(step)})
    sink.close()
    resumed = TensorBoardSink(tmp_path / "tb", purge_step=3)
    for step in (3, 4):
        resumed.log(step, {"reward_mean": 10.0 * step})
    resumed.close()
    assert read_tensorboard(tmp_path / "tb") == {"reward_mean": [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]}


def test_build_sinks_purges_after_the_checkpoint_step(tmp_path) -> None:
    cfg = LogConfig(tensorboard=True)
    (sink,) = build_sinks(cfg, tmp_path, {}, start_step=0, wandb_id=None)
    for step in range(1, 6):
        sink.log(step, {"reward_mean": float(step)})
    sink.close()
    (sink,) = build_sinks(cfg, tmp_path, {}, start_step=2, wandb_id=None)   # checkpoint after step 2
    sink.log(3, {"reward_mean": 30.0})
    sink.close()
    assert read_tensorboard(tmp_path / "tensorboard") == {"reward_mean": [(1, 1.0), (2, 2.0), (3, 30.0)]}


def test_build_sinks_makes_none_by_default(tmp_path) -> None:
    assert build_sinks(LogConfig(), tmp_path, {}, start_step=0, wandb_id=None) == []
    assert not any(tmp_path.iterdir())


# --- Weights & Biases (offline) ---------------------------------------------

@pytest.fixture
def wandb_offline(tmp_path, monkeypatch) -> None:
    """Offline W&B that reads no credentials and writes nothing outside tmp_path."""
    pytest.importorskip("wandb")
    for name in (
        "WANDB_API_KEY", "WANDB_DISABLED", "WANDB_DIR", "WANDB_RUN_ID", "WANDB_RESUME", "WANDB_PROJECT", "WANDB_ENTITY",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home" / name.lower()))


def wandb_records(run_file: Path):
    """The records of a .wandb transaction log.

    wandb 0.31 has no public reader of offline runs (the old
    wandb.sdk.internal.datastore is gone), so this follows its format: a
    7-byte header (":W&B", magic, version), then LevelDB-log blocks of 32 KiB
    whose chunks carry a 7-byte header (crc32, length, type: 1 full, 2 first,
    3 middle, 4 last) and together hold one serialised protobuf Record.
    """
    from wandb.proto import wandb_internal_pb2

    data, block = run_file.read_bytes(), 32 * 1024
    assert data[:4] == b":W&B"
    pos, payload = 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:          # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        payload += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(payload)
            payload = b""
            yield record


def wandb_history(run_file: Path) -> dict[int, dict[str, float]]:
    """step -> logged values (without wandb's own _timestamp, _runtime, _step)."""
    history = {}
    for record in wandb_records(run_file):
        if record.WhichOneof("record_type") == "history":
            items = {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in record.history.item}
            history[record.history.step.num] = {k: v for k, v in items.items() if not k.startswith("_")}
    return history


def offline_run_files(wandb_dir: Path, run_id: str, sessions: int, timeout: float = 10.0) -> list[Path]:
    """The transaction logs of a run's offline sessions, once each is complete.

    `finish()` returns before wandb-core has written the log (in about 1 of 4
    runs here the file held only its header right after), so wait for each
    session's final `exit` record. A session started in the same second as an
    earlier one of the same id gets the folder name with "-1" appended.
    """
    deadline = time.monotonic() + timeout
    while True:
        files = sorted(wandb_dir.glob(f"offline-run-*-{run_id}*/run-{run_id}.wandb"))
        kinds = [[r.WhichOneof("record_type") for r in wandb_records(f)] for f in files]
        if len(files) == sessions and all(k and k[-1] == "exit" for k in kinds):
            return files
        assert time.monotonic() < deadline, f"{sessions} complete offline sessions of {run_id} expected, found {kinds}"
        time.sleep(0.02)


def test_wandb_offline_writes_the_logged_scalars(tmp_path, wandb_offline) -> None:
    run_dir = tmp_path / "run"
    (sink,) = build_sinks(
        LogConfig(wandb=True, wandb_project="test"), run_dir, {"train": {"lr": 1e-6}}, start_step=0, wandb_id=None
    )
    run_id = sink.id
    sink.log(1, MIXED)
    sink.log(2, {"reward_mean": 0.5})
    sink.close()

    (run_file,) = offline_run_files(run_dir / "wandb", run_id, sessions=1)
    assert wandb_history(run_file) == {
        1: {"reward_mean": 0.25, "curation/rounds": 2, "eval/pass@1": 0.75},
        2: {"reward_mean": 0.5},
    }
    (run,) = [r.run for r in wandb_records(run_file) if r.WhichOneof("record_type") == "run"]
    assert (run.run_id, run.project, run.display_name) == (run_id, "test", "run")
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["train"] == {"lr": 1e-6}
    assert not (tmp_path / "no-netrc").exists()


def test_wandb_resumed_run_keeps_its_id(tmp_path, wandb_offline) -> None:
    first = WandbSink("test", tmp_path, "offline", "run", {})
    first.log(1, {"reward_mean": 0.25})
    first.close()
    resumed = WandbSink("test", tmp_path, "offline", "run", {}, resume_id=first.id)
    assert resumed.id == first.id
    resumed.log(2, {"reward_mean": 0.5})
    resumed.close()
    # Offline, each session is its own run folder with the same id; `wandb sync` joins them.
    histories = sorted((wandb_history(f) for f in offline_run_files(tmp_path / "wandb", first.id, sessions=2)), key=min)
    assert histories == [{1: {"reward_mean": 0.25}}, {2: {"reward_mean": 0.5}}]
