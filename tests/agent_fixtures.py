"""Environments for tests/e2e/test_agent_training.py, written as a user would: no reinforge import."""

from __future__ import annotations


class CountDown:
    """Say something; the environment asks twice for more, then scores the last turn's length (longer: better)."""

    def __init__(self) -> None:
        self.turns = 0

    def reset(self, row: dict) -> list[dict]:
        return [{"role": "system", "content": "Be brief."}, {"role": "user", "content": str(row["prompt"])}]

    def step(self, text: str) -> tuple[list[dict], float, bool]:
        self.turns += 1
        if self.turns < 3:
            return [{"role": "user", "content": "And then?"}], 0.0, False
        return [], min(1.0, len(text) / 20), True


class Broken:
    """Raises on the second turn of every episode."""

    def __init__(self) -> None:
        self.turns = 0

    def reset(self, row: dict) -> list[dict]:
        return [{"role": "user", "content": str(row["prompt"])}]

    def step(self, text: str) -> tuple[list[dict], float, bool]:
        self.turns += 1
        if self.turns == 2:
            raise RuntimeError("the simulator crashed")
        return [{"role": "user", "content": "more"}], 1.0, False


class Guess:
    """Rows hold only the number to find: {"target": 7}."""

    def reset(self, row: dict) -> list[dict]:
        self.target = int(row["target"])
        return [{"role": "user", "content": "Guess a number from 1 to 12."}]

    def step(self, text: str) -> tuple[list[dict], float, bool]:
        return [], float(str(self.target) in text), True


class PerTurn(CountDown):
    """CountDown's three turns, each scored by its length (longer: better)."""

    def step(self, text: str) -> tuple[list[dict], float, bool]:
        reply, _, done = super().step(text)
        return reply, min(1.0, len(text) / 20), done


class NoStart:
    """Raises in reset for rows whose prompt mentions 1 (about a quarter of the test rows), plays one turn otherwise."""

    def reset(self, row: dict) -> list[dict]:
        if "1" in str(row["prompt"]):
            raise ValueError("no such level")
        return [{"role": "user", "content": str(row["prompt"])}]

    def step(self, text: str) -> tuple[list[dict], float, bool]:
        return [], float(len(text) > 3), True


class NeverStarts:
    """Every reset raises: no episode gets a model turn."""

    def reset(self, row: dict) -> list[dict]:
        raise RuntimeError("the simulator is down")

    def step(self, text: str) -> tuple[list[dict], float, bool]:
        return [], 0.0, True
