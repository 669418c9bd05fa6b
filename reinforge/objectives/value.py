"""Critic math: per-token rewards, GAE (plain and decoupled), the clipped value
loss, and VAPO's NLL on correct samples. Pure tensor functions on [N, T]
completion tokens with a mask; no reduction (that is `aggregation`'s job).

Conventions: the outcome reward sits on the last valid token (EOS); the value
after it is 0; masked positions inside a row (e.g. tool output) are skipped,
so the recursion links each valid token to the next valid one; every output
is exactly 0 where mask is 0, and a row without valid tokens is all 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from reinforge.objectives.common import masked

# Advantage estimators that need a critic (values and per-token rewards, not
# only rewards and group ids): name -> where it lives. advantages.py refuses
# them with this pointer; the trainer calls them with the critic's values.
CRITIC_ADVANTAGES: dict[str, str] = {
    "gae": "reinforge.objectives.value.gae (decoupled_gae for VC-PPO / VAPO)",
}



@dataclass
class GAEOutput:
    """Advantages for the actor and returns (value targets) for the critic, both detached."""

    advantages: Tensor   # [N, T] per-token advantages, 0 where mask is 0
    returns: Tensor      # [N, T] value targets A + V, 0 where mask is 0


def gae(
    token_rewards: Tensor,        # [N, T] r_t (outcome on the last valid token, KL penalty in_reward)
    values: Tensor,               # [N, T] V(s_t) of the critic
    mask: Tensor,                 # [N, T] 1 for completion tokens
    *,
    gamma: float = 1.0,
    lam: float | Tensor = 0.95,   # a number, or [N] one lambda per sequence
) -> GAEOutput:
    """Generalised advantage estimation (arXiv 1506.02438, sec. 3):

        delta_t = r_t + gamma V_{t+1} - V_t,   V after the last valid token = 0
        A_t = sum_{l >= 0} (gamma lam)^l delta_{t+l},   returns_t = A_t + V_t

    computed backwards, A_t = delta_t + gamma lam A_{t+1}: one loop over T,
    vectorised over N. lam = 1 gives the Monte-Carlo reward-to-go as returns;
    lam = 0 gives the one-step TD target r_t + gamma V_{t+1}. Inputs are
    detached: advantages and returns are targets (sg in PPO, arXiv 1707.06347).
    """
    token_rewards, values = token_rewards.detach(), values.detach()
    valid = mask.bool()
    rows, steps = values.shape
    lam = torch.as_tensor(lam, dtype=values.dtype, device=values.device)    # [] or [N]
    next_value = values.new_zeros(rows)                                     # [N] V of the next valid token
    running = values.new_zeros(rows)                                        # [N] A of the next valid token
    advantages = [values.new_zeros(rows)] * steps
    for t in reversed(range(steps)):
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        step = delta + gamma * lam * running
        # Masked positions pass the recursion through untouched.
        running = torch.where(valid[:, t], step, running)
        next_value = torch.where(valid[:, t], values[:, t], next_value)
        advantages[t] = step
    advantages = masked(torch.stack(advantages, dim=1), valid)            # [N, T]
    return GAEOutput(advantages=advantages, returns=masked(advantages + values, valid))


def length_adaptive_lambda(lengths: Tensor, alpha: float = 0.05) -> Tensor:
    """VAPO's length-adaptive lambda (arXiv 2504.05118): lam = 1 - 1 / (alpha l), in [0, 1].

    Chosen so that sum_t lam^t ~ alpha l: longer sequences look further ahead.
    Clamped to [0, 1] (choice, ALGORITHMS.md); l = 0 gives 0, not NaN.
    """
    lengths = lengths.to(torch.get_default_dtype()) if not lengths.is_floating_point() else lengths
    return (1.0 - 1.0 / (alpha * lengths)).clamp(0.0, 1.0)


def decoupled_gae(
    token_rewards: Tensor,                        # [N, T]
    values: Tensor,                               # [N, T]
    mask: Tensor,                                 # [N, T]
    *,
    gamma: float = 1.0,
    lam_actor: float = 0.95,
    lam_critic: float = 1.0,
    length_adaptive_alpha: float | None = None,
) -> GAEOutput:
    """Decoupled GAE (VC-PPO, arXiv 2503.01491; VAPO, arXiv 2504.05118):

        advantages = GAE(lam_actor).advantages,   returns = GAE(lam_critic).returns

    lam_critic = 1 gives unbiased Monte-Carlo value targets, free of the
    critic's own bias under a sparse end-of-sequence reward; lam_actor < 1
    keeps the policy gradient's variance down. With `length_adaptive_alpha`
    set, lam_actor is VAPO's per-sequence 1 - 1/(alpha |y_i|) instead.
    """
    if length_adaptive_alpha is not None:
        lengths = mask.bool().sum(dim=1)                                    # [N]
        actor_lam: float | Tensor = length_adaptive_lambda(lengths, length_adaptive_alpha).to(values.dtype)
    else:
        actor_lam = lam_actor
    actor = gae(token_rewards, values, mask, gamma=gamma, lam=actor_lam)
    critic = gae(token_rewards, values, mask, gamma=gamma, lam=lam_critic)
    return GAEOutput(advantages=actor.advantages, returns=critic.returns)


def outcome_token_rewards(
    rewards: Tensor,              # [N] scalar outcome reward R_i
    mask: Tensor,                 # [N, T]
    kl: Tensor | None = None,     # [N, T] per-token KL estimate to the reference (k1 for PPO)
    kl_coef: float = 0.0,
) -> Tensor:
    """Per-token rewards [N, T] for GAE: R_i on the last valid token, minus the KL penalty

        r_t = R_i [t = last valid] - kl_coef sg(kl_t)   on valid tokens, 0 elsewhere

    ("KL in_reward", ALGORITHMS.md; InstructGPT, arXiv 2203.02155, eq. 2).
    A row with no valid token gets no reward.
    """
    valid = mask.bool()
    positions = torch.arange(valid.shape[1], device=valid.device).expand_as(valid)   # [N, T]
    last = torch.where(valid, positions, -1).amax(dim=1, keepdim=True)               # [N, 1]
    rewards = rewards.to(torch.get_default_dtype()) if not rewards.is_floating_point() else rewards
    return placed_token_rewards(torch.where(positions == last, rewards.detach().unsqueeze(1), 0.0), mask, kl, kl_coef)


def placed_token_rewards(
    token_rewards: Tensor,        # [N, T] rewards on their tokens (a multi-turn episode: each turn's on its last)
    mask: Tensor,                 # [N, T]
    kl: Tensor | None = None,     # [N, T]
    kl_coef: float = 0.0,
) -> Tensor:
    """Per-token rewards [N, T] for GAE, minus the KL penalty, 0 off the mask:
    r_t = token_rewards_t - kl_coef sg(kl_t)."""
    token_rewards = token_rewards.detach()
    if kl is not None and kl_coef != 0.0:
        token_rewards = token_rewards - kl_coef * kl.detach()
    return masked(token_rewards, mask.bool())


@dataclass
class ValueTerms:
    """What the value loss returns: unreduced terms and per-token diagnostics."""

    loss: Tensor                  # [N, T] per-token critic loss, 0 where mask is 0
    clip_frac: Tensor             # [N, T] 1 where the clipped branch is the (strict) max, i.e. the gradient is 0
    error: Tensor                 # [N, T] V - R, detached (for explained variance and the like)


def value_loss(
    values: Tensor,               # [N, T] V of the critic, requires grad
    old_values: Tensor,           # [N, T] V of the critic that produced the rollout, detached
    returns: Tensor,              # [N, T] value targets R (from gae), detached
    mask: Tensor,                 # [N, T]
    *,
    clip: float | None = 0.2,
) -> ValueTerms:
    """Clipped value loss (PPO, arXiv 1707.06347; the clip is that of
    its reference implementation, OpenAI baselines, not of the paper):

        l_t = 0.5 max((V - R)^2, (V_clip - R)^2),   V_clip = old + clip(V - old, -c, c)

    clip=None gives the plain 0.5 (V - R)^2. The gradient is 0 exactly where the
    clipped term is the strict max (V has left old +- c on the side away from R).
    """
    old_values, returns = old_values.detach(), returns.detach()
    unclipped = (values - returns) ** 2
    if clip is None:
        loss, clipped = 0.5 * unclipped, torch.zeros_like(unclipped, dtype=torch.bool)
    else:
        clipped_values = old_values + (values - old_values).clamp(-clip, clip)
        clipped_sq = (clipped_values - returns) ** 2
        loss = 0.5 * torch.maximum(unclipped, clipped_sq)
        clipped = clipped_sq.detach() > unclipped.detach()
    return ValueTerms(
        loss=masked(loss, mask),
        clip_frac=masked(clipped.to(values.dtype), mask),
        error=masked((values - returns).detach(), mask),
    )


def positive_nll(
    logprobs: Tensor,             # [N, T] log pi_theta, requires grad
    mask: Tensor,                 # [N, T]
    correct: Tensor,              # [N] bool, the sample's outcome is correct
) -> Tensor:
    """VAPO's NLL on correct samples (arXiv 2504.05118; the caller applies the weight 0.1):

        l_t = -logprobs_t on valid tokens of correct samples, 0 elsewhere.
    """
    return masked(-logprobs, mask.bool() & correct.bool().unsqueeze(1))
