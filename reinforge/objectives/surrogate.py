"""What every policy objective shares: its return type, the inputs the caller
passes, per-token metrics, and PPO's clipped surrogate (used by ppo_clip,
dual_clip, decoupled_ppo and the GSPO objectives, written once here).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from reinforge.objectives.common import masked

# The tensors every objective receives from the caller; the rest of its
# keyword arguments are settable parameters (ObjectiveSpec.policy_params). `selected`: a token
# selection of the whole optimizer batch, for the losses of covariance.BATCH_SELECTIONS;
# `top_logprobs` / `sampler_top_logprobs` [N, T, K]: the learner's and the sampler's log-probs of the
# sampler's top-K ids (rollout.record_top_k), for DPPO's top-K divergence.
POLICY_INPUTS = ("logprobs", "old_logprobs", "advantages", "mask", "sampler_logprobs", "selected", "top_logprobs",
                 "sampler_top_logprobs")


@dataclass
class PolicyTerms:
    """What a policy objective returns: unreduced terms and per-token diagnostics."""

    loss: Tensor  # [N, T] per-token loss terms (= -J_it), 0 where mask is 0
    # name -> [N, T] detached per-token values, to be mask-averaged
    metrics: dict[str, Tensor] = field(default_factory=dict)


def token_metrics(mask: Tensor, dtype: torch.dtype, **values: Tensor) -> dict[str, Tensor]:
    """Per-token diagnostics: detached, cast to `dtype` (flags become 0/1), 0 where mask is 0."""
    return {name: masked(value.detach().to(dtype), mask) for name, value in values.items()}


def require_sampler(sampler_logprobs: Tensor | None, objective: str) -> Tensor:
    if sampler_logprobs is None:
        raise ValueError(f"policy loss {objective!r} needs sampler_logprobs (the log-probs reported by "
                         "the rollout engine for the sampled tokens); pass them with the batch")
    return sampler_logprobs


@dataclass
class ClippedSurrogate:
    """PPO's clipped surrogate of a ratio, and where its clip is active (zero gradient)."""

    objective: Tensor      # J = min(r A, clip(r, 1 - eps_low, 1 + eps_high) A), same shape as r
    clipped_low: Tensor    # bool: A < 0 and r < 1 - eps_low
    clipped_high: Tensor   # bool: A > 0 and r > 1 + eps_high

    def flags(self) -> dict[str, Tensor]:
        """The clip indicators under their metric names."""
        return {"clip_frac_low": self.clipped_low, "clip_frac_high": self.clipped_high,
                "clip_frac": self.clipped_low | self.clipped_high}


def clipped_surrogate(ratio: Tensor, advantages: Tensor, eps_low: float, eps_high: float) -> ClippedSurrogate:
    """min(r A, clip(r, 1 - eps_low, 1 + eps_high) A) (arXiv 1707.06347, eq. 7), any shape.

    dJ/dr is A inside the band and 0 exactly where r has left it in the
    direction A pushes it; on the other side the unclipped r A is the min.
    Shared by ppo_clip, dual_clip, decoupled_ppo and the GSPO objectives.
    """
    clipped_ratio = ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    objective = torch.minimum(ratio * advantages, clipped_ratio * advantages)
    ratio = ratio.detach()
    return ClippedSurrogate(
        objective=objective,
        clipped_low=(advantages < 0) & (ratio < 1.0 - eps_low),
        clipped_high=(advantages > 0) & (ratio > 1.0 + eps_high),
    )


def surrogate_terms(objective: Tensor, mask: Tensor, dtype: torch.dtype, surrogate: ClippedSurrogate,
                    **metrics: Tensor) -> PolicyTerms:
    """Per-token terms of an objective built on `surrogate` ([N, T]: its J, or J with some tokens changed):
    loss -objective on the valid tokens; metrics the surrogate's clip flags then `metrics` (`token_metrics`)."""
    return PolicyTerms(loss=masked(-objective, mask),
                       metrics=token_metrics(mask, dtype, **surrogate.flags(), **metrics))
