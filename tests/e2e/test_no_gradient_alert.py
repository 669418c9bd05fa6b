"""Runs that train on nothing say so: one `no_gradient` alert (console and alerts.jsonl) when
every step of a short run on an untrained model had nothing to train on, none when steps train."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from reinforge.config import build_config
from reinforge.jobs.train import run

# An untrained model never answers right: every group's rewards are all 0.
SHORT = ["sft.enabled=false", "train.steps=4", "alerts.no_gradient_steps=2", "eval.num_prompts=2", "eval.num_samples=2"]


def _run(micro_overrides: list[str], tmp_path: Path, *extra: str) -> tuple[list[dict], list[dict]]:
    out = tmp_path / "run"
    run(build_config([*micro_overrides, *SHORT, *extra, f"output_dir={out}"]))
    alerts = [json.loads(line) for line in (out / "alerts.jsonl").read_text().splitlines()]
    steps = [
        r for line in (out / "metrics.jsonl").read_text().splitlines() if (r := json.loads(line)).get("stage") == "rl"
    ]
    return alerts, steps


@pytest.mark.parametrize(("recipe", "count", "what"), [
    ("olmo3", "curation/prompts_kept", "curation dropped every sampled group (filter zero_variance: each group's "
                                       "samples had identical rewards, so zero advantage; mean reward 0)"),
    ("dpo", "dpo/pairs", "no prompt gave a preference pair (each prompt's train.group_size samples were all "
                         "correct or all wrong; mean reward 0)"),
])
def test_a_run_that_trains_on_nothing_gets_one_alert(micro_overrides, tmp_path, capsys, recipe, count, what) -> None:
    alerts, steps = _run(micro_overrides, tmp_path, f"recipe={recipe}")
    assert [s[count] for s in steps] == [0.0] * 4                      # nothing to train on, every step
    assert [s["policy_version"] for s in steps] == [0] * 4              # so no update was ever taken
    assert [(a["step"], a["alert"]) for a in alerts] == [(2, "no_gradient")]
    assert alerts[0]["message"].startswith(f"step 2: 2 steps in a row took no update: {what} (training on nothing: ")
    assert capsys.readouterr().err.count("steps in a row took no update") == 1   # and once on the console (stderr)


def test_a_run_with_gradient_gets_none(micro_overrides, tmp_path) -> None:
    # The same filter with a reward that differs within groups (a digit somewhere in the completion or not).
    alerts, steps = _run(micro_overrides, tmp_path, "recipe=olmo3",
                         "reward.functions=[{name: format, params: {pattern: '[0-9]'}}]")
    assert all(s["curation/prompts_kept"] > 0 for s in steps) and steps[-1]["policy_version"] > 0
    assert alerts == []
