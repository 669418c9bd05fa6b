"""The full RL objective of one (micro-)batch: policy terms (with an optional
sampler-learner correction) + KL + entropy + NLL, weighted by the
aggregation weights of the whole optimizer batch.

`objective_loss` takes the weights from the caller (sliced from the full
batch, see `aggregation`); `recipe_loss` is the one-call form for a batch
that is not split.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping
from dataclasses import dataclass

from torch import Tensor

from reinforge.objectives.advantages import (
    ADVANTAGE_INPUTS,
    ADVANTAGE_TRANSFORMS,
    ADVANTAGES,
    TRANSFORM_INPUTS,
)
from reinforge.objectives.aggregation import AGGREGATIONS, loss_weights, masked_mean
from reinforge.objectives.common import (
    accepted_params,
    check_params,
    lookup,
    resolve,
    unknown_name_error,
)
from reinforge.objectives.corrections import (
    CORRECTION_INPUTS,
    CORRECTIONS,
    apply_correction,
)
from reinforge.objectives.kl import KL_ESTIMATORS, centred_kl_penalty, kl_terms, sequence_kl_penalty
from reinforge.objectives.policy import POLICY_LOSSES
from reinforge.objectives.recipes import RECIPES
from reinforge.objectives.spec import ObjectiveSpec, ValueSpec, stale_params
from reinforge.objectives.surrogate import POLICY_INPUTS
from reinforge.objectives.token_advantages import entropy_shaped_advantages
from reinforge.objectives.value import CRITIC_ADVANTAGES, positive_nll


@dataclass
class LossOutput:
    """The scalar to back-propagate and what to log about it."""

    loss: Tensor                 # scalar, differentiable w.r.t. logprobs
    metrics: dict[str, float]    # mask-averaged over this micro-batch's tokens (see objective_loss)


def resolve_spec(name: str, **overrides: object) -> ObjectiveSpec:
    """The objective of recipe `name` with overrides applied, every name and parameter checked.

    Keys that are ObjectiveSpec fields replace them; any other key is a
    parameter of the policy loss (e.g. eps_high=0.28). Overriding
    `policy_loss` (or `advantage`, `correction`) without its params drops the
    recipe's params, which belong to the recipe's own function. Unknown
    recipes, registry names and keys raise ValueError with a suggestion.
    """
    recipe = lookup(RECIPES, name, "recipe")
    if not isinstance(recipe.objective, ObjectiveSpec):
        raise ValueError(
            f"recipe {name!r} is a preference objective over chosen/rejected pairs, not a policy-gradient loss: "
            "use reinforge.objectives.preference_loss"
        )
    spec = recipe.objective
    spec_fields = {f.name for f in dataclasses.fields(ObjectiveSpec)}
    changes = {k: v for k, v in overrides.items() if k in spec_fields}
    current = {name: getattr(spec, name) for name in spec_fields}
    for params in stale_params(current, changes):
        changes.setdefault(params, {})
    if isinstance(changes.get("value"), Mapping):
        changes["value"] = ValueSpec(**changes["value"])
    spec = dataclasses.replace(spec, **changes)

    policy_fn = resolve(POLICY_LOSSES, spec.policy_loss, "policy loss")
    policy_accepts = accepted_params(policy_fn, reserved=POLICY_INPUTS)
    extra = {k: v for k, v in overrides.items() if k not in spec_fields}
    for key in extra:
        if policy_accepts is not None and key not in policy_accepts:
            raise unknown_name_error("override", key, spec_fields | policy_accepts)
    spec = dataclasses.replace(spec, policy_params={**spec.policy_params, **extra})
    check_spec(spec)
    return spec


def check_spec(spec: ObjectiveSpec) -> None:
    """Raise ValueError (with a suggestion) for any name or parameter of `spec` that does not resolve."""
    policy_fn = resolve(POLICY_LOSSES, spec.policy_loss, "policy loss")
    check_params(policy_fn, spec.policy_params, f"policy loss {spec.policy_loss!r}", reserved=POLICY_INPUTS)
    if spec.whiten_advantages and spec.advantage not in CRITIC_ADVANTAGES:
        raise ValueError(f"whiten_advantages whitens a critic's GAE advantages; advantage {spec.advantage!r} is "
                         "normalised by its own estimator (grpo: group std, lite_ppo / scalerl: batch std)")
    if spec.advantage in CRITIC_ADVANTAGES:
        if spec.value is None:
            raise ValueError(f"advantage {spec.advantage!r} needs a critic: set the objective's value settings")
        if spec.kl_normalization != "none":
            raise ValueError("kl_normalization=on_policy centres a sequence's KL after a group estimator; advantage "
                             f"{spec.advantage!r} places it on the critic's tokens: set kl_normalization=none")
    else:
        advantage_fn = resolve(ADVANTAGES, spec.advantage, "advantage estimator")
        check_params(advantage_fn, spec.advantage_params, f"advantage {spec.advantage!r}", reserved=ADVANTAGE_INPUTS)
        if spec.kl_normalization != "none" and "token_penalty" in inspect.signature(advantage_fn).parameters:
            raise ValueError(f"advantage {spec.advantage!r} charges the KL in the reward per token: "
                             "kl_normalization=on_policy would charge it twice; set kl_normalization=none")
    for part in spec.advantage_transforms:
        transform = resolve(ADVANTAGE_TRANSFORMS, part.name, "advantage transform")
        check_params(transform, part.params, f"advantage transform {part.name!r}", reserved=TRANSFORM_INPUTS)
    if spec.correction is not None:
        correction = resolve(CORRECTIONS, spec.correction, "correction")
        check_params(correction, spec.correction_params, f"correction {spec.correction!r}", reserved=CORRECTION_INPUTS)
    lookup(AGGREGATIONS, spec.aggregation, "aggregation")
    if spec.kl_estimator is not None:
        resolve(KL_ESTIMATORS, spec.kl_estimator, "KL estimator")
    for field_name, allowed in (("ratio_anchor", ("old", "sampler")), ("kl_placement", ("in_loss", "in_reward")),
                                ("reference", ("fixed", "ema")), ("kl_normalization", ("none", "on_policy"))):
        lookup({a: a for a in allowed}, getattr(spec, field_name), field_name)
    if spec.kl_normalization != "none" and spec.kl_placement != "in_reward":
        raise ValueError("kl_normalization=on_policy centres a KL placed in the reward: set kl_placement=in_reward "
                         "(a KL in the loss minus a constant has the same gradient)")
    if spec.entropy_advantage > 0 and spec.entropy_advantage_kappa <= 1:
        raise ValueError(f"entropy_advantage_kappa must be > 1, got {spec.entropy_advantage_kappa}")
    if spec.kl_coef < 0 or spec.nll_coef < 0:
        raise ValueError(f"kl_coef and nll_coef must be >= 0, got {spec.kl_coef} and {spec.nll_coef}")
    if not 0.0 <= spec.reference_ema <= 1.0:
        raise ValueError(f"reference_ema must lie in [0, 1], got {spec.reference_ema}")


def _check_shapes(logprobs: Tensor, advantages: Tensor, **tensors: Tensor | None) -> None:
    shape = tuple(logprobs.shape)
    if len(shape) != 2:
        raise ValueError(f"logprobs must be [N, T], got shape {shape}")
    if tuple(advantages.shape) not in (shape, shape[:1]):
        raise ValueError(f"advantages must be [N] or [N, T] with [N, T] = {list(shape)}, got {tuple(advantages.shape)}")
    for name, tensor in tensors.items():
        if tensor is not None and tuple(tensor.shape) != shape:
            raise ValueError(f"{name} must have the shape of logprobs {shape}, got {tuple(tensor.shape)}")


def _summarise(token_metrics: dict[str, Tensor], mask: Tensor) -> dict[str, Tensor]:
    """Mask-average every per-token metric; the ratio also reports its extremes."""
    out: dict[str, Tensor] = {}
    for key, values in token_metrics.items():
        out[f"{key}_mean" if key == "ratio" else key] = masked_mean(values, mask)
    ratio = token_metrics.get("ratio")
    if ratio is not None and mask.bool().any():
        valid = ratio[mask.bool()]
        out["ratio_min"], out["ratio_max"] = valid.min(), valid.max()
    return out


def shaped_rewards(
    spec: ObjectiveSpec,
    rewards: Tensor,                     # [N] verifier rewards
    old_logprobs: Tensor,                # [N, T] log pi_old of the sampled tokens
    ref_logprobs: Tensor | None,         # [N, T] log pi_ref; None when the spec has no KL term
    mask: Tensor,                        # [N, T]
) -> Tensor:
    """The rewards the advantage sees: R_i - beta sum_t sg(k_it), k the spec's kl_estimator, with
    the KL placed in the reward (kl_placement="in_reward", PPO / InstructGPT), else R unchanged.
    With kl_normalization="on_policy" (T1) the penalty joins the advantage instead, centred
    (`advantage_kl_shift`): R unchanged here."""
    if spec.kl_placement != "in_reward" or not spec.needs_reference or spec.kl_normalization != "none":
        return rewards
    return rewards - sequence_kl_penalty(old_logprobs, _required(ref_logprobs, "ref_logprobs (KL in the reward)"),
                                         mask, spec.kl_coef, spec.kl_estimator, spec.kl_clamp)


def advantage_kl_shift(
    spec: ObjectiveSpec,
    old_logprobs: Tensor | None,         # [N, T] log pi_old of the sampled tokens
    ref_logprobs: Tensor | None,         # [N, T] log pi_ref
    mask: Tensor,                        # [N, T]
) -> Tensor | None:
    """[N] what the advantage loses to a normalised KL in the reward (kl.centred_kl_penalty, T1's
    kl_normalization="on_policy"): A_i <- A_i - shift_i after the estimator. None without one."""
    if spec.kl_placement != "in_reward" or not spec.needs_reference or spec.kl_normalization == "none":
        return None
    return centred_kl_penalty(_required(old_logprobs, "old_logprobs (KL in the reward)"),
                              _required(ref_logprobs, "ref_logprobs (KL in the reward)"),
                              mask, spec.kl_coef, spec.kl_estimator, spec.kl_clamp)


def _token_advantages(spec: ObjectiveSpec, advantages: Tensor, logprobs: Tensor, entropy: Tensor | None) -> Tensor:
    """[N, T] advantages: per-sequence ones broadcast to their tokens, then the spec's entropy shaping, if any."""
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1).expand_as(logprobs)
    if spec.entropy_advantage > 0:
        advantages = entropy_shaped_advantages(advantages, _required(entropy, "entropy (entropy_advantage)"),
                                               spec.entropy_advantage, spec.entropy_advantage_kappa)
    return advantages


def _required(tensor: Tensor | None, what: str) -> Tensor:
    if tensor is None:
        raise ValueError(f"the objective needs {what}")
    return tensor


def objective_loss(
    spec: ObjectiveSpec,
    *,
    logprobs: Tensor,  # [N, T] log pi_theta of the completion tokens, requires grad
    old_logprobs: Tensor,  # [N, T] log pi_old, detached
    advantages: Tensor,  # [N] per sequence (broadcast to tokens) or [N, T] per token
    mask: Tensor,  # [N, T] 0/1 completion-token mask
    weights: Tensor,  # [N, T] aggregation weights, sliced from the full optimizer batch
    ref_logprobs: Tensor | None = None,  # [N, T] log pi_ref; required if spec.needs_reference
    sampler_logprobs: Tensor | None = None,  # [N, T] log pi_sampler (mu) from the rollout engine
    entropy: Tensor | None = None,  # [N, T] entropy of the next-token distribution; required if entropy_coef > 0
    correct: Tensor | None = None,  # [N] bool, verified-correct samples; required if nll_coef > 0
    selected: Tensor | None = None,  # [N, T] bool, the policy loss's token selection over the whole batch
    top_logprobs: Tensor | None = None,  # [N, T, K] log pi_theta (detached) of the sampler's top-K ids
    sampler_top_logprobs: Tensor | None = None,  # [N, T, K] the sampler's log-probs of its top-K ids
) -> LossOutput:
    """loss = sum(w * c * l_policy) + kl_coef * sum(w * k) - entropy_coef * sum(w * H) + nll_coef * sum(w * nll)

    with l_policy the policy objective's per-token terms (its ratio against
    pi_old or, with ratio_anchor="sampler", against mu), c the detached
    sampler-learner correction weights (1 without one), k the KL estimate
    (only with kl_placement="in_loss"; "in_reward" is applied to the rewards
    before the advantages, see kl.sequence_kl_penalty) and nll the negative
    log-likelihood of correct samples (VAPO).

    Summing this loss over the micro-batches of an optimizer batch gives the
    loss of the whole batch (the weights carry all normalisation). Metrics are
    means over this micro-batch's valid tokens: policy_loss, kl, entropy, the
    policy's per-token metrics (clip_frac_low / _high, ratio_mean / _min /
    _max, ...), the correction's (is_weight ...) and masked_frac (the fraction
    of [N, T] positions masked out). The sampler-learner mismatch is a figure of
    the whole batch, not of a micro-batch: `corrections.mismatch_metrics`, which
    the learner computes once per update.
    """
    _check_shapes(logprobs, advantages, old_logprobs=old_logprobs, mask=mask, weights=weights,
                  ref_logprobs=ref_logprobs, sampler_logprobs=sampler_logprobs, entropy=entropy)
    advantages = _token_advantages(spec, advantages, logprobs, entropy)      # [N, T]
    anchors = {"old": old_logprobs, "sampler": sampler_logprobs}
    anchor = _required(anchors[spec.ratio_anchor], f"sampler_logprobs (ratio_anchor={spec.ratio_anchor!r})")

    policy_fn = resolve(POLICY_LOSSES, spec.policy_loss, "policy loss")
    # A batch-level token selection (covariance.BATCH_SELECTIONS) comes sliced from the whole batch.
    # The sampler's top-K (DPPO's top-K divergence) likewise, when recorded; each only where given.
    # A policy function gets those it takes (accepted_params None: it takes **kwargs).
    takes = accepted_params(policy_fn)
    batch_inputs = {name: value for name, value in (("selected", selected), ("top_logprobs", top_logprobs),
                                                    ("sampler_top_logprobs", sampler_top_logprobs))
                    if value is not None and (takes is None or name in takes)}
    terms = policy_fn(logprobs=logprobs, old_logprobs=anchor, advantages=advantages, mask=mask,
                      sampler_logprobs=sampler_logprobs, **batch_inputs, **spec.policy_params)
    token_loss, token_metrics = terms.loss, dict(terms.metrics)              # [N, T]
    if spec.correction is not None:
        correction = apply_correction(
            spec.correction, old_logprobs=old_logprobs, mask=mask, **spec.correction_params,
            sampler_logprobs=_required(sampler_logprobs, f"sampler_logprobs (correction {spec.correction!r})"),
        )
        token_loss = token_loss * correction.weights
        token_metrics.update(correction.metrics)
    loss = (weights * token_loss).sum()
    metrics = {"policy_loss": masked_mean(token_loss.detach(), mask)}

    if spec.needs_reference or ref_logprobs is not None:
        ref = _required(ref_logprobs, f"ref_logprobs (KL {spec.kl_estimator}, kl_coef={spec.kl_coef})")
        kl = kl_terms(spec.kl_estimator or "k3", logprobs, ref, spec.kl_clamp)
        if spec.kl_placement == "in_loss":
            loss = loss + spec.kl_coef * (weights * kl).sum()
        metrics["kl"] = masked_mean(kl.detach(), mask)
    if spec.entropy_coef != 0 or entropy is not None:
        entropy = _required(entropy, f"entropy (entropy_coef={spec.entropy_coef})")
        if spec.entropy_coef != 0:   # else no gradient reaches the entropy: the LM head's backward skips its terms
            loss = loss - spec.entropy_coef * (weights * entropy).sum()
        metrics["entropy"] = masked_mean(entropy.detach(), mask)
    if spec.nll_coef > 0:
        nll = positive_nll(logprobs, mask, _required(correct, f"correct (nll_coef={spec.nll_coef})"))
        loss = loss + spec.nll_coef * (weights * nll).sum()
        metrics["nll_correct"] = masked_mean(nll.detach(), mask)

    metrics.update(_summarise(token_metrics, mask))
    metrics["masked_frac"] = 1.0 - mask.bool().sum() / max(mask.numel(), 1)
    return LossOutput(loss=loss, metrics={key: float(value) for key, value in metrics.items()})


def recipe_loss(
    name: str,
    *,
    logprobs: Tensor,                        # [N, T]
    old_logprobs: Tensor,                    # [N, T]
    advantages: Tensor,                      # [N] or [N, T]
    mask: Tensor,                            # [N, T]
    ref_logprobs: Tensor | None = None,      # [N, T]
    sampler_logprobs: Tensor | None = None,  # [N, T]
    group_ids: Tensor | None = None,         # [N], for prompt_mean
    max_length: int | None = None,           # L_norm of seq_mean_token_sum_norm
    entropy: Tensor | None = None,           # [N, T]
    correct: Tensor | None = None,           # [N] bool
    top_logprobs: Tensor | None = None,      # [N, T, K] learner log-probs of the sampler's top-K ids
    sampler_top_logprobs: Tensor | None = None,  # [N, T, K] the sampler's
    **overrides: object,
) -> LossOutput:
    """The loss of recipe `name` (with overrides, see resolve_spec) on one whole
    optimizer batch: aggregation weights from this batch, then objective_loss."""
    spec = resolve_spec(name, **overrides)
    weights = loss_weights(spec.aggregation, mask, group_ids=group_ids, max_length=max_length)
    return objective_loss(spec, logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, mask=mask,
                          weights=weights, ref_logprobs=ref_logprobs, sampler_logprobs=sampler_logprobs,
                          entropy=entropy, correct=correct, top_logprobs=top_logprobs,
                          sampler_top_logprobs=sampler_top_logprobs)
