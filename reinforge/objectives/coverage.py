"""Advantage estimators that aim to keep or widen what the policy can sample (pass@k coverage),
not only raise pass@1. Registered in `advantages.ADVANTAGES` with the estimators' signature

    fn(rewards: Tensor [N], group_ids: Tensor [N], **params) -> Tensor [N]

RLVR with a pass@1 advantage sharpens the policy around answers it already finds: pass@1 rises
while pass@k at large k falls (Yue et al., arXiv 2504.13837). The estimators here change which
samples carry the signal:

- `passk`: the advantage of the pass@k reward over all k-subsets of the group, in closed form
  (Chen et al., arXiv 2508.10751): a wrong sample is penalised only as much as it spoils the
  subsets it belongs to, so a group that already solves the prompt pushes its wrong samples
  away less than pass@1 does.
- `max_loo`: the leave-one-out best-of-group reward, verl's `grpo_passk` (Walder & Karkhanis,
  arXiv 2503.19595, k = group size): only the best sample of a group learns, and only by its
  margin over the runner-up.
- `w_reinforce`: weighted REINFORCE (Zhu et al., arXiv 2506.01347): a small weight on correct
  samples and a full one on wrong ones, most of the signal negative, which keeps probability
  mass spread over the other answers the model could give.
- `opo`: the length-weighted optimal baseline (Hao et al., arXiv 2505.23585; verl's `opo`).

Binary-reward estimators (passk, w_reinforce) count R_i = 1 as correct; other rewards are refused
unless `threshold` says which are correct (R_i >= threshold).
"""

from __future__ import annotations

import torch
from torch import Tensor

from reinforge.objectives.common import Groups


def correct_samples(rewards: Tensor, threshold: float | None, method: str) -> Tensor:
    """[N] bool, the samples counted as correct: R_i = 1 of binary rewards, or R_i >= threshold.

    Rewards other than 0 and 1 without a threshold are a ValueError: a shaped reward (format
    bonus, overlong penalty) has no single reading as "solved", and guessing one would change
    the method's meaning silently."""
    if threshold is not None:
        return rewards >= threshold
    if not bool(((rewards == 0) | (rewards == 1)).all()):
        raise ValueError(f"advantage {method!r} takes binary rewards (0 or 1); these are not: set "
                         f"objective.advantage_params.threshold to count R >= threshold as correct")
    return rewards == 1


def _comb_ratio(top: Tensor, bottom: Tensor, k: Tensor) -> Tensor:
    """C(top, k) / C(bottom, k) for integer tensors with 0 <= top <= bottom and 1 <= k <= bottom;
    0 where top < k. In log space (lgamma, float64), so large groups do not overflow."""
    top, bottom, k = top.double(), bottom.double(), k.double()
    enough = top >= k
    safe_top = torch.where(enough, top, k)                     # lgamma of a non-positive integer is inf
    log_ratio = (torch.lgamma(safe_top + 1) - torch.lgamma(safe_top - k + 1)
                 - torch.lgamma(bottom + 1) + torch.lgamma(bottom - k + 1))
    return torch.where(enough, torch.exp(log_ratio), torch.zeros_like(log_ratio))


def passk(rewards: Tensor, group_ids: Tensor, *, k: int = 4, threshold: float | None = None,
          eps: float = 1e-6) -> Tensor:
    """Pass@k training (Chen et al., arXiv 2508.10751, "analytical derivation"): a group of n with c correct,
        q = C(n - c, k) / C(n, k),  mean = 1 - q (pass@k),  sigma = sqrt(mean (1 - mean)),
        A_correct = q / (sigma + eps),   A_wrong = (q - C(n - c - 1, k - 1) / C(n - 1, k - 1)) / (sigma + eps)

    which is the z-scored pass@k reward max(R_S) of every k-subset S of the group (normalised
    over all C(n, k) subsets, std without Bessel's correction), averaged over the subsets that
    contain the sample. k = 1 is GRPO with the population std. A group with no correct sample or
    with fewer than k wrong ones (every subset passes) gets 0. A group smaller than k uses k = n
    (choice). k = 4 is a choice for groups of 8; the paper varies it.
    """
    if k < 1:
        raise ValueError(f"passk needs k >= 1, got {k}")
    correct = correct_samples(rewards, threshold, "passk")
    groups = Groups.of(group_ids)
    n = groups.sizes                                                          # [G]
    c = groups.sum(correct.to(torch.float64)).round().long()                   # [G]
    k_g = n.clamp(max=k)                                                       # [G]
    q = _comb_ratio(n - c, n, k_g)                                             # [G] P(a k-subset fails)
    q_wrong = _comb_ratio((n - c - 1).clamp(min=0), n - 1, (k_g - 1).clamp(min=0))   # [G] ... given one wrong in it
    q_wrong = torch.where(k_g > 1, q_wrong, torch.ones_like(q_wrong))          # k = 1: the subset is the sample
    sigma = (q * (1 - q)).clamp(min=0).sqrt()                                  # [G]
    a_correct, a_wrong = q / (sigma + eps), (q - q_wrong) / (sigma + eps)
    informative = (sigma > 0)[groups.index]
    dtype = rewards.dtype if rewards.is_floating_point() else torch.get_default_dtype()
    advantages = torch.where(correct, a_correct[groups.index], a_wrong[groups.index])
    return torch.where(informative, advantages, torch.zeros_like(advantages)).to(dtype)


def max_loo(rewards: Tensor, group_ids: Tensor, *, scale: bool = True, eps: float = 1e-6) -> Tensor:
    """Leave-one-out best-of-group (Walder & Karkhanis, arXiv 2503.19595, k = n; verl's grpo_passk):
        A_i = max_{j in g} R_j - max_{j in g, j != i} R_j,   divided by (std_g + eps) if scale

    so only a group's unique best sample gets a non-zero advantage, R_max - R_second; tied best
    samples and all others get 0. std_g with Bessel's correction (verl's norm_adv_by_std_in_grpo,
    on by default there). A group of one gets 0 (verl refuses it).
    """
    rewards = rewards if rewards.is_floating_point() else rewards.to(torch.get_default_dtype())
    groups = Groups.of(group_ids)
    best = rewards.new_full((groups.num_groups,), -torch.inf).scatter_reduce_(0, groups.index, rewards, "amax")
    is_best = rewards == best[groups.index]                                    # [N]
    ties = groups.sum(is_best.to(rewards.dtype))[groups.index]                 # [N] best samples in the group
    below = torch.where(is_best, torch.full_like(rewards, -torch.inf), rewards)
    second = rewards.new_full((groups.num_groups,), -torch.inf).scatter_reduce_(0, groups.index, below, "amax")
    unique_best = is_best & (ties == 1) & (groups.sizes[groups.index] > 1)
    advantages = torch.where(unique_best, best[groups.index] - second[groups.index], torch.zeros_like(rewards))
    if not scale:
        return advantages
    size = groups.sizes.to(rewards.dtype)
    mean = groups.sum(rewards) / size
    std = (groups.sum((rewards - mean[groups.index]) ** 2) / (size - 1).clamp(min=1)).sqrt()   # [G]
    # A non-zero margin means a group with spread (std > 0); the zeros stay zeros even with eps = 0.
    return torch.where(unique_best, advantages / (std[groups.index] + eps), advantages)


def w_reinforce(rewards: Tensor, group_ids: Tensor, *, positive_weight: float = 0.1, negative_weight: float = 1.0,
                threshold: float | None = None) -> Tensor:
    """Weighted REINFORCE (Zhu et al., arXiv 2506.01347): A_i = positive_weight if correct, else -negative_weight.

    The paper's W-REINFORCE is lambda PSR + NSR with rewards +1 / -1 and no baseline, lambda = 0.1;
    positive_weight = 0 is NSR (only wrong samples are pushed down), negative_weight = 0 PSR.
    Pushing a wrong answer down spreads its probability over every other token in proportion
    to the model's prior, instead of onto one sampled answer: the paper's reason why pass@k at
    large k is kept. Groups are ignored.
    """
    correct = correct_samples(rewards, threshold, "w_reinforce")
    dtype = rewards.dtype if rewards.is_floating_point() else torch.get_default_dtype()
    return torch.where(correct, torch.full(rewards.shape, positive_weight, dtype=dtype, device=rewards.device),
                       torch.full(rewards.shape, -negative_weight, dtype=dtype, device=rewards.device))


def opo(rewards: Tensor, group_ids: Tensor, *, mask: Tensor) -> Tensor:
    """OPO's optimal baseline (Hao et al., arXiv 2505.23585; verl's opo): A_i = R_i - b_g,
        b_g = sum_{j in g} |y_j| R_j / sum_{j in g} |y_j|,   |y_j| = completion tokens (mask row sum)

    the variance-minimising baseline sum ||grad logp||^2 R / sum ||grad logp||^2 when a
    sequence's squared gradient norm grows with its length; used with exact on-policy updates
    (one optimizer step per batch). A group of one gets 0 (verl: R_i, a baseline of 0); a group
    whose completions are all empty falls back to the plain group mean.
    """
    rewards = rewards if rewards.is_floating_point() else rewards.to(torch.get_default_dtype())
    if mask.dim() != 2 or mask.shape[0] != rewards.shape[0]:
        raise ValueError(f"opo needs mask [N, T] with N = {rewards.shape[0]}, got {tuple(mask.shape)}")
    groups = Groups.of(group_ids)
    lengths = mask.to(rewards.dtype).sum(dim=1)                                # [N]
    total = groups.sum(lengths)                                                # [G]
    weighted = groups.sum(lengths * rewards) / total.clamp(min=1)
    plain = groups.sum(rewards) / groups.sizes.to(rewards.dtype)
    baseline = torch.where(total > 0, weighted, plain)[groups.index]
    return torch.where(groups.sizes[groups.index] > 1, rewards - baseline, torch.zeros_like(rewards))
