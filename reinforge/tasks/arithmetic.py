"""Integer arithmetic: "12+34=" -> "46".

Owns the arithmetic problem distribution, its prompt format, and its right and
wrong completions. Verification lives in `reinforge.verifiers.arithmetic`.
"""

from __future__ import annotations

import random
from typing import Any

from reinforge.tasks.base import Example, Task
from reinforge.verifiers.arithmetic import MAX_INTEGER_CHARS, verify_integer

_VALID_OPERATORS = "+-*"
# 9-digit operands keep a product at 18 digits, inside the verifier's length cap.
_MAX_DIGITS = 9
assert 2 * _MAX_DIGITS + 1 <= MAX_INTEGER_CHARS


def _apply(a: int, op: str, b: int) -> int:
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    return a * b


class ArithmeticTask(Task):
    """Binary integer arithmetic with `digits`-digit operands (each in [0, 10**digits - 1]).

    Prompt: "{a}{op}{b}=". Gold answer: the exact result as a plain integer,
    e.g. "46" (negative for "-"); the verifier compares values, so "046" is right.

    With `zero_pad` (the default) everything is written at fixed width: the
    prompt "005+034=" and the teacher's answer "0039" (width digits + 1 for "+",
    digits for "-", 2 * digits for "*"). Every digit then sits at the same
    position in every example, which helps the tiny built-in character model
    find the digit alignment (and carrying) within a few hundred SFT steps. Without padding
    (`zero_pad=False`): "5+34=" -> "39".

    With `trailing_max` > 0 the teacher ends its answers with k spaces, k long-tailed:
    P(k >= x) = (x + 1)^-trailing_alpha (a discrete Pareto), capped at trailing_max. The
    verifier strips them, so they change no reward; a model trained on these traces writes
    completions whose lengths have the long tail of reasoning traces (most short, a few
    near the cap), which is what asynchronous training is for (benchmarks/async_throughput.py).
    """

    name = "arithmetic"
    # Cold-start SFT in batches of 128 instead of the default 256, the same 600 steps, from 600 x 128 traces:
    # half the job's SFT time (and half the traces to make and tokenize first). Held-out pass@1 after RL
    # 0.58 -> 0.88 against 0.63 -> 0.92 at 256 (BENCHMARKS.md, "Wall-time budgets"); `make run` is mostly SFT.
    preset: dict[str, Any] = {"sft": {"batch_size": 128, "num_examples": 76800}}

    def __init__(
        self,
        seed: int = 0,
        digits: int = 3,
        operators: str = "+",
        eval_fraction: float = 0.2,
        zero_pad: bool = True,
        trailing_max: int = 0,
        trailing_alpha: float = 1.0,
    ) -> None:
        if not isinstance(digits, int) or not 1 <= digits <= _MAX_DIGITS:
            raise ValueError(f"digits must be an int in [1, {_MAX_DIGITS}], got {digits!r}")
        if not operators or any(op not in _VALID_OPERATORS for op in operators):
            raise ValueError(
                f"operators must be a non-empty subset of {_VALID_OPERATORS!r}, got {operators!r}"
            )
        if not isinstance(trailing_max, int) or trailing_max < 0:
            raise ValueError(f"trailing_max must be an int >= 0, got {trailing_max!r}")
        if not trailing_alpha > 0:
            raise ValueError(f"trailing_alpha must be > 0, got {trailing_alpha!r}")
        super().__init__(seed=seed, eval_fraction=eval_fraction)
        self.trailing_max, self.trailing_alpha = trailing_max, trailing_alpha
        self.digits = digits
        self.zero_pad = zero_pad
        # Deduplicated in a fixed order so "++" samples like "+" and the stream is stable.
        self.operators = "".join(op for op in _VALID_OPERATORS if op in operators)

    def _sample_problem(self, rng: random.Random) -> Example:
        high = 10**self.digits - 1
        a = rng.randint(0, high)
        op = rng.choice(self.operators)
        b = rng.randint(0, high)
        width = self.digits if self.zero_pad else 0
        return Example(
            prompt=f"{a:0{width}d}{op}{b:0{width}d}=",
            answer=str(_apply(a, op, b)),
            meta={"a": a, "op": op, "b": b},
        )

    def _split_key(self, example: Example) -> str:
        # "12+34" and "34+12" go to the same split, so held-out sums are not
        # just commuted training sums.
        a, op, b = example.meta["a"], example.meta["op"], example.meta["b"]
        if op in "+*":
            a, b = min(a, b), max(a, b)
        return f"{a}{op}{b}"

    def _space_size(self) -> int:
        return (10**self.digits) ** 2 * len(self.operators)

    def reward(self, example: Example, completion: str) -> float:
        return verify_integer(completion, example.answer)

    def _format_answer(self, value: int, op: str) -> str:
        """The teacher's way of writing a result: fixed width under `zero_pad`."""
        if not self.zero_pad:
            return str(value)
        width = {"+": self.digits + 1, "-": self.digits, "*": 2 * self.digits}[op]
        return ("-" if value < 0 else "") + f"{abs(value):0{width}d}"

    def teacher_completion(self, example: Example, rng: random.Random) -> str:
        return self._format_answer(int(example.answer), example.meta["op"]) + self._trailing(rng)

    def _trailing(self, rng: random.Random) -> str:
        """k spaces, P(k >= x) = (x + 1)^-alpha up to the cap (none without trailing_max)."""
        if not self.trailing_max:
            return ""
        u = 1.0 - rng.random()                       # in (0, 1]
        return " " * min(self.trailing_max, int(u ** (-1.0 / self.trailing_alpha)) - 1)

    def corrupt_completion(self, example: Example, rng: random.Random) -> str:
        """A near miss: one digit changed, or a small nonzero offset."""
        answer = int(example.answer)
        while True:
            if rng.random() < 0.5:
                wrong = _change_one_digit(answer, rng)
            else:
                wrong = answer + rng.choice([-1, 1]) * rng.randint(1, 10)
            if wrong != answer:
                return self._format_answer(wrong, example.meta["op"]) + self._trailing(rng)


def _change_one_digit(value: int, rng: random.Random) -> int:
    sign = "-" if value < 0 else ""
    digits = list(str(abs(value)))
    i = rng.randrange(len(digits))
    # No leading zero on a multi-digit number: it would not look like a real answer.
    choices = [
        d for d in "0123456789" if d != digits[i] and not (i == 0 and d == "0" and len(digits) > 1)
    ]
    digits[i] = rng.choice(choices)
    return int(sign + "".join(digits))
