"""What users already have, trained through the endpoint unchanged: TRL environment_factory classes
(reinforge/serve/trl_env.py). verifiers environments: tests/unit/serve/test_verifiers_env.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from repo_paths import TESTS
from scripted_engine import Scripted
from typer.testing import CliRunner

from reinforge.cli import app
from reinforge.errors import ConfigError
from reinforge.models.tokenizer import build_char_tokenizer
from reinforge.rollout.base import SamplingParams, environment_returns
from reinforge.serve.agent import AgentFunctions, load_agent

runner = CliRunner()


@pytest.fixture(autouse=True)
def _fixtures_importable(monkeypatch):
    monkeypatch.syspath_prepend(str(TESTS))


def _scripted():
    def script(context: str) -> str:
        if "<tool_response>" not in context:
            return '<tool_call>{"name": "guess", "arguments": {"number": 3}}</tool_call>'
        return "done"

    return Scripted(script)


def test_a_trl_environment_class_plays_its_tools_and_scores_with_get_reward() -> None:
    engine = _scripted()
    agents = AgentFunctions(engine, load_agent("endpoint_agents:GuessTheNumber"),
                            lambda p: {"prompt": p, "answer": p.split()[-1]}, chat_template="never")
    rollout = agents.generate(["Target 3", "Target 5"], 2, SamplingParams(max_new_tokens=200))
    assert environment_returns(rollout).tolist() == [1.0, 1.0, 0.0, 0.0]
    tok = build_char_tokenizer()
    episode = rollout.episodes[2]
    assert episode.result.error is None and episode.result.turns == 2
    # reset's return joined the prompt; the tool's result came back in the model's format, out of the loss.
    assert tok.decode(list(rollout.prompt_ids[2])) == "Target 5 Find my number with the guess tool."
    n = int(rollout.completion_mask[2].sum())
    text = tok.decode(rollout.completion_ids[2, :n])
    assert text == '<tool_call>{"name": "guess", "arguments": {"number": 3}}</tool_call><eos>' \
                   "<tool_response>higher</tool_response>done<eos>"


def test_a_trl_class_without_get_reward_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match=r"task.agent='agent_fixtures:CountDown': CountDown has no get_reward\(\)"):
        load_agent("agent_fixtures:CountDown")


@pytest.mark.slow
def test_a_trl_environment_class_trains_unchanged(llama_dir: Path, tmp_path: Path) -> None:
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Guess {i}.", "answer": str(i)}) + "\n" for i in range(12)))
    out = tmp_path / "run"
    result = runner.invoke(app, [
        "train", f"model={llama_dir}", "sft.enabled=false", "train.steps=2", "train.prompts_per_step=2",
        "train.group_size=2", "rollout.max_new_tokens=4", "rollout.max_turns=2", "eval.num_prompts=2",
        "eval.num_samples=1", "log.progress=false", "threads=1", "task.name=dataset", f"task.options.path={data}",
        "task.agent=endpoint_agents:GuessTheNumber", f"output_dir={out}"])
    assert result.exit_code == 0, result.output
    rl = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r.get("stage") == "rl"]
    assert [r["step"] for r in rl] == [1, 2] and all(r["env/error_rate"] == 0 for r in rl)

