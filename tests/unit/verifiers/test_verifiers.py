"""Verifiers on hand-picked right, wrong and malformed completions."""

from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reinforge.models.charset import CHARSET
from reinforge.verifiers import verify_countdown, verify_integer
from reinforge.verifiers.countdown import MAX_NESTING, evaluate_countdown


@pytest.mark.parametrize(
    ("completion", "gold", "expected"),
    [
        ("46", "46", 1.0),
        ("46 ", "46", 1.0),  # surrounding whitespace is stripped
        (" 46\n", "46", 1.0),
        ("0046", "46", 1.0),  # compared by value: leading zeros accepted (documented)
        ("-2", "-2", 1.0),
        ("-0", "0", 1.0),
        ("1" * 20, "1" * 20, 1.0),  # exactly at the 20-character cap
        ("45", "46", 0.0),
        ("-46", "46", 0.0),
        ("", "46", 0.0),
        ("   ", "46", 0.0),
        ("4 6", "46", 0.0),
        ("46abc", "46", 0.0),
        ("46=", "46", 0.0),
        ("+46", "46", 0.0),
        ("46.0", "46", 0.0),
        ("--46", "46", 0.0),
        ("1" * 21, "1" * 21, 0.0),  # over the cap: rejected even though equal
        ("9" * 10_000, "46", 0.0),
        ("\u0664\u0666", "46", 0.0),  # Arabic-Indic "46": ASCII digits only
        ("46", "abc", 0.0),  # malformed gold never matches
    ],
)
def test_verify_integer(completion: str, gold: str, expected: float) -> None:
    assert verify_integer(completion, gold) == expected


def test_verify_integer_non_string_is_zero() -> None:
    assert verify_integer(None, "46") == 0.0  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("completion", "numbers", "target", "expected"),
    [
        ("3*5+7", [3, 5, 7], 22, 1.0),
        ("7+3*5", [3, 5, 7], 22, 1.0),  # precedence: 7+15
        (" 7 + 3 * 5 ", [3, 5, 7], 22, 1.0),  # spaces are allowed
        ("(3+5)*7", [3, 5, 7], 56, 1.0),
        ("3+5*7", [3, 5, 7], 56, 0.0),  # = 38
        ("3+5", [3, 5, 7], 8, 1.0),  # not every number has to be used
        ("5-3", [3, 5], 2, 1.0),
        ("10-3-5", [3, 5, 10], 2, 1.0),  # left-associative: (10-3)-5
        ("10-(3-5)", [3, 5, 10], 12, 1.0),
        ("8/2/2", [2, 2, 8], 2, 1.0),  # (8/2)/2
        ("6/(1-3/4)", [1, 3, 4, 6], 24, 1.0),  # exact fractions: 6/(1/4)
        ("(1+7)/2", [1, 2, 7], 4, 1.0),
        ("03+5", [3, 5], 8, 1.0),  # literals compared by value (documented)
        ("3*3+5", [3, 3, 5], 14, 1.0),  # 3 given twice, used twice
        ("3*3+5", [3, 5], 14, 0.0),  # 3 given once, used twice
        ("3+4", [3, 5], 7, 0.0),  # 4 not given
        ("-3+5", [3, 5], 2, 0.0),  # unary minus not allowed
        ("5+-3", [3, 5], 2, 0.0),
        ("5-(-3)", [3, 5], 8, 0.0),
        ("1/0", [0, 1], 1, 0.0),  # division by zero
        ("1/(2-2)", [1, 2, 2], 1, 0.0),
        ("", [3, 5], 8, 0.0),
        ("   ", [3, 5], 8, 0.0),
        ("()", [3, 5], 8, 0.0),
        ("(3+5", [3, 5], 8, 0.0),
        ("3+5)", [3, 5], 8, 0.0),
        (")3+5(", [3, 5], 8, 0.0),
        ("3++5", [3, 5], 8, 0.0),
        ("3+", [3, 5], 3, 0.0),
        ("3 5", [3, 5], 8, 0.0),  # two numbers with no operator
        ("35", [3, 5], 35, 0.0),  # digits do not concatenate numbers
        ("2.5*4", [2, 4, 5], 10, 0.0),  # no decimals
        ("3*5+7=22", [3, 5, 7], 22, 0.0),  # trailing garbage
        ("3+5 is 8", [3, 5], 8, 0.0),
        ("3\t+5", [3, 5], 8, 0.0),  # only plain spaces inside
        ("3^2", [2, 3], 9, 0.0),
        ("\uff13+5", [3, 5], 8, 0.0),  # full-width digit
    ],
)
def test_verify_countdown(
    completion: str, numbers: list[int], target: int, expected: float
) -> None:
    assert verify_countdown(completion, numbers, target) == expected


def test_countdown_value_is_exact() -> None:
    assert evaluate_countdown("6/(1-3/4)", [1, 3, 4, 6]) == Fraction(24)
    assert evaluate_countdown("1/3", [1, 3]) == Fraction(1, 3)
    assert evaluate_countdown("1/(2-2)", [1, 2, 2]) is None


def test_countdown_length_cap() -> None:
    ones = [1] * 150
    expr_99 = "+".join(["1"] * 99)  # 197 characters
    assert len(expr_99) == 197
    assert verify_countdown(expr_99, ones, 99) == 1.0
    expr_101 = "+".join(["1"] * 101)  # 201 characters
    assert verify_countdown(expr_101, ones, 101) == 0.0
    assert verify_countdown("1" * 100_000, [1], 1) == 0.0


def test_countdown_nesting_cap() -> None:
    ok = "(" * MAX_NESTING + "3" + ")" * MAX_NESTING
    too_deep = "(" * (MAX_NESTING + 1) + "3" + ")" * (MAX_NESTING + 1)
    assert verify_countdown(ok, [3], 3) == 1.0
    assert verify_countdown(too_deep, [3], 3) == 0.0
    assert verify_countdown("(" * 99 + "3" + ")" * 99, [3], 3) == 0.0
    assert verify_countdown("(" * 200, [3], 3) == 0.0


def test_countdown_non_string_is_zero() -> None:
    assert verify_countdown(None, [3, 5], 8) == 0.0  # type: ignore[arg-type]


_EXPRESSION_CHARS = "0123456789+-*/() "


@settings(max_examples=200, deadline=None)
@given(
    text=st.one_of(
        st.text(alphabet=_EXPRESSION_CHARS, max_size=60),
        st.text(alphabet=CHARSET, max_size=60),
        st.text(max_size=60),
    ),
    numbers=st.lists(st.integers(min_value=0, max_value=20), min_size=1, max_size=5),
    target=st.integers(min_value=-50, max_value=200),
)
def test_verifiers_never_raise(text: str, numbers: list[int], target: int) -> None:
    assert verify_countdown(text, numbers, target) in (0.0, 1.0)
    assert verify_integer(text, str(target)) in (0.0, 1.0)
