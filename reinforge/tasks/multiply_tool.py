"""Multiplication with a calculator tool: "123*456=" -> a `calculator` call, its result, the answer.

The built-in agentic task. Multiplying two 3-digit numbers in one pass is beyond the tiny
built-in model (it cannot carry through a six-digit product from a few thousand SFT traces), but
copying the expression into a tool call and the tool's result into the answer is within its
reach: the model learns to use the tool. Its teacher traces are conversations, the model's turns
and the tool's results (the results are context, not trained on); without tools
(`rollout.tools=[]`) the teacher answers directly, which is the baseline the tool beats.
"""

from __future__ import annotations

import json
import random
from typing import Any

from reinforge.tasks.arithmetic import ArithmeticTask, _change_one_digit
from reinforge.tasks.base import Example
from reinforge.verifiers.arithmetic import verify_integer

TOOL = "reinforge.tasks.multiply_tool:calculator"
# The Hermes tags, one token each in the built-in tokenizer as in Qwen2.5's (where they are added tokens): a
# conversation is then 74 tokens instead of 124, 54 of which spelt the four tags, so SFT and rollouts are shorter.
TAGS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")


def calculator(expression: str) -> str:
    """Evaluate an integer arithmetic expression with +, -, * and parentheses.

    Args:
        expression: The expression, for example "123*456" or "(12+3)*4".
    """
    parser = _Parser(expression.replace(" ", ""))
    value = parser.sum()
    if parser.at != len(parser.text):
        raise ValueError(f"unexpected {parser.text[parser.at]!r} at position {parser.at} of {expression!r}")
    return str(value)


class _Parser:
    """Recursive descent over `text`: sum := product (('+'|'-') product)*, product := atom ('*' atom)*,
    atom := digits | '-' atom | '(' sum ')'. Leading zeros are allowed ("012" is 12), unlike Python's
    own literals; at most 40 digits a number, so no call can take long."""

    def __init__(self, text: str):
        self.text, self.at = text, 0

    def peek(self) -> str:
        return self.text[self.at] if self.at < len(self.text) else ""

    def sum(self) -> int:
        value = self.product()
        while self.peek() in ("+", "-"):
            op = self.peek()
            self.at += 1
            value = value + self.product() if op == "+" else value - self.product()
        return value

    def product(self) -> int:
        value = self.atom()
        while self.peek() == "*":
            self.at += 1
            value *= self.atom()
            if abs(value) > 10**80:
                raise ValueError("the result is too large")
        return value

    def atom(self) -> int:
        c = self.peek()
        if c == "-":
            self.at += 1
            return -self.atom()
        if c == "(":
            self.at += 1
            value = self.sum()
            if self.peek() != ")":
                raise ValueError(f"missing ')' at position {self.at}")
            self.at += 1
            return value
        start = self.at
        while self.peek().isdigit() and self.peek().isascii():
            self.at += 1
        if start == self.at:
            raise ValueError(f"expected a number at position {start}" + (f", got {c!r}" if c else ""))
        if self.at - start > 40:
            raise ValueError("a number has more than 40 digits")
        return int(self.text[start:self.at])


def tool_call(expression: str) -> str:
    """The Hermes-form call of the calculator, compact JSON (fewer tokens for the built-in model to write),
    its arguments first: the model copies the prompt's expression from fewer positions back."""
    body = json.dumps({"arguments": {"expression": expression}, "name": "calculator"}, separators=(",", ":"))
    return f"<tool_call>{body}</tool_call>"


class MultiplyToolTask(ArithmeticTask):
    """`digits`-digit multiplication, zero-padded ("012*345="), answered with the calculator's help."""

    name = "multiply_tool"
    tools = (TOOL,)
    # The conversation is ~120 characters, 74 tokens with the tags as tokens: room for it in the built-in
    # model and for a whole call in one turn; two turns (the call, the answer), so a malformed call is not
    # rescued by a retry. The cold start's learning rate is lower than single-turn arithmetic's: at 3e-3 the
    # model learnt the call's form but not to copy digits within 600 steps; at 1e-3 copying appears at ~200
    # steps (its loss falls from 0.40 to 0.09 between steps 175 and 225), and 300 steps on the same schedule
    # never get there. After 400 steps greedy decoding is right on the held-out problems while sampled pass@1
    # is ~0.47 (the noisy traces' mass on miscopies and guesses), which RL raises; its learning rate is 2x
    # the default, as only a few of each trajectory's ~70 tokens decide its reward. RL runs 80 steps of 12
    # prompts: from the cold start of an Intel Xeon (held-out pass@1 0.463), +0.177 / +0.152 / +0.150 with seeds
    # 0 / 1 / 2 (greedy 0.98-0.99), where 110 steps of 8 (880 prompts against 960, in smaller updates) gave +0.169 with
    # seed 1 and +0.005 with seed 0, whose last steps left a policy that loops on digits (greedy 1.00 -> 0.77).
    # On the AMD EPYC 80 x 12 gave +0.174 (seed 0) and +0.133 (seed 1), 110 x 8 +0.182 and +0.133 (BENCHMARKS.md).
    preset: dict[str, Any] = {
        "model": {"max_positions": 160, "added_tokens": list(TAGS)},
        "rollout": {"max_new_tokens": 96, "max_turns": 2},
        "sft": {"steps": 400, "batch_size": 64, "num_examples": 25600, "lr": 1e-3},
        "train": {"steps": 80, "prompts_per_step": 12, "lr": 1e-4},
        "eval": {"num_prompts": 100, "every": 0},
    }

    def __init__(self, seed: int = 0, digits: int = 3, eval_fraction: float = 0.2) -> None:
        super().__init__(seed=seed, digits=digits, operators="*", eval_fraction=eval_fraction, zero_pad=True)

    def reward(self, example: Example, completion: str) -> float:
        return verify_integer(completion, example.answer)

    def _expression(self, example: Example) -> str:
        return example.prompt.removesuffix("=")

    def teacher_turns(self, example: Example, rng: random.Random) -> list[dict[str, str]]:
        expression = self._expression(example)
        result = calculator(expression)
        return _conversation(expression, result, result)

    def corrupt_turns(self, example: Example, rng: random.Random) -> list[dict[str, str]]:
        """A miscopied operand (the tool then answers another product), a miscopied result, or a guess
        without the tool: each wrong."""
        expression, answer = self._expression(example), int(example.answer)
        while True:
            kind = rng.randrange(3)
            if kind == 0:
                a, b = expression.split("*")
                wrong = [a, b]
                side = rng.randrange(2)
                wrong[side] = f"{_change_one_digit(int(wrong[side]), rng):0{len(wrong[side])}d}"[-len(wrong[side]):]
                call = "*".join(wrong)
                result = calculator(call)
                turns = _conversation(call, result, result)
                final = int(result)
            elif kind == 1:
                final = _change_one_digit(answer, rng)
                turns = _conversation(expression, str(answer), str(final))
            else:
                final = answer + rng.choice([-1, 1]) * rng.randint(1, 1000)
                turns = [{"role": "assistant", "content": str(final)}]
            if final != answer:
                return turns


def _conversation(expression: str, result: str, answer: str) -> list[dict[str, str]]:
    return [
        {"role": "assistant", "content": tool_call(expression)},
        {"role": "tool", "name": "calculator", "content": result},
        {"role": "assistant", "content": answer},
    ]
