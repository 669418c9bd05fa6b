"""Reward functions handed to `reinforge.train` as Python objects, registered here by name.

A function defined in a notebook or a script's `__main__` has no import path,
yet the config names every reward function by a string. `register` puts the
function in this module, and the config names it
`reinforge.rewards.user:<name>`, which the reward composer imports like any
'module:function': the same resolution, so every calling convention it
accepts works for these too.

The registry lives in the process: a run resumed from another process
(`reinforge train --resume`) must register its functions again (call
`reinforge.train` with them, or `register`); until then the name fails to
resolve with a message that says so.
"""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Callable

_REGISTERED: dict[str, Callable] = {}

# `short = lambda completions, **kw: ...`: the variable a lambda is assigned to, on its first line.
_ASSIGNED = re.compile(r"^\s*([A-Za-z_]\w*)\s*(?::[^=]+)?=\s*lambda\b")


def default_name(fn: Callable, position: int | None = None) -> str:
    """The name a reward function's metrics (reward/<name>_mean) go by: its `__name__`; for a lambda
    the variable it is assigned to, else `lambda_<position in reward_funcs>` (else `lambda_line<N>`),
    so that several lambdas are told apart; for a callable object its class; a partial its function's."""
    if isinstance(fn, functools.partial):
        return default_name(fn.func, position)
    name = getattr(fn, "__name__", "")
    if name.isidentifier():
        return name
    if name == "<lambda>":
        try:
            first = inspect.getsource(fn).splitlines()[0]
        except (OSError, TypeError, IndexError):      # defined in exec'd code or a prompt that keeps no source
            first = ""
        assigned = _ASSIGNED.match(first)
        if assigned and assigned.group(1) != "reward_funcs" and first.count("lambda") == 1:
            return assigned.group(1)
        return f"lambda_{position}" if position is not None else f"lambda_line{fn.__code__.co_firstlineno}"
    cls = type(fn).__name__
    return cls if cls.isidentifier() and cls != "function" else "reward"


def register(fn: Callable, name: str | None = None, position: int | None = None) -> str:
    """Register `fn` (under `name`, default `default_name(fn, position)`; `position`: its index in
    reward_funcs) and return the import path the config names it by. The same function registered
    again keeps its name; another function with a name already taken gets a suffix (`_2`, `_3`, ...)."""
    if not callable(fn):
        raise TypeError(f"a reward function must be callable, got {type(fn).__name__}")
    for taken, other in _REGISTERED.items():
        if other is fn and (name is None or name == taken):
            return f"{__name__}:{taken}"
    base = name or default_name(fn, position)
    key, i = base, 1
    while key in _REGISTERED or key in globals():
        i += 1
        key = f"{base}_{i}"
    _REGISTERED[key] = fn
    return f"{__name__}:{key}"


def __getattr__(name: str) -> Callable:
    if name in _REGISTERED:
        return _REGISTERED[name]
    raise AttributeError(
        f"no reward function {name!r} is registered in this process: it was a Python function given to "
        "reinforge.train(reward_funcs=[...]) in another one; call reinforge.train with it again (or "
        "reinforge.rewards.user.register), or give it by import path 'module:function'")
