"""Objectives: the pure tensor math of RL post-training (no models, no I/O).

Each part is a registry of functions with one signature, so a new paper is
one function plus one entry:

- `advantages`: ADVANTAGES, rewards [N] + group ids [N] -> advantages [N].
- `policy`: POLICY_LOSSES, per-token terms l = -J [N, T] + per-token metrics.
- `kl`: KL_ESTIMATORS, per-token k1 / k2 / k3 against a reference.
- `aggregation`: AGGREGATIONS, per-token weights over the whole optimizer
  batch; the only place where terms become a scalar (micro-batch exact).
- `spec`: ObjectiveSpec, a recipe's objective parts; RECIPE_OBJECTIVES.
- `loss`: objective_loss (one micro-batch, given weights) and recipe_loss.

Formulas and defaults: ALGORITHMS.md; every function's docstring repeats
its formula and cites its paper.
"""

from reinforge.objectives.advantages import ADVANTAGES, compute_advantages
from reinforge.objectives.aggregation import AGGREGATIONS, loss_weights
from reinforge.objectives.kl import KL_ESTIMATORS
from reinforge.objectives.loss import LossOutput, objective_loss, recipe_loss, resolve_spec
from reinforge.objectives.policy import POLICY_LOSSES
from reinforge.objectives.spec import RECIPE_OBJECTIVES, ObjectiveSpec

__all__ = [
    "ADVANTAGES",
    "AGGREGATIONS",
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "RECIPE_OBJECTIVES",
    "LossOutput",
    "ObjectiveSpec",
    "compute_advantages",
    "loss_weights",
    "objective_loss",
    "recipe_loss",
    "resolve_spec",
]
