"""Conversational prompts: a list of chat messages where a plain prompt is a string.

TRL's conversational layout and verl's parquet files give `prompt` as messages,
`[{"role": "system", "content": ...}, {"role": "user", "content": ...}]`.
Such a prompt travels through reinforge as a `Conversation`: a `str` (its
readable transcript, one "role: content" line per message) that also carries the
messages. Everything that only needs text (split hashing, logs, samples.jsonl,
a per-sample reward function's `prompt`) keeps working unchanged; the prompt
encoder (`reinforge.rollout.prompts.encode_prompts`) gives the messages, as
they are, to the tokenizer's chat template, and a TRL-style reward function
receives them as TRL passes them.

Why a `str` subclass and not a new field of `Example`: prompts cross the
rollout engines, the async sampler, SFT and DPO as `list[str]`; a subclass
keeps every one of those signatures true without touching them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

ROLES = ("system", "user", "assistant", "tool")


class Conversation(str):
    """A chat prompt: the str value is its transcript, `messages` the messages themselves."""

    messages: tuple[dict[str, str], ...]

    def __new__(cls, messages: Sequence[Mapping[str, Any]]) -> Conversation:
        reason = message_problem(messages)
        if reason is not None:
            raise ValueError(f"not a conversation: {reason}")
        clean = tuple({"role": str(m["role"]), "content": str(m["content"])} for m in messages)
        self = super().__new__(cls, "\n".join(f"{m['role']}: {m['content']}" for m in clean))
        self.messages = clean
        return self

    def __getnewargs__(self) -> tuple[Any, ...]:  # pickling (async sampler threads, Ray workers) keeps the messages
        return ([dict(m) for m in self.messages],)

    def as_list(self) -> list[dict[str, str]]:
        """Fresh message dicts, safe to hand to user code that may mutate them."""
        return [dict(m) for m in self.messages]


def looks_like_messages(value: Any) -> bool:
    """A list whose items are all mappings: meant as chat messages (validated by `message_problem`)."""
    return isinstance(value, list | tuple) and len(value) > 0 and all(isinstance(m, Mapping) for m in value)


def message_problem(messages: Any) -> str | None:
    """Why `messages` is not a usable chat prompt, or None when it is."""
    if not isinstance(messages, list | tuple) or not messages:
        return "expected a non-empty list of {role, content} messages"
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            return f"message {i} is {type(m).__name__}, not an object with role and content"
        if not isinstance(m.get("role"), str) or m["role"] not in ROLES:
            return f"message {i} has role {m.get('role')!r} (expected one of {', '.join(ROLES)})"
        if not isinstance(m.get("content"), str):
            return f"message {i} ({m['role']}) has content of type {type(m.get('content')).__name__}, not str"
    if not any(m["content"].strip() for m in messages if m["role"] == "user"):
        return "no user message with text"
    return None


def with_system(prompt: str, system: str | None) -> str:
    """`prompt` with a system message first (prompt.system): a plain prompt becomes [system, user];
    a conversation without a system message gets one; one with its own system message keeps it."""
    if system is None:
        return prompt
    if isinstance(prompt, Conversation):
        if prompt.messages[0]["role"] == "system":
            return prompt
        return Conversation([{"role": "system", "content": system}, *prompt.messages])
    return Conversation([{"role": "system", "content": system}, {"role": "user", "content": prompt}])


__all__ = ["ROLES", "Conversation", "looks_like_messages", "message_problem", "with_system"]
