"""Outcome advantages from group statistics of scalar rewards.

Every estimator has the signature

    fn(rewards: Tensor [N] float, group_ids: Tensor [N] long, **params) -> Tensor [N]

and sits in `ADVANTAGES`; a new estimator is one function and one entry.
Group ids are arbitrary integers (not necessarily contiguous), groups may
differ in size, and nothing loops over groups in Python.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from reinforge.objectives.common import Groups, resolve


@dataclass(frozen=True)
class GroupStats:
    """Statistics of each sample's own group, broadcast back to the samples."""

    mean: Tensor   # [N] mean_g of the rewards in the sample's group
    std: Tensor    # [N] std_g with Bessel's correction; 0 for a group of one
    size: Tensor   # [N] long, number of samples in the group


def group_stats(rewards: Tensor, group_ids: Tensor) -> GroupStats:
    """Per-group mean and unbiased std, computed with index_add (no loop over groups).

    std_g = sqrt( sum_{j in g} (R_j - mean_g)^2 / (|g| - 1) ), Bessel's correction
    as verl and TRL (ALGORITHMS.md, "choice"); a group of one has std 0 (not NaN).
    """
    if rewards.shape != group_ids.shape or rewards.dim() != 1:
        raise ValueError(
            f"rewards and group_ids must both be [N], got {tuple(rewards.shape)} and {tuple(group_ids.shape)}"
        )
    if not rewards.is_floating_point():
        rewards = rewards.to(torch.get_default_dtype())
    groups = Groups.of(group_ids)
    sizes = groups.sizes.to(rewards.dtype)                                   # [G]
    mean = (groups.sum(rewards) / sizes)[groups.index]                       # [N]
    squares = groups.sum((rewards - mean) ** 2)                              # [G]
    std = (squares / (sizes - 1).clamp(min=1)).sqrt()[groups.index]          # [N]
    return GroupStats(mean=mean, std=std, size=groups.sizes[groups.index])


def grpo(rewards: Tensor, group_ids: Tensor, *, eps: float = 1e-6) -> Tensor:
    """GRPO (arXiv 2402.03300, sec. 4.1.2): A_i = (R_i - mean_g) / (std_g + eps).

    A group of one has R_i = mean_g, hence A_i = 0; so has a group whose
    rewards are all equal (no learning signal, the "zero-variance" group).
    """
    stats = group_stats(rewards, group_ids)
    return (rewards - stats.mean) / (stats.std + eps)


def dr_grpo(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """Dr. GRPO (arXiv 2503.20783): A_i = R_i - mean_g.

    Dropping GRPO's division by std_g removes its question-level difficulty bias.
    """
    return rewards - group_stats(rewards, group_ids).mean


ADVANTAGES: dict[str, Callable[..., Tensor]] = {
    "grpo": grpo,
    "dr_grpo": dr_grpo,
}


def compute_advantages(name: str, rewards: Tensor, group_ids: Tensor, **params: float) -> Tensor:
    """Advantages [N] by estimator name (or "module:function" import path)."""
    fn = resolve(ADVANTAGES, name, "advantage estimator")
    return fn(rewards, group_ids, **params)
