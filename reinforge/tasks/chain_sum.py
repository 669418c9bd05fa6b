"""Chain sums: "3+5+7+2=" -> "3+5=08\\n08+7=15\\n15+2=17\\n", a multi-step task with a final-answer verifier.

Owns the problem distribution, its prompt format, the teacher's step-by-step solutions (one running
partial sum per line), the wrong solutions (one step miscalculated, the error carried to the end)
and the ground-truth correctness of each step. It exists so that process rewards (rewards/process.py)
have a built-in task whose solutions are made of steps: the verifier reads only the final answer, as
Math-Shepherd's does (arXiv 2312.08935), and a process reward model must learn which step went wrong.
"""

from __future__ import annotations

import random
import re
from typing import Any

from reinforge.tasks.arithmetic import _change_one_digit
from reinforge.tasks.base import Example, Task
from reinforge.verifiers.arithmetic import verify_integer

_MAX_TERMS = 6
_MAX_DIGITS = 4
_STEP = re.compile(r"([0-9]+)\+([0-9]+)=([0-9]+)", re.ASCII)


def final_answer(completion: str) -> str | None:
    """The text after the completion's last "=", stripped; None without an "=". """
    head, equals, tail = completion.rpartition("=")
    return tail.strip() if equals else None


def verify_chain_sum(completion: str, gold: str) -> float:
    """1.0 iff the completion's final answer (after its last "=") is the integer `gold` (verify_integer's
    rule: surrounding whitespace stripped, leading zeros allowed); 0.0 without an "=". The steps before
    it are not checked: that is what a process reward is for. Never raises."""
    if not isinstance(completion, str):
        return 0.0
    answer = final_answer(completion)
    return 0.0 if answer is None else verify_integer(answer, gold)


class ChainSumTask(Task):
    """The sum of `terms` numbers of `digits` digits, written as running partial sums, one per line.

    Prompt: "3+5+7+2=" (operands zero-padded to `digits` with `zero_pad`: "12+34+07=" for digits=2).
    Teacher solution: one line per addition, "3+5=08\\n08+7=15\\n15+2=17\\n": each line adds the next
    number to the previous line's result; partial sums are zero-padded to the width of the largest
    possible total (2 digits for four 1-digit numbers), so that every digit sits at the same place in
    every solution, as the arithmetic task pads for the built-in character model. The verifier checks
    the final answer only. The defaults are those a PRM of the built-in model's size learns to judge
    (docs/process-rewards.md: at digits=2 it did not).
    """

    name = "chain_sum"
    # Four 1-digit terms: an 8-character prompt and a 21-character solution (+ eos), in the built-in
    # model's 64 positions; 32 new tokens also hold three 2-digit terms (20 characters) or four (30).
    preset: dict[str, Any] = {
        "rollout": {"max_new_tokens": 32},
    }

    def __init__(self, seed: int = 0, terms: int = 4, digits: int = 1, eval_fraction: float = 0.2,
                 zero_pad: bool = True) -> None:
        if not isinstance(terms, int) or not 2 <= terms <= _MAX_TERMS:
            raise ValueError(f"terms must be an int in [2, {_MAX_TERMS}], got {terms!r}")
        if not isinstance(digits, int) or not 1 <= digits <= _MAX_DIGITS:
            raise ValueError(f"digits must be an int in [1, {_MAX_DIGITS}], got {digits!r}")
        super().__init__(seed=seed, eval_fraction=eval_fraction)
        self.terms, self.digits, self.zero_pad = terms, digits, zero_pad
        self.sum_width = len(str(terms * (10**digits - 1))) if zero_pad else 0

    def _sample_problem(self, rng: random.Random) -> Example:
        numbers = [rng.randint(0, 10**self.digits - 1) for _ in range(self.terms)]
        width = self.digits if self.zero_pad else 0
        return Example(prompt="+".join(f"{n:0{width}d}" for n in numbers) + "=", answer=str(sum(numbers)),
                       meta={"numbers": numbers})

    def _space_size(self) -> int:
        return (10**self.digits) ** self.terms

    def reward(self, example: Example, completion: str) -> float:
        return verify_chain_sum(completion, example.answer)

    def _solution(self, numbers: list[int], sums: list[int]) -> str:
        """The lines "left+number=sum\\n", left the previous line's sum (the first number on the first line)."""
        width = self.digits if self.zero_pad else 0
        lines, left = [], f"{numbers[0]:0{width}d}"
        for number, total in zip(numbers[1:], sums, strict=True):
            result = f"{total:0{self.sum_width}d}"
            lines.append(f"{left}+{number:0{width}d}={result}\n")
            left = result
        return "".join(lines)

    def teacher_completion(self, example: Example, rng: random.Random) -> str:
        numbers = example.meta["numbers"]
        sums = [sum(numbers[: i + 1]) for i in range(1, len(numbers))]
        return self._solution(numbers, sums)

    def corrupt_completion(self, example: Example, rng: random.Random) -> str:
        """One step, drawn uniformly, miscalculated (a digit changed, or off by 1..10, never negative);
        the steps after it add correctly to the wrong sum, so the final answer is wrong and only the
        steps from the error on are wrong: a process error that the final answer alone cannot place."""
        numbers = example.meta["numbers"]
        wrong_at = rng.randrange(len(numbers) - 1)
        sums, total = [], numbers[0]
        for i, number in enumerate(numbers[1:]):
            total += number
            if i == wrong_at:
                total = _near_miss(total, rng)
            sums.append(total)
        return self._solution(numbers, sums)

    def step_correct(self, example: Example, steps: list[str]) -> list[bool]:
        """Ground truth per step: every step up to and including this one is a line "left+number=sum" with
        left the previous step's sum (the first number first), number the next term, and sum their value;
        a step after a wrong one is wrong (its prefix cannot be completed into a right solution the way
        the teacher writes one). Steps are split as process rewards split them (rewards/process.split_steps)."""
        numbers = example.meta["numbers"]
        out, left, ok = [], numbers[0], True
        for i, step in enumerate(steps):
            match = _STEP.fullmatch(step.strip())
            ok = ok and match is not None and i + 1 < len(numbers) and int(match[1]) == left \
                and int(match[2]) == numbers[i + 1] and int(match[3]) == left + numbers[i + 1]
            if ok:
                left = int(match[3])
            out.append(ok)
        return out


def _near_miss(value: int, rng: random.Random) -> int:
    """A value near `value`, different from it and >= 0."""
    while True:
        if rng.random() < 0.5:
            wrong = _change_one_digit(value, rng)
        else:
            wrong = value + rng.choice([-1, 1]) * rng.randint(1, 10)
        if wrong != value and wrong >= 0:
            return wrong
