"""Per-token estimators of the KL divergence between the policy and a reference.

With delta = logprobs - ref_logprobs (clamped to [-20, 20], ALGORITHMS.md
"choice"), the estimators of Schulman's note "Approximating KL Divergence"
(http://joschu.net/blog/kl-approx.html) are

    k1 = delta,   k2 = delta^2 / 2,   k3 = exp(-delta) - 1 + delta  (>= 0).

Used on-policy as a loss, E[grad k2] = grad KL(pi || ref) and E[grad k3] =
grad KL(ref || pi); E[grad k1] = 0, so k1 belongs in the reward, not the loss.
GRPO (arXiv 2402.03300, eq. 4) uses k3 in the loss with beta = 0.04.

Every estimator has the signature fn(*, logprobs, ref_logprobs, clamp=None) -> [N, T]
and sits in `KL_ESTIMATORS`; `clamp` (objective.kl_clamp, off by default) bounds the
estimate to [-clamp, clamp], as verl and OpenRLHF bound k3 at 10. Off by default because
the clamp removes the KL gradient of exactly the tokens that moved furthest from the
reference (k3 > 10: pi below about 1/14 of ref), and the log-ratio clamp at 20 already keeps
k3 finite. The straight-through forms k1_st / k3_st (verl's "k1+" / "k3+") report k1 / k3
and take k2's gradient. Terms are not masked: the aggregation weights
are 0 on padding.

Placement (ALGORITHMS.md, "KL to the reference"): in the loss (GRPO), or in
the reward, r_t <- r_t - beta sg(k_t) (PPO / InstructGPT, arXiv 2203.02155,
with k1), see `sequence_kl_penalty`. In the reward the estimator is a value
estimate of the sequence's KL, not a gradient: k1 and k3 are unbiased for
KL(pi || ref) under pi (E_pi[exp(-delta)] = 1), k3 with lower variance
(verl's "low_var_kl"); k2 is biased (second order in delta; verl's "mse").
All three are allowed; `objective.kl_estimator` picks one in either
placement. Reference kinds: the frozen initial policy, or an EMA of the
policy (T1, arXiv 2501.11651), see `ema_update_`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import Tensor

from reinforge.objectives.common import log_ratio, resolve


def _clamped(k: Tensor, clamp: float | None) -> Tensor:
    """k clamped to [-clamp, clamp] (value and gradient: no gradient outside), or k if clamp is None."""
    return k if clamp is None else k.clamp(-clamp, clamp)


def k1(*, logprobs: Tensor, ref_logprobs: Tensor, clamp: float | None = None) -> Tensor:
    """k1 = delta = logprobs - ref_logprobs (unbiased, high variance, can be < 0)."""
    return _clamped(log_ratio(logprobs, ref_logprobs), clamp)


def k2(*, logprobs: Tensor, ref_logprobs: Tensor, clamp: float | None = None) -> Tensor:
    """k2 = delta^2 / 2 (biased, low variance, >= 0)."""
    return _clamped(log_ratio(logprobs, ref_logprobs) ** 2 / 2, clamp)


def k3(*, logprobs: Tensor, ref_logprobs: Tensor, clamp: float | None = None) -> Tensor:
    """k3 = exp(-delta) - 1 + delta (unbiased for KL(pi || ref) under pi, >= 0).

    dk3/dlogprobs = 1 - exp(-delta). Computed with expm1, which is exact near
    delta = 0; the clamp at 0 only removes a rounding error of a few ulp there
    (where the true value and gradient are ~0), so k3 >= 0 holds in floating point.
    With `clamp` (verl's low_var_kl and OpenRLHF's k3 use 10) k3 = min(k3, clamp), and a
    token past it has no KL gradient.
    """
    delta = log_ratio(logprobs, ref_logprobs)
    return _clamped((torch.expm1(-delta) + delta).clamp_min(0.0), clamp)


def abs_kl(*, logprobs: Tensor, ref_logprobs: Tensor, clamp: float | None = None) -> Tensor:
    """|delta| (verl's "abs"): >= 0, biased; its gradient is sign(delta), of constant size."""
    return _clamped(log_ratio(logprobs, ref_logprobs).abs(), clamp)


def _straight_through(forward: Tensor, logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """The value of `forward` (detached) with the gradient of k2: k2 - sg(k2) + sg(forward)."""
    backward = k2(logprobs=logprobs, ref_logprobs=ref_logprobs)
    return backward - backward.detach() + forward.detach()


def k1_st(*, logprobs: Tensor, ref_logprobs: Tensor, clamp: float | None = None) -> Tensor:
    """k1's value with k2's gradient (verl's "k1+"): on-policy E[grad] = grad KL(pi || ref), which k1's is not.

    The clamp bounds the value only; the gradient stays k2's."""
    return _straight_through(k1(logprobs=logprobs, ref_logprobs=ref_logprobs, clamp=clamp), logprobs, ref_logprobs)


def k3_st(*, logprobs: Tensor, ref_logprobs: Tensor, clamp: float | None = None) -> Tensor:
    """k3's value with k2's gradient (verl's "k3+"): on-policy E[grad] = grad KL(pi || ref), not KL(ref || pi).

    The clamp bounds the value only; the gradient stays k2's."""
    return _straight_through(k3(logprobs=logprobs, ref_logprobs=ref_logprobs, clamp=clamp), logprobs, ref_logprobs)


KL_ESTIMATORS: dict[str, Callable[..., Tensor]] = {
    "k1": k1,
    "k2": k2,
    "k3": k3,
    "abs": abs_kl,
    "k1_st": k1_st,
    "k3_st": k3_st,
}


def kl_terms(name: str, logprobs: Tensor, ref_logprobs: Tensor, clamp: float | None = None) -> Tensor:
    """Per-token KL estimates [N, T] by estimator name (or "module:function"); `clamp` (objective.kl_clamp)
    is passed only when set, so an estimator of your own need not take it unless you use it."""
    extra = {} if clamp is None else {"clamp": clamp}
    return resolve(KL_ESTIMATORS, name, "KL estimator")(logprobs=logprobs, ref_logprobs=ref_logprobs, **extra)


def reward_kl_terms(
    estimator: str,            # key of KL_ESTIMATORS (or "module:function")
    old_logprobs: Tensor,      # [N, T] log pi_old of the sampled tokens (the policy that sampled them)
    ref_logprobs: Tensor,      # [N, T] log pi_ref
    mask: Tensor,              # [N, T]
    clamp: float | None = None,  # objective.kl_clamp
) -> Tensor:
    """sg(k_t) per token, [N, T], 0 on padding: the KL estimate a reward is charged per token."""
    k = kl_terms(estimator, old_logprobs.detach(), ref_logprobs.detach(), clamp)
    return torch.where(mask.bool(), k, torch.zeros_like(k))


def sequence_kl_penalty(
    old_logprobs: Tensor,      # [N, T] log pi_old of the sampled tokens (the policy that sampled them)
    ref_logprobs: Tensor,      # [N, T] log pi_ref
    mask: Tensor,              # [N, T]
    kl_coef: float,
    estimator: str = "k1",
    clamp: float | None = None,
) -> Tensor:
    """beta * sum_t sg(k_t) per sequence, [N]: the KL placed in the reward.

    With one outcome reward per sequence, r_t <- r_t - beta sg(k_t) on every
    token sums to R_i - beta sum_t k_it for a critic-free advantage; a
    critic's GAE takes the per-token form (value.outcome_token_rewards).
    """
    return kl_coef * reward_kl_terms(estimator, old_logprobs, ref_logprobs, mask, clamp).sum(dim=1)


def centred_kl_penalty(
    old_logprobs: Tensor,      # [N, T] log pi_old of the sampled tokens
    ref_logprobs: Tensor,      # [N, T] log pi_ref
    mask: Tensor,              # [N, T]
    kl_coef: float,
    estimator: str = "k1",
    clamp: float | None = None,
) -> Tensor:
    """T1's on-policy KL normalisation (arXiv 2501.11651, "on-policy KL normalization"), [N]:

        KL_i = sum_t sg(k_it),   p_i = beta (KL_i - mean_j KL_j),   A_i <- A_i - p_i

    the mean over the batch's on-policy samples j (every row given: the caller passes the valid
    ones). The reward's KL penalty is centred before it joins the advantage, after the estimator:
    so the group normalisation neither cancels it (a penalty shared by a group would) nor rescales
    it, and, with KL_i >= 0, it no longer shifts every advantage down (which would lower the
    probability of every sampled answer, correct ones too); only a sample's KL relative to the
    batch's is charged. The paper pairs it with the EMA reference (`ema_update_`). This formula
    is a reading of the paper's description (the KL's mean over the on-policy samples is
    subtracted so that the KL-penalised reward stays centred); Tinker's centred KL penalty,
    A_t += beta (mean KL - k_t), does the same per token.
    """
    kl = reward_kl_terms(estimator, old_logprobs, ref_logprobs, mask, clamp).sum(dim=1)    # [N]
    return kl_coef * (kl - kl.mean()) if kl.numel() else kl


@torch.no_grad()
def ema_update_(reference: Iterable[Tensor], policy: Iterable[Tensor], ema: float) -> None:
    """ref <- ema ref + (1 - ema) theta, in place, parameter by parameter (T1's EMA reference).

    ema = 1 keeps the reference fixed; ema = 0 makes it the current policy.
    """
    for ref, theta in zip(reference, policy, strict=True):
        ref.lerp_(theta.to(ref.dtype), 1.0 - ema)


def adaptive_kl_coef(kl_coef: float, observed_kl: float, target: float, horizon_gain: float = 0.1) -> float:
    """The adaptive KL controller of Ziegler et al. (arXiv 1909.08593, sec. 2.2):

        e = clip(KL / KL_target - 1, -0.2, 0.2),   beta' = beta (1 + K_beta e),   K_beta = 0.1

    KL is the batch's mean per-sequence KL to the reference (sum_t k1). beta grows when the policy
    drifts past the target and shrinks when it stays inside; the clip bounds each change to 2%.
    """
    error = min(max(observed_kl / target - 1.0, -0.2), 0.2)
    return kl_coef * (1.0 + horizon_gain * error)
