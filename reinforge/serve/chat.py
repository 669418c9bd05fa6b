"""Chat requests as the model's tokens, and the model's turns as OpenAI chat messages.

A request's messages are rendered by the model's chat template (reinforge/agents/render.py, the tools'
schemas passed as `apply_chat_template(..., tools=...)`). When they continue a conversation this
episode had with the endpoint (its messages start with an earlier request's messages and the answer the
endpoint gave it), the prompt is that earlier call's prompt and sampled tokens, then the template's
tokens for the new messages (`Renderer.reply`): the model's own turns are never tokenised again from
their text, so the trajectory is exactly what was sampled. Otherwise the messages are rendered whole.

The model's tool calls are read out of its text by the parser of its family (reinforge/agents/tools.py,
`TOOL_CALL_PARSERS`, the one the in-process tool rollout uses) and returned as `tool_calls`.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from reinforge.agents.render import Renderer
from reinforge.agents.tools import TOOL_CALL_PARSERS

Message = dict[str, Any]


def text_of(content: Any) -> str:
    """A message's content as text: a string, None (empty), or OpenAI content parts (their text joined)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict) and p.get("type") == "text")
    return str(content)


def _arguments(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def normal(message: Message) -> tuple:
    """What identifies a message when a later request repeats it: role, text, tool calls (name, arguments)."""
    functions = [c.get("function", {}) for c in message.get("tool_calls") or ()]
    calls = tuple((str(f.get("name")), json.dumps(_arguments(f.get("arguments")), sort_keys=True)) for f in functions)
    return (message.get("role"), text_of(message.get("content")).strip(), calls, message.get("tool_call_id"))


def template_message(message: Message) -> Message:
    """A client's message as the chat template reads it: text content, tool calls with decoded arguments."""
    out: Message = {"role": message.get("role"), "content": text_of(message.get("content"))}
    for key in ("name", "tool_call_id"):
        if message.get(key) is not None:
            out[key] = message[key]
    if message.get("tool_calls"):
        out["tool_calls"] = [{"type": "function", "id": c.get("id"),
                              "function": {"name": c.get("function", {}).get("name"),
                                           "arguments": _arguments(c.get("function", {}).get("arguments"))}}
                             for c in message["tool_calls"]]
    return out


@dataclass
class ChatThread:
    """A conversation an episode had: as the client sees it (its answer last), as the template renders it
    (the answer as the turn's text, tool-call markup included), and its tokens (prompt and sampled)."""

    client: list[tuple]       # `normal` of each message, the answer last
    rendered: list[Message]
    context: list[int]
    turn_ids: list[int]
    tools: str                # the request's tools, as JSON: a continuation must offer the same


def chat_prompt(renderer: Renderer, threads: list[ChatThread], messages: list[Message], tools_key: str
                ) -> tuple[list[int], list[Message]]:
    """The prompt tokens of a chat request and its messages as the template renders them (see the module
    docstring): a continuation of the longest thread it extends, else the messages rendered whole."""
    seen = [normal(m) for m in messages]
    for thread in sorted(threads, key=lambda t: -len(t.client)):
        n = len(thread.client)
        if thread.tools == tools_key and len(seen) > n and seen[:n] == thread.client \
                and messages[-1].get("role") != "assistant":
            new = [template_message(m) for m in messages[n:]]
            after = thread.rendered + new
            reply = renderer.reply(thread.rendered, after, thread.turn_ids)
            return thread.context + list(reply), after
    rendered = [template_message(m) for m in messages]
    return list(renderer.prompt(rendered)), rendered


def assistant_message(text: str, tools: bool, parser: str) -> tuple[Message, str]:
    """The OpenAI message of a model turn, and its finish reason: with tools in the request, the calls the
    family's parser reads become `tool_calls` (content: the text before them), finish reason 'tool_calls'."""
    if tools:
        turn = TOOL_CALL_PARSERS[parser](text)
        if turn.calls:
            calls = [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": c.name, "arguments": json.dumps(c.arguments)}} for c in turn.calls]
            return {"role": "assistant", "content": turn.text_before or None, "tool_calls": calls}, "tool_calls"
    return {"role": "assistant", "content": text}, "stop"
