"""Environments: the protocol of multi-turn RL for everything that is not a tool call (games,
simulated users, multi-step tasks), and the checks of a user's class.

An environment is a plain class, named with `task.environment=module:Class` (or
`path/to/file.py:Class`), that needs nothing from reinforge:

    class MyEnv:
        def reset(self, row: dict) -> list[dict]: ...          # the opening messages for this dataset row
        def step(self, text: str) -> tuple[list[dict], float, bool]: ...   # reply messages, this turn's reward, done

It is constructed with no arguments, one instance per trajectory. This module owns checking such
a class when it is named (`load_environment`, before any model loads); playing an episode against
an instance is reinforge/agents/episode.py, a batch of them in one rollout reinforge/agents/rollout.py.
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path
from typing import Any, NoReturn

from reinforge.errors import ConfigError
from reinforge.objectives.common import resolve, unknown_name_error
from reinforge.rewards.conventions import import_user_function, module_from_file

KEY = "task.environment"
PROTOCOL = "reset(self, row: dict) -> list[dict] and step(self, text: str) -> tuple[list[dict], float, bool]"



# ----------------------------------------------------------------------------------------------------------------
# Naming a class: checked at load time, before anything runs
# ----------------------------------------------------------------------------------------------------------------


def load_environment(name: str) -> type:
    """The class named by `name` ('module:Class' or 'path/to/file.py:Class'), checked against the protocol:
    a class, constructible with no arguments, with callable `reset(row)` and `step(text)`. ConfigError (one
    line naming task.environment, the class and what to change) for anything else. Nothing is constructed."""
    found = _import(name)
    where = f"{KEY}={name!r}"
    if not inspect.isclass(found):
        raise ConfigError(f"{where} is not a class (its type is {type(found).__name__}): name a class with {PROTOCOL}")
    required = _required_parameters(found)
    if required:
        raise ConfigError(
            f"{where}: {found.__name__}() requires {', '.join(required)}, but an environment is constructed with "
            "no arguments (one instance per trajectory): give each a default, or read per-row values from the row "
            "reset(row) receives")
    for method, argument in (("reset", "row"), ("step", "text")):
        problem = _method_problem(found, method)
        if problem:
            raise ConfigError(f"{where}: {found.__name__}.{method} {problem}; the protocol calls {method}({argument}) "
                              f"with one argument: {PROTOCOL}")
    return found


def split_import_name(key: str, name: str, forms: str) -> tuple[str, str]:
    """(module or file, attribute) of a user's 'module:name' / 'path/to/file.py:name' given at config key
    `key`; ConfigError naming the accepted `forms` for a malformed one, or a file that does not exist."""
    module_name, _, attr = name.rpartition(":")
    if not module_name or not attr:
        raise ConfigError(f"{key}={name!r} is not {forms}: name the module or file, a colon, and the name")
    if module_name.endswith(".py") and not Path(module_name).expanduser().is_file():
        raise ConfigError(f"{key}={name!r}: file '{module_name}' does not exist (relative paths start at the "
                          f"working directory, {Path.cwd()})")
    return module_name, attr


def _import(name: str) -> object:
    """What `name` names, through the importer reward functions use (a file is loaded once per process)."""
    module_name, attr = split_import_name(KEY, name, "'module:Class' or 'path/to/file.py:Class'")
    try:
        if module_name.endswith(".py"):
            module = module_from_file(Path(module_name).expanduser().resolve(), "environment file")
            return getattr(module, attr) if hasattr(module, attr) else _missing(name, module, attr)
        return import_user_function(name) or resolve({}, name, "environment")
    except ConfigError:
        raise
    except ValueError as err:  # the importer's one-line reasons: no such module, no such name, a file that fails
        module = sys.modules.get(module_name)
        if module is None:
            reason = str(err.__cause__ or err)   # resolve() wraps the ImportError
            raise ConfigError(f"{KEY}={name!r} cannot be imported: {reason} (name a module on the Python path or in "
                              "the working directory, or a file as 'path/to/file.py:Class')") from None
        return getattr(module, attr) if hasattr(module, attr) else _missing(name, module, attr)
    except Exception as err:  # the user's module raised while importing
        raise ConfigError(f"{KEY}={name!r}: importing '{module_name}' raised {type(err).__name__}: {err}") from None


def _missing(name: str, module: Any, attr: str) -> NoReturn:
    classes = [k for k, v in vars(module).items()
               if inspect.isclass(v) and v.__module__ == module.__name__ and not k.startswith("_")]
    module_name = name.rpartition(":")[0]
    if not classes:
        raise ConfigError(f"{KEY}={name!r}: '{module_name}' defines no class; write one with {PROTOCOL}")
    raise ConfigError(f"{KEY}={name!r}: in '{module_name}', {unknown_name_error('class', attr, classes)}")


def _required_parameters(cls: type) -> list[str]:
    """The parameters `cls()` would be missing."""
    try:
        parameters = inspect.signature(cls).parameters.values()
    except (TypeError, ValueError):  # a class on a builtin base without a readable signature: nothing to check
        return []
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    return [p.name for p in parameters if p.default is inspect.Parameter.empty and p.kind not in variadic]


def _method_problem(cls: type, method: str) -> str | None:
    """Why `cls().<method>(x)` cannot be called as the protocol calls it; None if it can."""
    attribute = getattr(cls, method, None)
    if attribute is None:
        return "is missing"
    if not callable(attribute):
        return f"is a {type(attribute).__name__}, not a method"
    if inspect.iscoroutinefunction(attribute):
        return "is async; the protocol's methods are plain functions"
    try:
        signature = inspect.signature(attribute)
    except (TypeError, ValueError):  # a builtin without a readable signature: its call will tell
        return None
    # A plain function on the class is bound to the instance (self first); a static or class method is not.
    bound = (None, None) if inspect.isfunction(inspect.getattr_static(cls, method, None)) else (None,)
    try:
        signature.bind(*bound)
    except TypeError:
        return f"takes {signature}"
    return None


__all__ = ["KEY", "PROTOCOL", "load_environment"]
