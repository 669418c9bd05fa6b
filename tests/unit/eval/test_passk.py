"""pass@k against hand-computed values and the direct binomial formula."""

from __future__ import annotations

import math

import pytest

from reinforge.eval import pass_at_k, pass_at_k_curve


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (4, 1, 2, 0.5),  # 1 - C(3,2)/C(4,2) = 1 - 3/6
        (5, 2, 3, 0.9),  # 1 - C(3,3)/C(5,3) = 1 - 1/10
        (5, 2, 2, 0.7),  # 1 - C(3,2)/C(5,2) = 1 - 3/10
        (10, 3, 1, 0.3),  # pass@1 = c/n
        (4, 0, 2, 0.0),
        (4, 4, 2, 1.0),
        (4, 3, 2, 1.0),  # n - c = 1 < k: every pair contains a correct sample
        (1, 1, 1, 1.0),
        (1, 0, 1, 0.0),
    ],
)
def test_pass_at_k_hand_values(n: int, c: int, k: int, expected: float) -> None:
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_matches_binomial_formula() -> None:
    for n in range(1, 17):
        for c in range(n + 1):
            for k in range(1, n + 1):
                direct = 1.0 - math.comb(n - c, k) / math.comb(n, k)
                assert pass_at_k(n, c, k) == pytest.approx(direct, abs=1e-12), (n, c, k)


@pytest.mark.parametrize(("n", "c", "k"), [(4, 5, 1), (4, -1, 1), (4, 1, 0), (4, 1, 5), (0, 0, 1)])
def test_pass_at_k_rejects_bad_arguments(n: int, c: int, k: int) -> None:
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)


def test_curve_power_of_two_n() -> None:
    # Prompt A: 1 of 4 correct; prompt B: none.
    # pass@1 = (1/4 + 0)/2, pass@2 = (1/2 + 0)/2, pass@4 = (1 + 0)/2.
    curve = pass_at_k_curve([1, 0], n=4)
    assert list(curve) == ["1", "2", "4"]
    assert curve["1"] == pytest.approx(0.125)
    assert curve["2"] == pytest.approx(0.25)
    assert curve["4"] == pytest.approx(0.5)


def test_curve_adds_n_when_not_power_of_two() -> None:
    # c=2 of n=5: pass@1 = 0.4, pass@2 = 1 - 3/10, pass@4 = 1 (n-c=3 < 4), pass@5 = 1.
    curve = pass_at_k_curve([2], n=5)
    assert list(curve) == ["1", "2", "4", "5"]
    assert curve["1"] == pytest.approx(0.4)
    assert curve["2"] == pytest.approx(0.7)
    assert curve["4"] == 1.0
    assert curve["5"] == 1.0


def test_curve_n_one() -> None:
    assert pass_at_k_curve([1, 0, 0, 1], n=1) == {"1": 0.5}


def test_curve_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError):
        pass_at_k_curve([], n=4)
    with pytest.raises(ValueError):
        pass_at_k_curve([5], n=4)
    with pytest.raises(ValueError):
        pass_at_k_curve([0], n=0)
