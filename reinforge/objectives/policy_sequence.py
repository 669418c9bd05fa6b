"""Sequence-level policy objectives (GSPO, GSPO-token, GMPO), registered in
`policy.POLICY_LOSSES` with the same signature as the token-level ones.

A sequence objective J_i is returned as per-token terms: -J_i at each valid
token of sequence i (`broadcast_to_tokens`). With seq_mean_token_mean
weights 1 / (N |y_i|) a row then contributes exactly -J_i / N, i.e. the loss
is the mean over sequences of -J_i, which is what these papers optimise; any
other aggregation weights each J_i by the row's total weight instead.
Per-sequence advantages are the sequence mean of the [N, T] advantages
(the same value when A is broadcast from a sequence, as usual).
"""

from __future__ import annotations

import torch
from torch import Tensor

from reinforge.objectives.aggregation import (
    broadcast_to_tokens,
    sequence_geometric_mean,
    sequence_mean,
)
from reinforge.objectives.common import log_ratio
from reinforge.objectives.surrogate import PolicyTerms, clipped_surrogate, surrogate_terms, token_metrics


def _sequence_terms(objective: Tensor, mask: Tensor, dtype: torch.dtype, **metrics: Tensor) -> PolicyTerms:
    """Per-sequence J [N] and metrics [N] as per-token terms: each broadcast to the valid tokens."""
    return PolicyTerms(
        loss=broadcast_to_tokens(-objective, mask),
        metrics={name: broadcast_to_tokens(value.detach().to(dtype), mask) for name, value in metrics.items()},
    )


def gspo(
    *,
    logprobs: Tensor,                       # [N, T] log pi_theta, requires grad
    old_logprobs: Tensor,                   # [N, T] log pi_old, detached
    advantages: Tensor,                     # [N, T] (constant within a sequence, usually)
    mask: Tensor,                           # [N, T]
    sampler_logprobs: Tensor | None = None,  # unused
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
) -> PolicyTerms:
    """GSPO, Group Sequence Policy Optimization (arXiv 2507.18071), per sequence:

        s_i = exp((1/|y_i|) sum_t (logprobs - old_logprobs))     (length-normalised sequence ratio)
        J_i = min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i),  A_i = sequence mean of A

    One clip decision per sequence: unclipped, dJ_i/dlogp_it = s_i A_i / |y_i|.
    The term -J_i is broadcast to each valid token (module docstring): with
    seq_mean_token_mean the row contributes J_i / N. Metrics: the sequence's
    clip flags (clip_frac_low / _high / clip_frac) and s_i (ratio), broadcast.
    """
    seq_ratio = torch.exp(sequence_mean(log_ratio(logprobs, old_logprobs), mask))   # [N] s_i
    surrogate = clipped_surrogate(seq_ratio, sequence_mean(advantages, mask), eps_low, eps_high)
    return _sequence_terms(surrogate.objective, mask, logprobs.dtype, **surrogate.flags(), ratio=seq_ratio)


def gspo_token(
    *,
    logprobs: Tensor,                       # [N, T] log pi_theta, requires grad
    old_logprobs: Tensor,                   # [N, T] log pi_old, detached
    advantages: Tensor,                     # [N, T] per token
    mask: Tensor,                           # [N, T]
    sampler_logprobs: Tensor | None = None,  # unused
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
) -> PolicyTerms:
    """GSPO-token (arXiv 2507.18071), per token:

        s_it = sg(s_i) exp(logprobs_it - sg(logprobs_it))   (value s_i, ds_it/dlogp_it = s_i)
        J_it = min(s_it A_it, clip(s_it, 1 - eps_low, 1 + eps_high) A_it)

    Allows token-level advantages with GSPO's sequence ratio. When A is
    constant within a sequence it equals gspo under seq_mean_token_mean, in
    value and gradient: (1/|y_i|) sum_t J_it = J_i, and the clip decision is
    the sequence's. Metrics as gspo (the flags here are per token).
    """
    seq_ratio = torch.exp(sequence_mean(log_ratio(logprobs.detach(), old_logprobs), mask))  # [N] sg(s_i)
    token_ratio = seq_ratio.unsqueeze(1) * torch.exp(logprobs - logprobs.detach())          # [N, T] s_it
    surrogate = clipped_surrogate(token_ratio, advantages, eps_low, eps_high)
    return surrogate_terms(surrogate.objective, mask, logprobs.dtype, surrogate, ratio=token_ratio)


def gmpo(
    *,
    logprobs: Tensor,                       # [N, T] log pi_theta, requires grad
    old_logprobs: Tensor,                   # [N, T] log pi_old, detached
    advantages: Tensor,                     # [N, T] (constant within a sequence, usually)
    mask: Tensor,                           # [N, T]
    sampler_logprobs: Tensor | None = None,  # unused
    eps: float = 0.4,
) -> PolicyTerms:
    """GMPO, Geometric-Mean Policy Optimization (arXiv 2507.20673), per sequence:

        d_t = logprobs - old_logprobs,  d*_t = sgn(A_i) min(sgn(A_i) d_t, sgn(A_i) clip(d_t, -eps, eps))
        J_i = A_i exp((1/|y_i|) sum_t d*_t)    (A_i times the geometric mean of the clipped ratios)

    The clip acts on token log-ratios in log space: for A_i > 0 only d_t > eps
    is clipped, for A_i < 0 only d_t < -eps; a clipped token has zero gradient.
    sgn is taken of the sequence advantage A_i = sequence mean of A (choice:
    the paper's A is per sequence). -J_i is broadcast to the tokens as in gspo.
    Metrics: clip_frac (per token, the clip bound is active) and ratio (the
    unclipped geometric mean exp(mean_t d_t), broadcast).
    """
    token_log_ratio = log_ratio(logprobs, old_logprobs)                       # [N, T] d
    seq_advantage = sequence_mean(advantages, mask)                           # [N] A_i
    sign = torch.sign(seq_advantage).unsqueeze(1)                             # [N, 1]
    clipped_log_ratio = sign * torch.minimum(sign * token_log_ratio, sign * token_log_ratio.clamp(-eps, eps))
    objective = seq_advantage * sequence_geometric_mean(clipped_log_ratio, mask)   # [N]
    d = token_log_ratio.detach()
    clipped = ((sign > 0) & (d > eps)) | ((sign < 0) & (d < -eps))            # [N, T]
    return PolicyTerms(
        loss=broadcast_to_tokens(-objective, mask),
        metrics={**token_metrics(mask, logprobs.dtype, clip_frac=clipped),
                 "ratio": broadcast_to_tokens(sequence_geometric_mean(d, mask), mask)},
    )
