"""Every config key with its type, value and documentation, read from the typed config itself.

What `reinforge config` prints: the docs live once, on the fields of
`reinforge.config` (STYLE principle 7), and this module only walks them. With
a recipe, the values are those `build_config` resolves for it (its preset on
top of the defaults), and the keys the preset changes are marked.
"""

from __future__ import annotations

import difflib
import textwrap
import types
import typing
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from reinforge.config.load import build_config
from reinforge.config.root import Config
from reinforge.errors import ConfigError


@dataclass(frozen=True)
class KeyDoc:
    key: str          # dotted, as an override spells it: rollout.temperature
    type: str         # the annotation, readable: float, native|hf, str | None
    value: Any        # the default, or the recipe's resolved value; REQUIRED when there is none
    doc: str
    changed: bool     # the recipe's preset sets it to something other than the default


REQUIRED = "(required)"
SET = "(set: the keys below)"


def _type_name(annotation: Any) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return "|".join(str(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in args)
    if annotation is type(None):
        return "None"
    if origin is not None:
        return f"{getattr(origin, '__name__', str(origin))}[{', '.join(_type_name(a) for a in args)}]"
    return getattr(annotation, "__name__", str(annotation))


def _section_class(annotation: Any) -> type[BaseModel] | None:
    """The config section class of a field (`LoraConfig` for `LoraConfig | None`), None for a plain value."""
    candidates = (
        typing.get_args(annotation)
        if typing.get_origin(annotation) in (typing.Union, types.UnionType)
        else (annotation,)
    )
    for c in candidates:
        if isinstance(c, type) and issubclass(c, BaseModel):
            return c
    return None


def _default(field) -> Any:
    if field.default is not PydanticUndefined:
        return field.default
    if field.default_factory is not None:
        return field.default_factory()
    return REQUIRED


def _walk(model: type[BaseModel], values: BaseModel | None, defaults: BaseModel | None, prefix: str) -> list[KeyDoc]:
    out = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        section = _section_class(field.annotation)
        value = getattr(values, name) if values is not None else _default(field)
        default = getattr(defaults, name) if defaults is not None else _default(field)
        if section is not None and (isinstance(value, BaseModel) or value is None or value == REQUIRED):
            if type(None) in typing.get_args(field.annotation):   # an optional section (model.lora): on or off
                out.append(KeyDoc(key, _type_name(field.annotation), None if value is None else SET,
                                  field.description or section.__doc__ or "", (value is None) != (default is None)))
            out += _walk(section, value if isinstance(value, BaseModel) else None,
                         default if isinstance(default, BaseModel) else None, f"{key}.")
            continue
        if isinstance(value, BaseModel):
            value = value.model_dump(mode="json")
        if isinstance(default, BaseModel):
            default = default.model_dump(mode="json")
        if isinstance(value, list):
            value = [v.model_dump(mode="json") if isinstance(v, BaseModel) else v for v in value]
        if isinstance(default, list):
            default = [v.model_dump(mode="json") if isinstance(v, BaseModel) else v for v in default]
        out.append(KeyDoc(key, _type_name(field.annotation), value, field.description or "", value != default))
    return out


def config_keys(section: str | None = None, recipe: str | None = None) -> list[KeyDoc]:
    """The keys of `section` (a section such as rollout, or a top-level key such as seed; None: all),
    with their defaults, or with the values `recipe` resolves to."""
    resolved = build_config([f"recipe={recipe}"]) if recipe is not None else None
    defaults = Config.model_construct(**{name: _default(f) for name, f in Config.model_fields.items()})
    keys = _walk(Config, resolved, defaults if resolved is not None else None, "")
    if section is None:
        return keys
    chosen = [k for k in keys if k.key == section or k.key.startswith(f"{section}.")]
    if not chosen:
        names = list(Config.model_fields)
        close = difflib.get_close_matches(section, names, n=1, cutoff=0.5)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise ConfigError(f"unknown config section '{section}'{hint} (sections and top-level keys: {', '.join(names)})")
    return chosen


def _show(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return value if value else "''"
    return str(value).replace("'", "")


def format_keys(keys: list[KeyDoc], width: int = 100, recipe: str | None = None) -> str:
    """`key = value  (type)` then the doc, indented; keys the recipe changes are marked `*`."""
    lines = []
    for k in keys:
        mark = "  *" if recipe is not None and k.changed else ""
        lines.append(f"{k.key} = {_show(k.value)}  ({k.type}){mark}")
        if k.doc:
            lines += textwrap.wrap(k.doc, width=max(40, width - 4), initial_indent="    ", subsequent_indent="    ")
    if recipe is not None:
        lines.append(
            f"\n* set by the preset of recipe {recipe} (reinforge/recipes/{recipe}.yaml); other values are the defaults"
        )
    return "\n".join(lines)
