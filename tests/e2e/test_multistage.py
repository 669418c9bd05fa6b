"""Multi-stage pipelines: stage settings and their precedence, model chaining, resume, the shipped r1 / r1_zero."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from typer.testing import CliRunner

from reinforge.cli import app
from reinforge.errors import ConfigError
from reinforge.jobs.multistage import PipelineSpec, run_pipeline, stage_configs

runner = CliRunner()


def _write(path: Path, data: dict) -> str:
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_stage_settings_precedence_and_model_chain(tmp_path: Path) -> None:
    spec = PipelineSpec.load(
        _write(
            tmp_path / "p.yaml",
            {
                "name": "demo",
                "settings": {"seed": 5, "train.lr": 1.0e-4, "eval.num_prompts": 7},
                "stages": [
                    {"name": "a", "settings": {"train.steps": 0, "train.lr": 2.0e-4}},
                    {
                        "name": "b",
                        "settings": {
                            "recipe": "dr_grpo",
                            "sft.enabled": False,
                            "curation": {"filters": ["zero_variance"]},
                        },
                    },
                ],
            },
        )
    )
    out = tmp_path / "out"
    a, b = stage_configs(spec, ["seed=9", "train.lr=3e-4", "b:train.lr=4e-4", "b:model.path=/elsewhere"], out)
    # pipeline settings < overrides for all < stage settings < overrides for one stage < the chain
    assert (a.seed, b.seed) == (9, 9)
    assert a.train.lr == 2e-4 and b.train.lr == 4e-4
    assert a.eval.num_prompts == b.eval.num_prompts == 7
    assert (a.train.steps, b.recipe, b.sft.enabled, b.curation.filters) == (0, "dr_grpo", False, ["zero_variance"])
    assert a.model.path == "builtin" and b.model.path == str(out / "1-a" / "model")
    assert (a.output_dir, b.output_dir) == (str(out / "1-a"), str(out / "2-b"))


@pytest.mark.parametrize(("data", "message"), [
    ({"stages": []}, "non-empty list of stages"),
    ({"stages": [{"name": "a"}, {"name": "a"}]}, "distinct"),
    ({"stages": [{"name": "a", "setings": {}}]}, "mapping with 'name'"),
    ({"stages": [{"name": "a"}], "extra": 1}, "unknown keys"),
    ({"stages": [{"name": "a", "settings": {"train.stepz": 1}}]}, "did you mean 'steps'"),
])
def test_bad_pipeline_files_are_config_errors(tmp_path: Path, data: dict, message: str) -> None:
    path = _write(tmp_path / "p.yaml", data)
    with pytest.raises(ConfigError, match=message):
        stage_configs(PipelineSpec.load(path), [], tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_unknown_pipeline_names_the_shipped_ones_and_unknown_stages_are_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="shipped: r1, r1_distill, r1_zero"):
        PipelineSpec.load("r2")
    with pytest.raises(
        ConfigError, match="does not have .stages: cold_start, reasoning_rl, rejection_sft, all_scenario_rl"
    ):
        stage_configs(PipelineSpec.load("r1"), ["reasoning:train.steps=1"], tmp_path / "out")


@pytest.mark.slow
def test_two_stage_pipeline_chains_models_and_skips_finished_stages(tmp_path: Path, micro_overrides) -> None:
    path = _write(
        tmp_path / "p.yaml",
        {
            "name": "two",
            "stages": [
                {"name": "sft", "settings": {"train.steps": 0}},
                # A reward for containing a "1" gives the micro model's groups reward variance (a quarter of
                # its random samples have one), so RL moves the weights.
                {
                    "name": "rl",
                    "settings": {
                        "recipe": "grpo",
                        "sft.enabled": False,
                        "train.lr": 1e-3,
                        "reward.functions": [
                            {"name": "verifier"},
                            {"name": "format", "params": {"pattern": "1", "mode": "search"}},
                        ],
                    },
                },
            ],
        },
    )
    out = tmp_path / "out"
    result = run_pipeline(path, micro_overrides, out)
    assert [s.name for s in result.stages] == ["sft", "rl"] and [s.rl_steps for s in result.stages] == [0, 3]
    # The RL stage started from the SFT stage's model: its start-of-RL evaluation is the SFT stage's final one.
    assert result.stages[1].start == result.stages[0].final
    assert json.loads((out / "pipeline.json").read_text())["stages"][1]["final"] == result.stages[1].final
    first = load_file(out / "1-sft" / "model" / "model.safetensors")
    assert any(not torch.equal(first[k], v) for k, v in load_file(out / "2-rl" / "model" / "model.safetensors").items())
    stamps = {p: p.stat().st_mtime_ns for p in out.glob("*/summary.json")}
    again = runner.invoke(app, ["pipeline", path, *micro_overrides, "--out", str(out)])
    assert again.exit_code == 0, again.output
    assert {p: p.stat().st_mtime_ns for p in out.glob("*/summary.json")} == stamps      # nothing re-ran
    assert "rl" in again.output and f"{result.stages[1].final['pass@1']:.3f}" in again.output
    changed = runner.invoke(app, ["pipeline", path, *micro_overrides, "seed=3", "--out", str(out)])
    assert changed.exit_code == 2 and "was run with other settings" in changed.output


@pytest.mark.slow
def test_r1_zero_runs_end_to_end(tmp_path: Path, micro_overrides) -> None:
    result = run_pipeline("r1_zero", micro_overrides, tmp_path / "out")
    (stage,) = result.stages
    assert stage.name == "rl" and stage.recipe == "grpo" and stage.rl_steps == 3
    summary = json.loads((tmp_path / "out" / "1-rl" / "summary.json").read_text())
    assert summary["sft"] is None                          # straight from the starting model
    lines = [json.loads(x) for x in (tmp_path / "out" / "1-rl" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if r["stage"] == "rl"] == [1, 2, 3]


@pytest.mark.slow
def test_r1_runs_its_four_stages_end_to_end(tmp_path: Path, micro_overrides) -> None:
    # One-digit sums and a longer cold start give the micro model some correct samples to keep.
    micro = [o for o in micro_overrides if not o.startswith(("train.steps=", "sft.steps="))]
    args = [*micro, "train.steps=2", "task.options.digits=1", "train.num_prompts=40",
            "cold_start:sft.steps=150", "cold_start:sft.batch_size=32", "cold_start:sft.num_examples=4800",
            "rejection_sft:sft.steps=5", "rejection_sft:sft.rejection_prompts=16"]
    result = runner.invoke(app, ["pipeline", "r1", *args, "--out", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    stages = json.loads((tmp_path / "out" / "pipeline.json").read_text())["stages"]
    assert [(s["name"], s["rl_steps"]) for s in stages] == [
        ("cold_start", 0), ("reasoning_rl", 2), ("rejection_sft", 0), ("all_scenario_rl", 2)]
    for before, after in zip(stages[:-1], stages[1:], strict=True):   # each stage starts where the previous one ended
        assert after["start"] == before["final"] or after["name"] == "rejection_sft"
    sft = json.loads((tmp_path / "out" / "3-rejection_sft" / "summary.json").read_text())["sft"]
    assert sft["source"] == "rejection" and sft["rejection/kept"] >= 1 and sft["steps"] == 5
    assert 0 < sft["rejection/acceptance_rate"] <= 1
    for stage in stages:
        assert all(0.0 <= stage["final"][k] <= 1.0 for k in ("pass@1", "greedy_accuracy"))
