"""TRL's `environment_factory` classes, trained as they are: `task.agent=module:Class`.

TRL's GRPOTrainer (trl 1.x) plays such a class as follows, and so does this adapter, through the endpoint:
one instance per episode, constructed with no arguments; `reset(**row)` with the dataset row's fields,
whose string return (if any) is appended to the last message of the prompt; the class's public methods
(every function not starting with `_`, besides `reset` and `get_reward`) are the model's tools, their
schemas read from type hints and docstrings (`transformers.utils.get_json_schema`); the model's calls are
run and their results (an exception: `{"error": ...}`) go back as tool messages until a turn calls no
tool (or the episode's rollout.max_turns calls are made); `get_reward()` is the episode's reward.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable
from typing import Any

from reinforge.errors import ConfigError

_KEY = "task.agent"


def trl_agent(cls: type, name: str) -> Callable[[Any, dict], float]:
    """The agent function that plays `cls` (checked now: ConfigError naming task.agent for a class TRL
    would refuse, or that reinforge cannot score)."""
    where = f"{_KEY}={name!r}"
    members = dict(inspect.getmembers(cls, predicate=inspect.isfunction))
    if "reset" not in members:
        raise ConfigError(f"{where}: {cls.__name__} has no reset method; a TRL environment_factory class defines "
                          "reset(**row) -> str | None, its tools as public methods, and get_reward() -> float")
    if "get_reward" not in members:
        raise ConfigError(f"{where}: {cls.__name__} has no get_reward(): its episodes would have no reward (TRL "
                          "scores them with reward_funcs; here the environment scores them, with get_reward)")
    tool_names = sorted(k for k in members if k not in ("reset", "get_reward") and not k.startswith("_"))
    try:
        probe = cls()
        schemas = [_schema(getattr(probe, k)) for k in tool_names]
    except Exception as err:  # the class's own constructor, or a method without the hints a schema needs
        raise ConfigError(f"{where}: {type(err).__name__}: {err}") from None

    def agent(client: Any, row: dict) -> float:
        import openai

        env = cls()
        observation = env.reset(**row)
        prompt = row.get("prompt", "")
        messages = [dict(m) for m in prompt] if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}]
        if isinstance(observation, str):
            messages[-1] = {**messages[-1], "content": str(messages[-1].get("content") or "") + observation}
        tools = {k: getattr(env, k) for k in tool_names}
        while True:
            try:
                reply = client.chat.completions.create(model="policy", messages=messages, tools=schemas or None)
            except openai.BadRequestError as err:
                if getattr(err, "code", None) in ("call_limit", "context_length_exceeded"):
                    break            # the episode's calls or the model's positions are spent: scored as it stands
                raise
            message = reply.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                break
            for call in message.tool_calls:
                messages.append({"role": "tool", "tool_call_id": call.id, "name": call.function.name,
                                 "content": _run(tools, call.function.name, call.function.arguments)})
        return env.get_reward()

    agent.__name__ = f"trl_{cls.__name__}"
    return agent


def _schema(method: Callable[..., Any]) -> dict:
    from transformers.utils import get_json_schema

    return get_json_schema(method)


def _run(tools: dict[str, Callable[..., Any]], name: str, arguments: str) -> str:
    """A tool call's result as the message's text; what fails is the error TRL would report."""
    if name not in tools:
        return json.dumps({"error": f"unknown tool {name!r}; the tools are {sorted(tools)}"})
    try:
        result = tools[name](**json.loads(arguments))
    except Exception as err:  # the model's arguments or the tool's own failure: the model is told
        return json.dumps({"error": str(err)})
    return result if isinstance(result, str) else json.dumps(result) if isinstance(result, dict | list) \
        else str(result)
