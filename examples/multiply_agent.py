"""The built-in multiply_tool task played by an agent function through the OpenAI-compatible endpoint:

    reinforge train task.name=multiply_tool task.agent=examples/multiply_agent.py:solve

The same episodes as the in-process tool rollout (`reinforge train task.name=multiply_tool`): the model
calls the calculator, gets its result, answers; the reward is the task's verifier on the answer.
"""

from __future__ import annotations

import json

import openai
from transformers.utils import get_json_schema

from reinforge.tasks.multiply_tool import calculator
from reinforge.verifiers.arithmetic import verify_integer

TOOLS = [get_json_schema(calculator)]


def solve(client, row: dict) -> float:
    messages = [{"role": "user", "content": row["prompt"]}]
    for _ in range(2):                                  # the task's two turns: the call, the answer
        try:
            message = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS).choices[0].message
        except openai.BadRequestError as err:
            # No room left for the answer (a long turn and a long tool error fill the model's positions) or the
            # run's turns are spent: the episode ends unanswered, its calls trained on with reward 0.
            if err.code in ("context_length_exceeded", "call_limit"):
                return 0.0
            raise
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
