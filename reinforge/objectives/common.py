"""Small pieces every objective module shares: registry look-up, the clamped
log-ratio, and vectorised group statistics.

Kept here so that advantages, policy losses, KL estimators and aggregation
import one implementation of each instead of pasting it.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TypeVar

import torch
from torch import Tensor

T = TypeVar("T")

# log pi - log pi' is clamped to this range before exp (ALGORITHMS.md, "choice"):
# exp(20) ~ 4.9e8 is finite in fp32 and far outside any trust region.
LOG_RATIO_CLAMP = 20.0


def unknown_name_error(kind: str, name: str, known: Iterable[str]) -> ValueError:
    """A ValueError naming the closest known name (difflib), and all of them."""
    known = sorted(known)
    close = difflib.get_close_matches(name, known, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return ValueError(f"unknown {kind} {name!r}{hint} (known: {', '.join(known)})")


def lookup(table: Mapping[str, T], name: str, kind: str) -> T:
    """`table[name]`, or a ValueError with a suggestion; no import paths."""
    if name in table:
        return table[name]
    raise unknown_name_error(kind, name, table)


def resolve(table: Mapping[str, Callable], name: str, kind: str) -> Callable:
    """A registry entry by name, or user code by import path "package.module:function".

    The import path is the escape hatch for variants that do not (yet) live in
    reinforge: the function must have the same signature as the table's entries.
    """
    if ":" not in name:
        return lookup(table, name, kind)
    module_name, _, attr = name.partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"cannot import {kind} {name!r}: {err}") from err
    if not callable(fn):
        raise ValueError(f"{kind} {name!r} is not callable")
    return fn


def accepted_params(fn: Callable, reserved: Iterable[str] = ()) -> set[str] | None:
    """The keyword parameters `fn` takes besides `reserved` (the inputs its
    caller passes itself); None if it takes **kwargs, i.e. any key."""
    signature = inspect.signature(fn).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature):
        return None
    return {p.name for p in signature} - set(reserved)


def check_params(fn: Callable, params: Mapping[str, object], kind: str, reserved: Iterable[str] = ()) -> None:
    """Raise ValueError (with a suggestion) for keys of `params` that `fn` does not take, and for a string
    given where the parameter's default is a number or a bool (the CLI reads `k=2` as YAML, so a string
    there comes from Python, `"2"` for `2`, and would fail deep inside the loss at the first step)."""
    accepted = accepted_params(fn, reserved)
    defaults = {p.name: p.default for p in inspect.signature(fn).parameters.values()}
    for key, value in params.items():
        if accepted is not None and key not in accepted:
            raise unknown_name_error(f"parameter of {kind}", key, accepted)
        default = defaults.get(key, inspect.Parameter.empty)
        if isinstance(value, str) and isinstance(default, (bool, int, float)):
            wanted = type(default).__name__
            raise ValueError(f"parameter {key!r} of {kind} takes {'an' if wanted == 'int' else 'a'} {wanted} "
                             f"(default {default!r}), "
                             f"got the string {value!r}: pass {key}={value} unquoted")


def log_ratio(logprobs: Tensor, other_logprobs: Tensor) -> Tensor:
    """log pi - log pi', clamped to [-20, 20] so that exp() stays finite.

    torch.clamp passes the gradient unchanged inside the range (boundaries
    included) and blocks it outside, where the ratio is absurd anyway.
    """
    return (logprobs - other_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def masked(values: Tensor, mask: Tensor) -> Tensor:
    """`values` where mask is set, exactly 0 elsewhere (where() also drops inf/NaN of padding)."""
    return torch.where(mask.bool(), values, torch.zeros_like(values))


@dataclass(frozen=True)
class Groups:
    """Group membership of N samples; ids may be any integers, groups any size."""

    index: Tensor   # [N] long, dense group index in [0, G) of each sample
    sizes: Tensor   # [G] long, samples per group

    @classmethod
    def of(cls, group_ids: Tensor) -> Groups:
        if group_ids.dim() != 1:
            raise ValueError(f"group_ids must be 1-D [N], got shape {tuple(group_ids.shape)}")
        _, index, sizes = torch.unique(group_ids, return_inverse=True, return_counts=True)
        return cls(index=index, sizes=sizes)

    @property
    def num_groups(self) -> int:
        return self.sizes.numel()

    def sum(self, values: Tensor) -> Tensor:
        """Per-group sums of per-sample `values` [N] -> [G]."""
        return values.new_zeros(self.num_groups).index_add_(0, self.index, values)
