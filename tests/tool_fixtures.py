"""Tools for tests/unit/agents/test_tools.py, loaded by name ("tool_fixtures:add") and by path
("tests/tool_fixtures.py:add")."""

from __future__ import annotations

import os
import time


def add(a: int, b: int = 0) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


def lookup(city: str, fields: list[str]) -> dict:
    """Weather in a city.

    Args:
        city: The city's name.
        fields: Which measurements to return.
    """
    return {"city": city, "fields": fields, "temperature": 21.5}


def fail(message: str) -> str:
    """Always raises.

    Args:
        message: The exception's message.
    """
    raise ValueError(message)


def hang(seconds: float) -> str:
    """Sleeps far longer than any tool may take.

    Args:
        seconds: How long to sleep.
    """
    time.sleep(seconds)
    return "woke up"


def huge(megabytes: int) -> str:
    """A result of `megabytes` million characters.

    Args:
        megabytes: The result's size in millions of characters.
    """
    return "x" * (megabytes * 10**6)


def die() -> str:
    """Ends its own process without answering."""
    os._exit(3)


def untyped(a):
    """No type hint.

    Args:
        a: Anything.
    """
    return a


def undocumented(a: int) -> int:
    """An argument without an 'Args:' line."""
    return a


async def shout(text: str) -> str:
    """An async tool: awaited in its worker.

    Args:
        text: What to repeat.
    """
    return text.upper()
