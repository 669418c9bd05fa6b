"""Held-out evaluation: sampled pass@1, greedy accuracy, unbiased pass@k; per domain for a mix; pass@1
within token budgets (eval/budget.py)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import torch

from reinforge.eval.budget import budget_correct
from reinforge.eval.passk import pass_at_k_curve
from reinforge.rollout import Rollout, RolloutEngine, SamplingParams
from reinforge.rollout.base import environment_returns
from reinforge.tasks import Example, Task


@dataclass
class EvalResult:
    pass_at_1: float               # mean fraction of correct samples (sampling temperature)
    greedy_accuracy: float         # fraction of prompts whose greedy completion is correct
    pass_at_k: dict[str, float]    # k -> unbiased pass@k, k = 1, 2, 4, ..., n
    mean_length: float             # mean sampled completion length in tokens
    num_prompts: int
    num_samples: int
    # a task of several domains (a mix): domain -> {"pass@1", "greedy_accuracy", "num_prompts"} over its
    # prompts; {} for a task of one domain
    domains: dict[str, dict[str, float]] = field(default_factory=dict)
    # eval.token_budgets: B -> pass@1 of the same samples cut at B new tokens (eval/budget.py); {} when off
    pass_at_budget: dict[str, float] = field(default_factory=dict)

    def to_summary(self) -> dict:
        out = asdict(self)
        out["pass@1"] = out.pop("pass_at_1")
        out["pass@k"] = out.pop("pass_at_k")
        if not out["domains"]:
            del out["domains"]
        if not out["pass_at_budget"]:
            del out["pass_at_budget"]
        return out

    @classmethod
    def from_summary(cls, summary: dict) -> EvalResult:
        """The inverse of `to_summary`."""
        out = dict(summary)
        return cls(pass_at_1=out.pop("pass@1"), pass_at_k=out.pop("pass@k"), **out)


def _correct(task: Task, examples: list[Example], rollout: Rollout) -> list[bool]:
    """Row r is right: the task's verifier accepts its text (the last turn of an episode with tools), or
    the environment's return is positive (episodes of task.environment)."""
    returns = environment_returns(rollout)
    if returns is not None:
        return [bool(r > 0) for r in returns]
    return _accepted(task, examples, rollout.texts)


def _accepted(task: Task, examples: list[Example], texts: list[str]) -> list[bool]:
    """The task's verifier accepts text r as the answer to examples[r]."""
    return [task.reward(e, t) >= 1.0 for e, t in zip(examples, texts, strict=True)]


def evaluate(
    engine: RolloutEngine,
    task: Task,
    examples: list[Example],
    *,
    num_samples: int,
    sampling: SamplingParams,
    seed: int,
    batch_prompts: int = 64,
    on_batch: Callable[[int], None] | None = None,
    token_budgets: Sequence[int] = (),
    decode: Callable[[list[list[int]]], list[str]] | None = None,
) -> EvalResult:
    """Evaluate under a fixed sampling seed, leaving the caller's RNG state untouched.
    `on_batch(n)`: after each batch of prompts, with the n prompts it held (a progress bar).
    `token_budgets`: also pass@1 with each sample cut at B tokens (eval/budget.py), the cut tokens
    decoded by `decode` (the policy tokenizer's batch_decode without special tokens)."""
    if token_budgets and decode is None:
        raise ValueError("token_budgets needs decode, the tokenizer's decoding of a cut completion")
    correct_counts: list[int] = []
    budget_right = {b: 0 for b in token_budgets}
    greedy_right: list[bool] = []
    total_len = 0.0
    greedy = SamplingParams(max_new_tokens=sampling.max_new_tokens, greedy=True)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        for start in range(0, len(examples), batch_prompts):
            chunk = examples[start : start + batch_prompts]
            prompts = [e.prompt for e in chunk]
            sampled = engine.generate(prompts, num_samples, sampling)
            total_len += float(sampled.lengths.sum())
            rows = [e for e in chunk for _ in range(num_samples)]
            right = _correct(task, rows, sampled)
            cut = budget_correct(sampled, token_budgets, decode, lambda texts: _accepted(task, rows, texts))  # noqa: B023
            for b, ok in cut.items():
                budget_right[b] += int(ok.sum())
            correct_counts += [sum(right[i * num_samples : (i + 1) * num_samples]) for i in range(len(chunk))]
            greedy_right += _correct(task, chunk, engine.generate(prompts, 1, greedy))
            if on_batch is not None:
                on_batch(len(chunk))
    n = len(examples)
    return EvalResult(
        pass_at_1=sum(c / num_samples for c in correct_counts) / n,
        greedy_accuracy=sum(greedy_right) / n,
        pass_at_k=pass_at_k_curve(correct_counts, num_samples),
        mean_length=total_len / (n * num_samples),
        num_prompts=n,
        num_samples=num_samples,
        domains=_by_domain(task, examples, correct_counts, greedy_right, num_samples),
        pass_at_budget={str(b): c / (n * num_samples) for b, c in budget_right.items()},
    )


def _by_domain(task: Task, examples: list[Example], correct_counts: list[int], greedy_right: list[bool],
               num_samples: int) -> dict[str, dict[str, float]]:
    """pass@1, greedy accuracy and prompt count over each domain's prompts, in the task's order of
    domains (those with held-out prompts); {} for a task of one domain."""
    if len(task.domains) < 2:
        return {}
    out = {}
    for domain in task.domains:
        rows = [i for i, e in enumerate(examples) if task.domain_of(e) == domain]
        if rows:
            out[domain] = {"pass@1": sum(correct_counts[i] for i in rows) / (num_samples * len(rows)),
                           "greedy_accuracy": sum(greedy_right[i] for i in rows) / len(rows),
                           "num_prompts": len(rows)}
    return out
