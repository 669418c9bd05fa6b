"""The full RL objective of one (micro-)batch: policy terms + KL + entropy,
weighted by the aggregation weights of the whole optimizer batch.

    loss = sum(w * l_policy) + kl_coef * sum(w * k) - entropy_coef * sum(w * H)

`objective_loss` takes the weights from the caller (sliced from the full
batch, see `aggregation`); `recipe_loss` is the one-call form for a batch
that is not split.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from torch import Tensor

from reinforge.objectives.advantages import ADVANTAGES
from reinforge.objectives.aggregation import AGGREGATIONS, loss_weights, masked_mean
from reinforge.objectives.common import (
    accepted_params,
    check_params,
    lookup,
    resolve,
    unknown_name_error,
)
from reinforge.objectives.kl import KL_ESTIMATORS, kl_terms
from reinforge.objectives.policy import POLICY_INPUTS, POLICY_LOSSES
from reinforge.objectives.spec import RECIPE_OBJECTIVES, ObjectiveSpec


@dataclass
class LossOutput:
    """The scalar to back-propagate and what to log about it."""

    loss: Tensor                 # scalar, differentiable w.r.t. logprobs
    metrics: dict[str, float]    # mask-averaged over this micro-batch's tokens (see objective_loss)


def resolve_spec(name: str, **overrides: object) -> ObjectiveSpec:
    """RECIPE_OBJECTIVES[name] with overrides applied, every name and parameter checked.

    Keys that are ObjectiveSpec fields replace them; any other key is a
    parameter of the policy loss (e.g. eps_high=0.28). Overriding
    `policy_loss` (or `advantage`) without its params drops the recipe's
    params, which belong to the recipe's own function. Unknown recipes,
    registry names and keys raise ValueError with a suggestion.
    """
    spec = lookup(RECIPE_OBJECTIVES, name, "recipe")
    spec_fields = {f.name for f in dataclasses.fields(ObjectiveSpec)}
    changes = {k: v for k, v in overrides.items() if k in spec_fields}
    for fn_field, params_field in (("policy_loss", "policy_params"), ("advantage", "advantage_params")):
        if fn_field in changes and params_field not in changes:
            changes[params_field] = {}     # the recipe's params belong to the recipe's function
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
    advantage_fn = resolve(ADVANTAGES, spec.advantage, "advantage estimator")
    check_params(advantage_fn, spec.advantage_params, f"advantage {spec.advantage!r}", reserved=("rewards", "group_ids"))
    lookup(AGGREGATIONS, spec.aggregation, "aggregation")
    if spec.kl_estimator is not None:
        resolve(KL_ESTIMATORS, spec.kl_estimator, "KL estimator")


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


def objective_loss(
    spec: ObjectiveSpec,
    *,
    logprobs: Tensor,                        # [N, T] log pi_theta of the completion tokens, requires grad
    old_logprobs: Tensor,                    # [N, T] log pi_old, detached
    advantages: Tensor,                      # [N] per sequence (broadcast to tokens) or [N, T] per token
    mask: Tensor,                            # [N, T] 0/1 completion-token mask
    weights: Tensor,                         # [N, T] aggregation weights, sliced from the full optimizer batch
    ref_logprobs: Tensor | None = None,      # [N, T] log pi_ref; required if spec.needs_reference
    sampler_logprobs: Tensor | None = None,  # [N, T] log pi_sampler from the rollout engine
    entropy: Tensor | None = None,           # [N, T] entropy of the next-token distribution; required if entropy_coef > 0
) -> LossOutput:
    """loss = sum(w * l_policy) + kl_coef * sum(w * k) - entropy_coef * sum(w * H).

    Summing this loss over the micro-batches of an optimizer batch gives the
    loss of the whole batch (the weights carry all normalisation). Metrics are
    means over this micro-batch's valid tokens: policy_loss (token mean of
    -J), kl, entropy, the policy's per-token metrics (clip_frac_low,
    clip_frac_high, clip_frac, ratio_mean / _min / _max), and masked_frac
    (the fraction of the [N, T] positions that are masked out).
    """
    _check_shapes(logprobs, advantages, old_logprobs=old_logprobs, mask=mask, weights=weights,
                  ref_logprobs=ref_logprobs, sampler_logprobs=sampler_logprobs, entropy=entropy)
    if spec.needs_reference and ref_logprobs is None:
        raise ValueError(f"the objective has a KL term ({spec.kl_estimator}, kl_coef={spec.kl_coef}): pass ref_logprobs")
    if spec.entropy_coef > 0 and entropy is None:
        raise ValueError(f"the objective has an entropy bonus (entropy_coef={spec.entropy_coef}): pass entropy")
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1).expand_as(logprobs)              # [N, T]

    policy_fn = resolve(POLICY_LOSSES, spec.policy_loss, "policy loss")
    terms = policy_fn(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, mask=mask,
                      sampler_logprobs=sampler_logprobs, **spec.policy_params)
    loss = (weights * terms.loss).sum()
    metrics = {"policy_loss": masked_mean(terms.loss.detach(), mask)}
    if spec.kl_estimator is not None and ref_logprobs is not None:
        kl = kl_terms(spec.kl_estimator, logprobs, ref_logprobs)             # [N, T]
        loss = loss + spec.kl_coef * (weights * kl).sum()
        metrics["kl"] = masked_mean(kl.detach(), mask)
    if entropy is not None:
        loss = loss - spec.entropy_coef * (weights * entropy).sum()
        metrics["entropy"] = masked_mean(entropy.detach(), mask)
    metrics.update(_summarise(terms.metrics, mask))
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
    entropy: Tensor | None = None,           # [N, T]
    group_ids: Tensor | None = None,         # [N], for prompt_mean
    max_length: int | None = None,           # L_norm of seq_mean_token_sum_norm
    **overrides: object,
) -> LossOutput:
    """The loss of recipe `name` (with overrides, see resolve_spec) on one whole
    optimizer batch: aggregation weights from this batch, then objective_loss."""
    spec = resolve_spec(name, **overrides)
    weights = loss_weights(spec.aggregation, mask, group_ids=group_ids, max_length=max_length)
    return objective_loss(spec, logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, mask=mask,
                          weights=weights, ref_logprobs=ref_logprobs, sampler_logprobs=sampler_logprobs,
                          entropy=entropy)
