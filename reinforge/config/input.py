"""What a user types, before it becomes a Config: `key=value` overrides, YAML files, and unknown
keys refused with the closest valid key or, for a name from TRL or verl, the full reinforge key
(reinforge/config/synonyms.py). Every failure is one ConfigError line naming the file or key.
"""

from __future__ import annotations

import difflib
import re
import types
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from reinforge.errors import ConfigError

if typing.TYPE_CHECKING:
    from reinforge.config.synonyms import Synonym

# Names within one section that users bring from peft, so the suggestion is right even when the
# spelling is nothing alike; names from TRL and verl, across sections, are in reinforge/config/synonyms.py.
_SYNONYMS = {
    "rank": "r",             # peft's LoraConfig spells these lora_alpha, lora_dropout
    "lora_r": "r",
    "lora_alpha": "alpha",
    "lora_dropout": "dropout",
}


def _unknown_key_message(path: str, key: str, valid: list[str], what: str = "config key") -> str:
    close = [_SYNONYMS[key]] if _SYNONYMS.get(key) in valid else difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    hint = f"; did you mean '{close[0]}'?" if close else ""
    return f"unknown {what} '{path}'{hint} (valid: {', '.join(sorted(valid))})"


def optional_section(annotation: Any) -> Any:
    """`Section` for an optional section `Section | None` (model.lora), so that its keys are checked too."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def leaves(path: str, value: Any) -> list[tuple[str, Any]]:
    """(dotted path, value) of every leaf under `path`: `a: {b: 1}` -> [("a.b", 1)]."""
    if isinstance(value, dict) and value:
        return [leaf for key, sub in value.items() for leaf in leaves(f"{path}.{key}", sub)]
    return [(path, value)]


def _sections_with(key: str, root: type[BaseModel]) -> list[str]:
    """The full keys `section.key` of the sections of `root` (the Config) that have a field `key`."""
    found = []
    for name, info in root.model_fields.items():
        annotation = optional_section(info.annotation)
        if isinstance(annotation, type) and issubclass(annotation, BaseModel) and key in annotation.model_fields:
            found.append(f"{name}.{key}")
    return found


def find_synonym(path: str) -> Synonym | None:
    """The synonym of the dotted key `path` as typed: a verl path, else a TRL or OpenRLHF name by its
    last part. Here, above both tables: OpenRLHF's table (synonyms_openrlhf.py) builds on synonyms.py."""
    from reinforge.config.synonyms import TRL_NAMES, VERL_NAMES
    from reinforge.config.synonyms_openrlhf import OPENRLHF_NAMES, openrlhf_family

    name = path.rpartition(".")[2]
    return VERL_NAMES.get(path) or TRL_NAMES.get(name) or OPENRLHF_NAMES.get(name) or openrlhf_family(name)


def _unknown_messages(path: str, key: str, value: Any, model: type[BaseModel], top_level: bool) -> list[str]:
    """The refusals of the unknown key `path`: a TRL / verl name says where reinforge has it (across
    sections; each such name of an unknown section); a misspelling names the closest key of its section."""
    from reinforge.config.synonyms import synonym_message

    known = [synonym_message(leaf, leaf_value, synonym) for leaf, leaf_value in leaves(path, value)
             if (synonym := find_synonym(leaf)) is not None]     # verl's nested names arrive as one unknown section
    if known:
        return known
    if top_level and key in _VERL_SECTIONS and isinstance(value, dict):
        # verl's sections: a near spelling of ours (trainer -> train) would point at a key that does another job
        return [f"unknown config key '{leaf}' (a name from verl's config, which reinforge has under no name; "
                "`reinforge config` lists every key)" for leaf, _ in leaves(path, value)]
    return [_unknown_message(path, key, value, model, top_level)]


# verl's top-level sections that reinforge does not have (its `critic` section is reinforge's too).
_VERL_SECTIONS = ("data", "actor_rollout_ref", "algorithm", "trainer", "reward_model", "custom_reward_function")


def _unknown_message(path: str, key: str, value: Any, model: type[BaseModel], top_level: bool) -> str:
    elsewhere = _sections_with(key, model) if top_level else []     # `lr=...` at the top: train.lr or sft.lr
    if elsewhere:
        return f"unknown config key '{path}'; did you mean {' or '.join(repr(k) for k in elsewhere)}?"
    valid = list(model.model_fields)
    if not isinstance(value, dict):      # a single value is never a section: `pretrain=x` is not `train`
        scalar = [k for k in valid if not _is_section(model.model_fields[k].annotation)]
        message = _unknown_key_message(path, key, scalar)
        return message.replace(f"(valid: {', '.join(sorted(scalar))})", f"(valid: {', '.join(sorted(valid))})")
    return _unknown_key_message(path, key, valid)


def _is_section(annotation: Any) -> bool:
    annotation = optional_section(annotation)
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def check_keys(data: dict[str, Any], model: type[BaseModel], prefix: str = "") -> None:
    """Reject unknown keys at any depth, naming the closest valid key; every unknown key at once (a
    config file brought from TRL or verl has several), on one line."""
    problems = unknown_keys(data, model, prefix)
    if len(problems) == 1:
        raise ConfigError(problems[0])
    if problems:
        shown = " | ".join(p.removeprefix("unknown config key ") for p in problems)
        raise ConfigError(f"{len(problems)} unknown config keys: {shown}")


def unknown_keys(data: dict[str, Any], model: type[BaseModel], prefix: str = "") -> list[str]:
    """One refusal per unknown key of `data`, at any depth, in the order of the file."""
    fields = model.model_fields
    problems: list[str] = []
    for key, value in data.items():
        path = f"{prefix}{key}"
        if key not in fields:
            problems += _unknown_messages(path, key, value, model, top_level=not prefix)
            continue
        annotation = optional_section(fields[key].annotation)
        if isinstance(value, dict) and isinstance(annotation, type) and issubclass(annotation, BaseModel):
            problems += unknown_keys(value, annotation, prefix=f"{path}.")
    return problems


def deep_merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            if key == "objective":
                # A replaced part drops the old part's params (one rule with resolve_spec: objectives.spec).
                from reinforge.objectives.spec import stale_params

                stale = stale_params(out[key], value)
                out[key] = deep_merge({k: v for k, v in out[key].items() if k not in stale}, value)
            else:
                out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    """`a.b=1 c=x` -> {"a": {"b": 1}, "c": "x"}; values are parsed as YAML scalars."""
    tree: dict[str, Any] = {}
    for i, item in enumerate(overrides):
        if item.startswith("-"):
            raise ConfigError(_argparse_message(item, overrides[i + 1] if i + 1 < len(overrides) else None))
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override '{item}' is not of the form key=value")
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        if isinstance(value, str) and _FLOAT.fullmatch(value):
            value = float(value)  # YAML 1.1 reads "3e-4" as a string; users mean a number
        if key == "model" and not isinstance(value, dict):
            # `model=PATH` is `model.path=PATH`, so that it composes with model.lora.r=8 and the like.
            key, value = "model.path", str(value)
        node = tree
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override '{item}' conflicts with an earlier override of '{part}'")
        node[parts[-1]] = value
    return tree


def _argparse_message(item: str, following: str | None) -> str:
    """The refusal of an argparse-style option (`--n_samples_per_prompt 8`, `--bf16`, `--seed=1`), as
    launchers like OpenRLHF's take them: its key=value spelling, and where a peer's name lives here."""
    name, sep, raw = item.lstrip("-").partition("=")
    if not sep:      # `--key value`, or a flag (`--bf16`) when no plain value follows
        takes_value = following is not None and "=" not in following and (
            not following.startswith("-") or re.fullmatch(r"-\.?\d[\d.eE+-]*", following) is not None)   # -0.1
        raw = following if takes_value else "true"
    typed = f"{item} {following}" if not sep and raw == following else item
    message = f"'{typed}': settings are key=value, write {name}={raw}"
    from reinforge.config.synonyms import synonym_message

    synonym = find_synonym(name)
    if synonym is None:
        return message
    value = yaml.safe_load(raw) if raw else raw
    hint = synonym_message(name, value, synonym).removeprefix(f"unknown config key '{name}'")
    return f"{message}; and {name} is not a reinforge key{hint}"


def load_yaml(path: str | Path) -> dict[str, Any]:
    """The mapping in the YAML file `path`; ConfigError (one line: file, line and column, the parser's
    message) for a file that is missing, unreadable, not YAML, or not a mapping."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(
            f"config file '{path}' {'is a directory' if path.is_dir() else 'does not exist'}: give a YAML file"
        )
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except OSError as err:
        raise ConfigError(f"config file '{path}' cannot be read: {err.strerror or err}") from None
    except UnicodeDecodeError as err:
        raise ConfigError(f"config file '{path}' is not UTF-8 text (byte {err.start}): save it as UTF-8") from None
    except yaml.YAMLError as err:
        raise ConfigError(_yaml_error_message(path, err)) from None
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file '{path}' must hold a mapping of keys (lines like 'recipe: grpo'), not a {type(data).__name__}"
        )
    return data


def _yaml_error_message(path: Path, err: yaml.YAMLError) -> str:
    mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
    where = f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    problem = getattr(err, "problem", None) or str(err)
    context, started = getattr(err, "context", None), getattr(err, "context_mark", None)
    if context and started is not None and started is not mark:
        context = f"{context} that starts at line {started.line + 1}"
    detail = f"{problem} ({context})" if context else problem
    return f"config file '{path}'{where}: YAML syntax error: {' '.join(detail.split())}"
