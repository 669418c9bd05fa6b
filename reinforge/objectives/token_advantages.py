"""REINFORCE++ advantages (arXiv 2501.03262): per-token returns, whitened over the whole batch.

Unlike the group estimators of `advantages`, whose result is one number per sample, these give
one advantage per token [N, T]: the KL penalty sits on each token of the reward (r_t = R [t =
last] - beta sg(k_t)), each token's advantage is its return-to-go, and the returns of every
valid token of the batch are normalised together ("global batch normalisation"), not per group.
They take the completion mask and the per-token penalty as inputs (`mask`, `token_penalty`,
which `AdvantagePipeline` passes to an estimator that declares them) and are registered in
`advantages.ADVANTAGES` like any estimator.
"""

from __future__ import annotations

import torch
from torch import Tensor

from reinforge.objectives.common import Groups
from reinforge.objectives.value import gae, outcome_token_rewards


def masked_whiten(values: Tensor, mask: Tensor, *, eps: float = 1e-8, unbiased: bool = False) -> Tensor:
    """(x - mean) / sqrt(max(var, eps)) over the valid tokens of the whole batch, 0 off the mask.

    mean and var are over all tokens with mask 1 (every sequence of the batch together), var
    without Bessel's correction: OpenRLHF's global advantage normalisation, the reference
    implementation of REINFORCE++ (its rsqrt of var clamped at 1e-8); `unbiased=True` divides
    by count - 1 instead, as verl's masked_whiten of GAE advantages does. A batch of equal values
    gives 0 everywhere, not NaN.
    """
    valid = mask.bool()
    count = valid.sum().clamp(min=1)
    mean = torch.where(valid, values, 0.0).sum() / count
    var = torch.where(valid, (values - mean) ** 2, 0.0).sum() / ((count - 1).clamp(min=1) if unbiased else count)
    return torch.where(valid, (values - mean) * var.clamp(min=eps).rsqrt(), 0.0)


def token_returns(rewards: Tensor, mask: Tensor, token_penalty: Tensor | None, gamma: float = 1.0) -> Tensor:
    """G_t = sum_{s >= t, valid} gamma^(s - t) r_s with r_s = R [s = last valid] - token_penalty_s, [N, T].

    The KL in the reward of REINFORCE++ (arXiv 2501.03262): token_penalty = beta sg(k1)
    per token; None = no KL term. Computed as GAE with V = 0 and lambda = 1 (the Monte-Carlo return).
    """
    token_rewards = outcome_token_rewards(rewards, mask, token_penalty, 1.0 if token_penalty is not None else 0.0)
    return gae(token_rewards, torch.zeros_like(token_rewards), mask, gamma=gamma, lam=1.0).advantages


def reinforce_pp(
    rewards: Tensor,
    group_ids: Tensor,
    *,
    mask: Tensor,
    token_penalty: Tensor | None = None,
    gamma: float = 1.0,
    eps: float = 1e-8,
) -> Tensor:
    """REINFORCE++ (arXiv 2501.03262; OpenRLHF advantage_estimator=reinforce), per token [N, T]:
    r_t = R_i [t = last] - beta sg(k_t), G_t = sum_{s >= t} gamma^(s-t) r_s, A_t = whiten_batch(G)_t.

    beta sg(k_t) is `token_penalty` (k1 in the recipe; None: no KL in the reward); whiten_batch is
    over every valid token of the batch (`masked_whiten`), not per group: no critic and no group
    baseline, the batch statistics are the baseline. Groups are ignored.
    """
    return masked_whiten(token_returns(rewards, mask, token_penalty, gamma), mask, eps=eps)


def reinforce_pp_baseline(
    rewards: Tensor,
    group_ids: Tensor,
    *,
    mask: Tensor,
    token_penalty: Tensor | None = None,
    gamma: float = 1.0,
    eps: float = 1e-8,
) -> Tensor:
    """REINFORCE++-baseline (arXiv 2501.03262; OpenRLHF reinforce_baseline), per token [N, T]:
    R'_i = R_i - mean_g(R), then reinforce_pp of R': A_t = whiten_batch(G(R'))_t.

    The group mean removes the prompt's difficulty; the batch std (not GRPO's group std)
    scales, so a group whose rewards barely differ is not blown up. Without a KL in the reward
    every token of a sequence gets the same advantage.
    """
    rewards = rewards if rewards.is_floating_point() else rewards.to(torch.get_default_dtype())
    groups = Groups.of(group_ids)
    group_mean = (groups.sum(rewards) / groups.sizes.to(rewards.dtype))[groups.index]      # [N]
    return reinforce_pp(rewards - group_mean, group_ids, mask=mask, token_penalty=token_penalty, gamma=gamma, eps=eps)


def entropy_shaped_advantages(advantages: Tensor, entropy: Tensor, alpha: float, kappa: float) -> Tensor:
    """Entropy-based advantage shaping (Cheng et al., arXiv 2506.14758), per token [N, T]:

        A'_t = A_t + psi_t,   psi_t = min(alpha sg(H_t), |A_t| / kappa),   kappa > 1

    H_t the entropy of the policy's next-token distribution, detached: a bonus on uncertain
    tokens (where reasoning branches), bounded by |A_t| / kappa so that it never flips the sign of
    a negative advantage (A' <= A (1 - 1/kappa) < 0) and never dominates it. Zero advantages stay 0.
    """
    if kappa <= 1:
        raise ValueError(f"entropy advantage shaping needs kappa > 1, got {kappa}")
    bonus = torch.minimum(alpha * entropy.detach(), advantages.abs() / kappa)
    return advantages + bonus
