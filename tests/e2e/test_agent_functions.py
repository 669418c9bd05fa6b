"""Agents as plain functions trained through the endpoint (task.agent, reinforge/serve/agent.py): the rows
the learner gets hold exactly the tokens the agents were given, a bad agent fails its own episode only,
and a run trains an agent written against the `openai` client alone."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch
from repo_paths import TESTS
from typer.testing import CliRunner

from reinforge.cli import app
from reinforge.models.factory import load_policy
from reinforge.rollout import NativeEngine
from reinforge.rollout.base import SamplingParams, environment_returns
from reinforge.serve.agent import AgentFunctions, load_agent
from reinforge.settings import ModelConfig

runner = CliRunner()
PARAMS = SamplingParams(max_new_tokens=5)


@pytest.fixture(autouse=True)
def _fixtures_importable(monkeypatch):
    monkeypatch.syspath_prepend(str(TESTS))


@pytest.fixture(scope="module")
def engine(llama_dir):
    return NativeEngine(load_policy(ModelConfig(path=str(llama_dir)), 0))


def rows(prompt: str) -> dict:
    return {"prompt": prompt, "answer": "0"}


def test_the_rows_hold_exactly_the_tokens_each_agent_was_given(engine) -> None:
    given, lock = [], threading.Lock()

    def agent(client, row):
        messages, mine = [{"role": "user", "content": row["prompt"]}], []
        for _ in range(2):
            choice = client.chat.completions.create(model="policy", messages=messages).choices[0]
            mine.append(choice.model_extra["token_ids"])
            messages += [choice.message, {"role": "user", "content": "More."}]
        with lock:
            given.append(mine)
        return float(len(mine[-1]))

    agents = AgentFunctions(engine, agent, rows, timeout_s=60)
    rollout = agents.generate(["What is 1 + 2?", "What is 3 + 4?"], 3, PARAMS,
                              generator=torch.Generator().manual_seed(0))
    assert rollout.num_rows == 6 and rollout.group_ids.tolist() == [0, 0, 0, 1, 1, 1]
    trained = []
    for r in range(6):
        mask = rollout.trained_mask[r].bool()
        ids = rollout.completion_ids[r]
        # the model's turns, each a run of trained tokens
        turns, current = [], []
        for token, is_model in zip(ids[: int(rollout.completion_mask[r].sum())].tolist(), mask.tolist(), strict=False):
            if is_model:
                current.append(token)
            elif current:
                turns.append(current)
                current = []
        trained.append(turns + ([current] if current else []))
    assert sorted(map(str, trained)) == sorted(map(str, given))
    returns = environment_returns(rollout)
    assert returns.tolist() == [float(len(t[-1])) for t in trained]
    assert all(e.result.turns == 2 and e.result.stop_reason == "done" for e in rollout.episodes)
    assert rollout.episodes[0].metrics["endpoint/calls_per_episode"] == 2.0


@pytest.mark.parametrize("name, error", [
    ("raises", "the agent raised RuntimeError: the harness crashed"),
    ("not_a_number", "the agent returned str 'good' as its reward: return a finite number"),
    ("greedy", "the endpoint refused a request of the agent: temperature=0.0 was asked, and this run samples with "
               "temperature=1.0"),
    ("hangs", "the agent did not return within 3 s (task.agent_timeout_s); its later requests are refused"),
])
def test_a_bad_agent_fails_its_own_episodes_with_the_reason(engine, name: str, error: str) -> None:
    agents = AgentFunctions(engine, load_agent(f"endpoint_agents:{name}"), rows, timeout_s=3)
    rollout = agents.generate(["Count from 0.", "Count from 1."], 2, PARAMS, generator=torch.Generator().manual_seed(0))
    failed = [e for e in rollout.episodes if e.result.error is not None]
    expected = 2 if name == "hangs" else 4          # only the row 'Count from 0.' hangs
    assert len(failed) == expected, [e.result.error for e in rollout.episodes]
    assert all(e.result.error.startswith(error) and e.result.stop_reason == "error" for e in failed)
    returns = environment_returns(rollout)
    assert returns.isnan().sum() == expected and returns[~returns.isnan()].tolist() == [1.0] * (4 - expected)


def test_an_async_agent_gets_an_async_client(engine) -> None:
    agents = AgentFunctions(engine, load_agent("endpoint_agents:async_talker"), rows)
    rollout = agents.generate(["Count from 2."], 2, PARAMS)
    assert [e.result.error for e in rollout.episodes] == [None, None]
    assert [e.result.turns for e in rollout.episodes] == [1, 1]


def _rows_file(tmp_path: Path) -> Path:
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Count from {i}.", "answer": str(i)}) + "\n" for i in range(12)))
    return data


@pytest.mark.slow
def test_an_agent_written_against_the_openai_client_trains_and_its_reward_rises(llama_dir: Path,
                                                                               tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = runner.invoke(app, [
        "train", f"model={llama_dir}", "sft.enabled=false", "train.steps=10", "train.prompts_per_step=4",
        "train.group_size=8", "train.micro_batch_size=32", "train.lr=3e-2", "rollout.max_new_tokens=1",
        "rollout.max_turns=3", "eval.num_prompts=2", "eval.num_samples=2", "log.progress=false", "log.samples_every=1",
        "threads=1", "task.name=dataset", f"task.options.path={_rows_file(tmp_path)}",
        "task.agent=endpoint_agents:talker", f"output_dir={out}"])
    assert result.exit_code == 0, result.output
    rl = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r.get("stage") == "rl"]
    assert [r["step"] for r in rl] == list(range(1, 11))
    assert all(r["env/episodes"] == 32 and r["env/turns_mean"] == 3 and r["env/error_rate"] == 0 for r in rl)
    assert all(r["endpoint/calls_per_episode"] == 3 and "agent/turn_chars" in r for r in rl)
    rewards = [r["reward_mean"] for r in rl]
    # Measured: 0.31 over the first three steps, 0.79 over the last three (a third of untrained turns start readably).
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.25, rewards
    samples = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    roles = [m["role"] for m in samples[0]["trajectory"]]
    assert roles == ["user", "assistant", "user", "assistant", "user", "assistant"]


def test_a_missing_agent_or_async_mode_is_one_line_before_anything_runs(llama_dir: Path, tmp_path: Path) -> None:
    base = ["train", f"model={llama_dir}", "task.name=dataset", f"task.options.path={_rows_file(tmp_path)}",
            f"output_dir={tmp_path / 'run'}"]
    result = runner.invoke(app, [*base, "task.agent=endpoint_agents:nobody"])
    assert result.exit_code == 2 and "task.agent='endpoint_agents:nobody': 'endpoint_agents' has no 'nobody'" \
        in result.output, result.output
    result = runner.invoke(app, [*base, "task.agent=endpoint_agents:talker", "train.mode=async"])
    assert result.exit_code == 2 and "task.agent runs its episodes through the endpoint of the synchronous loop" \
        in result.output, result.output
    assert not (tmp_path / "run").exists()
