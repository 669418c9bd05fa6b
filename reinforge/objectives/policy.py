"""Policy objectives: per-token loss terms l_it = -J_it, never reduced.

Every objective has the signature

    fn(*, logprobs, old_logprobs, advantages, mask, sampler_logprobs=None, **params) -> PolicyTerms

with all tensors [N, T] (the caller broadcasts per-sequence advantages to
tokens) and sits in `POLICY_LOSSES`; a new objective is one function and one
entry. Reduction to a scalar happens only in `aggregation`. Padded positions
must hold finite log-probs (0 is customary); their terms are set to 0.

Token-level objectives live here; the sequence-level ones (GSPO, GSPO-token,
GMPO) in `policy_sequence`. Every ratio is exp of a `common.log_ratio`, whose
clamp to [-20, 20] keeps values and gradients finite for any input.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from reinforge.objectives.common import log_ratio, masked
from reinforge.objectives.covariance import clip_cov, kl_cov
from reinforge.objectives.policy_sequence import gmpo, gspo, gspo_token
from reinforge.objectives.surrogate import (
    PolicyTerms,
    clipped_surrogate,
    require_sampler,
    surrogate_terms,
    token_metrics,
)


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
    surrogate = clipped_surrogate(ratio, advantages, eps_low, eps_high)
    return surrogate_terms(surrogate.objective, mask, ratio.dtype, surrogate, ratio=ratio)


def dual_clip(
    *,
    logprobs: Tensor,                       # [N, T] log pi_theta, requires grad
    old_logprobs: Tensor,                   # [N, T] log pi_old, detached
    advantages: Tensor,                     # [N, T]
    mask: Tensor,                           # [N, T]
    sampler_logprobs: Tensor | None = None,  # unused
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    clip_c: float = 3.0,
) -> PolicyTerms:
    """Dual-clip PPO (Ye et al., arXiv 1912.09729), per token:

        J = max(J_ppo, c A)  if A < 0,   J = J_ppo  if A >= 0     (J_ppo as in ppo_clip)

    For A < 0, J_ppo = r A is unbounded below as r grows; the second bound
    caps the loss at -c A, with zero gradient, once r > c (c > 1 required).
    clip_frac_* are ppo_clip's flags; dual_clip_frac counts the tokens where
    the c A bound is active. The gradient is 0 exactly on clip_frac | dual_clip_frac.
    """
    if clip_c <= 1.0:
        raise ValueError(f"dual_clip needs clip_c > 1, got {clip_c}")
    ratio = torch.exp(log_ratio(logprobs, old_logprobs))                      # [N, T]
    surrogate = clipped_surrogate(ratio, advantages, eps_low, eps_high)
    floor = clip_c * advantages                                               # [N, T] no grad
    dual_clipped = (advantages < 0) & (surrogate.objective.detach() < floor)
    objective = torch.where(dual_clipped, floor, surrogate.objective)
    return surrogate_terms(objective, mask, ratio.dtype, surrogate, dual_clip_frac=dual_clipped, ratio=ratio)


def cispo(
    *,
    logprobs: Tensor,                       # [N, T] log pi_theta, requires grad
    old_logprobs: Tensor,                   # [N, T] log pi_old, detached
    advantages: Tensor,                     # [N, T]
    mask: Tensor,                           # [N, T]
    sampler_logprobs: Tensor | None = None,  # unused: the ratio is against pi_old
    r_max: float = 5.0,
) -> PolicyTerms:
    """CISPO (MiniMax-M1, arXiv 2506.13585), per token:

        J = sg(min(r, r_max)) A logprobs,  r = exp(logprobs - old_logprobs)

    The importance weight is clipped and detached instead of the update being
    masked, so every token keeps a gradient min(r, r_max) A; inside PPO's band
    that equals ppo_clip's r A. No lower bound on r (ALGORITHMS.md, choice).
    clip_frac_high (= clip_frac) counts tokens with r > r_max, whatever the sign of A.
    """
    ratio = torch.exp(log_ratio(logprobs, old_logprobs)).detach()             # [N, T]
    weight = ratio.clamp(max=r_max)
    clipped = ratio > r_max
    return PolicyTerms(
        loss=masked(-weight * advantages * logprobs, mask),
        metrics=token_metrics(mask, ratio.dtype, clip_frac_high=clipped, clip_frac=clipped, ratio=ratio),
    )


def sapo(
    *,
    logprobs: Tensor,                       # [N, T] log pi_theta, requires grad
    old_logprobs: Tensor,                   # [N, T] log pi_old, detached
    advantages: Tensor,                     # [N, T]
    mask: Tensor,                           # [N, T]
    sampler_logprobs: Tensor | None = None,  # unused
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
) -> PolicyTerms:
    """SAPO, Soft Adaptive Policy Optimization (Gao et al., arXiv 2511.20347), per token:

        J = f(r) A,  f(r) = sigmoid(tau (r - 1)) 4 / tau,  tau = tau_pos if A > 0 else tau_neg

    A smooth gate instead of a hard clip: dJ/dlogp = f'(r) r A with
    f'(r) = 4 sigmoid(x) (1 - sigmoid(x)), x = tau (r - 1), so f'(1) = 1 (the
    on-policy gradient is A) and the gradient decays with |r - 1| but is never
    0 (in floating point it underflows only for x beyond ~36 in fp64).
    The per-token gate f'(r) is reported as soft_gate.
    """
    ratio = torch.exp(log_ratio(logprobs, old_logprobs))                      # [N, T]
    tau = torch.where(advantages > 0, advantages.new_tensor(tau_pos), advantages.new_tensor(tau_neg))
    gate = torch.sigmoid(tau * (ratio - 1.0))                                 # [N, T]
    objective = gate * (4.0 / tau) * advantages
    return PolicyTerms(
        loss=masked(-objective, mask),
        metrics=token_metrics(mask, ratio.dtype, ratio=ratio, soft_gate=4.0 * gate * (1.0 - gate)),
    )


def _divergence_masked(
    logprobs: Tensor,          # [N, T] log pi_theta, requires grad
    sampler_logprobs: Tensor,  # [N, T] log pi_sampler
    advantages: Tensor,        # [N, T]
    mask: Tensor,              # [N, T]
    blocked_up: Tensor,        # [N, T] bool: p rose out of the trust region
    blocked_down: Tensor,      # [N, T] bool: p fell out of the trust region
    divergence: dict[str, Tensor],
    ratio_cap: float | None = None,
) -> PolicyTerms:
    """DPPO's masked surrogate J = m (p / p_mu) A; m = 0 where the move left the trust
    region in the direction A pushes it (up for A > 0, down for A < 0). With `ratio_cap` c,
    a token whose ratio exceeds c counts as c: J = m c A with gradient m c A grad logp
    (verl's truncation, min(r, clip_ratio_c) detached, c = 3 by its default config)."""
    ratio = torch.exp(log_ratio(logprobs, sampler_logprobs))                  # [N, T] p / p_mu
    clipped_high = (advantages > 0) & blocked_up
    clipped_low = (advantages < 0) & blocked_down
    clipped = clipped_low | clipped_high
    weight = ratio
    if ratio_cap is not None:
        weight = torch.where(ratio.detach() > ratio_cap, ratio_cap * torch.exp(logprobs - logprobs.detach()), ratio)
    objective = torch.where(clipped, torch.zeros_like(ratio), weight * advantages)
    return PolicyTerms(
        loss=masked(-objective, mask),
        metrics=token_metrics(mask, ratio.dtype, clip_frac_low=clipped_low, clip_frac_high=clipped_high,
                               clip_frac=clipped, ratio=ratio, **divergence),
    )


def _beyond_delta(
    logprobs: Tensor,          # [N, T] log pi_theta, requires grad
    sampler_logprobs: Tensor,  # [N, T] log pi_sampler
    advantages: Tensor,        # [N, T]
    mask: Tensor,              # [N, T]
    name: str,                 # the divergence's metric name
    divergence: Tensor,        # [N, T] D, detached
    delta: float,
    p: Tensor | None = None,     # [N, T] the sampled token's probabilities; None: exp(logprobs), detached
    p_mu: Tensor | None = None,  # [N, T] under the sampler; None: exp(sampler_logprobs)
    ratio_cap: float | None = None,
) -> PolicyTerms:
    """_divergence_masked with the trust region D <= delta: a token outside it is blocked in the
    direction its sampled token's probability moved (up where p > p_mu, down where p < p_mu)."""
    if p is None or p_mu is None:
        p, p_mu = torch.exp(logprobs.detach()), torch.exp(sampler_logprobs)
    outside = divergence > delta
    return _divergence_masked(logprobs, sampler_logprobs, advantages, mask,
                              blocked_up=outside & (p > p_mu), blocked_down=outside & (p < p_mu),
                              divergence={name: divergence}, ratio_cap=ratio_cap)


def dppo_tv(
    *,
    logprobs: Tensor,                       # [N, T] log pi_theta, requires grad
    old_logprobs: Tensor,                   # [N, T] unused: the ratio is against the sampler
    advantages: Tensor,                     # [N, T]
    mask: Tensor,                           # [N, T]
    sampler_logprobs: Tensor | None = None,  # [N, T] log pi_sampler, required
    delta: float = 0.15,
    ratio_cap: float | None = None,
) -> PolicyTerms:
    """DPPO, binary total-variation trust region (Qi et al., "Rethinking the Trust
    Region in LLM Reinforcement Learning", arXiv 2602.04879), per token:

        J = m (p / p_mu) A,   p = exp(logprobs), p_mu = exp(sampler_logprobs)
        m = 0 if (A > 0 and p - p_mu > delta) or (A < 0 and p_mu - p > delta), else 1

    The ratio is anchored on the sampler, not on pi_old; the mask uses the
    detached p. Metrics: clip_frac_high / _low / clip_frac (masked tokens by
    direction), ratio (p / p_mu), tv = |p - p_mu|. `ratio_cap` (None: the paper's, no cap;
    verl's default config truncates at 3): see _divergence_masked.
    """
    sampler_logprobs = require_sampler(sampler_logprobs, "dppo_tv")
    p, p_mu = torch.exp(logprobs.detach()), torch.exp(sampler_logprobs)       # [N, T]
    return _divergence_masked(logprobs, sampler_logprobs, advantages, mask,
                              blocked_up=p - p_mu > delta, blocked_down=p_mu - p > delta,
                              divergence={"tv": (p - p_mu).abs()}, ratio_cap=ratio_cap)


def _probability_floor(dtype: torch.dtype) -> float:
    """The clamp of probabilities inside the Bernoulli KL: [floor, 1 - floor] (choice).

    1e-12, or the dtype's machine epsilon where that is larger (fp32: 1.2e-7), so
    that 1 - floor < 1 is representable and no log is taken of 0.
    """
    return max(1e-12, torch.finfo(dtype).eps)


def dppo_kl(
    *,
    logprobs: Tensor,                       # [N, T] log pi_theta, requires grad
    old_logprobs: Tensor,                   # [N, T] unused: the ratio is against the sampler
    advantages: Tensor,                     # [N, T]
    mask: Tensor,                           # [N, T]
    sampler_logprobs: Tensor | None = None,  # [N, T] log pi_sampler, required
    delta: float = 0.05,
    ratio_cap: float | None = None,
) -> PolicyTerms:
    """DPPO, binary KL trust region (arXiv 2602.04879), per token: J = m (p / p_mu) A with

        D = p_mu log(p_mu / p) + (1 - p_mu) log((1 - p_mu) / (1 - p))
        m = 0 if D > delta and (A > 0 and p > p_mu, or A < 0 and p < p_mu), else 1

    D is the KL between the Bernoulli distributions "sampled token or not"
    under the sampler and the current policy. Both probabilities are clamped
    to [floor, 1 - floor] inside D (see _probability_floor), so D is finite
    when p or p_mu is 0 or 1. Metrics as dppo_tv, with binary_kl = D instead of tv.
    """
    sampler_logprobs = require_sampler(sampler_logprobs, "dppo_kl")
    floor = _probability_floor(logprobs.dtype)
    p = torch.exp(logprobs.detach()).clamp(floor, 1.0 - floor)                # [N, T]
    p_mu = torch.exp(sampler_logprobs).clamp(floor, 1.0 - floor)              # [N, T]
    kl = p_mu * (p_mu.log() - p.log()) + (1.0 - p_mu) * (torch.log1p(-p_mu) - torch.log1p(-p))
    return _beyond_delta(logprobs, sampler_logprobs, advantages, mask, "binary_kl", kl, delta, p, p_mu,
                         ratio_cap=ratio_cap)


def _top_k_probabilities(top_logprobs: Tensor | None, sampler_top_logprobs: Tensor | None,
                         objective: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(p_k, mu_k) [N, T, K] and the lumped rest (p_o, mu_o) [N, T] = 1 - sum_k, clamped at 0 (rounding)."""
    if top_logprobs is None or sampler_top_logprobs is None:
        raise ValueError(f"policy loss {objective!r} needs the sampler's top-K log-probs and the learner's at the "
                         "same ids: set rollout.record_top_k > 0 (rollout.engine=native)")
    p, p_mu = torch.exp(top_logprobs.detach()), torch.exp(sampler_top_logprobs)             # [N, T, K]
    return p, p_mu, (1.0 - p.sum(-1)).clamp(min=0.0), (1.0 - p_mu.sum(-1)).clamp(min=0.0)


def dppo_topk_tv(
    *,
    logprobs: Tensor,                       # [N, T] log pi_theta of the sampled tokens, requires grad
    old_logprobs: Tensor,                   # [N, T] unused: the ratio is against the sampler
    advantages: Tensor,                     # [N, T]
    mask: Tensor,                           # [N, T]
    sampler_logprobs: Tensor | None = None,  # [N, T] log pi_sampler of the sampled tokens, required
    top_logprobs: Tensor | None = None,     # [N, T, K] log pi_theta of the sampler's top-K ids (detached)
    sampler_top_logprobs: Tensor | None = None,  # [N, T, K] log pi_sampler of its top-K ids
    delta: float = 0.15,
) -> PolicyTerms:
    """DPPO with the top-K total-variation trust region (arXiv 2602.04879), per token:

        D = 0.5 (sum_k |p_k - mu_k| + |(1 - sum_k p_k) - (1 - sum_k mu_k)|)
        J = m (p / p_mu) A,  m = 0 if D > delta and (A > 0 and p > p_mu, or A < 0 and p < p_mu), else 1

    over the sampler's K most likely ids at the position (mu_k its probabilities, p_k the current
    policy's at the same ids) plus one bucket lumping every other token: the TV between the two
    distributions coarsened to K + 1 outcomes, a lower bound of the full TV that reaches it as K
    grows. p, p_mu: the sampled token's probabilities, which give the direction of the move (as in
    dppo_tv, which this is with K = 1 and the sampled token as the one id). Metrics as dppo_tv,
    with tv = D.
    """
    sampler_logprobs = require_sampler(sampler_logprobs, "dppo_topk_tv")
    p_k, mu_k, p_o, mu_o = _top_k_probabilities(top_logprobs, sampler_top_logprobs, "dppo_topk_tv")
    tv = 0.5 * ((p_k - mu_k).abs().sum(-1) + (p_o - mu_o).abs())                          # [N, T]
    return _beyond_delta(logprobs, sampler_logprobs, advantages, mask, "tv", tv, delta)


def dppo_topk_kl(
    *,
    logprobs: Tensor,                       # [N, T] log pi_theta of the sampled tokens, requires grad
    old_logprobs: Tensor,                   # [N, T] unused: the ratio is against the sampler
    advantages: Tensor,                     # [N, T]
    mask: Tensor,                           # [N, T]
    sampler_logprobs: Tensor | None = None,  # [N, T] log pi_sampler of the sampled tokens, required
    top_logprobs: Tensor | None = None,     # [N, T, K] log pi_theta of the sampler's top-K ids (detached)
    sampler_top_logprobs: Tensor | None = None,  # [N, T, K] log pi_sampler of its top-K ids
    delta: float = 0.05,
) -> PolicyTerms:
    """DPPO with the top-K KL trust region (arXiv 2602.04879), per token: J as dppo_topk_tv with

        D = sum_k mu_k log(mu_k / p_k) + mu_o log(mu_o / p_o),   mu_o = 1 - sum_k mu_k, p_o = 1 - sum_k p_k

    the KL(sampler || policy) over the K + 1 outcomes (top-K ids, the rest). A term with mu = 0
    (a token the sampler's top-k / top-p filter removed) is 0; p_o and mu_o are clamped to
    [floor, 1] inside the log (see _probability_floor). Metrics as dppo_topk_tv, with top_k_kl = D.
    """
    sampler_logprobs = require_sampler(sampler_logprobs, "dppo_topk_kl")
    p_k, mu_k, p_o, mu_o = _top_k_probabilities(top_logprobs, sampler_top_logprobs, "dppo_topk_kl")
    floor = _probability_floor(logprobs.dtype)
    inner = torch.where(mu_k > 0, mu_k * (sampler_top_logprobs - top_logprobs.detach()), torch.zeros_like(mu_k))
    rest = torch.where(mu_o > 0, mu_o * (mu_o.clamp(min=floor).log() - p_o.clamp(min=floor).log()),
                       torch.zeros_like(mu_o))
    kl = inner.sum(-1) + rest                                                                  # [N, T]
    return _beyond_delta(logprobs, sampler_logprobs, advantages, mask, "top_k_kl", kl, delta)


def decoupled_ppo(
    *,
    logprobs: Tensor,                       # [N, T] log pi_theta, requires grad
    old_logprobs: Tensor,                   # [N, T] log pi_prox: the learner's own log-probs before this update
    advantages: Tensor,                     # [N, T]
    mask: Tensor,                           # [N, T]
    sampler_logprobs: Tensor | None = None,  # [N, T] log pi_behav (mu) from the rollout engine, required
    eps: float = 0.2,
    w_max: float = 5.0,
) -> PolicyTerms:
    """Decoupled PPO (AReaL, arXiv 2505.24298), per token:

        J = w min(u A, clip(u, 1 - eps, 1 + eps) A),  u = exp(logprobs - prox),  w = sg(exp(prox - mu))

    The trust region is taken around the proximal policy (old_logprobs) and
    the behaviour policy mu enters only through the detached importance weight
    w; tokens with w > w_max get a zero term (the cap is a choice,
    ALGORITHMS.md). With mu == prox, w = 1 and this is ppo_clip. Metrics:
    ppo_clip's clip fractions and ratio (u), behav_weight (w), behav_masked_frac.
    """
    sampler_logprobs = require_sampler(sampler_logprobs, "decoupled_ppo")
    ratio = torch.exp(log_ratio(logprobs, old_logprobs))                      # [N, T] u
    behav_weight = torch.exp(log_ratio(old_logprobs, sampler_logprobs)).detach()  # [N, T] w
    behav_masked = behav_weight > w_max
    surrogate = clipped_surrogate(ratio, advantages, eps, eps)
    objective = torch.where(behav_masked, torch.zeros_like(ratio), behav_weight * surrogate.objective)
    return surrogate_terms(objective, mask, ratio.dtype, surrogate, ratio=ratio, behav_weight=behav_weight,
                           behav_masked_frac=behav_masked)


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
        loss=masked(-advantages * logprobs, mask),
        metrics={"ratio": masked(ratio, mask)},
    )


def gpg(
    *,
    logprobs: Tensor,                       # [N, T] log pi_theta, requires grad
    old_logprobs: Tensor,                   # [N, T] only for the ratio diagnostic
    advantages: Tensor,                     # [N, T] GPG's corrected advantage (ADVANTAGES["gpg"])
    mask: Tensor,                           # [N, T]
    sampler_logprobs: Tensor | None = None,  # unused
) -> PolicyTerms:
    """GPG, Group Policy Gradient (arXiv 2504.02546), per token:

        J = A logprobs     (no ratio, no clip, no reference model)

    The policy term is REINFORCE's; what makes GPG is its advantage (group
    mean baseline rescaled by B / (B - M), ADVANTAGES["gpg"]) and token_mean
    aggregation, so this delegates to `reinforce`.
    """
    return reinforce(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, mask=mask,
                     sampler_logprobs=sampler_logprobs)


POLICY_LOSSES: dict[str, Callable[..., PolicyTerms]] = {
    "ppo_clip": ppo_clip,
    "dual_clip": dual_clip,
    "gspo": gspo,
    "gspo_token": gspo_token,
    "gmpo": gmpo,
    "cispo": cispo,
    "sapo": sapo,
    "dppo_tv": dppo_tv,
    "dppo_kl": dppo_kl,
    "dppo_topk_tv": dppo_topk_tv,
    "dppo_topk_kl": dppo_topk_kl,
    "decoupled_ppo": decoupled_ppo,
    "reinforce": reinforce,
    "gpg": gpg,
    "clip_cov": clip_cov,
    "kl_cov": kl_cov,
}
