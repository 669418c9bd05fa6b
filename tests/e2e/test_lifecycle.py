"""How a train run starts and ends when it does not simply run to the end, each with the one line it
prints, its exit status and what it leaves on disk: a run that could train no step, SIGINT / SIGTERM
during RL (a checkpoint of the step, then an exact resume), a start that failed (the retry in the
same output_dir works), the resume line, samples of a run shorter than log.samples_every, the
held-out share of a data file, and the report's table of settings that differ."""

from __future__ import annotations

import html
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import lifecycle_fixtures
import pytest
import torch
from conftest import MICRO
from repo_paths import REPO
from safetensors.torch import load_file
from typer.testing import CliRunner

from reinforge.cli import app
from reinforge.telemetry.recorder import TIMING_KEYS
from reinforge.telemetry.report import load_runs, run_table

runner = CliRunner()
REWARDS = "reward.functions=[{name: verifier}, {name: lifecycle_fixtures:interrupting_length}]"
# 9 RL steps of 4 prompts x 4 samples (a batch of 16), a checkpoint every 3.
# A user's data file, scored by string equality (no verifier worker process to start).
DATASET = ["sft.enabled=false", "task.name=dataset", "task.options.verifier=exact"]
NINE_STEPS = [*MICRO, "train.steps=9", "checkpoint.every=3", "checkpoint.keep_last=5", REWARDS]


def _lines(path: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(x).items() if k not in TIMING_KEYS} for x in path.read_text().splitlines()]


def _data(path: Path, rows: int) -> Path:
    path.write_text("".join(json.dumps({"prompt": f"What is {a} + 1?", "answer": str(a + 1)}) + "\n"
                            for a in range(rows)))
    return path


def _error_lines(output: str) -> list[str]:
    return [x for x in output.splitlines() if x.startswith("error:")]


# ---------------------------------------------------------------- a run that could train no step

def test_fewer_prompts_than_a_step_is_refused_before_the_model_loads(tmp_path: Path, monkeypatch) -> None:
    import reinforge.jobs.train

    def no_load(*args):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(reinforge.jobs.train, "load_policy", no_load)    # the refusal comes before any load
    out = tmp_path / "run"
    result = runner.invoke(app, ["train", *MICRO, "train.num_prompts=3", "train.prompts_per_step=8",
                                 f"output_dir={out}"])
    assert result.exit_code == 2, result.output
    assert _error_lines(result.output) == [
        "error: train.num_prompts=3 is fewer than train.prompts_per_step=8 (the distinct prompts each RL step draws): "
        "RL would train 0 steps; set train.prompts_per_step=3 or less, or raise train.num_prompts"]
    assert not out.exists()


def test_a_data_file_smaller_than_a_step_names_its_split_and_the_fix(tmp_path: Path) -> None:
    out = tmp_path / "run"
    data = _data(tmp_path / "d.jsonl", 4)      # the hash split holds 1 of the 4 rows out
    result = runner.invoke(app, ["train", *MICRO, *DATASET,
                                 f"task.options.path={data}", f"output_dir={out}"])
    assert result.exit_code == 2, result.output
    assert _error_lines(result.output) == [
        f"error: the train split of '{data}' (1 of its 4 rows held out for evaluation: task.options.eval_fraction) "
        "has 3 prompt(s), fewer than train.prompts_per_step=4 (the distinct prompts each RL step draws): RL would "
        "train 0 steps; set train.prompts_per_step=3 or less, or give it more data"]
    assert not out.exists()
    # The fix the line names works.
    fixed = runner.invoke(app, ["train", *MICRO, *DATASET, f"task.options.path={data}",
                                "train.prompts_per_step=3", f"output_dir={out}"])
    assert fixed.exit_code == 0, fixed.output
    assert json.loads((out / "summary.json").read_text())["rl_steps"] == 3


def test_a_run_that_trains_no_step_stops_instead_of_looking_finished(tmp_path: Path, monkeypatch) -> None:
    import reinforge.jobs.train

    monkeypatch.setattr(reinforge.jobs.train, "check_can_train", lambda *args: None)   # past the check at start
    out = tmp_path / "run"
    result = runner.invoke(app, ["train", *MICRO, "train.num_prompts=3", "train.prompts_per_step=8",
                                 f"output_dir={out}"])
    assert result.exit_code == 2, result.output
    reason = ("the train split has 3 prompts, fewer than train.prompts_per_step=8: set train.prompts_per_step=3 or "
              "less, or give it more prompts (train.num_prompts, data)")
    assert _error_lines(result.output) == [f"error: RL trained 0 steps: {reason}"]
    assert not (out / "summary.json").exists() and not (out / "model").exists()
    assert _lines(out / "metrics.jsonl")[-1] == {"stage": "stopped", "step": 0, "reason": reason}
    header, (row,) = run_table(load_runs([out]))
    assert row[header.index("status")] == f"stopped: {reason}"


def test_rl_that_ends_early_says_so_on_the_console_and_in_the_report(tmp_path: Path) -> None:
    # Every prompt leaves the pool after its first group (an easy reward): 8 prompts last two steps of 4.
    out = tmp_path / "run"
    result = runner.invoke(app, ["train", *MICRO, "train.num_prompts=8", "train.steps=5",
                                 "curation.retire_pass_rate=0.5",
                                 "reward.functions=[{name: format, params: {pattern: '.', mode: search}}]",
                                 f"output_dir={out}"])
    assert result.exit_code == 0, result.output
    (line,) = [x for x in result.output.splitlines() if x.startswith("RL ended")]
    assert line == ("RL ended at step 2 of 5: only 0 of the 8 train prompts are left in the pool "
                    "(curation.retire_pass_rate), fewer than train.prompts_per_step=4: raise the threshold or "
                    "train.num_prompts")
    header, (row,) = run_table(load_runs([out]))
    assert row[header.index("status")] == "done (RL ended early, at step 2)"


# ---------------------------------------------------------------- SIGINT / SIGTERM

@pytest.fixture
def interrupt_at(monkeypatch):
    def arm(spec: str) -> None:
        lifecycle_fixtures.reset()
        monkeypatch.setenv("INTERRUPT_AT", spec)
    return arm


@pytest.mark.parametrize(("name", "code"), [("SIGINT", 130), ("SIGTERM", 143)])
def test_a_signal_at_step_7_saves_step_7_and_says_how_to_resume(tmp_path: Path, interrupt_at, name, code) -> None:
    out = tmp_path / "run"
    interrupt_at(f"{name} 7 16")
    result = runner.invoke(app, ["train", *NINE_STEPS, f"output_dir={out}"])
    assert result.exit_code == code, result.output
    line = f"interrupted at step 7; saved step 7; resume with `reinforge train --resume {out}`"
    assert result.output.splitlines()[-1] == line
    assert f"{name}: finishing step 7, then saving it and stopping" in result.output
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [
        "step-000003", "step-000006", "step-000007"]
    assert not (out / "summary.json").exists() and not (out / "model").exists()
    records = _lines(out / "metrics.jsonl")
    assert [r["step"] for r in records if r["stage"] == "rl"] == list(range(1, 8))
    assert records[-1] == {"stage": "interrupted", "step": 7, "reason": line}
    header, (row,) = run_table(load_runs([out]))
    assert row[header.index("status")] == "interrupted at step 7"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler     # the handlers are put back


def test_resume_after_an_interrupt_equals_an_uninterrupted_run(tmp_path: Path, interrupt_at) -> None:
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    interrupt_at("none 0 0")
    assert runner.invoke(app, ["train", *NINE_STEPS, f"output_dir={whole}"]).exit_code == 0
    interrupt_at("SIGINT 7 16")
    assert runner.invoke(app, ["train", *NINE_STEPS, f"output_dir={cut}"]).exit_code == 130
    interrupt_at("none 0 0")
    resumed = runner.invoke(app, ["train", "--resume", str(cut)])
    assert resumed.exit_code == 0, resumed.output
    assert f"resuming from step 7 of 9 ({cut / 'checkpoints' / 'step-000007'})" in resumed.output
    summary, expected = (json.loads((d / "summary.json").read_text()) for d in (cut, whole))
    assert summary["resumed_from_step"] == 7 and summary["eval"] == expected["eval"]
    a, b = load_file(whole / "model" / "model.safetensors"), load_file(cut / "model" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert _lines(cut / "metrics.jsonl") == _lines(whole / "metrics.jsonl")     # the "interrupted" line is gone
    header, (row,) = run_table(load_runs([cut]))
    assert row[header.index("status")] == "done"


def test_a_second_signal_stops_at_once_and_names_the_last_checkpoint(tmp_path: Path, interrupt_at) -> None:
    out = tmp_path / "run"
    interrupt_at("SIGINT 8 16 2")
    result = runner.invoke(app, ["train", *NINE_STEPS, f"output_dir={out}"])
    assert result.exit_code == 130, result.output
    assert result.output.splitlines()[-1] == (
        f"interrupted in step 8 (stopped at once, the step unfinished); saved step 6; resume with "
        f"`reinforge train --resume {out}`")
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000003", "step-000006"]
    assert _lines(out / "metrics.jsonl")[-1]["stage"] == "interrupted"


def test_a_signal_before_rl_stops_at_once_with_nothing_saved(tmp_path: Path, monkeypatch) -> None:
    import reinforge.jobs.train

    def sft_then_ctrl_c(*args):
        os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(reinforge.jobs.train, "run_sft_stage", sft_then_ctrl_c)
    out = tmp_path / "run"
    result = runner.invoke(app, ["train", *MICRO, f"output_dir={out}"])
    assert result.exit_code == 130, result.output
    assert result.output.splitlines()[-1] == (
        "interrupted before RL step 1 (in SFT or the start evaluation); nothing saved (checkpoints start with RL); "
        f"resume with `reinforge train --resume {out}`")
    assert not (out / "checkpoints").exists()
    monkeypatch.undo()
    resumed = runner.invoke(app, ["train", "--resume", str(out)])      # starts the run over, in place
    assert resumed.exit_code == 0, resumed.output
    assert f"resume: no checkpoint in {out} yet (checkpoints start with RL): starting the run over" in resumed.output
    assert [r["stage"] for r in _lines(out / "metrics.jsonl")].count("interrupted") == 0


@pytest.mark.slow
def test_sigterm_to_a_real_process_exits_143_after_saving(tmp_path: Path) -> None:
    out = tmp_path / "run"
    env = {**os.environ, "INTERRUPT_AT": "SIGTERM 4 16",
           "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "reinforge.cli", "train", *NINE_STEPS, f"output_dir={out}"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 143, proc.stderr
    assert proc.stderr.splitlines()[-1] == (
        f"interrupted at step 4; saved step 4; resume with `reinforge train --resume {out}`")
    assert (out / "checkpoints" / "step-000004").is_dir()


# ---------------------------------------------------------------- a failed start, the retry

def test_a_start_that_failed_does_not_block_the_retry(tmp_path: Path) -> None:
    out = tmp_path / "run"
    traces = tmp_path / "traces.jsonl"
    traces.write_text('{"prompt": "What is 1 + 1?"}\n')      # no completion: fails when SFT reads it
    args = ["train", *MICRO, "sft.source=file", f"sft.data_path={traces}", f"output_dir={out}"]
    failed = runner.invoke(app, args)
    assert failed.exit_code == 2, failed.output
    assert (out / "config.yaml").exists() and not (out / "checkpoints").exists()
    # The retry, with the override that fixes it, in the same output_dir, without --resume or --overwrite.
    retry = runner.invoke(app, [*args[:-1], "sft.enabled=false", f"output_dir={out}"])
    assert retry.exit_code == 0, retry.output
    assert (f"output_dir '{out}' holds a run that stopped before its first RL step (nothing to resume): "
            "replacing it") in retry.output
    assert json.loads((out / "summary.json").read_text())["rl_steps"] == 3
    assert "enabled: false" in (out / "config.yaml").read_text()
    # A run that trained is never replaced that way.
    again = runner.invoke(app, args)
    assert again.exit_code == 2 and "already holds a run" in again.output


def test_a_folder_with_files_of_the_users_is_never_replaced(tmp_path: Path) -> None:
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.yaml").write_text("my: settings\n")
    (out / "notes.txt").write_text("keep me\n")
    result = runner.invoke(app, ["train", *MICRO, f"output_dir={out}"])
    assert result.exit_code == 2 and "already holds a run" in result.output
    assert (out / "notes.txt").read_text() == "keep me\n"


# ---------------------------------------------------------------- what a run says and writes

def test_a_run_shorter_than_samples_every_writes_its_last_steps_samples(tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = runner.invoke(app, ["train", *MICRO, "log.samples_every=10", f"output_dir={out}"])
    assert result.exit_code == 0, result.output
    samples = _lines(out / "samples.jsonl")
    assert [s["step"] for s in samples] == [3] * 4      # log.samples_per_step=4 rows of the last step


def test_an_automatic_split_of_a_users_file_is_said_once_with_its_key(tmp_path: Path) -> None:
    data = _data(tmp_path / "d.jsonl", 30)
    result = runner.invoke(app, ["train", *MICRO, *DATASET, f"task.options.path={data}",
                                 f"output_dir={tmp_path / 'run'}"])
    assert result.exit_code == 0, result.output
    note = [x for x in result.output.splitlines() if "held out" in x]
    assert note == [f"dataset '{data}': 6 of its 30 rows (20%) are held out for evaluation, the rest trained on "
                    "(task.options.eval_fraction=0.2, a split by a hash of each prompt; task.options.eval_path=FILE "
                    "evaluates on a file of your own instead)"]
    held = tmp_path / "held.jsonl"
    _data(held, 6)
    own = runner.invoke(app, ["train", *MICRO, *DATASET, f"task.options.path={data}",
                              f"task.options.eval_path={held}", f"output_dir={tmp_path / 'own'}"])
    assert own.exit_code == 0 and "held out" not in own.output


STOPS = [f"</step {i}>" for i in range(12)]     # a long value: 12 stop strings


def test_the_settings_that_differ_show_reward_functions_by_name_and_cut_long_values(tmp_path: Path) -> None:
    from reinforge.telemetry.report import SETTING_CHARS, _differing_settings, _html

    runs = []
    for name, extra in (("a", ["reward.functions=[{name: verifier}]"]),
                        ("b", ["reward.functions=[{name: verifier}, {name: length_penalty, weight: 0.5, "
                               "params: {target: 2}}]", f"rollout.stop={json.dumps(STOPS)}"])):
        out = tmp_path / name
        assert runner.invoke(app, ["train", *MICRO, "train.steps=1", *extra, f"output_dir={out}"]).exit_code == 0
        runs.append(out)
    header, rows = _differing_settings(load_runs(runs))
    assert header[0] == "setting" and len(header) == 3
    by_key = {row[0]: row[1:] for row in rows}
    assert by_key["reward.functions"] == ["verifier", "verifier, 0.5 × length_penalty(target=2)"]
    page = _html(load_runs(runs), [], [])      # the page without its plots
    assert "verifier, 0.5 × length_penalty(target=2)" in page and "&#x27;weight&#x27;" not in page
    long = json.dumps(STOPS)
    assert by_key["rollout.stop"] == ["[]", long] and len(long) > SETTING_CHARS
    assert f'<td title="{html.escape(long)}">{html.escape(long[: SETTING_CHARS - 1])}…</td>' in page


def test_an_interrupted_pipeline_stage_says_how_to_go_on_and_the_same_command_does(tmp_path: Path,
                                                                                  interrupt_at) -> None:
    out = tmp_path / "out"
    command = ["pipeline", "r1_zero", *MICRO, "train.steps=4", REWARDS, "--out", str(out)]
    interrupt_at("SIGINT 2 16")
    result = runner.invoke(app, command)
    assert result.exit_code == 130, result.output
    assert result.output.splitlines()[-1] == (
        f"interrupted at step 2; saved step 2 (stage {out / '1-rl'}); go on with the same command and --out {out}")
    interrupt_at("none 0 0")
    again = runner.invoke(app, command)
    assert again.exit_code == 0, again.output
    assert json.loads((out / "1-rl" / "summary.json").read_text())["resumed_from_step"] == 2
