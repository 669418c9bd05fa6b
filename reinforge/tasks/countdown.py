"""Countdown: combine some of the given numbers with + - * / to hit a target.

Owns the countdown problem distribution, its prompt format, the exhaustive
solver that writes teacher completions, and the wrong-but-plausible completions.
Verification lives in `reinforge.verifiers.countdown`.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator
from dataclasses import dataclass
from fractions import Fraction

from reinforge.tasks.base import Example, Task
from reinforge.verifiers.countdown import verify_countdown

_OPS = "+-*/"
_PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2}
_LEAF_PRECEDENCE = 3
# The solver enumerates ordered expression trees; beyond 5 numbers that is too slow.
_MAX_NUMBERS = 5


@dataclass(frozen=True)
class _Expr:
    """An expression tree rendered with minimal parentheses, and its exact value."""

    value: Fraction
    text: str
    precedence: int


def _combine(left: _Expr, op: str, right: _Expr) -> _Expr | None:
    """`left op right`, or None on division by zero."""
    if op == "/" and right.value == 0:
        return None
    prec = _PRECEDENCE[op]
    left_text = f"({left.text})" if left.precedence < prec else left.text
    # The parser is left-associative: a-(b+c) and a/(b*c) need their parentheses,
    # a+(b-c) and a*(b/c) do not (exact arithmetic makes them equal).
    needs = right.precedence < prec or (right.precedence == prec and op in "-/")
    right_text = f"({right.text})" if needs else right.text
    if op == "+":
        value = left.value + right.value
    elif op == "-":
        value = left.value - right.value
    elif op == "*":
        value = left.value * right.value
    else:
        value = left.value / right.value
    return _Expr(value, f"{left_text}{op}{right_text}", prec)


def _trees(values: tuple[int, ...]) -> Iterator[_Expr]:
    """Every expression over `values` in this order: all tree shapes and operators."""
    if len(values) == 1:
        yield _Expr(Fraction(values[0]), str(values[0]), _LEAF_PRECEDENCE)
        return
    for split in range(1, len(values)):
        for left in _trees(values[:split]):
            for right in _trees(values[split:]):
                for op in _OPS:
                    expr = _combine(left, op, right)
                    if expr is not None:
                        yield expr


def _ordered_subsets(numbers: list[int], size: int) -> Iterator[tuple[int, ...]]:
    # Sorted and deduplicated so repeated numbers do not repeat the search.
    return iter(sorted(set(itertools.permutations(numbers, size))))


def solve(numbers: list[int], target: int) -> str | None:
    """A shortest expression (fewest numbers, at least two) equal to `target`, or None."""
    for size in range(2, len(numbers) + 1):
        for ordered in _ordered_subsets(numbers, size):
            for expr in _trees(ordered):
                if expr.value == target:
                    return expr.text
    return None


def _random_expr(values: list[int], rng: random.Random) -> _Expr | None:
    """A random tree over `values` in the given order, or None on division by zero."""
    exprs = [_Expr(Fraction(v), str(v), _LEAF_PRECEDENCE) for v in values]
    while len(exprs) > 1:
        i = rng.randrange(len(exprs) - 1)
        combined = _combine(exprs[i], rng.choice(_OPS), exprs[i + 1])
        if combined is None:
            return None
        exprs[i : i + 2] = [combined]
    return exprs[0]


class CountdownTask(Task):
    """`num_numbers` numbers in [1, max_number] and a reachable target in [1, max_target].

    Prompt: "{n1} {n2} {n3}>{target}:", e.g. "3 5 7>24:". Answer: the target.
    Teacher completion: an expression without spaces, e.g. "3*(5+7)" (minimal
    parentheses), using as few numbers as possible. Each number may be used at
    most once; not all have to be used.
    """

    name = "countdown"

    def __init__(
        self,
        seed: int = 0,
        num_numbers: int = 3,
        max_number: int = 10,
        max_target: int = 100,
        eval_fraction: float = 0.2,
    ) -> None:
        if not isinstance(num_numbers, int) or not 2 <= num_numbers <= _MAX_NUMBERS:
            raise ValueError(
                f"num_numbers must be an int in [2, {_MAX_NUMBERS}], got {num_numbers!r}"
            )
        if not isinstance(max_number, int) or max_number < 1:
            raise ValueError(f"max_number must be an int >= 1, got {max_number!r}")
        if not isinstance(max_target, int) or max_target < 1:
            raise ValueError(f"max_target must be an int >= 1, got {max_target!r}")
        super().__init__(seed=seed, eval_fraction=eval_fraction)
        self.num_numbers = num_numbers
        self.max_number = max_number
        self.max_target = max_target

    def _sample_problem(self, rng: random.Random) -> Example:
        # Build the target from a random expression, so a solution always exists.
        # Out-of-range or fractional values are retried, then new numbers drawn.
        while True:
            numbers = [rng.randint(1, self.max_number) for _ in range(self.num_numbers)]
            for _ in range(20):
                used = rng.sample(numbers, rng.randint(2, self.num_numbers))
                expr = _random_expr(used, rng)
                if expr is None or expr.value.denominator != 1:
                    continue
                target = int(expr.value)
                if 1 <= target <= self.max_target:
                    return Example(
                        prompt=" ".join(map(str, numbers)) + f">{target}:",
                        answer=str(target),
                        meta={"numbers": numbers, "target": target},
                    )

    def _split_key(self, example: Example) -> str:
        # Reorderings of the same numbers are the same problem: keep them together.
        numbers = sorted(example.meta["numbers"])
        return f"{numbers}>{example.meta['target']}"

    def reward(self, example: Example, completion: str) -> float:
        return verify_countdown(completion, example.meta["numbers"], example.meta["target"])

    def teacher_completion(self, example: Example, rng: random.Random) -> str:
        # Deterministic (rng unused): one canonical solution per problem is easier to imitate.
        solution = solve(example.meta["numbers"], example.meta["target"])
        # None is impossible for generated problems: the target came from an expression.
        if solution is None:
            raise ValueError(f"no solution for countdown problem {example.prompt!r}")
        return solution

    def corrupt_completion(self, example: Example, rng: random.Random) -> str:
        """A well-formed expression over the numbers that misses the target."""
        numbers, target = example.meta["numbers"], example.meta["target"]
        for _ in range(100):
            used = rng.sample(numbers, rng.randint(2, len(numbers)))
            expr = _random_expr(used, rng)
            if expr is not None and expr.value != target:
                return expr.text
        # Fallback, deterministic: with two numbers a+b and a-b differ, so a miss exists.
        for ordered in _ordered_subsets(numbers, 2):
            for expr in _trees(ordered):
                if expr.value != target:
                    return expr.text
        raise AssertionError("unreachable: a+b and a-b cannot both equal the target")
