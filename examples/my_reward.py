"""Reward functions of your own, in the conventions reinforge accepts (told apart by signature).

Pass one as `reward.functions=[{name: examples/my_reward.py:correct}]` on the command line,
or `reward_funcs=["examples/my_reward.py:correct"]` (or the function itself) from Python.
"""

from __future__ import annotations

from reinforge.verifiers.math import verify


def correct(prompts: list, completions: list, answer: list, **kwargs) -> list[float]:
    """TRL's batched form: every dataset column arrives as a keyword list (here `answer`)."""
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]  # plain or chat
    return [verify(text, gold) for text, gold in zip(texts, answer, strict=True)]


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
    """verl's form: one sample, its ground truth from `reward_model.ground_truth` or `answer`."""
    return verify(solution_str, ground_truth)


def short(completion: str, **row) -> float:
    """reinforge's per-sample form: the keyword arguments it declares, and the row's fields."""
    return -0.01 * len(completion)
