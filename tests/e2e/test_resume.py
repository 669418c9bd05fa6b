"""Checkpoints, exact resume and the guards.

The central claim: a run killed with SIGKILL at any moment and resumed with
`reinforge train --resume` ends with bit-identical weights and the same
metrics.jsonl and alerts.jsonl as a run that was never interrupted (wall-clock
figures aside).
"""

from __future__ import annotations

import errno
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from repo_paths import REPO
from safetensors.torch import load_file
from typer.testing import CliRunner

from reinforge.cli import app
from reinforge.config import build_config
from reinforge.errors import RunStopped
from reinforge.jobs.train import run
from reinforge.telemetry.checkpoint import CheckpointStore, CheckpointWriteError
from reinforge.telemetry.errors import os_error_message
from reinforge.telemetry.recorder import TIMING_KEYS

runner = CliRunner()

# Every kind of state a step carries: an EMA reference (T1), an EMA baseline and Gaussian noise
# in the advantage (generator), two mini-batches (shuffled by the generator), a pool of 6 prompts
# (reshuffled every 1.5 steps) with Olmo 3's active refill behind a zero-variance filter, held-out
# evaluations during RL, a checkpoint every step. A length penalty makes rewards vary even where
# the micro model never answers correctly, so that the baselines and filters have work to do.
STATEFUL = {
    "recipe": "grpo",
    "reward": {"functions": [{"name": "verifier"}, {"name": "length_penalty", "params": {"target": 2}}]},
    "curation": {"filters": ["zero_variance"], "refill": "active", "max_rounds": 2},
    "objective": {
        "reference": "ema", "reference_ema": 0.5,
        "advantage_transforms": [{"name": "ema_baseline_mix"}, {"name": "gaussian_noise", "params": {"sigma": 0.5}}],
    },
    "train": {"steps": 6, "num_prompts": 6, "mini_batches": 2, "lr": 1e-3},
    "checkpoint": {"every": 1, "keep_last": 2},
    "eval": {"every": 2, "every_prompts": 3},
    "alerts": {"window": 1, "entropy_collapse_ratio": 0.99},   # fires now and then: alerts.jsonl is compared too
}


def _lines(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [{k: v for k, v in json.loads(x).items() if k not in TIMING_KEYS} for x in path.read_text().splitlines()]


def _weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(out / "model" / "model.safetensors")


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "reinforge.cli", "train", *args]


@pytest.mark.slow
def test_sigkill_at_a_random_step_then_resume_equals_an_uninterrupted_run(tmp_path: Path, micro_overrides) -> None:
    config = tmp_path / "stateful.yaml"
    config.write_text(yaml.safe_dump(STATEFUL))
    micro_overrides = [o for o in micro_overrides if not o.startswith("train.steps=")]   # overrides beat the file
    whole = tmp_path / "whole"
    run(build_config([*micro_overrides, f"output_dir={whole}"], str(config)))

    rng = random.Random()
    # After a random step, a random moment into the next (a micro step, checkpoint included, takes ~50 ms).
    kill_after, delay = rng.randint(1, 5), rng.uniform(0.0, 0.02)
    note = f"killed after RL step {kill_after} + {delay:.2f} s"
    killed = tmp_path / "killed"
    proc = subprocess.Popen(_cli("-c", str(config), *micro_overrides, f"output_dir={killed}"), cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while sum(r.get("stage") == "rl" for r in _lines(killed / "metrics.jsonl")) < kill_after:
        assert proc.poll() is None, proc.stderr.read().decode()
        assert time.monotonic() < deadline, "the run did not reach the step"
        time.sleep(0.01)
    time.sleep(delay)
    assert proc.poll() is None, f"the run ended before the kill ({note})"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (killed / "summary.json").exists(), note

    resumed = subprocess.run(_cli("--resume", str(killed)), cwd=REPO, capture_output=True, text=True, timeout=120)
    assert resumed.returncode == 0, resumed.stderr + resumed.stdout
    summary = json.loads((killed / "summary.json").read_text())
    expected = json.loads((whole / "summary.json").read_text())
    assert summary["eval"] == expected["eval"], note
    # It continued from a checkpoint of a step at or after the one the kill followed
    # (None: killed before the first checkpoint was complete, so it started over).
    assert summary["resumed_from_step"] in ({None} if kill_after == 1 else set()) | {
        kill_after - 1,
        kill_after,
        kill_after + 1,
    }, note

    a, b = _weights(whole), _weights(killed)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), note
    assert _lines(killed / "metrics.jsonl") == _lines(whole / "metrics.jsonl"), note
    assert _lines(killed / "alerts.jsonl") == _lines(whole / "alerts.jsonl"), note
    assert len(_lines(whole / "alerts.jsonl")) > 0
    assert sorted(p.name for p in (killed / "checkpoints").iterdir()) == ["step-000005", "step-000006"]


def test_resume_of_a_finished_run_changes_nothing_but_wall_time(tmp_path: Path, micro_overrides) -> None:
    out = tmp_path / "run"
    first = run(build_config([*micro_overrides, f"output_dir={out}"]))
    before = _lines(out / "metrics.jsonl"), _weights(out)
    again = runner.invoke(app, ["train", "--resume", str(out)])
    assert again.exit_code == 0, again.output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["resumed_from_step"] == 3 and summary["eval"] == first.summary["eval"]
    assert _lines(out / "metrics.jsonl") == before[0]
    assert all(torch.equal(before[1][k], v) for k, v in _weights(out).items())


def _tensors(value: float) -> dict:
    return {"model": {"w": torch.full((3,), value)}, "rl": {"step": int(value)}}


def test_checkpoints_are_atomic_and_only_the_last_k_are_kept(tmp_path: Path, monkeypatch) -> None:
    store = CheckpointStore(tmp_path / "checkpoints", keep_last=2)
    for step in (1, 2, 3):
        store.save(step, _tensors(step), {"step": step})
    assert [c.step for c in store.all()] == [2, 3]
    assert torch.equal(store.latest().tensors()["model"]["w"], torch.full((3,), 3.0))

    # An error in the middle of writing step 4: nothing of it is left, step 3 is still the latest.
    import reinforge.telemetry.checkpoint as ckpt

    real_write = ckpt._write

    def failing_write(path, fill):
        if path.name == ckpt.META_FILE:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real_write(path, fill)

    monkeypatch.setattr(ckpt, "_write", failing_write)
    with pytest.raises(CheckpointWriteError, match="checkpoint of step 4 not written to .*No space left on device"):
        store.save(4, _tensors(4), {"step": 4})
    assert [c.step for c in store.all()] == [2, 3]
    assert sorted(p.name for p in store.root.iterdir()) == ["step-000002", "step-000003"]


_KILL_DURING_SAVE = """
import os, signal, sys, torch
import reinforge.telemetry.checkpoint as ckpt
store = ckpt.CheckpointStore(sys.argv[1], keep_last=2)
store.save(1, {"model": {"w": torch.ones(3)}}, {"step": 1})
real_write = ckpt._write
def dying_write(path, fill):
    real_write(path, fill)                       # state.pt of step 2 is complete on disk ...
    os.kill(os.getpid(), signal.SIGKILL)         # ... and the process dies before trainer_state.json
ckpt._write = dying_write
store.save(2, {"model": {"w": torch.zeros(3)}}, {"step": 2})
"""


def test_a_process_killed_while_writing_a_checkpoint_leaves_the_previous_one_loadable(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    proc = subprocess.run(
        [sys.executable, "-c", _KILL_DURING_SAVE, str(root)], cwd=REPO, capture_output=True, timeout=60
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert any(p.name.startswith(".tmp-step-000002") for p in root.iterdir())   # the half-written one
    store = CheckpointStore(root, keep_last=2)
    latest = store.latest()
    assert latest.step == 1 and latest.meta() == {"step": 1}
    assert torch.equal(latest.tensors()["model"]["w"], torch.ones(3))
    store.save(2, {"model": {"w": torch.zeros(3)}}, {"step": 2})                # the next save cleans up
    assert sorted(p.name for p in root.iterdir()) == ["step-000001", "step-000002"]


# ---------------------------------------------------------------- guards

def test_nonfinite_updates_are_skipped_and_the_run_stops_with_the_last_good_weights(
    tmp_path: Path, micro_overrides
) -> None:
    start = tmp_path / "start"        # the same run without RL: its weights are the start of RL
    run(build_config([*micro_overrides, "train.steps=0", f"output_dir={start}"]))
    out = tmp_path / "nan"
    cfg = build_config([*micro_overrides, "train.steps=10", "train.max_nonfinite_steps=3", "checkpoint.every=0",
                        "objective.policy_loss=guard_fixtures:nan_loss", f"output_dir={out}"])
    with pytest.raises(RunStopped, match="3 steps in a row had a NaN/inf loss") as stopped:
        run(cfg)
    assert "step-000003" in str(stopped.value) and f"--resume {out}" in str(stopped.value)
    rl = [r for r in _lines(out / "metrics.jsonl") if r["stage"] == "rl"]
    # micro config: 2 mini-batches per step, both skipped; no optimizer step, so the policy version stays 0.
    assert [(r["guard/skipped_steps"], r["guard/skipped_total"], r["policy_version"]) for r in rl] == [
        (2.0, 2.0, 0), (2.0, 4.0, 0), (2.0, 6.0, 0)]
    assert _lines(out / "metrics.jsonl")[-1]["stage"] == "stopped"
    from reinforge.telemetry.report import load_runs, run_table
    assert run_table(load_runs([out]))[1][0][4] == f"stopped: {_lines(out / 'metrics.jsonl')[-1]['reason']}"
    saved = CheckpointStore(out / "checkpoints", 2).latest()
    assert saved.step == 3
    state = saved.tensors()
    assert state["rl"]["optimizer"]["state"] == {}                  # Adam's moments never saw a NaN
    assert state["rl"]["scheduler"]["last_epoch"] == 0
    good = _weights(start)
    assert all(torch.equal(state["model"][k], good[k]) for k in good)


def test_cli_reports_a_stopped_run_and_refuses_to_overwrite(tmp_path: Path, micro_overrides) -> None:
    out = tmp_path / "nan"
    args = ["train", *micro_overrides, "train.max_nonfinite_steps=1", "objective.policy_loss=guard_fixtures:nan_loss",
            f"output_dir={out}"]
    result = runner.invoke(app, args)
    assert result.exit_code == 2 and "1 steps in a row" in result.output and "Traceback" not in result.output
    again = runner.invoke(app, args)
    assert again.exit_code == 2 and "already holds a run" in again.output and "--overwrite" in again.output
    replaced = runner.invoke(app, [*args[:-2], f"output_dir={out}", "--overwrite"])
    assert replaced.exit_code == 0, replaced.output
    assert (out / "summary.json").exists()
    mixed = runner.invoke(app, ["train", "--resume", str(out), "train.steps=9"])
    assert mixed.exit_code == 2 and "overrides are not allowed" not in mixed.output and "config.yaml" in mixed.output
    missing = runner.invoke(app, ["train", "--resume", str(tmp_path / "nowhere")])
    assert missing.exit_code == 2 and "holds no run" in missing.output


@pytest.mark.parametrize(("code", "words"), [
    (errno.ENOSPC, "disk is full"), (errno.EACCES, "permission denied"), (errno.EROFS, "read-only"),
])
def test_os_errors_end_with_a_clear_message(
    tmp_path: Path, micro_overrides, monkeypatch, code: int, words: str
) -> None:
    import reinforge.jobs.train

    def fail(*args, **kwargs):
        raise OSError(code, os.strerror(code), str(tmp_path / "run" / "metrics.jsonl"))

    monkeypatch.setattr(reinforge.jobs.train, "run", fail)
    result = runner.invoke(app, ["train", *micro_overrides, f"output_dir={tmp_path / 'run'}"])
    assert result.exit_code == 1 and words in result.output and "metrics.jsonl" in result.output
    assert "Traceback" not in result.output
    assert words in os_error_message(OSError(code, os.strerror(code)))
