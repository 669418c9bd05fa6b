"""A run's configuration: what a user writes, read into one typed `Config` and checked once.

    root.py     `Config` (every section) and the task section
    load.py     `build_config`: defaults < task preset < recipe preset < YAML file < key=value overrides
    input.py    parsing what users type (YAML, overrides) and the unknown-key messages
    synonyms.py, synonyms_openrlhf.py   TRL's, verl's and OpenRLHF's names for reinforge's keys
    checks.py   every rule across sections, and of the config against its model, data and files
    keys.py     `reinforge keys`: every key with its type, default and description

The sections themselves (model, rollout, train, reward, ...) are one floor lower, in
reinforge/settings/, where every part of a run that takes one imports it from.
"""

from __future__ import annotations

from reinforge.config.input import deep_merge, load_yaml, parse_overrides
from reinforge.config.load import (
    RECIPES_DIR,
    build_config,
    config_to_yaml,
    format_validation_error,
    recipe_preset,
    task_preset,
)
from reinforge.config.root import Config, TaskConfig

__all__ = ["RECIPES_DIR", "Config", "TaskConfig", "build_config", "config_to_yaml", "deep_merge",
           "format_validation_error", "load_yaml", "parse_overrides", "recipe_preset", "task_preset"]


def __getattr__(name: str):
    # The sections were importable from here before they were split out (reinforge/settings/).
    import reinforge.settings as settings

    if name in settings.__all__:
        return getattr(settings, name)
    raise AttributeError(f"module 'reinforge.config' has no attribute {name!r}")
