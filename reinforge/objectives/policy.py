"""Policy objectives: per-token loss terms l_it = -J_it, never reduced.

Every objective has the signature

    fn(*, logprobs, old_logprobs, advantages, mask, sampler_logprobs=None, **params) -> PolicyTerms

with all tensors [N, T] (the caller broadcasts per-sequence advantages to
tokens) and sits in `POLICY_LOSSES`; a new objective is one function and one
entry. Reduction to a scalar happens only in `aggregation`. Padded positions
must hold finite log-probs (0 is customary); their terms are set to 0.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from reinforge.objectives.common import log_ratio

# The tensors every objective receives from the caller; the rest of its
# keyword arguments are settable parameters (ObjectiveSpec.policy_params).
POLICY_INPUTS = ("logprobs", "old_logprobs", "advantages", "mask", "sampler_logprobs")


@dataclass
class PolicyTerms:
    """What a policy objective returns: unreduced terms and per-token diagnostics."""

    loss: Tensor                                                   # [N, T] per-token loss terms (= -J_it), 0 where mask is 0
    metrics: dict[str, Tensor] = field(default_factory=dict)       # name -> [N, T] detached per-token values, to be mask-averaged


def _masked(values: Tensor, mask: Tensor) -> Tensor:
    """`values` where mask is set, exactly 0 elsewhere (where() also drops inf/NaN of padding)."""
    return torch.where(mask.bool(), values, torch.zeros_like(values))


def ppo_clip(
    *,
    logprobs: Tensor,                       # [N, T] log pi_theta, requires grad
    old_logprobs: Tensor,                   # [N, T] log pi_old, detached
    advantages: Tensor,                     # [N, T]
    mask: Tensor,                           # [N, T] 1 for completion tokens
    sampler_logprobs: Tensor | None = None,  # unused: the ratio is against pi_old
    eps_low: float = 0.2,
    eps_high: float = 0.2,
) -> PolicyTerms:
    """PPO clipped surrogate (arXiv 1707.06347, eq. 7), per token:

        J = min(r A, clip(r, 1 - eps_low, 1 + eps_high) A),  r = exp(logprobs - old_logprobs)

    eps_high > eps_low is DAPO's "clip-higher" (arXiv 2503.14476, sec. 3.1). The
    gradient dJ/dlogp is r A inside the band and 0 exactly where the ratio has
    left the band in the direction A pushes it (r > 1 + eps_high with A > 0,
    r < 1 - eps_low with A < 0); those tokens count in clip_frac_high / _low.
    """
    ratio = torch.exp(log_ratio(logprobs, old_logprobs))                      # [N, T]
    clipped_ratio = ratio.clamp(1.0 - eps_low, 1.0 + eps_high)                # [N, T]
    objective = torch.minimum(ratio * advantages, clipped_ratio * advantages)  # [N, T]
    ratio = ratio.detach()
    clipped_low = (advantages < 0) & (ratio < 1.0 - eps_low)
    clipped_high = (advantages > 0) & (ratio > 1.0 + eps_high)
    return PolicyTerms(
        loss=_masked(-objective, mask),
        metrics={
            "clip_frac_low": _masked(clipped_low.to(ratio.dtype), mask),
            "clip_frac_high": _masked(clipped_high.to(ratio.dtype), mask),
            "clip_frac": _masked((clipped_low | clipped_high).to(ratio.dtype), mask),
            "ratio": _masked(ratio, mask),
        },
    )


def reinforce(
    *,
    logprobs: Tensor,                       # [N, T] log pi_theta, requires grad
    old_logprobs: Tensor,                   # [N, T] only for the ratio diagnostic
    advantages: Tensor,                     # [N, T]
    mask: Tensor,                           # [N, T]
    sampler_logprobs: Tensor | None = None,  # unused
) -> PolicyTerms:
    """REINFORCE (Williams 1992; as the policy term of RLOO, arXiv 2402.14740):

        J = A logprobs     (no ratio, no clip; dJ/dlogp = A)

    The ratio r = exp(logprobs - old_logprobs) is reported only as a diagnostic
    of how far the policy has moved from the one that produced the batch.
    """
    ratio = torch.exp(log_ratio(logprobs, old_logprobs)).detach()            # [N, T]
    return PolicyTerms(
        loss=_masked(-advantages * logprobs, mask),
        metrics={"ratio": _masked(ratio, mask)},
    )


POLICY_LOSSES: dict[str, Callable[..., PolicyTerms]] = {
    "ppo_clip": ppo_clip,
    "reinforce": reinforce,
}
