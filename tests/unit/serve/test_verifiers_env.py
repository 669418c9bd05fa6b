"""verifiers environments (the PyPI package, 0.4.0) trained through the endpoint unchanged
(reinforge/serve/verifiers_env.py): the rows are the taskset's tasks (or the user's data), each episode is
played by verifiers' own harness program through its interception server to the endpoint, and its reward is
the environment's own rubric. The environments are tests/vf_*_env.py, written against the installed package."""

from __future__ import annotations

import json
import math
import sys
import types
from pathlib import Path

import pytest
from repo_paths import REPO, TESTS
from scripted_engine import Scripted
from typer.testing import CliRunner

from reinforge.agents.setup import ExampleRows
from reinforge.cli import app
from reinforge.errors import ConfigError
from reinforge.models.tokenizer import build_char_tokenizer
from reinforge.rollout.base import SamplingParams, environment_returns
from reinforge.serve.agent import AgentFunctions, load_agent
from reinforge.tasks.verifiers_taskset import VerifiersTasksetTask

# `make test` installs the extras, verifiers among them, so these run in CI; they skip only where the extras are
# absent (`make test-lower`'s environment, a user's bare install), which cannot play a verifiers environment.
pytest.importorskip("verifiers.v1", reason="verifiers is an optional dependency: pip install 'reinforge[extras]'")

runner = CliRunner()


@pytest.fixture(autouse=True)
def _fixtures_importable(monkeypatch):
    monkeypatch.syspath_prepend(str(TESTS))


def repeat_some(context: str) -> str:
    """The scripted model: repeats the last word when it is 'sun' or 'cat', else writes 'no'."""
    word = context.rsplit(" ", 1)[-1]
    return word if word in ("sun", "cat") else "no"


def test_an_environment_plays_its_tasks_and_its_rubric_is_the_reward() -> None:
    task = VerifiersTasksetTask("vf-repeat-env")
    taskset_rows = ExampleRows(task)
    sun = next(e.prompt for e in task.drawn() if e.prompt == "Repeat: sun")
    dog = next(e.prompt for e in task.drawn() if e.prompt == "Repeat: dog")

    def rows(prompt: str) -> dict:       # two of the taskset's rows, and one of the user's data (its task's fields)
        return {"prompt": prompt, "word": "cat", "answer": ""} if prompt == "Say cat" else taskset_rows(prompt)

    agents = AgentFunctions(Scripted(repeat_some), load_agent("verifiers:vf-repeat-env"), rows, chat_template="never")
    rollout = agents.generate([sun, dog, "Say cat"], 1, SamplingParams(max_new_tokens=20))
    # repeated (1.0 when the reply is the word) + 0.5 x length (characters / 10): 'sun' 1 + 0.15, 'no' 0 + 0.1
    assert environment_returns(rollout).tolist() == pytest.approx([1.15, 0.1, 1.15])
    sun_episode = rollout.episodes[0]
    assert sun_episode.result.error is None and sun_episode.result.stop_reason == "done"
    assert {k: v for k, v in sun_episode.metrics.items() if k.startswith("agent/")} == pytest.approx(
        {"agent/reward/repeated": 1.0, "agent/reward/length": 0.3, "agent/metric/reply_chars": 3.0})
    # verifiers' chat program sent the task's prompt; the model's tokens are the ones trained on
    tok = build_char_tokenizer()
    assert tok.decode(list(rollout.prompt_ids[0])) == "Repeat: sun"
    assert tok.decode(rollout.completion_ids[1, : int(rollout.completion_mask[1].sum())]) == "no<eos>"
    assert rollout.episodes[0].metrics["endpoint/calls_per_episode"] == 1.0


def test_a_harness_that_runs_in_process_plays_several_turns_as_one_chain() -> None:
    agents = AgentFunctions(Scripted(lambda context: "sun" if "sun" in context else "no"),
                            load_agent("verifiers:vf-inprocess-env"),
                            lambda p: {"prompt": p, "word": p.split()[-1]}, chat_template="never")
    rollout = agents.generate(["Repeat: sun", "Repeat: dog"], 1, SamplingParams(max_new_tokens=20))
    assert environment_returns(rollout).tolist() == pytest.approx([1.15, 0.1])   # the last reply's scores
    tok = build_char_tokenizer()
    n = int(rollout.completion_mask[0].sum())
    assert tok.decode(rollout.completion_ids[0, :n]) == "sun<eos>Again.\nsun<eos>"
    # the model's two turns trained on, the harness's follow-up between them context
    assert rollout.trained_mask[0, :n].tolist() == [1.0] * 4 + [0.0] * 7 + [1.0] * 4
    assert rollout.episodes[0].result.turns == 2 and rollout.episodes[0].metrics["endpoint/untrained_calls"] == 0


def test_an_episode_whose_rubric_raises_fails_alone_with_verifiers_reason() -> None:
    agents = AgentFunctions(Scripted(lambda _: "hi"), load_agent("verifiers:vf-broken-env"),
                            lambda p: {"prompt": p, "answer": ""}, chat_template="never")
    rollout = agents.generate(["Say anything"], 1, SamplingParams(max_new_tokens=5))
    result = rollout.episodes[0].result
    assert result.stop_reason == "error" and not result.trainable and math.isnan(environment_returns(rollout)[0])
    assert result.error == ("the agent raised RuntimeError: verifiers recorded the episode as failed: TaskError: task "
                            "BrokenTask scoring: KeyError: 'answer'")


def test_the_documented_environment_loads_and_gives_its_tasks_as_rows(monkeypatch) -> None:
    docs = (REPO / "docs" / "agents.md").read_text()
    block = next(b for b in docs.split("```python\n")[1:] if "class RepeatTaskset" in b).split("```")[0]
    module = types.ModuleType("vf_docs_example")
    exec(compile(block, "docs/agents.md", "exec"), module.__dict__)
    monkeypatch.setitem(sys.modules, "vf_docs_example", module)
    task = VerifiersTasksetTask("vf-docs-example", eval_fraction=0.01)
    assert [(e.prompt, e.meta["vf_task"]["word"]) for e in task.train_split(3)] == [
        ("Repeat: cat", "cat"), ("Repeat: dog", "dog"), ("Repeat: sun", "sun")]
    assert callable(load_agent("verifiers:vf-docs-example"))


def test_what_cannot_run_here_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match=r"task.agent='verifiers:vf-bash-env': its agent 'agent' plays the harness "
                                          r"'bash', which runs the model's code; reinforge runs verifiers environments "
                                          r"on this machine, outside any sandbox"):
        load_agent("verifiers:vf-bash-env")
    with pytest.raises(ConfigError, match=r"task.agent='verifiers:no-such-env': verifiers cannot load it: "
                                          r"ModuleNotFoundError: taskset 'no-such-env' not found"):
        load_agent("verifiers:no-such-env")
    with pytest.raises(ConfigError, match=r"task.agent='verifiers:' names no environment"):
        load_agent("verifiers:")


@pytest.mark.slow
def test_an_environment_trains_on_its_own_tasks(llama_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = runner.invoke(app, [
        "train", f"model={llama_dir}", "sft.enabled=false", "train.steps=2", "train.prompts_per_step=2",
        "train.group_size=2", "train.num_prompts=6", "rollout.max_new_tokens=4", "eval.num_prompts=2",
        "eval.num_samples=1", "log.progress=false", "threads=1", "task.agent=verifiers:vf-inprocess-env",
        f"output_dir={out}"])
    assert result.exit_code == 0, result.output
    rl = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r.get("stage") == "rl"]
    assert [r["step"] for r in rl] == [1, 2]
    assert all(r["env/error_rate"] == 0 and r["env/episodes"] == 4 for r in rl)
    # the rubric's own figures, logged per step
    assert all("agent/reward/repeated" in r and "agent/reward/length" in r for r in rl)
