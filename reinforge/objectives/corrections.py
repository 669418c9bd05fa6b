"""Sampler-learner mismatch: per-token correction weights and mismatch metrics.

The rollout engine (the sampler, mu) and the learner compute slightly
different probabilities for the same weights, so a batch sampled from mu is
slightly off-policy for pi_old (Yao et al. 2025, "Your Efficient RL Framework
Secretly Brings You Off-Policy RL Training",
https://fengyao.notion.site/off-policy-rl). A correction multiplies each
token's loss term by a detached weight built from

    rho_t = pi_old(y_t) / mu(y_t) = exp(old_logprobs - sampler_logprobs)

(log-ratio clamped to [-20, 20] by `common.log_ratio`; ALGORITHMS.md,
"Sampler-learner mismatch"). Truncation (TIS) caps rho; masking (MIS) drops
tokens or whole sequences whose rho leaves a band (IcePop, Ling Team 2025;
token- and sequence-level variants compared in Liu, Li et al. 2025, "When
Speed Kills Stability: Demystifying RL Collapse from the Training-Inference
Mismatch", https://richardli.xyz/rl-collapse).

Every correction has the signature

    fn(*, old_logprobs, sampler_logprobs, mask, **params) -> Correction

with all tensors [N, T], and sits in `CORRECTIONS`. Invariants: weights are
detached, exactly 0 where mask is 0, and never NaN (padding may hold any
value, it is never read).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from reinforge.objectives.aggregation import broadcast_to_tokens, masked_mean
from reinforge.objectives.common import check_params, log_ratio, masked, resolve

# The tensors every correction receives from the caller; its other keyword
# arguments are settable parameters.
CORRECTION_INPUTS = ("old_logprobs", "sampler_logprobs", "mask")


@dataclass
class Correction:
    """What a correction returns: per-token loss weights and per-token diagnostics."""

    weights: Tensor  # [N, T] detached, multiplies each token's loss term; 0 where mask is 0
    # name -> [N, T] detached per-token values, to be mask-averaged
    metrics: dict[str, Tensor] = field(default_factory=dict)


def _token_log_rho(old_logprobs: Tensor, sampler_logprobs: Tensor, mask: Tensor) -> Tensor:
    """log rho_t = old - mu, clamped, detached, 0 at masked positions (so sums skip them). [N, T]"""
    return masked(log_ratio(old_logprobs.detach(), sampler_logprobs.detach()), mask)


def _sequence_log_rho(old_logprobs: Tensor, sampler_logprobs: Tensor, mask: Tensor) -> Tensor:
    """log prod_t rho_t = sum_t m_t log rho_t per sequence, [N, T] -> [N]; 0 for an empty row."""
    return _token_log_rho(old_logprobs, sampler_logprobs, mask).sum(dim=1)


def _flag(condition: Tensor, like: Tensor) -> Tensor:
    return condition.to(like.dtype)


def _check_positive(**values: float) -> None:
    for name, value in values.items():
        if not value > 0:
            raise ValueError(f"{name} must be > 0, got {value}")


def _check_band(low: float, high: float) -> None:
    if not 0 <= low <= high:
        raise ValueError(f"need 0 <= low <= high, got low={low}, high={high}")


def tis(
    *,
    old_logprobs: Tensor,                   # [N, T] log pi_old (learner)
    sampler_logprobs: Tensor,               # [N, T] log mu (rollout engine)
    mask: Tensor,                           # [N, T] 1 for completion tokens
    cap: float = 2.0,
) -> Correction:
    """Token-level truncated importance sampling (Yao et al. 2025, fengyao.notion.site/off-policy-rl):

        w_t = min(rho_t, C),   C = cap = 2 (ALGORITHMS.md)

    Only the upper tail is truncated: a token mu over-samples (rho < 1) is
    down-weighted in full. metrics: is_weight (w_t), is_clipped (1 where rho_t > C).
    """
    _check_positive(cap=cap)
    rho = torch.exp(_token_log_rho(old_logprobs, sampler_logprobs, mask))      # [N, T]
    weights = masked(rho.clamp(max=cap), mask)
    return Correction(
        weights=weights,
        metrics={"is_weight": weights, "is_clipped": masked(_flag(rho > cap, rho), mask)},
    )


def tis_sequence(
    *,
    old_logprobs: Tensor,                   # [N, T] log pi_old (learner)
    sampler_logprobs: Tensor,               # [N, T] log mu (rollout engine)
    mask: Tensor,                           # [N, T]
    cap: float = 2.0,
) -> Correction:
    """Sequence-level truncated importance sampling, broadcast to the sequence's tokens:

        w_i = min(prod_t rho_it, C) = exp(min(sum_t log rho_it, log C)),   C = cap = 2

    Computed in log space, so a long sequence whose product of ratios would
    overflow (or underflow) fp32 gives exactly C (or ~0) instead of inf / NaN.
    metrics: is_weight (w_i at each token), is_clipped (1 at every token of a
    sequence whose product exceeds C).
    """
    _check_positive(cap=cap)
    log_rho = _sequence_log_rho(old_logprobs, sampler_logprobs, mask)           # [N]
    weights = broadcast_to_tokens(torch.exp(log_rho.clamp(max=math.log(cap))), mask)
    clipped = broadcast_to_tokens(_flag(log_rho > math.log(cap), log_rho), mask)
    return Correction(weights=weights, metrics={"is_weight": weights, "is_clipped": clipped})


def mis(
    *,
    old_logprobs: Tensor,                   # [N, T] log pi_old (learner)
    sampler_logprobs: Tensor,               # [N, T] log mu (rollout engine)
    mask: Tensor,                           # [N, T]
    low: float = 0.5,
    high: float = 2.0,
) -> Correction:
    """Token-level masked importance sampling (IcePop, Ling Team 2025; Liu, Li et al. 2025):

        w_t = 1 if low <= rho_t <= high else 0    (band inclusive)

    A token whose probability disagrees too much between the engines is
    dropped from the gradient instead of reweighted. The band [0.5, 2] (a
    factor of 2 either way, matching TIS's C = 2) is a choice. The weight
    zeroes a term but leaves the mask alone, so with aggregation weights
    computed from the mask a rejected token still counts in the denominator.
    metrics: is_weight (w_t), is_masked (1 where a valid token is rejected).
    """
    _check_band(low, high)
    rho = torch.exp(_token_log_rho(old_logprobs, sampler_logprobs, mask))      # [N, T]
    inside = (rho >= low) & (rho <= high)
    weights = masked(_flag(inside, rho), mask)
    return Correction(
        weights=weights,
        metrics={"is_weight": weights, "is_masked": masked(_flag(~inside, rho), mask)},
    )


def mis_sequence(
    *,
    old_logprobs: Tensor,                   # [N, T] log pi_old (learner)
    sampler_logprobs: Tensor,               # [N, T] log mu (rollout engine)
    mask: Tensor,                           # [N, T]
    low: float = 0.5,
    high: float = 2.0,
) -> Correction:
    """Sequence-level masked importance sampling (Seq-MIS, Liu, Li et al. 2025):

        w_i = 1 if low <= prod_t rho_it <= high else 0, at every token of sequence i

    The sequence ratio is the product of token ratios, as in tis_sequence
    (choice: not the geometric mean, which would make the band independent of
    length; with the product a long sequence leaves the band more easily).
    Compared in log space (log low <= sum_t log rho_it <= log high), so it
    never overflows. The band [0.5, 2] is a choice. metrics: is_weight (w_i at
    each token), is_masked (1 at every token of a rejected sequence).
    """
    _check_band(low, high)
    log_rho = _sequence_log_rho(old_logprobs, sampler_logprobs, mask)           # [N]
    log_low = math.log(low) if low > 0 else -math.inf
    inside = (log_rho >= log_low) & (log_rho <= math.log(high))
    weights = broadcast_to_tokens(_flag(inside, log_rho), mask)
    rejected = broadcast_to_tokens(_flag(~inside, log_rho), mask)
    return Correction(weights=weights, metrics={"is_weight": weights, "is_masked": rejected})


CORRECTIONS: dict[str, Callable[..., Correction]] = {
    "tis": tis,
    "tis_sequence": tis_sequence,
    "mis": mis,
    "mis_sequence": mis_sequence,
}


def apply_correction(
    name: str,
    *,
    old_logprobs: Tensor,                   # [N, T]
    sampler_logprobs: Tensor,               # [N, T]
    mask: Tensor,                           # [N, T]
    **params,
) -> Correction:
    """Correction `name` (a CORRECTIONS key or "module:function") with `params`;
    a ValueError (with a suggestion) for an unknown name or parameter."""
    fn = resolve(CORRECTIONS, name, "correction")
    check_params(fn, params, f"correction {name!r}", reserved=CORRECTION_INPUTS)
    return fn(old_logprobs=old_logprobs, sampler_logprobs=sampler_logprobs, mask=mask, **params)


@torch.no_grad()
def mismatch_metrics(old_logprobs: Tensor, sampler_logprobs: Tensor, mask: Tensor) -> dict[str, float]:
    """How far the sampler's probabilities are from the learner's, over valid tokens:

    - mismatch_abs_diff_mean / _max: mean / max of |mu(y_t) - pi_old(y_t)|
      (probabilities, not logs; Yao et al. 2025 report the max as the
      telling one: it grows with length and parallelism while the mean stays flat);
    - mismatch_log_ratio_mean: mean of delta = old - mu (clamped);
    - mismatch_kl: mean of k3 = (r - 1) - log r = expm1(delta) - delta, r = pi_old / mu,
      an unbiased, >= 0 estimate of KL(mu || pi_old), because the tokens were sampled from mu
      (E_mu[r] = 1, E_mu[-log r] = KL(mu || pi_old); Schulman, "Approximating KL Divergence");
    - is_weight_mean / _max: mean / max of the per-token importance weight r = pi_old / mu,
      what TIS truncates (Yao et al. 2025): a max far above 1 means a few tokens would carry
      huge weights without the cap (the exploding-IS-weights alert watches it).

    An empty mask gives 0.0 for every key (1.0 for the IS weights), never NaN.
    """
    valid = mask.bool()
    old = masked(old_logprobs.detach(), mask)                                 # padding -> log p = 0,
    sampler = masked(sampler_logprobs.detach(), mask)                         # abs diff 0 there
    abs_diff = (torch.exp(sampler) - torch.exp(old)).abs()                     # [N, T]
    delta = log_ratio(old, sampler)                                            # [N, T], 0 at padding
    k3 = (torch.expm1(delta) - delta).clamp_min(0.0)                           # >= 0 up to rounding
    return {
        "mismatch_abs_diff_mean": masked_mean(abs_diff, valid).item(),
        "mismatch_abs_diff_max": abs_diff.max().item() if valid.any() else 0.0,
        "mismatch_log_ratio_mean": masked_mean(delta, valid).item(),
        "mismatch_kl": masked_mean(k3, valid).item(),
        "is_weight_mean": masked_mean(torch.exp(delta), valid).item() if valid.any() else 1.0,
        "is_weight_max": torch.exp(delta.masked_fill(~valid, float("-inf"))).max().item() if valid.any() else 1.0,
    }
