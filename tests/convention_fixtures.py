"""Reward functions written for TRL and verl (and some that fit no convention), loaded by import
path in tests/unit/rewards/test_reward_composition.py and tests/e2e/test_first_contact.py. Each records its
arguments in CALLS so that a test can check what the composer passed."""

from __future__ import annotations

import asyncio

CALLS: dict[str, list[dict]] = {}


def _record(name: str, kwargs: dict) -> None:
    CALLS.setdefault(name, []).append(kwargs)


def trl_accuracy(prompts, completions, solution, **kwargs):
    """TRL style: 1.0 where the completion's text equals the row's `solution` column."""
    _record("trl_accuracy", {"prompts": prompts, "completions": completions, "solution": solution, **kwargs})
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [1.0 if t.strip() == s else 0.0 for t, s in zip(texts, solution, strict=True)]


def trl_length(completions, **kwargs):
    """TRL style: the completion's length in characters; None (not applicable) when it is empty."""
    _record("trl_length", {"completions": completions, **kwargs})
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [float(len(t)) if t else None for t in texts]


def trl_wrong_length(prompts, completions, **kwargs):
    return [1.0]


def trl_raises(prompts, completions, **kwargs):
    raise ValueError("x")


async def trl_async(prompts, completions, **kwargs):
    await asyncio.sleep(0)
    return [2.0] * len(completions)


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """verl style: a dict with 'score' (and extra info) for math rows, a bare float otherwise."""
    _record("compute_score", {"data_source": data_source, "solution_str": solution_str,
                              "ground_truth": ground_truth, "extra_info": extra_info})
    score = 1.0 if solution_str.strip() == str(ground_truth) else 0.0
    return {"score": score, "acc": score} if data_source == "math" else score


def verl_no_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"acc": 1.0}


async def sample_async(completion: str) -> float:
    await asyncio.sleep(0)
    return float(len(completion))


def sample_raises_on_bad(completion: str) -> float:
    if completion == "bad":
        raise ValueError("x")
    return 1.0


def no_form(x, y):
    return 0.0


def mixed_forms(completion, completions):
    return 0.0


def positional_only(completion, /):
    return 0.0


def always_raises(completion: str) -> float:
    raise ValueError("x")


def returns_good(completion: str):
    """A per-sample function that returns a label instead of a number."""
    return "good"


def trl_strings(prompts, completions, **kwargs):
    """TRL style, but its numbers are strings: TRL refuses them."""
    return ["1.0"] * len(completions)


def trl_returns_none(prompts, completions, **kwargs):
    """TRL style, with the `return` forgotten."""
    [len(c) for c in completions]


def verl_returns_none(data_source, solution_str, ground_truth, extra_info=None):
    """verl style, with the `return` forgotten: scores no sample."""
    len(solution_str)


def sample_returns_none(completion: str):
    """reinforge's per-sample form, with the `return` forgotten: declines every sample."""
    len(completion)


def declines_non_numbers(completion: str, answer: str):
    """Declines (None) a completion that is not a number, as a strict parser does on an untrained model's text."""
    return float(completion.strip() == answer) if completion.strip().lstrip("-").isdigit() else None
