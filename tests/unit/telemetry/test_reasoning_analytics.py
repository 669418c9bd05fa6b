"""Reasoning analytics: reflection words in RL samples (telemetry/reflection.py) and held-out accuracy
within a token budget (eval/budget.py). Counts and accuracies are derived by hand in the comments."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from reinforge.config import build_config
from reinforge.curation.batches import _weighted_mean
from reinforge.errors import ConfigError
from reinforge.eval.budget import cut_texts
from reinforge.eval.evaluate import evaluate
from reinforge.models import Policy, build_tiny_qwen2
from reinforge.models.tokenizer import build_char_tokenizer
from reinforge.rollout import HFEngine, NativeEngine, Rollout, SamplingParams
from reinforge.settings import AnalyticsConfig, ModelConfig
from reinforge.tasks import Example, build_task
from reinforge.tasks.arithmetic import ArithmeticTask
from reinforge.telemetry.reflection import count_reflections, reflection_metrics, reflection_patterns, word_key

WORDS = AnalyticsConfig().reflection_words   # wait, let me check, verify, double-check, re-examine, hmm
TEXTS = [
    "Wait, 2+2=4. wait... waiting is not it. Hmm.",
    "Let me\ncheck: let me check. I double-checked and double-check again; re-examine",
    "await the verifier; verify",
    "",
    "hmmm HMM",
]
# [N, W], W in the order of WORDS:
# 0: "Wait" and "wait" (case), not "waiting"; "Hmm"
# 1: "Let me\ncheck" (any whitespace) and "let me check"; "double-check" but not "double-checked"; "re-examine"
# 2: "verify" but not "verifier"; "await" is not "wait"
# 4: "HMM", not "hmmm"
COUNTS = [[2, 0, 0, 0, 0, 1], [0, 2, 0, 1, 1, 0], [0, 0, 1, 0, 0, 0], [0] * 6, [0, 0, 0, 0, 0, 1]]


def test_default_words_and_their_keys() -> None:
    assert WORDS == ["wait", "let me check", "verify", "double-check", "re-examine", "hmm"]
    assert [word_key(w) for w in WORDS] == ["wait", "let_me_check", "verify", "double_check", "re_examine", "hmm"]


def test_counts_match_whole_words_and_phrases_in_any_case() -> None:
    assert count_reflections(TEXTS, reflection_patterns(WORDS)).tolist() == COUNTS
    assert count_reflections([], reflection_patterns(WORDS)).shape == (0, 6)


def test_metrics_split_by_the_verifier() -> None:
    counts = torch.tensor(COUNTS)
    lengths = torch.tensor([10, 20, 10, 5, 5])        # 50 sampled tokens
    correct = torch.tensor([True, False, True, False, False])
    parts = reflection_metrics(counts, lengths, correct, WORDS)
    flat = {k: (w, v) for w, figures in parts for k, v in figures.items()}
    # rows with any word: 0, 1, 2, 4 -> 4/5; correct rows 0, 2: both; incorrect rows 1, 3, 4: rows 1 and 4
    assert flat["reasoning/reflection_rate"] == (5, pytest.approx(0.8))
    assert flat["reasoning/reflection_rate/correct"] == (2, pytest.approx(1.0))
    assert flat["reasoning/reflection_rate/incorrect"] == (3, pytest.approx(2 / 3))
    # occurrences per row 3, 4, 1, 0, 1 (9 in all): 9 / 50 tokens; correct (3 + 1) / 20; incorrect (4 + 0 + 1) / 30
    assert flat["reasoning/reflections_per_1k_tokens"] == (50, pytest.approx(180.0))
    assert flat["reasoning/reflections_per_1k_tokens/correct"] == (20, pytest.approx(200.0))
    assert flat["reasoning/reflections_per_1k_tokens/incorrect"] == (30, pytest.approx(1000 * 5 / 30))
    # each word's occurrences per 1000 of the 50 tokens: wait 2, let me check 2, verify 1, ..., hmm 2
    words = {k.removeprefix("reasoning/reflection_words/"): v for k, (_, v) in flat.items() if "words/" in k}
    assert words == pytest.approx({"wait": 40.0, "let_me_check": 40.0, "verify": 20.0, "double_check": 20.0,
                                   "re_examine": 20.0, "hmm": 40.0})


def test_a_kind_with_no_sample_is_nan_and_weighs_nothing() -> None:
    parts = reflection_metrics(torch.tensor(COUNTS[:2]), torch.tensor([10, 20]), torch.tensor([False, False]), WORDS)
    flat = {k: (w, v) for w, figures in parts for k, v in figures.items()}
    weight, rate = flat["reasoning/reflection_rate/correct"]
    assert weight == 0 and math.isnan(rate)
    assert flat["reasoning/reflection_rate/incorrect"] == (2, 1.0)


def test_rounds_of_a_step_combine_to_the_figures_of_all_their_rows() -> None:
    """Curation's refill rounds are averaged with the weights the figures carry (`_weighted_mean`): the step's
    figures must be those of all its rows at once, whatever the split (round 1 here has no correct row)."""
    counts, lengths = torch.tensor(COUNTS), torch.tensor([10, 20, 10, 5, 5])
    correct = torch.tensor([False, False, True, False, True])
    whole = _weighted_mean(reflection_metrics(counts, lengths, correct, WORDS))
    split = _weighted_mean([*reflection_metrics(counts[:2], lengths[:2], correct[:2], WORDS),
                            *reflection_metrics(counts[2:], lengths[2:], correct[2:], WORDS)])
    assert split.keys() == whole.keys()
    assert split == pytest.approx(whole)


def test_config_refuses_words_sharing_a_key_and_bad_budgets(micro_overrides) -> None:
    with pytest.raises(ConfigError, match="analytics.reflection_words"):
        build_config([*micro_overrides, "analytics.reflection_words=[double-check, double check]"])
    with pytest.raises(ConfigError, match="analytics.reflection_words"):
        build_config([*micro_overrides, "analytics.reflection_words=['--']"])
    with pytest.raises(ConfigError, match=r"eval.token_budgets has 5 > rollout.max_new_tokens=4"):
        build_config([*micro_overrides, "eval.token_budgets=[2,5]"])
    with pytest.raises(ConfigError, match="eval.token_budgets"):
        build_config([*micro_overrides, "eval.token_budgets=[0]"])
    assert build_config([*micro_overrides, "eval.token_budgets=[4,2,2]"]).eval.token_budgets == [2, 4]
    assert build_config([*micro_overrides, "analytics.reflection_words=[]"]).analytics.reflection_words == []


# --- accuracy within a token budget ---------------------------------------------------------------

class FixedEngine:
    """Completions given as text, one char token each (the char tokenizer); `ends`: the completion ended
    with eos (else it ran into the generation limit: truncated, no eos)."""

    def __init__(self, completions: dict[str, list[tuple[str, bool]]]):
        self.completions, self.tok = completions, build_char_tokenizer()

    def generate(self, prompts, group_size, params: SamplingParams, policy_version: int = 0) -> Rollout:
        rows = [c for p in prompts for c in self.completions[p][:group_size]]
        ids = [self.tok(text)["input_ids"] + ([self.tok.eos_token_id] if ends else []) for text, ends in rows]
        width = max(len(i) for i in ids)
        completion_ids = torch.tensor([i + [0] * (width - len(i)) for i in ids])
        mask = torch.tensor([[1.0] * len(i) + [0.0] * (width - len(i)) for i in ids])
        return Rollout(prompt_ids=[[0]] * len(rows), completion_ids=completion_ids, pad_id=0, completion_mask=mask,
                       sampler_logprobs=torch.zeros(mask.shape), truncated=torch.tensor([not e for _, e in rows]),
                       group_ids=torch.arange(len(prompts)).repeat_interleave(group_size), policy_version=0,
                       texts=[t for t, _ in rows])


def test_pass_at_budget_on_fixed_completions() -> None:
    task = build_task("arithmetic", digits=2)
    example = Example(prompt="23+23=", answer="46", meta={})
    tok = build_char_tokenizer()
    engine = FixedEngine({example.prompt: [("046", True), ("46", True), ("0460", False), ("9", True)]})
    result = evaluate(engine, task, [example], num_samples=4, sampling=SamplingParams(max_new_tokens=4), seed=0,
                      token_budgets=[2, 3, 4], decode=lambda ids: tok.batch_decode(ids, skip_special_tokens=True))
    # full: "046" right, "46" right, "0460" (460) wrong, "9" wrong -> 2/4
    # B=2: "04" wrong, "46" right (2 tokens), "04" wrong, "9" right? no: 9 != 46 -> 1/4
    # B=3: "046" right (its eos is token 4), "46", "046" right: the answer complete within 3 tokens -> 3/4
    # B=4: "046"+eos fits, "46", "0460" wrong, "9" -> 2/4, as the full completions
    assert result.pass_at_1 == 0.5
    assert result.pass_at_budget == {"2": 0.25, "3": 0.75, "4": 0.5}
    assert result.to_summary()["pass_at_budget"] == result.pass_at_budget
    from reinforge.telemetry.recorder import eval_metrics
    assert {k: v for k, v in eval_metrics(result).items() if "budget" in k} == {
        "eval/pass@1@budget_2": 0.25, "eval/pass@1@budget_3": 0.75, "eval/pass@1@budget_4": 0.5}
    with pytest.raises(ValueError, match="decode"):
        evaluate(engine, task, [example], num_samples=4, sampling=SamplingParams(), seed=0, token_budgets=[2])


def _policy() -> Policy:
    policy = build_tiny_qwen2(ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                                          intermediate_size=64), seed=0)
    with torch.no_grad():   # make eos likely in some contexts: completions of many lengths
        policy.model.get_output_embeddings().weight[policy.tokenizer.eos_token_id] *= 30.0
    return policy


PROMPTS = ["12+34=", "7+8=", "999+1=", "5+5="]


@pytest.mark.parametrize("engine_cls", [NativeEngine, HFEngine])
def test_cutting_at_b_tokens_is_generating_with_a_limit_of_b(engine_cls) -> None:
    """The equivalence eval/budget.py relies on: under one seed, the first B tokens of each sample do not
    depend on the generation limit, so a completion cut at B is what max_new_tokens=B samples."""
    policy = _policy()
    engine = engine_cls(policy)
    decode = lambda ids: policy.tokenizer.batch_decode(ids, skip_special_tokens=True)  # noqa: E731

    def sample(limit: int) -> Rollout:
        torch.manual_seed(7)
        return engine.generate(PROMPTS, 4, SamplingParams(temperature=1.0, max_new_tokens=limit))

    full = sample(16)
    lengths = full.completion_mask.sum(dim=1)
    for b in (3, 6):
        assert (lengths > b).any() and (lengths <= b).any()     # some rows are cut, some ended within B
        limited = sample(b)
        assert cut_texts(full, b, decode) == limited.texts
        assert torch.equal(full.completion_ids[:, :b] * full.completion_mask[:, :b].long(),
                           limited.completion_ids[:, :b] * limited.completion_mask[:, :b].long())


class EvenLength(ArithmeticTask):
    """A verifier a random model passes about half the time: the completion has an even number of chars."""

    def reward(self, example: Example, completion: str) -> float:
        return float(len(completion) % 2 == 0)


def test_pass_at_budget_equals_pass_at_1_of_a_limited_generation() -> None:
    policy = _policy()
    engine, task = NativeEngine(policy), EvenLength(digits=2)
    examples = task.eval_split(6)
    decode = lambda ids: policy.tokenizer.batch_decode(ids, skip_special_tokens=True)  # noqa: E731
    full = evaluate(engine, task, examples, num_samples=4, sampling=SamplingParams(max_new_tokens=12), seed=3,
                    token_budgets=[2, 5, 12], decode=decode)
    for b in (2, 5):
        limited = evaluate(engine, task, examples, num_samples=4, sampling=SamplingParams(max_new_tokens=b), seed=3)
        assert full.pass_at_budget[str(b)] == limited.pass_at_1
    assert full.pass_at_budget["12"] == full.pass_at_1
    assert 0 < full.pass_at_budget["5"] < 1


# --- a real run ----------------------------------------------------------------------------------

def test_a_short_run_logs_reflection_and_budget_metrics(tmp_path: Path, micro_overrides) -> None:
    """Three GRPO steps of the built-in task from a barely trained model, which writes random characters. The
    reward is the format function "has one of the letters a-e" (either case), so "correct" (what pass_rate counts)
    is that; the reflection words are those letters as whole words (any case). A sample with one has such a
    letter: the incorrect samples have none (a swapped split would show there). Every row of a step is in samples.jsonl
    (no curation filter, samples_per_step = the batch), so each logged figure is recomputed from them."""
    from reinforge.jobs.train import run

    letters = ["a", "b", "c", "d", "e"]
    out = tmp_path / "run"
    cfg = build_config([*micro_overrides, f"output_dir={out}", "rollout.max_new_tokens=6", "curation.filters=[]",
                        "reward.functions=[{name: format, params: {pattern: '[a-eA-E]', mode: search}}]",
                        f"analytics.reflection_words=[{','.join(letters)}]", "log.samples_every=1",
                        "log.samples_per_step=16", "eval.token_budgets=[1,3,6]"])
    result = run(cfg)
    lines = [json.loads(x) for x in (Path(result.output_dir) / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in lines if r["stage"] == "rl"]
    samples = [json.loads(x) for x in (Path(result.output_dir) / "samples.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rl] == [1, 2, 3]
    patterns = reflection_patterns(letters)
    for r in rl:
        rows = [x for x in samples if x["step"] == r["step"]]
        assert len(rows) == 16 == 4 * r["curation/prompts_sampled"]
        counts = count_reflections([x["completion"] for x in rows], patterns)
        correct = torch.tensor([x["reward"] > 0 for x in rows])
        assert r["pass_rate"] == pytest.approx(float(correct.float().mean()))
        lengths = torch.tensor([len(x["completion_tokens"]) for x in rows])
        expected = _weighted_mean(reflection_metrics(counts, lengths, correct, letters))
        logged = {k: (math.nan if r[k] is None else r[k]) for k in expected}
        assert logged == pytest.approx(expected, nan_ok=True)
        assert r["reasoning/reflection_rate/incorrect"] in (0.0, None)
    assert any(0 < r["pass_rate"] < 1 for r in rl)     # both kinds of sample
    assert max(r["reasoning/reflection_rate/correct"] or 0.0 for r in rl) > 0      # the letters were found
    evals = [r for r in lines if r["stage"] == "eval"]
    summary = json.loads((Path(result.output_dir) / "summary.json").read_text())
    for record, stage in zip(evals, ("start", "final"), strict=True):
        ev = summary["eval"][stage]
        assert list(ev["pass_at_budget"]) == ["1", "3", "6"]
        # B = rollout.max_new_tokens cuts nothing; the verifier (not the reward) judges held-out answers
        assert ev["pass_at_budget"]["6"] == ev["pass@1"]
        assert record["eval/pass@1@budget_6"] == ev["pass@1"]
