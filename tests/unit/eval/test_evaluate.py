"""Held-out evaluation aggregates per-prompt sample outcomes into pass@1, pass@k and greedy accuracy."""

from __future__ import annotations

import pytest
import torch

from reinforge.eval.evaluate import evaluate
from reinforge.rollout import Rollout, SamplingParams
from reinforge.tasks import build_task


class ScriptedEngine:
    """A test double: answers each prompt with scripted completions (sampled) or one (greedy)."""

    def __init__(self, sampled: dict[str, list[str]], greedy: dict[str, str]):
        self.sampled, self.greedy = sampled, greedy

    def generate(self, prompts, group_size, params: SamplingParams, policy_version: int = 0) -> Rollout:
        texts = (
            [self.greedy[p] for p in prompts]
            if params.greedy
            else [t for p in prompts for t in self.sampled[p][:group_size]]
        )
        n = len(texts)
        lengths = torch.tensor([len(t) + 1 for t in texts], dtype=torch.float32)   # + eos
        mask = (torch.arange(8).unsqueeze(0) < lengths.unsqueeze(1)).float()
        return Rollout(
            prompt_ids=[[0]] * n, completion_ids=torch.zeros(n, 8, dtype=torch.long), pad_id=0, completion_mask=mask,
            sampler_logprobs=torch.zeros(n, 8), truncated=torch.zeros(n, dtype=torch.bool),
            group_ids=torch.arange(len(prompts)).repeat_interleave(n // len(prompts)), policy_version=0, texts=texts,
        )


def test_pass_at_k_and_greedy_from_scripted_outcomes() -> None:
    task = build_task("arithmetic", digits=2)
    a, b = task.eval_split(2)
    right_a, right_b = a.answer, b.answer
    wrong = "99999"
    engine = ScriptedEngine(
        sampled={a.prompt: [right_a, wrong, wrong, wrong], b.prompt: [right_b] * 4},
        greedy={a.prompt: wrong, b.prompt: right_b},
    )
    result = evaluate(engine, task, [a, b], num_samples=4, sampling=SamplingParams(), seed=0)
    # Prompt a: 1 of 4 right; prompt b: 4 of 4.
    assert result.pass_at_1 == pytest.approx((0.25 + 1.0) / 2)
    # pass@2 of a = 1 - C(3,2)/C(4,2) = 1 - 3/6 = 0.5; of b = 1.
    assert result.pass_at_k == pytest.approx({"1": 0.625, "2": 0.75, "4": 1.0})
    assert result.greedy_accuracy == 0.5
    # Lengths: a's samples are len(answer)+1 and 6 tokens; b's are len(answer)+1.
    expected_len = ((len(right_a) + 1) + 3 * 6 + 4 * (len(right_b) + 1)) / 8
    assert result.mean_length == pytest.approx(expected_len)
    summary = result.to_summary()
    assert summary["pass@1"] == result.pass_at_1 and summary["pass@k"]["2"] == 0.75
