"""The built-in multiply_tool task played by an agent function through the OpenAI-compatible endpoint:

    reinforge train task.name=multiply_tool task.agent=examples/multiply_agent.py:solve

The same episodes as the in-process tool rollout (`reinforge train task.name=multiply_tool`): the model
calls the calculator, gets its result, answers; the reward is the task's verifier on the answer.
"""

from __future__ import annotations

import json

from transformers.utils import get_json_schema

from reinforge.tasks.multiply_tool import calculator
from reinforge.verifiers.arithmetic import verify_integer

TOOLS = [get_json_schema(calculator)]


def solve(client, row: dict) -> float:
    messages = [{"role": "user", "content": row["prompt"]}]
    for _ in range(2):                                  # the task's two turns: the call, the answer
        message = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS).choices[0].message
        messages.append(message)
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            try:
                result = calculator(**json.loads(call.function.arguments))
            except Exception as err:  # noqa: BLE001 - the model's arguments: it is told what went wrong
                result = f"Error: {err}"
            messages.append({"role": "tool", "tool_call_id": call.id, "name": call.function.name, "content": result})
    return verify_integer(message.content or "", row["answer"])
