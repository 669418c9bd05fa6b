"""End to end: the CLI on micro configs, the run directory, determinism, bad input."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from reinforge.cli import app
from reinforge.config import build_config
from reinforge.pipeline import run

runner = CliRunner()


def _finite(record: dict) -> bool:
    return all(v is not None and (not isinstance(v, float) or math.isfinite(v)) for v in record.values())


@pytest.mark.parametrize("recipe", ["grpo", "dr_grpo"])
def test_three_step_run_writes_a_complete_run_dir(tmp_path: Path, micro_overrides, recipe: str) -> None:
    out = tmp_path / "run"
    result = runner.invoke(app, ["train", *micro_overrides, f"recipe={recipe}", f"output_dir={out}"])
    assert result.exit_code == 0, result.output
    assert "greedy accuracy" in result.output           # the before/after table
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in lines if r["stage"] == "rl"]
    assert [r["step"] for r in rl] == [1, 2, 3]
    for key in ("reward_mean", "response_length_mean", "entropy", "clip_frac", "grad_norm", "lr", "tokens_per_s", "step_seconds"):
        assert all(key in r for r in rl), key
    assert all(_finite(r) for r in lines)
    assert ("kl" in rl[0]) == (recipe == "grpo")
    summary = json.loads((out / "summary.json").read_text())
    for stage in ("start", "final"):
        ev = summary["eval"][stage]
        assert 0.0 <= ev["pass@1"] <= 1.0 and 0.0 <= ev["greedy_accuracy"] <= 1.0
        assert list(ev["pass@k"]) == ["1", "2", "4"]
        assert ev["pass@k"]["1"] == pytest.approx(ev["pass@1"])
    assert summary["wall_seconds"] > 0
    assert yaml.safe_load((out / "config.yaml").read_text())["recipe"] == recipe
    ckpt = out / "checkpoint"
    assert {"model.safetensors", "config.json", "tokenizer.json", "optimizer.pt"} <= {p.name for p in ckpt.iterdir()}


def test_same_seed_same_numbers(tmp_path: Path, micro_overrides) -> None:
    def metrics(name: str) -> list[dict]:
        cfg = build_config([*micro_overrides, f"output_dir={tmp_path / name}"])
        result = run(cfg)
        drop = {"tokens_per_s", "step_seconds", "generation_seconds"}
        lines = [json.loads(x) for x in (Path(result.output_dir) / "metrics.jsonl").read_text().splitlines()]
        return [{k: v for k, v in line.items() if k not in drop} for line in lines] + [result.summary["eval"]]

    assert metrics("a") == metrics("b")


def test_local_model_directory_goes_through_the_same_path(tmp_path: Path, micro_overrides, tiny_model_dir: str) -> None:
    out = tmp_path / "run"
    result = runner.invoke(app, ["train", *micro_overrides, f"model={tiny_model_dir}", f"output_dir={out}"])
    assert result.exit_code == 0, result.output
    assert yaml.safe_load((out / "config.yaml").read_text())["model"]["path"] == tiny_model_dir


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("train.stepz=3", "did you mean 'steps'"),
        ("model=/does/not/exist", "does not exist"),
        ("task.name=arithmatic", "did you mean 'arithmetic'"),
    ],
)
def test_bad_input_is_a_clear_error_and_writes_nothing(tmp_path: Path, micro_overrides, override: str, message: str) -> None:
    out = tmp_path / "run"
    result = runner.invoke(app, ["train", *micro_overrides, override, f"output_dir={out}"])
    assert result.exit_code == 2
    assert message in result.output
    assert "Traceback" not in result.output
    assert not out.exists()


def test_existing_run_is_not_overwritten(tmp_path: Path, micro_overrides) -> None:
    out = tmp_path / "run"
    assert runner.invoke(app, ["train", *micro_overrides, f"output_dir={out}"]).exit_code == 0
    before = (out / "metrics.jsonl").read_text()
    result = runner.invoke(app, ["train", *micro_overrides, f"output_dir={out}"])
    assert result.exit_code == 2 and "already holds a run" in result.output
    assert (out / "metrics.jsonl").read_text() == before


@pytest.mark.parametrize(
    ("override", "message"),
    [("task.options.digits=0", "digits must be"), ("objective.aggregation=token_maen", "did you mean 'token_mean'")],
)
def test_bad_option_values_are_config_errors(tmp_path: Path, micro_overrides, override: str, message: str) -> None:
    out = tmp_path / "run"
    result = runner.invoke(app, ["train", *micro_overrides, override, f"output_dir={out}"])
    assert result.exit_code == 2 and message in result.output, result.output
    assert not out.exists()
