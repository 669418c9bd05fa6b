"""A new user's first run with what they bring from TRL or verl: conversational data files, a
system prompt, and reward functions in TRL's or verl's convention, on a local Llama with a BPE
tokenizer and a chat template (built here; nothing downloaded). Also the two ways such a run
must fail: a reward function of no known form (before anything loads) and one that raises."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from repo_paths import TESTS
from typer.testing import CliRunner

from reinforge.cli import app
from reinforge.config import build_config
from reinforge.jobs.train import run

SYSTEM = "Be brief."


@pytest.fixture(autouse=True)
def _fixtures_importable(monkeypatch):
    monkeypatch.syspath_prepend(str(TESTS))


def _overrides(model: Path, data: Path, out: Path, reward: str) -> list[str]:
    return [
        f"model={model}", "sft.enabled=false", "train.steps=2", "train.prompts_per_step=2", "train.group_size=2",
        "train.micro_batch_size=8", "rollout.max_new_tokens=4", "rollout.cpu_kernels=false", "eval.num_prompts=2",
        "eval.num_samples=2", "log.progress=false", "threads=1", "task.name=dataset", f"task.options.path={data}",
        f"task.options.eval_path={data}", "task.options.verifier=exact", f"prompt.system={SYSTEM}",
        f"reward.functions=[{{name: {reward}}}]", f"output_dir={out}",
    ]


def _rl_steps(out: Path) -> list[int]:
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in lines if r.get("stage") == "rl"]


def test_the_chat_template_gets_the_system_message_and_the_generation_prompt(llama_dir: Path) -> None:
    from reinforge.data.chat import Conversation, with_system
    from reinforge.models.tokenizer import load_tokenizer
    from reinforge.rollout import encode_prompts

    tok = load_tokenizer(llama_dir)
    prompts = [with_system("What is 2 + 2?", SYSTEM),
               Conversation([{"role": "system", "content": "Own."}, {"role": "user", "content": "Hi"}])]
    assert [tok.decode(ids) for ids in encode_prompts(tok, prompts)] == [
        "<|system|>Be brief.<|end|><|user|>What is 2 + 2?<|end|><|assistant|>",
        "<|system|>Own.<|end|><|user|>Hi<|end|><|assistant|>",
    ]


def test_trl_reward_function_on_trl_conversational_jsonl(llama_dir: Path, tmp_path: Path) -> None:
    from convention_fixtures import CALLS

    data = tmp_path / "trl.jsonl"
    rows = [{"prompt": [{"role": "user", "content": f"What is {a} + 1?"}], "solution": str(a + 1)} for a in range(4)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    CALLS.clear()
    out = tmp_path / "run"
    result = run(build_config(_overrides(llama_dir, data, out, "convention_fixtures:trl_accuracy")))
    assert result.summary["rl_steps"] == 2 and _rl_steps(out) == [1, 2]
    probe, *calls = CALLS["trl_accuracy"]
    assert len(probe["prompts"]) == 3                        # the probe before training: 3 rows, 1 sample each
    assert len(calls) == 2                                   # one batched call per RL step
    solution_of = {r["prompt"][0]["content"]: r["solution"] for r in rows}
    for call in calls:
        assert len(call["prompts"]) == len(call["completions"]) == len(call["solution"]) == 4   # 2 prompts x 2
        for prompt, completion, solution, ids in zip(call["prompts"], call["completions"], call["solution"],
                                                     call["completion_ids"], strict=True):
            # As TRL passes conversational data: message lists, the system prompt first, assistant completions.
            assert prompt[0] == {"role": "system", "content": SYSTEM} and prompt[1]["role"] == "user"
            assert solution == solution_of[prompt[1]["content"]]
            assert [m["role"] for m in completion] == ["assistant"] and isinstance(completion[0]["content"], str)
            assert 1 <= len(ids) <= 4 and all(isinstance(i, int) for i in ids)
        assert call["answer"] == call["solution"]            # the answer was read from TRL's solution column


def test_verl_compute_score_on_verl_parquet(llama_dir: Path, tmp_path: Path) -> None:
    import datasets
    from convention_fixtures import CALLS

    rows = [{"data_source": "math",
             "prompt": [{"role": "system", "content": "Reason."}, {"role": "user", "content": f"What is {a} + 2?"}],
             "ability": "math", "reward_model": {"ground_truth": str(a + 2), "style": "rule"},
             "extra_info": {"index": a, "split": "train"}} for a in range(4)]
    data = tmp_path / "train.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(data))
    CALLS.clear()
    out = tmp_path / "run"
    result = run(build_config(_overrides(llama_dir, data, out, "convention_fixtures:compute_score")))
    assert result.summary["rl_steps"] == 2 and _rl_steps(out) == [1, 2]
    calls = CALLS["compute_score"][3:]                       # after the probe's 3 samples before training
    assert len(calls) == 2 * 4                               # once per completion: 2 steps x 2 prompts x 2
    by_index = {r["extra_info"]["index"]: r for r in rows}
    for call in calls:
        row = by_index[call["extra_info"]["index"]]
        assert call["extra_info"] == row["extra_info"] and call["data_source"] == "math"
        assert call["ground_truth"] == row["reward_model"]["ground_truth"] and isinstance(call["solution_str"], str)


def test_a_reward_function_of_no_known_form_is_refused_before_anything_loads(tmp_path: Path) -> None:
    out = tmp_path / "run"
    # The model path does not exist: the refusal comes before the model is looked at.
    result = CliRunner().invoke(app, ["train", "model=/nonexistent/model", f"output_dir={out}",
                                      "reward.functions=[{name: convention_fixtures:no_form}]"])
    assert result.exit_code == 2, result.output
    assert "(x, y) fits none of the accepted forms: per-sample f(prompt, completion, answer, **row)" in result.output
    assert "TRL batched f(prompts, completions, **kwargs)" in result.output
    assert "verl compute_score(data_source, solution_str, ground_truth, extra_info=None)" in result.output
    assert "Traceback" not in result.output and not out.exists()


def test_a_reward_function_that_raises_ends_the_run_with_one_line(llama_dir: Path, tmp_path: Path) -> None:
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {a} + 1?", "answer": str(a + 1)}) + "\n" for a in range(4)))
    out = tmp_path / "run"
    result = CliRunner().invoke(app, ["train", *_overrides(llama_dir, data, out, "convention_fixtures:always_raises")])
    assert result.exit_code == 2, result.output
    (line,) = [x for x in result.output.splitlines() if "reward function" in x]
    assert line.startswith(
        "error: reward function convention_fixtures.always_raises raised ValueError('x') on sample 0 "
        "(prompt 'system: Be brief.\\nuser: What is "
    )
    assert line.endswith(f"reward functions raised on 4 of 4 samples (always_raises: 4), more than "
                         f"reward.max_error_rate=0.05; full traceback in {out / 'error.log'}")
    assert "Traceback" not in result.output
    log = (out / "error.log").read_text()
    assert "Traceback (most recent call last)" in log and 'raise ValueError("x")' in log and "ValueError: x" in log
    # Nothing that looks finished: no summary, no final model; metrics.jsonl ends with the failure.
    assert not (out / "summary.json").exists() and not (out / "model").exists()
    last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["stage"] == "failed" and last["reason"] == line.removeprefix("error: ").split("; full traceback")[0]
    from reinforge.telemetry.report import load_runs, run_table

    header, (row,) = run_table(load_runs([out]))
    assert row[header.index("status")] == "failed in step 1"


@pytest.mark.parametrize(("reward", "returned"), [
    ("convention_fixtures:returns_good", "returned a str ('good'), expected a float"),
    ("convention_fixtures:trl_returns_none", "returned None, expected a list of 3 floats (one per completion)"),
    ("convention_fixtures:trl_wrong_length", "returned 1 values for 3 completions, expected one per completion"),
    ("convention_fixtures:sample_returns_none", "returned None on all 3 probe samples and on their gold answers"),
])
def test_a_reward_that_returns_no_reward_stops_before_any_evaluation(llama_dir: Path, tmp_path: Path, reward: str,
                                                                     returned: str) -> None:
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {a} + 1?", "answer": str(a + 1)}) + "\n" for a in range(4)))
    out = tmp_path / "run"
    overrides = [o for o in _overrides(llama_dir, data, out, reward) if not o.startswith("eval.num_prompts")]
    result = CliRunner().invoke(app, ["train", *overrides, "eval.num_prompts=200"])
    assert result.exit_code == 2, result.output
    (line,) = [x for x in result.output.splitlines() if "reward function" in x]
    name = reward.replace(":", ".")
    assert line.startswith(f"error: reward function {name} {returned}") and "before training): return " in line
    # Nothing was evaluated or trained: the probe ran before the start-of-RL evaluation.
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()] \
        if (out / "metrics.jsonl").exists() else []
    assert not [r for r in records if r.get("stage") in ("eval", "rl")]
