"""Resume past damaged checkpoints, and a disk that fills up while one is written.

One uninterrupted run of the stateful config (3 steps, a checkpoint every step, the last 2 kept)
is copied, its newest checkpoint (step 3) damaged, and the copy resumed: it must fall back to
step 2, say so in one line, and end bit-identical to the uninterrupted run. When no checkpoint
is intact, or the disk is full, the run ends with one line and exit code 2, changing nothing.
"""

from __future__ import annotations

import errno
import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from conftest import MICRO
from e2e.test_resume import STATEFUL, _lines, _weights
from typer.testing import CliRunner

import reinforge.telemetry.checkpoint as ckpt
from reinforge.cli import app
from reinforge.config import build_config
from reinforge.config.load import resume_config
from reinforge.jobs.train import run
from reinforge.telemetry.checkpoint import CheckpointStore, CheckpointWriteError

runner = CliRunner()


@pytest.fixture(scope="module")
def whole(tmp_path_factory) -> Path:
    """The uninterrupted run: checkpoints step-000002 and step-000003, final model, metrics."""
    root = tmp_path_factory.mktemp("damaged")
    config = root / "stateful.yaml"
    config.write_text(yaml.safe_dump(STATEFUL))
    out = root / "whole"
    run(build_config([*MICRO, f"output_dir={out}"], str(config)))      # MICRO's train.steps=3 beats the file
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000002", "step-000003"]
    return out


def _copy(whole: Path, tmp_path: Path) -> Path:
    out = tmp_path / "copy"
    shutil.copytree(whole, out)
    return out


def _snapshot(out: Path) -> dict[str, bytes]:
    """Every file of a run directory, byte for byte."""
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def _resume(out: Path, capsys) -> tuple[dict, list[str]]:
    """Resume in this process; the summary and the lines it wrote to stderr."""
    capsys.readouterr()
    result = run(resume_config(out), resume=True)
    return result.summary, capsys.readouterr().err.splitlines()


def _assert_equals_uninterrupted(out: Path, whole: Path) -> None:
    a, b = _weights(whole), _weights(out)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert _lines(out / "metrics.jsonl") == _lines(whole / "metrics.jsonl")
    assert _lines(out / "alerts.jsonl") == _lines(whole / "alerts.jsonl")
    assert (
        json.loads((out / "summary.json").read_text())["eval"]
        == json.loads((whole / "summary.json").read_text())["eval"]
    )
    # The damaged checkpoint was replaced by a good one of the same step.
    assert [c.load().step for c in CheckpointStore(out / "checkpoints", 2).all()] == [2, 3]


def _cut(path: Path, keep: int) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:keep])


def _state_size(whole: Path) -> int:
    return (whole / "checkpoints" / "step-000003" / "state.pt").stat().st_size


# (what is done to step-000003, the reason the fallback line gives); sizes are filled in by the test.
DAMAGE = {
    "state.pt cut short": ("state.pt: {half} of {size} bytes (file cut short?)"),
    "state.pt empty": ("state.pt: empty, {size} bytes when written"),
    "trainer_state.json broken": ("trainer_state.json: checksum mismatch (changed after it was written)"),
    "manifest.json broken": ("manifest.json: not valid JSON (Expecting ',' delimiter: line 1 column 14 (char 13))"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_newest_checkpoint_is_skipped_and_the_run_ends_as_an_uninterrupted_one(
        whole: Path, tmp_path: Path, capsys, damage: str) -> None:
    out = _copy(whole, tmp_path)
    newest = out / "checkpoints" / "step-000003"
    size = _state_size(whole)
    if damage == "state.pt cut short":
        _cut(newest / "state.pt", size // 2)
    elif damage == "state.pt empty":
        _cut(newest / "state.pt", 0)
    elif damage == "trainer_state.json broken":
        text = (newest / "trainer_state.json").read_text()
        (newest / "trainer_state.json").write_text(text[:-1] + ",")       # same size, no longer JSON
    else:
        (newest / "manifest.json").write_text('{"format": 1 "step": 3}')
    summary, err = _resume(out, capsys)
    reason = DAMAGE[damage].format(half=size // 2, size=size)
    assert [line for line in err if "skipped" in line] == [
        f"resume: skipped checkpoint step-000003 ({reason}); resuming from step-000002"]
    assert summary["resumed_from_step"] == 2
    _assert_equals_uninterrupted(out, whole)


def test_checkpoints_without_a_manifest_load_when_intact_and_are_skipped_when_not(
        whole: Path, tmp_path: Path, capsys) -> None:
    """Checkpoints from before manifests: unverified, used when both files load."""
    out = _copy(whole, tmp_path)
    for manifest in (out / "checkpoints").glob("*/manifest.json"):
        manifest.unlink()
    store = CheckpointStore(out / "checkpoints", 2)
    assert store.load_for_resume(report=pytest.fail).step == 3                # intact: no line
    _cut(out / "checkpoints" / "step-000003" / "state.pt", 100)
    summary, err = _resume(out, capsys)
    skipped = [line for line in err if "skipped" in line]
    assert skipped == [
        "resume: skipped checkpoint step-000003 (state.pt: does not load (PytorchStreamReader failed "
        "reading zip archive: failed finding central directory); no manifest); resuming from step-000002"
    ]
    assert summary["resumed_from_step"] == 2
    _assert_equals_uninterrupted(out, whole)


def test_with_no_intact_checkpoint_resume_stops_with_one_line_and_changes_nothing(whole: Path, tmp_path: Path) -> None:
    out = _copy(whole, tmp_path)
    _cut(out / "checkpoints" / "step-000003" / "state.pt", 0)
    (out / "checkpoints" / "step-000002" / "manifest.json").write_text("")
    before = _snapshot(out)
    result = runner.invoke(app, ["train", "--resume", str(out)])
    assert result.exit_code == 2, result.output
    assert result.output.splitlines() == [
        f"error: --resume: no intact checkpoint in {out / 'checkpoints'}: step-000003 (state.pt: empty, "
        f"{_state_size(whole)} bytes when written), step-000002 (manifest.json: not valid JSON (Expecting value: "
        "line 1 column 1 (char 0))). Nothing was changed; restore a checkpoint from a copy, or start the run over "
        "with --overwrite"]
    assert _snapshot(out) == before          # metrics.jsonl, alerts, config, checkpoints: byte for byte


def test_two_damaged_checkpoints_are_named_in_one_line(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "checkpoints", keep_last=3)
    for step in (1, 2, 3):
        store.save(step, {"w": torch.full((2,), float(step))}, {"step": step})
    (store.root / "step-000003" / "state.pt").unlink()
    (store.root / "step-000002" / "trainer_state.json").write_text("{}")
    lines: list[str] = []
    loaded = store.load_for_resume(report=lines.append)
    assert loaded.step == 1 and loaded.meta == {"step": 1} and torch.equal(loaded.tensors["w"], torch.ones(2))
    assert lines == ["resume: skipped checkpoints step-000003 (state.pt: missing), step-000002 (trainer_state.json: "
                     "2 of 11 bytes (file cut short?)); resuming from step-000001"]
    # The resumed run's next save replaces the damaged later history, so keep_last counts good ones.
    store.save(2, {"w": torch.zeros(2)}, {"step": 2})
    assert [c.step for c in store.all()] == [1, 2]


def test_the_manifest_lists_every_file_with_its_size_and_sha256(tmp_path: Path) -> None:
    import hashlib

    store = CheckpointStore(tmp_path / "checkpoints", keep_last=1)
    path = store.save(7, {"w": torch.ones(2)}, {"step": 7}).path
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["format"] == 1 and manifest["step"] == 7
    assert manifest["files"]["trainer_state.json"] == {
        "bytes": 11, "sha256": hashlib.sha256(b'{"step": 7}').hexdigest()}
    state = (path / "state.pt").read_bytes()
    assert manifest["files"]["state.pt"] == {"bytes": len(state), "sha256": hashlib.sha256(state).hexdigest()}
    assert sorted(p.name for p in path.iterdir()) == ["manifest.json", "state.pt", "trainer_state.json"]


@pytest.mark.parametrize("failure", ["oserror", "torch"])
def test_a_full_disk_leaves_no_checkpoint_that_could_pass_for_intact(tmp_path: Path, monkeypatch, failure: str) -> None:
    store = CheckpointStore(tmp_path / "run" / "checkpoints", keep_last=2)
    store.save(1, {"w": torch.ones(2)}, {"step": 1})

    def full(obj, f):
        f.write(b"PK\x03\x04 part of a zip")        # some bytes reached the disk before it filled
        if failure == "oserror":                     # torch.save into a Python file passes the OSError on
            raise OSError(errno.ENOSPC, "No space left on device")
        # torch's own writer hides the errno (torch 2.x, torch.save to a path)
        raise RuntimeError("[enforce fail at inline_container.cc:672] . PytorchStreamWriter failed writing "
                           "file data/0: file write failed")

    monkeypatch.setattr(ckpt.torch, "save", full)
    with pytest.raises(CheckpointWriteError) as raised:
        store.save(2, {"w": torch.zeros(2)}, {"step": 2})
    what = ("No space left on device" if failure == "oserror" else
            "torch could not write state.pt ([enforce fail at inline_container.cc:672] . PytorchStreamWriter failed "
            "writing file data/0: file write failed; is the disk full?)")
    assert str(raised.value) == (
        f"checkpoint of step 2 not written to {store.root}: {what}. Free space on that disk (or move the run "
        f"directory, output_dir, to one with room), then `reinforge train --resume {tmp_path / 'run'}` continues "
        "from step-000001")
    assert sorted(p.name for p in store.root.iterdir()) == ["step-000001"]
    assert store.load_for_resume(report=pytest.fail).step == 1


def test_disk_full_during_a_run_ends_with_one_line_and_exit_2_then_resume_finishes_it(
        whole: Path, tmp_path: Path, monkeypatch) -> None:
    out = tmp_path / "full"
    real_write = ckpt._write

    def fills_at_step_3(path: Path, fill) -> None:
        if path.parent.name.startswith(".tmp-step-000003") and path.name == "state.pt":
            path.write_bytes(b"PK\x03\x04 part of a zip")
            raise OSError(errno.ENOSPC, "No space left on device")
        real_write(path, fill)

    monkeypatch.setattr(ckpt, "_write", fills_at_step_3)
    config = tmp_path / "stateful.yaml"
    config.write_text(yaml.safe_dump(STATEFUL))
    result = runner.invoke(app, ["train", "-c", str(config), *MICRO, f"output_dir={out}"])
    assert result.exit_code == 2, result.output
    # Earlier lines are the run's own (the SFT summary, alerts); the error is one line, the last.
    assert "Traceback" not in result.output and result.output.splitlines()[-1].startswith("error: checkpoint of step 3")
    assert [line for line in result.output.splitlines() if "error" in line or "checkpoint" in line] == [
        f"error: checkpoint of step 3 not written to {out / 'checkpoints'}: No space left on device. Free space on "
        f"that disk (or move the run directory, output_dir, to one with room), then `reinforge train --resume {out}` "
        "continues from step-000002"]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000001", "step-000002"]

    monkeypatch.setattr(ckpt, "_write", real_write)           # space freed
    again = runner.invoke(app, ["train", "--resume", str(out)])
    assert again.exit_code == 0, again.output
    _assert_equals_uninterrupted(out, whole)


def test_export_names_a_damaged_checkpoint_instead_of_exporting_it(whole: Path, tmp_path: Path) -> None:
    from reinforge.errors import ConfigError
    from reinforge.jobs.export import export_model

    out = _copy(whole, tmp_path)
    _cut(out / "checkpoints" / "step-000003" / "state.pt", 0)
    with pytest.raises(ConfigError) as raised:
        export_model(out, tmp_path / "exported")
    assert str(raised.value) == (f"checkpoint {out / 'checkpoints' / 'step-000003'} is damaged (state.pt: empty, "
                                 f"{_state_size(whole)} bytes when written): export another with --step")
    assert not (tmp_path / "exported").exists()
    export_model(out, tmp_path / "exported", step=2)
    assert (tmp_path / "exported" / "model.safetensors").is_file()
