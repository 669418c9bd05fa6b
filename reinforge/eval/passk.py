"""Unbiased pass@k estimation from n samples per prompt (Chen et al., 2021).

Owns the estimator and its averaging over prompts into a pass@k curve.
"""

from __future__ import annotations


def pass_at_k(n: int, c: int, k: int) -> float:
    """P(at least one of k samples drawn without replacement from n is correct), c correct.

    Equals 1 - C(n-c, k) / C(n, k), computed as 1 - prod_{i=n-c+1}^{n} (1 - k/i),
    which avoids huge binomials.
    """
    if not 0 <= c <= n:
        raise ValueError(f"need 0 <= c <= n, got c={c}, n={n}")
    if not 1 <= k <= n:
        raise ValueError(f"need 1 <= k <= n, got k={k}, n={n}")
    if n - c < k:
        return 1.0  # every k-subset contains a correct sample
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def _curve_ks(n: int) -> list[int]:
    ks = []
    k = 1
    while k <= n:
        ks.append(k)
        k *= 2
    if ks[-1] != n:
        ks.append(n)
    return ks


def pass_at_k_curve(correct_counts: list[int], n: int) -> dict[str, float]:
    """Mean pass@k over prompts for k = 1, 2, 4, ... <= n, plus k = n.

    `correct_counts[j]` is the number of correct samples out of `n` for prompt j.
    Keys are str(k) so the result can go straight into JSON / metric loggers.
    """
    if n < 1:
        raise ValueError(f"need n >= 1, got {n}")
    if not correct_counts:
        raise ValueError("correct_counts is empty")
    return {
        str(k): sum(pass_at_k(n, c, k) for c in correct_counts) / len(correct_counts)
        for k in _curve_ks(n)
    }
