"""Multi-turn training end to end: a user's environment class on a local Llama with a chat template,
the built-in tool task in every recipe and in async mode."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from repo_paths import REPO, TESTS
from typer.testing import CliRunner

from reinforge.cli import app
from reinforge.objectives import RECIPES, ObjectiveSpec

runner = CliRunner()


@pytest.fixture(autouse=True)
def _fixtures_importable(monkeypatch):
    monkeypatch.syspath_prepend(str(TESTS))


@pytest.fixture(scope="module")
def chatty_llama(llama_dir: Path, tmp_path_factory) -> Path:
    """The chat-template Llama with its end-of-turn token made likely, so its turns end (a random model's
    would all run to max_new_tokens, which ends an episode at its first turn)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tok = AutoModelForCausalLM.from_pretrained(llama_dir), AutoTokenizer.from_pretrained(llama_dir)
    with torch.no_grad():
        model.get_output_embeddings().weight[tok.eos_token_id] *= 12.0
    path = tmp_path_factory.mktemp("chatty_llama")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _lines(out: Path, stage: str) -> list[dict]:
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r.get("stage") == stage]


def _rows(tmp_path: Path) -> Path:
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Count from {i}.", "answer": str(i)}) + "\n" for i in range(12)))
    return data


def _env_run(llama_dir: Path, data: Path, out: Path, environment: str, *extra: str):
    return runner.invoke(app, [
        "train", f"model={llama_dir}", "sft.enabled=false", "train.steps=3", "train.prompts_per_step=2",
        "train.group_size=2", "train.micro_batch_size=8", "rollout.max_new_tokens=6", "rollout.max_turns=3",
        "eval.num_prompts=2", "eval.num_samples=2", "log.progress=false", "log.samples_every=1", "threads=1",
        "task.name=dataset",
        f"task.options.path={data}", f"task.environment={environment}",
        f"output_dir={out}", *extra])


def test_a_user_environment_trains_on_a_llama_with_a_chat_template(chatty_llama: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = _env_run(chatty_llama, _rows(tmp_path), out, "agent_fixtures:CountDown", "rollout.max_new_tokens=24",
                      "train.group_size=4")
    assert result.exit_code == 0, result.output
    rl = _lines(out, "rl")
    assert [r["step"] for r in rl] == [1, 2, 3]
    # Up to three model turns each (the environment asks twice; a turn cut at max_new_tokens ends its episode),
    # the replies in the context and out of the loss.
    assert all(r["env/episodes"] == 8 and r["env/turns_mean"] > 1.5 for r in rl)
    assert all(r["env/environment_tokens_mean"] > 0 and r["env/error_rate"] == 0.0 for r in rl)
    assert all(r["response_length_mean"] == r["env/model_tokens_mean"] for r in rl)
    assert any(r.get("grad_norm", 0.0) > 0 for r in rl)          # a group with unequal returns trained
    samples = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    whole = [s for s in samples if s["turns"] == 3]
    assert whole, [s["stop_reason"] for s in samples]
    roles = [m["role"] for m in whole[0]["trajectory"]]
    assert roles == ["system", "user", "assistant", "user", "assistant", "user", "assistant"]
    assert whole[0]["trajectory"][3]["content"] == "And then?"
    summary = json.loads((out / "summary.json").read_text())
    assert 0.0 <= summary["eval"]["final"]["pass@1"] <= 1.0


def test_an_environment_that_raises_is_recorded_and_the_run_goes_on(chatty_llama: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = _env_run(chatty_llama, _rows(tmp_path), out, "agent_fixtures:Broken", "train.steps=2",
                      "rollout.max_new_tokens=24")
    assert result.exit_code == 0, result.output
    rl = _lines(out, "rl")
    assert all(r["env/error_rate"] == 1.0 and r["env/stop/error"] == 1.0 for r in rl)
    assert all(r["reward/valid_frac"] == 0.0 and "policy_loss" not in r for r in rl)   # no gradient from them
    sample = json.loads((out / "samples.jsonl").read_text().splitlines()[0])
    assert sample["error"] == "step raised RuntimeError: the simulator crashed" and sample["reward"] is None


def test_a_missing_environment_class_is_one_line_before_anything_runs(llama_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = _env_run(llama_dir, _rows(tmp_path), out, "agent_fixtures:Nope")
    assert result.exit_code == 2
    assert "task.environment='agent_fixtures:Nope'" in result.output and not out.exists()


RL_RECIPES = sorted(n for n, r in RECIPES.items() if isinstance(r.objective, ObjectiveSpec))
# A micro model after a short cold start on the tool task's traces opens its turns with a tool call, so
# every step has multi-turn episodes: tool results (or the parser's errors) in the context.
TOOL_RUN = ["task.name=multiply_tool", "sft.steps=100", "sft.batch_size=32", "sft.num_examples=3200", "sft.lr=1e-2",
            "rollout.max_new_tokens=24", "model.max_positions=160", "eval.num_prompts=2", "eval.num_samples=2"]


@pytest.mark.slow
@pytest.mark.parametrize("name", RL_RECIPES)
def test_every_rl_recipe_trains_the_tool_task(tmp_path: Path, micro_overrides: list[str], name: str) -> None:
    out = tmp_path / "run"
    result = runner.invoke(app, ["train", *micro_overrides, *TOOL_RUN, f"recipe={name}", f"output_dir={out}"])
    assert result.exit_code == 0, result.output
    rl = _lines(out, "rl")
    assert [r["step"] for r in rl] == [1, 2, 3]
    assert all(r["env/turns_mean"] > 1.0 and r["env/environment_tokens_mean"] > 0 for r in rl)
    assert all("tools/calls_per_trajectory" in r and "tools/malformed_rate" in r for r in rl)
    summary = json.loads((out / "summary.json").read_text())
    assert "final_without_tools" in summary["eval"]


def test_environment_rows_need_no_prompt_nor_answer(chatty_llama: Path, tmp_path: Path) -> None:
    data = tmp_path / "games.jsonl"
    data.write_text("".join(json.dumps({"target": t}) + "\n" for t in range(1, 13)))
    out = tmp_path / "run"
    result = _env_run(chatty_llama, data, out, "agent_fixtures:Guess", "train.steps=1", "rollout.max_new_tokens=24")
    assert result.exit_code == 0, result.output
    sample = json.loads((out / "samples.jsonl").read_text().splitlines()[0])
    assert sample["trajectory"][0]["content"].startswith("Guess a number")


def test_the_documented_example_environment_trains_from_its_command(tmp_path: Path, micro_overrides) -> None:
    examples = REPO / "examples"
    out = tmp_path / "run"
    result = runner.invoke(app, [
        "train", *micro_overrides, "task.name=dataset", f"task.options.path={examples / 'guess_number_rows.jsonl'}",
        f"task.environment={examples / 'guess_number_env.py'}:GuessNumber", "sft.enabled=false",
        "model.max_positions=256", "rollout.max_new_tokens=4", "train.steps=2", f"output_dir={out}"])
    assert result.exit_code == 0, result.output
    rl = _lines(out, "rl")
    assert [r["step"] for r in rl] == [1, 2] and all(r["env/error_rate"] == 0.0 for r in rl)
    assert all(r["env/turns_mean"] > 1 for r in rl)     # a turn without a number gets a reply and goes on


def test_turn_rewards_train_a_critic_recipe_and_are_refused_for_group_advantages(chatty_llama: Path,
                                                                                   tmp_path: Path) -> None:
    data = _rows(tmp_path)
    out = tmp_path / "run"
    result = _env_run(chatty_llama, data, out, "agent_fixtures:PerTurn", "recipe=ppo", "train.steps=2",
                      "task.environment_reward=turn", "rollout.max_new_tokens=24")
    assert result.exit_code == 0, result.output
    rl = _lines(out, "rl")
    assert [r["step"] for r in rl] == [1, 2]
    assert all(r["env/turns_mean"] > 1 and math.isfinite(r["critic/value_loss"]) for r in rl)
    refused = _env_run(chatty_llama, data, tmp_path / "grpo", "agent_fixtures:PerTurn", "task.environment_reward=turn")
    assert refused.exit_code == 2 and "task.environment_reward=turn needs a critic" in refused.output


def test_dpo_pairs_episodes_of_the_tool_task_on_the_models_tokens(tmp_path: Path, micro_overrides) -> None:
    out = tmp_path / "run"
    result = runner.invoke(app, ["train", *micro_overrides, *TOOL_RUN, "recipe=dpo", f"output_dir={out}"])
    assert result.exit_code == 0, result.output
    rl = _lines(out, "rl")
    assert [r["step"] for r in rl] == [1, 2, 3]
    assert all(r["env/turns_mean"] > 1.0 and "dpo/pairs" in r for r in rl)
    assert all(r["response_length_mean"] == r["env/model_tokens_mean"] for r in rl)


def test_episodes_whose_reset_raises_have_no_tokens_and_no_gradient(chatty_llama: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = _env_run(chatty_llama, _rows(tmp_path), out, "agent_fixtures:NoStart", "train.steps=4",
                      "train.prompts_per_step=4", "rollout.max_new_tokens=12")
    assert result.exit_code == 0, result.output
    rl = _lines(out, "rl")
    assert [r["step"] for r in rl] == [1, 2, 3, 4]
    assert any(r["env/error_rate"] > 0 for r in rl) and all(r["env/error_rate"] < 1 for r in rl)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_run_whose_every_reset_raises_finishes_without_an_update(tmp_path: Path, micro_overrides, mode) -> None:
    out = tmp_path / "run"
    result = runner.invoke(app, ["train", *micro_overrides, "task.environment=agent_fixtures:NeverStarts",
                                 f"train.mode={mode}", "train.steps=2", f"output_dir={out}"])
    assert result.exit_code == 0, result.output
    rl = _lines(out, "rl")
    assert [r["step"] for r in rl] == [1, 2]
    assert all(r["env/error_rate"] == 1.0 and "policy_loss" not in r and r["policy_version"] == 0 for r in rl)


def test_rejection_sampling_sft_of_episodes_is_refused_before_anything_runs(tmp_path: Path, micro_overrides) -> None:
    out = tmp_path / "run"
    result = runner.invoke(app, ["train", *micro_overrides, "task.name=multiply_tool", "sft.source=rejection",
                                 f"output_dir={out}"])
    assert result.exit_code == 2 and "rejection sampling of episodes is not built" in result.output
    assert not out.exists()
