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
from dataclasses import dataclass, field, fields
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


def _doc(text: str, *registries: str, **bounds: float) -> dict[str, object]:
    """Field metadata: the doc that `reinforge config objective` prints, where '{names}' stands for
    the keys of `registries` ('module:TABLE', read when the config is built, so the list is never
    out of date), and the bounds (ge, le) the config checks an override against."""
    return {"doc": text, "registries": registries, "bounds": bounds}


_VALUE_FIELDS = ", ".join(f.name for f in fields(ValueSpec))


@dataclass(frozen=True)
class ObjectiveSpec:
    """The objective parts of an RL method (ALGORITHMS.md recipe table).

    Each field is documented once, in its metadata: the config's objective section
    (reinforge.settings.objective.ObjectiveConfig) is derived from these fields, one override per field.
    """

    advantage: str = field(default="grpo", metadata=_doc(
        "Advantage estimator: {names}, or 'module:function' (gae needs a critic: objective.value).",
        "reinforge.objectives.advantages:ADVANTAGES", "reinforge.objectives.value:CRITIC_ADVANTAGES"))
    advantage_params: Mapping[str, object] = field(default_factory=dict, hash=False, metadata=_doc(
        "Keyword parameters of the advantage estimator, e.g. {eps: 1e-6}."))
    advantage_transforms: tuple[Part, ...] = field(default=(), metadata=_doc(
        "Transforms applied to the advantages in order (Gaussian noise, |A| filter, cross-prompt EMA baseline)."))
    policy_loss: str = field(default="ppo_clip", metadata=_doc(
        "Policy objective: {names}, or 'module:function'.", "reinforge.objectives.policy:POLICY_LOSSES"))
    policy_params: Mapping[str, object] = field(default_factory=dict, hash=False, metadata=_doc(
        "Keyword parameters of the policy objective, e.g. {eps_low: 0.2, eps_high: 0.28}; merged into the recipe's "
        "while policy_loss stays the same, a new policy_loss starts from its own defaults."))
    ratio_anchor: Literal["old", "sampler"] = field(default="old", metadata=_doc(
        "Denominator of the ratio: the learner's pi_old, or the sampler's log-probs mu (ScaleRL)."))
    correction: str | None = field(default=None, metadata=_doc(
        "Sampler-learner correction: {names}, or 'none'.", "reinforge.objectives.corrections:CORRECTIONS"))
    correction_params: Mapping[str, object] = field(default_factory=dict, hash=False, metadata=_doc(
        "Keyword parameters of the correction, e.g. {cap: 2.0}."))
    aggregation: str = field(default="seq_mean_token_mean", metadata=_doc(
        "Loss aggregation: {names}.", "reinforge.objectives.aggregation:AGGREGATIONS"))
    kl_estimator: str | None = field(default="k3", metadata=_doc(
        "KL estimator {names}, or 'none' (no KL term, no reference model).", "reinforge.objectives.kl:KL_ESTIMATORS"))
    kl_clamp: float | None = field(default=None, metadata=_doc(
        "Bound of the per-token KL estimate, k <- clamp(k, -kl_clamp, kl_clamp) (verl and OpenRLHF bound k3 at 10); "
        "None: unbounded (a clamped token has no KL gradient, and the log-ratio clamp at 20 keeps k3 finite).", ge=0))
    kl_placement: Literal["in_loss", "in_reward"] = field(default="in_loss", metadata=_doc(
        "KL term in the loss (J -= beta agg(k)), or subtracted from the reward (r_t -= beta sg(k_t))."))
    kl_normalization: Literal["none", "on_policy"] = field(default="none", metadata=_doc(
        "With kl_placement=in_reward: on_policy centres each sample's KL penalty on the batch mean and adds it "
        "after the advantage estimator, A_i -= beta (KL_i - mean KL) (T1); none: R_i -= beta KL_i before it."))
    kl_coef: float = field(default=0.04, metadata=_doc("KL coefficient beta.", ge=0))
    reference: Literal["fixed", "ema"] = field(default="fixed", metadata=_doc(
        "Reference policy: the frozen start of RL, or an EMA of the policy (T1)."))
    reference_ema: float = field(default=0.99, metadata=_doc(
        "EMA rate of an EMA reference: ref <- ema ref + (1 - ema) theta after each RL step.", ge=0, le=1))
    entropy_coef: float = field(default=0.0, metadata=_doc("Entropy bonus coefficient c: J += c agg(H)."))
    entropy_advantage: float = field(default=0.0, metadata=_doc(
        "Entropy-based advantage shaping (arXiv 2506.14758): A_t += min(alpha sg(H_t), |A_t| / "
        "entropy_advantage_kappa) with this alpha; 0 = off.", ge=0))
    entropy_advantage_kappa: float = field(default=2.0, metadata=_doc(
        "kappa > 1 of the entropy advantage shaping: the bonus is at most |A_t| / kappa.", ge=1))
    nll_coef: float = field(default=0.0, metadata=_doc(
        "Weight of the NLL loss on correct samples (VAPO): J -= coef agg(-logp [correct]).", ge=0))
    whiten_advantages: bool = field(default=False, metadata=_doc(
        "Whiten a critic's GAE advantages over the valid tokens of the batch, (A - mean) / std with Bessel's "
        "correction, as verl (always) and OpenRLHF do; reinforge's default leaves GAE's scale as it is."))
    value: ValueSpec | None = field(default=None, metadata=_doc(
        f"Critic settings ({_VALUE_FIELDS}) of PPO-family recipes; None: critic-free."))

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
