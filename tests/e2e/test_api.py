"""reinforge.train: the CLI's config path and run, from Python; the docs' example runs."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from conftest import MICRO
from repo_paths import REPO
from typer.testing import CliRunner

import reinforge
from reinforge.api import dataset_path, reward_name, train_overrides
from reinforge.cli import app
from reinforge.config import build_config
from reinforge.errors import ConfigError
from reinforge.rewards.compose import RewardComposer, resolve_reward_function
from reinforge.rewards.user import register
from reinforge.tasks.arithmetic import ArithmeticTask

DOC = REPO / "docs" / "python-api.md"


def module_reward(completion: str) -> float:
    """A reward with an import path (this test module)."""
    return float(len(completion))


def test_the_docs_example_runs_and_uses_the_notebook_reward(tmp_path) -> None:
    (code,) = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.DOTALL)
    # The example as written, with a tiny model and step count and the run in tmp_path.
    tiny = ", ".join(
        f'"{k}": {v!r}' for k, v in (m.split("=", 1) for m in MICRO) if k not in ("sft.steps", "train.steps")
    )
    edits = {
        'output_dir="runs/python-api"': f'output_dir="{tmp_path / "run"}"',
        '"sft.steps": 200, "train.steps": 20}': f'"sft.steps": 3, "train.steps": 2, "log.samples_every": 1, {tiny}}}',
    }
    for old, new in edits.items():
        assert code.count(old) == 1, old
        code = code.replace(old, new)
    namespace: dict = {"__name__": "__main__"}       # as in a notebook: brevity has no import path
    exec(compile(code, str(DOC), "exec"), namespace)  # noqa: S102
    result = namespace["result"]
    run_dir = tmp_path / "run"
    assert (
        result.run_dir == run_dir
        and result.model_dir == run_dir / "model"
        and (run_dir / "model" / "config.json").is_file()
    )
    summary = json.loads((run_dir / "summary.json").read_text())
    assert result.summary == summary and result.eval == summary["eval"] and summary["rl_steps"] == 2
    last_rl = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if '"stage": "rl"' in x][-1]
    assert result.metrics == {k: v for k, v in last_rl.items() if k != "stage"} and result.metrics["step"] == 2
    assert result.config.reward.functions[1].name == "reinforge.rewards.user:brevity"
    # The rows went to a file named by their content (in the cache that also holds the CPU kernels).
    assert result.config.task.options["path"] == dataset_path(namespace["rows"])
    # The notebook's function scored every sample: its value is -0.1 x the completion's length.
    for sample in map(json.loads, (run_dir / "samples.jsonl").read_text().splitlines()):
        assert sample["rewards"]["brevity"] == pytest.approx(-0.1 * len(sample["completion"]))
        assert sample["reward"] == pytest.approx(sample["rewards"]["verifier"] + 0.1 * sample["rewards"]["brevity"])


def test_arguments_build_the_config_the_cli_builds(tmp_path) -> None:
    overrides = train_overrides(
        "models/m",
        tmp_path / "data.jsonl",
        [module_reward, "format"],
        "dapo",
        {
            "train": {"steps": 2, "lr": 3e-4},
            "rollout.stop": ["END"],
            "task.options.verifier": "integer",
            "reward.functions": [{"name": "verifier", "weight": 2.0}],
            "seed": 7,
        },
    )
    cli = build_config(
        [
            "model=models/m",
            "recipe=dapo",
            "task.name=dataset",
            f"task.options.path={tmp_path / 'data.jsonl'}",
            "task.options.verifier=integer",
            "train.steps=2",
            "train.lr=3e-4",
            "rollout.stop=[END]",
            "reward.functions=[{name: verifier, weight: 2.0}]",
            "seed=7",
        ]
    )
    assert build_config(overrides) == cli        # the settings win over reward_funcs, as later overrides do
    # Strings stay strings, whatever YAML would make of them bare.
    odd = build_config(
        train_overrides(None, None, None, None, {"rollout.stop": ["a: b\n", "x=y", "[1]"], "output_dir": "123"})
    )
    assert odd.rollout.stop == ["a: b\n", "x=y", "[1]"] and odd.output_dir == "123"


def test_errors_raise_the_message_the_cli_prints(tmp_path) -> None:
    with pytest.raises(ConfigError) as err:
        reinforge.train(**{"train.learning_rate": 1e-4, "output_dir": str(tmp_path / "run")})
    printed = CliRunner().invoke(app, ["train", "train.learning_rate=1e-4", f"output_dir={tmp_path / 'run'}"],
                                 env={"COLUMNS": "1000"})
    assert printed.exit_code == 2 and printed.output.strip() == f"error: {err.value}"
    assert "'train.learning_rate'" in str(err.value) and not (tmp_path / "run").exists()
    with pytest.raises(TypeError, match="reward_funcs entries must be callables or strings, got int"):
        reinforge.train(reward_funcs=[3])


def test_reward_callables_resolve_through_the_composers_import_path() -> None:
    assert reward_name(module_reward) == "test_api:module_reward"       # importable: named by its path
    assert reward_name("format") == "format"

    def local(completion: str) -> float:
        return 2.0

    name = reward_name(local)
    assert name.startswith("reinforge.rewards.user:local") and reward_name(local) == name      # registered once
    assert resolve_reward_function(name, {}) is local
    other = register(lambda completion: 0.0)
    assert (
        other.startswith("reinforge.rewards.user:lambda_line") and resolve_reward_function(other, {})(completion="x")
        == 0.0
    )
    with pytest.raises(ValueError, match="no reward function 'gone' is registered in this process"):
        resolve_reward_function("reinforge.rewards.user:gone", {})


def test_lambdas_are_named_so_that_their_metrics_differ() -> None:
    # A lambda's __name__ is "<lambda>": named by the variable it is assigned to, else its place in reward_funcs.
    brevity = lambda completion: -len(completion) / 100.0     # noqa: E731  (what a notebook user writes)
    overrides = train_overrides(None, None, [brevity, lambda completion: 1.0, lambda completions, **kw: [0.0]],
                                None, {})
    names = [f["name"] for f in yaml.safe_load(overrides[0].partition("=")[2])]
    assert [n.partition(":")[2].split("_")[0] for n in names] == ["brevity", "lambda", "lambda"]
    assert names[1].endswith(":lambda_1") and names[2].endswith(":lambda_2")
    composer = RewardComposer(build_config(overrides).reward, ArithmeticTask(), 8)
    assert [t.key for t in composer.terms] == [n.partition(":")[2] for n in names]


def test_rows_and_datasets_give_one_content_named_file(tmp_path, monkeypatch) -> None:
    from datasets import Dataset

    monkeypatch.setenv("REINFORGE_CACHE", str(tmp_path))
    rows = [{"prompt": "1+2=", "answer": "3"}, {"prompt": "2+2=", "answer": "4"}]
    path = dataset_path(rows)
    assert dataset_path(Dataset.from_list(rows)) == path and Path(path).parent == tmp_path / "datasets"
    assert [json.loads(x) for x in Path(path).read_text().splitlines()] == rows
    assert dataset_path(rows[:1]) != path and dataset_path("data.jsonl") == "data.jsonl"
    with pytest.raises(TypeError, match="dataset must be a file path, a list of dicts, a datasets.Dataset"):
        dataset_path({"prompt": "1+2="})
