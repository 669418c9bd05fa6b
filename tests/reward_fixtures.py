"""User reward functions for tests/unit/rewards/test_reward_composition.py, loaded by import path."""

from __future__ import annotations

CALLS: list[dict] = []   # keyword arguments of each call to `record`


def target_distance(completion: str, target: int) -> float:
    """-|completion - target|, `target` from the example's meta; raises on a non-integer completion."""
    return -abs(int(completion) - target)


def skip_empty(completion: str) -> float | None:
    """None (do not score) for an empty completion, else 1.0."""
    return None if not completion.strip() else 1.0


def scaled_length(length: int, scale: float) -> float:
    """scale * |y|, `scale` from the config's params."""
    return scale * length


def record(**kwargs) -> float:
    CALLS.append(kwargs)
    return 0.0


def not_finite(completion: str) -> float:
    return float("nan") if completion == "nan" else 0.0
