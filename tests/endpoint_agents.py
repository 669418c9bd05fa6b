"""Agents for tests/e2e/test_agent_functions.py, written as a user would: the `openai` client only, no
reinforge import."""

from __future__ import annotations

import json
import time

TOOLS = [{"type": "function", "function": {
    "name": "count", "description": "Count the characters of a text.",
    "parameters": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}}]


def count(text: str) -> int:
    return len(text)


def talker(client, row: dict) -> dict:
    """Three turns with a tool of its own: the model's tool calls are run, otherwise it is asked for more;
    the reward is whether its last turn starts with a letter, a digit or a space (about a third do, untrained)."""
    messages = [{"role": "user", "content": str(row["prompt"])}]
    answer = ""
    for _ in range(3):
        reply = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        message = reply.choices[0].message
        messages.append(message)
        answer = message.content or ""
        if message.tool_calls:
            for call in message.tool_calls:
                result = count(**json.loads(call.function.arguments))
                messages.append({"role": "tool", "tool_call_id": call.id, "content": str(result)})
        else:
            messages.append({"role": "user", "content": "And then?"})
    readable = answer[:1].isascii() and (answer[:1].isalnum() or answer[:1] == " ")
    return {"reward": float(readable), "turn_chars": float(len(answer))}


async def async_talker(client, row: dict) -> float:
    reply = await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": row["prompt"]}])
    return min(1.0, len(reply.choices[0].message.content or "") / 24)


def raises(client, row: dict) -> float:
    client.chat.completions.create(model="policy", messages=[{"role": "user", "content": row["prompt"]}])
    raise RuntimeError("the harness crashed")


def hangs(client, row: dict) -> float:
    client.chat.completions.create(model="policy", messages=[{"role": "user", "content": row["prompt"]}])
    if row["prompt"].endswith("0."):        # the row 'Count from 0.': its episodes never return
        time.sleep(3600)
    return 1.0


def not_a_number(client, row: dict) -> str:
    client.chat.completions.create(model="policy", messages=[{"role": "user", "content": row["prompt"]}])
    return "good"


def greedy(client, row: dict) -> float:
    """Asks for temperature 0, which the run does not sample with; catches the refusal and claims a reward."""
    try:
        client.chat.completions.create(model="policy", messages=[{"role": "user", "content": row["prompt"]}],
                                       temperature=0.0)
    except Exception:  # noqa: BLE001 - a harness that swallows errors: the refusal is still recorded
        pass
    client.chat.completions.create(model="policy", messages=[{"role": "user", "content": row["prompt"]}])
    return 1.0


class GuessTheNumber:
    """A TRL environment_factory class, as trl's GRPOTrainer(environment_factory=GuessTheNumber) takes it."""

    def reset(self, **row) -> str:
        self.target, self.solved = int(row["answer"]), False
        return " Find my number with the guess tool."

    def guess(self, number: int) -> str:
        """Guess the number.

        Args:
            number: The number guessed.
        """
        if number == self.target:
            self.solved = True
            return "correct"
        return "higher" if number < self.target else "lower"

    def get_reward(self) -> float:
        return float(self.solved)
