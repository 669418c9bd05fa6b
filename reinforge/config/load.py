"""A run's configuration from what a user writes: defaults, recipe preset, YAML file and dotted
command-line overrides, validated and checked before anything runs.

Precedence (later wins): field defaults < the task's preset (`Task.preset`) < recipe preset
(`reinforge/recipes/<recipe>.yaml`) < user YAML file (`config=FILE`) < `key=value` overrides.
Unknown keys are errors that name the closest valid key (config/input.py); the sections validate
their own fields (reinforge/settings/); every rule across sections runs from here (config/checks.py).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from reinforge.config.checks import check_config, check_lengths, fit_builtin_moe, fit_sft_to_data, fit_to_model_dir
from reinforge.config.input import check_keys, deep_merge, leaves, load_yaml, parse_overrides
from reinforge.config.root import Config, TaskConfig
from reinforge.errors import ConfigError

RECIPES_DIR = Path(__file__).parent.parent / "recipes"


def recipe_preset(name: str) -> dict[str, Any]:
    """The YAML preset of a named recipe (empty if the recipe has none)."""
    path = RECIPES_DIR / f"{name}.yaml"
    return load_yaml(path) if path.is_file() else {}


def task_preset(user: dict[str, Any]) -> dict[str, Any]:
    """The config values the named task runs best with (`Task.preset`): under the recipe's and the user's."""
    from reinforge.tasks import TASKS

    task = user.get("task") if isinstance(user.get("task"), dict) else {}
    name = task.get("name", TaskConfig.model_fields["name"].default)
    return copy.deepcopy(TASKS[name].preset) if name in TASKS else {}


def build_config(overrides: list[str] | None = None, config_file: str | None = None, *,
                 architecture_of: str | None = None) -> Config:
    """Resolve defaults, recipe preset, YAML file and overrides into one validated Config, fitted to
    its model folder's architecture (models/model_dir.py). `architecture_of`: where to read that
    architecture when model.path is written later (a pipeline stage's model, made by the stage before)."""
    user = load_yaml(config_file) if config_file else {}
    cli = parse_overrides(overrides or [])
    if isinstance(cli.get("model"), str):
        cli["model"] = {"path": cli["model"]}
    if isinstance(user.get("model"), str):
        user["model"] = {"path": user["model"]}
    merged_user = deep_merge(user, cli)
    check_keys(merged_user, Config)
    recipe = merged_user.get("recipe", Config.model_fields["recipe"].default)
    preset = recipe_preset(str(recipe))
    check_keys(preset, Config, prefix=f"recipes/{recipe}.yaml: ")
    try:
        cfg = Config.model_validate(deep_merge(deep_merge(task_preset(merged_user), preset), merged_user))
    except ValidationError as err:
        raise ConfigError(format_validation_error(err)) from None
    given = {leaf for leaf, _ in leaves("", preset)} | {leaf for leaf, _ in leaves("", merged_user)}
    given = {leaf.lstrip(".") for leaf in given}
    check_config(cfg)
    cfg = fit_sft_to_data(cfg, given)
    if (architecture_of or cfg.model.path) == "builtin":
        check_lengths(cfg, cfg.model.max_positions, "model.max_positions")
        return fit_builtin_moe(cfg, given)
    # The model folder's architecture decides the engine and the learner forward, before anything loads.
    return fit_to_model_dir(cfg, given, architecture_of)


def resume_config(run_dir: str | Path, *, command: str = "--resume", rewards: bool = True) -> Config:
    """The resolved config a run wrote to RUN_DIR/config.yaml, pointed at RUN_DIR (it may have moved).
    `command` starts the error messages; `rewards=False` leaves the reward functions unresolved (export
    computes no reward, and a notebook function given to reinforge.train lives only in its process)."""
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        raise ConfigError(f"{command}: '{run_dir}' holds no run (no config.yaml)")
    try:     # a damaged file: one line with its line and column
        cfg = Config.model_validate(load_yaml(path), context={"resolve_rewards": rewards})
    except ValidationError as err:
        raise ConfigError(f"{command}: {path} is not a valid config ({format_validation_error(err)})") from None
    return cfg.model_copy(update={"output_dir": str(run_dir)})


def format_validation_error(err: ValidationError) -> str:
    lines, located = [], False
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        lines.append(f"{loc}: {msg}" if loc else msg)
        located = located or bool(loc)
    # A message of a whole-config check (unknown recipe) names its key itself.
    return ("invalid configuration: " if located else "") + "; ".join(lines)


def config_to_yaml(cfg: Config) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
