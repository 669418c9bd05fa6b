"""ObjectiveSpec: the objective parts of a method, by registry name.

A method is a composition (ALGORITHMS.md, "Recipes"): an advantage estimator
(plus optional transforms), a policy objective (ratio level and trust region),
an optional sampler-learner correction, an aggregation, a KL term (estimator,
placement, reference kind), an entropy bonus, and, for critic methods, the
value/GAE settings. A spec is frozen and its parameter mappings are
read-only: the trainer resolves it once (with overrides) and never mutates it
during a step (verl's mutated live config is the bug this avoids).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal


def _frozen(params: Mapping[str, object]) -> Mapping[str, object]:
    return MappingProxyType(dict(params))


# Each replaceable part and the field of its keyword parameters.
PART_PARAMS = {"advantage": "advantage_params", "policy_loss": "policy_params", "correction": "correction_params"}


def stale_params(base: Mapping[str, object], changes: Mapping[str, object]) -> set[str]:
    """The params fields of `base` that `changes` makes meaningless.

    A part replaced by another function (policy_loss=cispo over ppo_clip)
    drops the old params, which belong to the old function; the new params
    (if any) come with the change. Used by resolve_spec and by the config's
    merge of presets, so both follow one rule.
    """
    return {params for part, params in PART_PARAMS.items() if part in changes and changes[part] != base.get(part)}


@dataclass(frozen=True)
class Part:
    """One named part with its keyword parameters, e.g. an advantage transform."""

    name: str                                                        # registry key, or "module:function"
    params: Mapping[str, object] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "params", _frozen(self.params))


@dataclass(frozen=True)
class ValueSpec:
    """The critic's part of a PPO-family method (GAE, arXiv 1506.02438; VC-PPO 2503.01491; VAPO 2504.05118)."""

    gamma: float = 1.0                              # discount; 1 for outcome rewards on the last token
    lam_actor: float = 0.95                         # GAE lambda of the policy's advantages
    lam_critic: float = 0.95                        # GAE lambda of the value targets (decoupled GAE: 1.0)
    length_adaptive_alpha: float | None = None      # VAPO: lam_actor = 1 - 1/(alpha |y|) per sequence; None = fixed
    value_clip: float | None = 0.2                  # clip of V - V_old in the value loss; None = unclipped
    pretrain_steps: int = 0                         # VC-PPO value pre-training on the initial policy's returns


@dataclass(frozen=True)
class PreferenceSpec:
    """A preference (pairwise) objective: DPO and relatives (ALGORITHMS.md, dpo row)."""

    loss_type: str = "sigmoid"      # key of PREFERENCE_LOSSES: sigmoid (DPO) or ipo
    beta: float = 0.1
    label_smoothing: float = 0.0    # cDPO's s; 0 = DPO


@dataclass(frozen=True)
class ObjectiveSpec:
    """The objective parts of an RL method (ALGORITHMS.md recipe table)."""

    advantage: str = "grpo"                                 # key of ADVANTAGES, "gae" (critic), or "module:function"
    advantage_params: Mapping[str, object] = field(default_factory=dict, hash=False)   # keyword args of the estimator
    advantage_transforms: tuple[Part, ...] = ()             # ADVANTAGE_TRANSFORMS applied in order (noise, |A| filter, EMA mix)
    policy_loss: str = "ppo_clip"                           # key of POLICY_LOSSES, or "module:function"
    policy_params: Mapping[str, object] = field(default_factory=dict, hash=False)      # e.g. {"eps_low": 0.2, "eps_high": 0.28}
    ratio_anchor: Literal["old", "sampler"] = "old"         # the ratio's denominator: pi_old, or the sampler's mu (ScaleRL)
    correction: str | None = None                           # key of CORRECTIONS (tis, tis_sequence, mis, mis_sequence); None = none
    correction_params: Mapping[str, object] = field(default_factory=dict, hash=False)  # e.g. {"cap": 2.0}
    aggregation: str = "seq_mean_token_mean"                # key of AGGREGATIONS
    kl_estimator: str | None = "k3"                         # key of KL_ESTIMATORS; None = no KL term, no reference model
    kl_placement: Literal["in_loss", "in_reward"] = "in_loss"   # J -= beta agg(k), or r_t -= beta sg(k_t)
    kl_coef: float = 0.04                                   # beta
    reference: Literal["fixed", "ema"] = "fixed"            # frozen initial policy, or ref <- ema ref + (1 - ema) theta (T1)
    reference_ema: float = 0.99                             # the ema of an EMA reference
    entropy_coef: float = 0.0                               # c of the entropy bonus: J += c agg(H)
    nll_coef: float = 0.0                                   # VAPO's NLL on correct samples: J -= coef agg(-logp [correct])
    value: ValueSpec | None = None                          # critic settings; None = critic-free

    def __post_init__(self) -> None:
        # Read-only copies, so that no caller can mutate a spec (or the recipe table) in place.
        for name in ("advantage_params", "policy_params", "correction_params"):
            object.__setattr__(self, name, _frozen(getattr(self, name)))
        transforms = tuple(t if isinstance(t, Part) else Part(**t) for t in self.advantage_transforms)
        object.__setattr__(self, "advantage_transforms", transforms)

    @property
    def needs_reference(self) -> bool:
        """True if a reference policy's log-probs must be computed (a KL term with beta > 0)."""
        return self.kl_estimator is not None and self.kl_coef > 0

    @property
    def needs_critic(self) -> bool:
        return self.value is not None
