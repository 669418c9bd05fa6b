"""The config's objective section, derived from ObjectiveSpec: one override per spec field, with
the field's doc and bounds (its metadata, objectives/spec.py) and the registry names its doc lists
read from the registries themselves. A field is declared and documented once, on the spec; only
the shortcuts eps_low and eps_high, which are policy_params and no spec field, are declared here.
"""

from __future__ import annotations

import dataclasses
import importlib
import types
import typing
from collections.abc import Mapping
from typing import Any

from pydantic import Field, create_model

from reinforge.objectives.spec import ObjectiveSpec, Part
from reinforge.settings import Section


def _names(registries: tuple[str, ...]) -> str:
    """The keys of each 'module:TABLE', in table order, comma-separated."""
    tables = [
        getattr(importlib.import_module(module), table) for module, _, table in (r.partition(":") for r in registries)
    ]
    return ", ".join(key for t in tables for key in t)


class TransformConfig(Section):
    name: str = Field(
        description=f"Advantage transform: "
        f"{_names(('reinforge.objectives.advantages:ADVANTAGE_TRANSFORMS',))}, or 'module:function'."
    )
    params: dict[str, Any] = Field(
        default_factory=dict, description="Keyword parameters of the transform, e.g. sigma=0.1."
    )


# Not spec fields: keys of policy_params, given at the top of the section (objective.eps_high=0.28).
_SHORTCUTS: dict[str, Any] = {
    "eps_low": (
        float | None,
        Field(None, ge=0, description="Shortcut for the policy objective's eps_low (lower clip range of the ratio)."),
    ),
    "eps_high": (
        float | None,
        Field(None, ge=0, description="Shortcut for the policy objective's eps_high (clip-higher when > eps_low)."),
    ),
}
_SHORTCUTS_AFTER = "policy_params"


def _override_type(hint: Any) -> Any:
    """The config type of an override of a spec field of type `hint` (None: keep the recipe's):
    parameter mappings are dicts, the transforms a list of {name, params}, the critic's ValueSpec a
    dict of its fields."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and len(args) == 1:
        hint = args[0]                        # str | None -> str ('none' removes the part)
    if typing.get_origin(hint) is Mapping or dataclasses.is_dataclass(hint):
        return dict[str, Any] | None
    if typing.get_origin(hint) is tuple and typing.get_args(hint)[0] is Part:
        return list[TransformConfig] | None
    return hint | None


class _ObjectiveOverrides(Section):
    def overrides(self) -> dict[str, Any]:
        """The set fields as ObjectiveSpec overrides ('none' removes an optional part)."""
        out = self.model_dump(exclude_none=True)
        for key in ("kl_estimator", "correction"):
            if out.get(key) == "none":
                out[key] = None
        return out


_DOC = """Overrides of the recipe's objective parts (see `reinforge recipes NAME`); None keeps the recipe's value.

    A composition of your own is a recipe plus overrides here; any part may be
    your own function by import path, e.g. policy_loss=mypkg.losses:my_loss.
    """


def _objective_config() -> type[_ObjectiveOverrides]:
    hints = typing.get_type_hints(ObjectiveSpec)
    overrides: dict[str, Any] = {}
    for f in dataclasses.fields(ObjectiveSpec):
        meta = f.metadata
        doc = meta["doc"].replace("{names}", _names(meta["registries"])) if meta["registries"] else meta["doc"]
        overrides[f.name] = (_override_type(hints[f.name]), Field(None, description=doc, **meta["bounds"]))
        if f.name == _SHORTCUTS_AFTER:
            overrides.update(_SHORTCUTS)
    return create_model("ObjectiveConfig", __base__=_ObjectiveOverrides, __module__=__name__,
                        __doc__=_DOC, **overrides)


ObjectiveConfig = _objective_config()
