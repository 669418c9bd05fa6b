"""ObjectiveSpec: the objective parts of a recipe, by registry name, and the
table of recipes that exist so far (ALGORITHMS.md, "Recipes").

A spec is frozen and its parameter mappings are read-only: the trainer
resolves it once (with overrides) and never mutates it during a step.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType


@dataclass(frozen=True)
class ObjectiveSpec:
    """The objective parts of a recipe (ALGORITHMS.md recipe table)."""

    advantage: str = "grpo"                    # key of ADVANTAGES, or "module:function"
    advantage_params: Mapping[str, float] = field(default_factory=dict, hash=False)   # keyword args of the advantage estimator, e.g. {"eps": 1e-6}
    policy_loss: str = "ppo_clip"              # key of POLICY_LOSSES, or "module:function"
    policy_params: Mapping[str, float] = field(default_factory=dict, hash=False)      # keyword args of the policy loss, e.g. {"eps_low": 0.2, "eps_high": 0.2}
    aggregation: str = "seq_mean_token_mean"   # key of AGGREGATIONS
    kl_estimator: str | None = "k3"            # key of KL_ESTIMATORS; None = no KL term, no reference model needed
    kl_coef: float = 0.04                      # beta of the in-loss KL: J <- J - beta * agg(k)
    entropy_coef: float = 0.0                  # c of the entropy bonus: J <- J + c * agg(H)

    def __post_init__(self) -> None:
        # Read-only copies, so that no caller can mutate a spec (or the recipe table) in place.
        object.__setattr__(self, "advantage_params", MappingProxyType(dict(self.advantage_params)))
        object.__setattr__(self, "policy_params", MappingProxyType(dict(self.policy_params)))

    @property
    def needs_reference(self) -> bool:
        """True if the loss has a KL term, i.e. reference log-probs must be computed."""
        return self.kl_estimator is not None and self.kl_coef > 0


RECIPE_OBJECTIVES: dict[str, ObjectiveSpec] = {
    # GRPO, arXiv 2402.03300: group z-score advantage, PPO clip, per-sequence token mean, k3 in the loss.
    "grpo": ObjectiveSpec(
        advantage="grpo",
        policy_loss="ppo_clip",
        policy_params={"eps_low": 0.2, "eps_high": 0.2},
        aggregation="seq_mean_token_mean",
        kl_estimator="k3",
        kl_coef=0.04,
    ),
    # Dr. GRPO, arXiv 2503.20783: no std division, constant length normaliser, no KL.
    "dr_grpo": ObjectiveSpec(
        advantage="dr_grpo",
        policy_loss="ppo_clip",
        policy_params={"eps_low": 0.2, "eps_high": 0.2},
        aggregation="seq_mean_token_sum_norm",
        kl_estimator=None,
        kl_coef=0.0,
    ),
}
