"""Covariance-based entropy control: Clip-Cov and KL-Cov (Cui et al., "The Entropy Mechanism of
Reinforcement Learning for Reasoning Language Models", arXiv 2505.22617).

The paper shows that, under policy gradient, the entropy change of a step follows the covariance
between a token's log-prob and its advantage, and that a small fraction of tokens with a large
covariance drives the entropy collapse. Both methods act on those tokens only, per token

    Cov_t = (logp_t - mean(logp)) (A_t - mean(A)),    means over the batch's trained tokens

with logp the CURRENT policy's detached log-probs. The two means and the selection ("the top
k of the batch", "r N random tokens of the batch") are statistics of the whole optimizer batch,
not of a micro-batch. So, like the aggregation weights (`aggregation`), the learner computes the
selection ONCE per optimizer mini-batch, from a no-grad forward over all of its rows (the model
does not change between its micro-batches), and slices it into micro-batches: the gradient is
then exactly independent of micro-batching (tests/unit/learner/test_rollout_learner.py runs every recipe at
several splits). The price is one extra forward per mini-batch. verl computes the selection
inside each micro-batch's loss instead, so its top-k changes with the micro-batch size; that is
the choice this avoids. Across data-parallel ranks the means and the selection go through the
aggregation's `BatchReduce` (sums and concatenations of the whole batch).

A policy function called directly on a whole batch (recipe_loss, tests) computes its own
selection when none is passed. `BATCH_SELECTIONS` maps a policy loss to its selection function.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from reinforge.objectives.aggregation import LOCAL, BatchReduce
from reinforge.objectives.common import log_ratio, masked
from reinforge.objectives.surrogate import PolicyTerms, clipped_surrogate, surrogate_terms, token_metrics


def token_covariance(logprobs: Tensor, advantages: Tensor, mask: Tensor, reduce: BatchReduce = LOCAL) -> Tensor:
    """Cov_t = (logp_t - mean logp) (A_t - mean A), [N, T], 0 off the mask (arXiv 2505.22617).

    The means are over every trained token of the whole batch (all ranks, through `reduce`); the
    inputs are detached: the covariance selects tokens, it carries no gradient.
    """
    logprobs, advantages = logprobs.detach(), advantages.detach()
    valid = mask.bool()
    m = valid.to(logprobs.dtype)
    sums = reduce.sum(torch.stack([m.sum(), (logprobs * m).sum(), (advantages * m).sum()]))  # [3]
    count = sums[0].clamp(min=1)
    return masked((logprobs - sums[1] / count) * (advantages - sums[2] / count), mask)


def _batch_count(fraction: float, mask: Tensor, reduce: BatchReduce) -> int:
    """max(1, floor(fraction x trained tokens of the whole batch)): the paper's r N / k N."""
    tokens = int(reduce.sum(mask.bool().sum().to(torch.float64)).item())
    return max(1, int(fraction * tokens))


def top_of_batch(score: Tensor, eligible: Tensor, count: int, reduce: BatchReduce = LOCAL) -> Tensor:
    """bool [N, T]: the eligible tokens whose score is among the `count` largest of the whole batch.

    The threshold is the count-th largest eligible score over all ranks (`reduce.cat`); with fewer
    eligible tokens, all of them. Ties at the threshold are all kept (a measure-zero event for
    continuous scores).
    """
    values = reduce.cat(score[eligible])                                       # [E] whole batch
    if values.numel() == 0:
        return torch.zeros_like(eligible)
    threshold = torch.topk(values, min(count, values.numel())).values[-1]
    return eligible & (score >= threshold)


def kl_cov_selection(
    *, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, reduce: BatchReduce = LOCAL,
    generator: torch.Generator | None = None, k_ratio: float = 2e-3, penalty_coef: float = 1.0,
    tolerance: float = 1e-5,
) -> Tensor:
    """I_KL: the top k_ratio fraction of the batch's trained tokens by Cov_t (arXiv 2505.22617)."""
    cov = token_covariance(logprobs, advantages, mask, reduce)
    return top_of_batch(cov, mask.bool(), _batch_count(k_ratio, mask, reduce), reduce)


def clip_cov_selection(
    *, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, reduce: BatchReduce = LOCAL,
    generator: torch.Generator | None = None, clip_ratio: float = 2e-4, cov_low: float = 1.0,
    cov_high: float = 5.0, eps_low: float = 0.2, eps_high: float = 0.2,
) -> Tensor:
    """I_clip: r N tokens drawn uniformly among those with cov_low < Cov_t < cov_high
    (arXiv 2505.22617), N the batch's trained tokens.

    Tokens whose PPO clip is already active (zero gradient anyway) are not candidates, so the
    budget is spent on tokens that would move (as the paper's released implementation does).
    The uniform draw: a U(0, 1) key per token from `generator`, the r N largest keys win.
    """
    cov = token_covariance(logprobs, advantages, mask, reduce)
    ratio = torch.exp(log_ratio(logprobs.detach(), old_logprobs))
    flags = clipped_surrogate(ratio, advantages, eps_low, eps_high)
    eligible = mask.bool() & (cov > cov_low) & (cov < cov_high) & ~(flags.clipped_low | flags.clipped_high)
    keys = torch.rand(cov.shape, generator=generator, dtype=cov.dtype, device="cpu").to(cov.device)
    return top_of_batch(keys, eligible, _batch_count(clip_ratio, mask, reduce), reduce)


def clip_cov(
    *,
    logprobs: Tensor,                       # [N, T] log pi_theta, requires grad
    old_logprobs: Tensor,                   # [N, T] log pi_old, detached
    advantages: Tensor,                     # [N, T]
    mask: Tensor,                           # [N, T]
    sampler_logprobs: Tensor | None = None,  # unused
    selected: Tensor | None = None,         # [N, T] bool I_clip of the whole batch; None: from these tensors
    clip_ratio: float = 2e-4,
    cov_low: float = 1.0,
    cov_high: float = 5.0,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
) -> PolicyTerms:
    """Clip-Cov (arXiv 2505.22617), per token, on PPO's clipped surrogate:

        J_t = min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)   if t not in I_clip,   0 if t in I_clip

    I_clip (`clip_cov_selection`): clip_ratio x N tokens drawn at random among those with
    cov_low < Cov_t < cov_high (paper: r = 2e-4, bounds 1 and 5). Selected tokens leave the
    policy gradient (their term is 0, so is their gradient). Metric cov_clip_frac: the fraction
    of tokens selected.
    """
    if selected is None:
        selected = clip_cov_selection(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, mask=mask,
                                      clip_ratio=clip_ratio, cov_low=cov_low, cov_high=cov_high, eps_low=eps_low,
                                      eps_high=eps_high)
    ratio = torch.exp(log_ratio(logprobs, old_logprobs))                      # [N, T]
    surrogate = clipped_surrogate(ratio, advantages, eps_low, eps_high)
    objective = torch.where(selected, torch.zeros_like(ratio), surrogate.objective)
    return surrogate_terms(objective, mask, ratio.dtype, surrogate, cov_clip_frac=selected, ratio=ratio)


def kl_cov(
    *,
    logprobs: Tensor,                       # [N, T] log pi_theta, requires grad
    old_logprobs: Tensor,                   # [N, T] log pi_old, detached
    advantages: Tensor,                     # [N, T]
    mask: Tensor,                           # [N, T]
    sampler_logprobs: Tensor | None = None,  # unused
    selected: Tensor | None = None,         # [N, T] bool I_KL of the whole batch; None: from these tensors
    k_ratio: float = 2e-3,
    penalty_coef: float = 1.0,
    tolerance: float = 1e-5,
) -> PolicyTerms:
    """KL-Cov (arXiv 2505.22617), per token, on the unclipped policy gradient:

        J_t = r A                                     if t not in I_KL
        J_t = r A - penalty_coef |logp_t - logp_old_t|     if t in I_KL,     r = exp(logp - logp_old)

    I_KL (`kl_cov_selection`): the top k_ratio fraction of the batch's tokens by Cov_t (paper:
    2e-3 for Qwen2.5-7B; penalty_coef 1, verl's ppo_kl_coef). The penalty's gradient is
    -penalty_coef sign(logp - logp_old): 0 where the policy is still pi_old, so it acts from the
    second optimizer step on a batch (mini_batches or ppo_epochs > 1). Metrics: cov_kl_frac
    (fraction selected), cov_kl (the penalty |logp - logp_old| on the selected tokens).

    Where |logp - logp_old| <= tolerance the penalty is 0 (choice). At pi_old the learner's
    recomputed log-probs differ from logp_old by float rounding only (~1e-7, and by layout: the
    micro-batch size changes it), and the sign of that noise would otherwise set a gradient of
    +-penalty_coef on every selected token of a batch's first optimizer step.
    """
    if selected is None:
        selected = kl_cov_selection(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, mask=mask,
                                    k_ratio=k_ratio)
    ratio = torch.exp(log_ratio(logprobs, old_logprobs))                      # [N, T]
    distance = (logprobs - old_logprobs).abs()                                # [N, T]
    penalty = torch.where(selected & (distance.detach() > tolerance), distance, torch.zeros_like(ratio))
    objective = ratio * advantages - penalty_coef * penalty
    return PolicyTerms(
        loss=masked(-objective, mask),
        metrics=token_metrics(mask, ratio.dtype, cov_kl_frac=selected, cov_kl=penalty, ratio=ratio),
    )


# Policy losses whose terms need a selection of tokens over the whole optimizer batch: the learner
# calls the selection once per mini-batch (with the policy params) and passes it as `selected`.
BATCH_SELECTIONS: dict[str, Callable[..., Tensor]] = {
    "clip_cov": clip_cov_selection,
    "kl_cov": kl_cov_selection,
}
