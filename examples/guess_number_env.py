"""An environment of your own: a number-guessing game, in the protocol reinforge calls (no reinforge import).

Train on it with

    reinforge train task.name=dataset task.options.path=examples/guess_number_rows.jsonl \
        task.environment=examples/guess_number_env.py:GuessNumber

Each dataset row holds the number to find, e.g. `{"target": 37}` (and optionally its range, `low` and
`high`); it needs no prompt nor answer, since the environment writes the opening and scores the game. The model guesses,
the environment answers "higher" or "lower", and the game ends when the guess is right or the guesses
run out. The protocol is two methods:

* `reset(row) -> list[dict]`: the opening chat messages for this row (at least one);
* `step(text) -> (reply messages, reward, done)`: the model's turn as text in; the messages that answer
  it, this turn's reward (a finite float) and whether the game is over out.

reinforge constructs the class with no arguments, one instance per trajectory, so per-game state
lives on `self`. A `step` that raises ends that trajectory with the error recorded and no gradient
from it; the run goes on.
"""

from __future__ import annotations

import re


class GuessNumber:
    """Find a whole number in [low, high] in at most `max_guesses` tries; 1.0 for finding it."""

    def __init__(self, max_guesses: int = 7) -> None:   # 7 guesses find any number in 1..100 by halving
        self.max_guesses = max_guesses
        self.target = 0
        self.guesses = 0

    def reset(self, row: dict) -> list[dict]:
        self.target, self.guesses = int(row["target"]), 0
        low, high = int(row.get("low", 1)), int(row.get("high", 100))
        return [
            {"role": "system", "content": "You are playing a guessing game. Answer with one whole number."},
            {"role": "user", "content": f"I am thinking of a number from {low} to {high}. "
                                        f"You have {self.max_guesses} guesses. What is your first guess?"},
        ]

    def step(self, text: str) -> tuple[list[dict], float, bool]:
        numbers = re.findall(r"-?\d+", text)
        if not numbers:   # a turn without a number costs a little and uses no guess
            return [{"role": "user", "content": "Please answer with one whole number."}], -0.1, False
        guess = int(numbers[-1])
        self.guesses += 1
        if guess == self.target:
            return [{"role": "user", "content": f"Correct, it is {guess}!"}], 1.0, True
        if self.guesses >= self.max_guesses:
            return [{"role": "user", "content": f"Out of guesses: it was {self.target}."}], 0.0, True
        hint = "higher" if guess < self.target else "lower"
        left = self.max_guesses - self.guesses
        reply = f"No, it is {hint}. {left} guess{'es' if left > 1 else ''} left."
        return [{"role": "user", "content": reply}], 0.0, False
