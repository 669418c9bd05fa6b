"""Objectives: the pure tensor math of RL post-training (no models, no I/O).

Each part is a registry of functions with one signature, so a new paper is
one function plus one entry; any entry may also be user code given by
import path "package.module:function".

- `advantages`: ADVANTAGES (rewards [N] + group ids [N] -> [N]; REINFORCE++'s, in
  `token_advantages`, -> [N, T] per-token returns whitened over the batch),
  ADVANTAGE_TRANSFORMS (noise, |A| filter, EMA baseline mix) and the
  stateful AdvantagePipeline.
- `policy` / `policy_sequence`: POLICY_LOSSES, per-token terms l = -J [N, T]
  + per-token metrics (PolicyTerms, PPO's clipped surrogate: `surrogate`).
- `corrections`: CORRECTIONS (tis, mis ...), detached per-token weights, and
  sampler-learner mismatch metrics.
- `kl`: KL_ESTIMATORS (k1 / k2 / k3), the in-reward penalty, EMA reference update.
- `aggregation`: AGGREGATIONS, per-token weights over the whole optimizer
  batch; the only place where terms become a scalar (micro-batch and rank exact).
- `value`: GAE (decoupled, length-adaptive), value loss, VAPO's NLL term.
- `preference`: DPO, cDPO and IPO losses.
- `spec` / `recipes`: ObjectiveSpec and the named methods (RECIPES).
- `loss`: objective_loss (one micro-batch, given weights) and recipe_loss.

Formulas and defaults: ALGORITHMS.md; every function's docstring repeats
its formula and cites its paper.
"""

from reinforge.objectives.advantages import (
    ADVANTAGE_TRANSFORMS,
    ADVANTAGES,
    AdvantagePipeline,
    AdvantageResult,
    compute_advantages,
)
from reinforge.objectives.aggregation import AGGREGATIONS, LOCAL, BatchReduce, loss_weights
from reinforge.objectives.corrections import CORRECTIONS, apply_correction, mismatch_metrics
from reinforge.objectives.kl import KL_ESTIMATORS
from reinforge.objectives.loss import (
    LossOutput,
    advantage_kl_shift,
    objective_loss,
    recipe_loss,
    resolve_spec,
    shaped_rewards,
)
from reinforge.objectives.policy import POLICY_LOSSES
from reinforge.objectives.preference import PREFERENCE_LOSSES, preference_loss
from reinforge.objectives.recipes import RECIPE_OBJECTIVES, RECIPES, SYSTEMS, Recipe
from reinforge.objectives.spec import ObjectiveSpec, Part, PreferenceSpec, ValueSpec
from reinforge.objectives.surrogate import PolicyTerms
from reinforge.objectives.value import decoupled_gae, gae, value_loss

__all__ = [
    "ADVANTAGES",
    "ADVANTAGE_TRANSFORMS",
    "AGGREGATIONS",
    "CORRECTIONS",
    "KL_ESTIMATORS",
    "LOCAL",
    "POLICY_LOSSES",
    "PREFERENCE_LOSSES",
    "RECIPES",
    "RECIPE_OBJECTIVES",
    "SYSTEMS",
    "AdvantagePipeline",
    "AdvantageResult",
    "BatchReduce",
    "LossOutput",
    "ObjectiveSpec",
    "Part",
    "PolicyTerms",
    "PreferenceSpec",
    "Recipe",
    "ValueSpec",
    "advantage_kl_shift",
    "apply_correction",
    "compute_advantages",
    "decoupled_gae",
    "gae",
    "loss_weights",
    "mismatch_metrics",
    "objective_loss",
    "preference_loss",
    "recipe_loss",
    "resolve_spec",
    "shaped_rewards",
    "value_loss",
]
