"""Credit assignment: from a batch's rewards to advantages, where whole groups are available.

Two kinds behind one interface; the objective decides which (`spec.needs_critic`):

- `GroupCredit`: a group-relative estimator (GRPO, Dr.GRPO, RLOO, MaxRL, ...)
  and its transforms, one advantage per sample;
- `CriticCredit`: a learned critic and GAE (PPO, VC-PPO, VAPO), one advantage
  per token. The outcome reward sits on the last token, the KL penalty (the
  spec's estimator, detached) on every token when it is placed in the reward
  (InstructGPT, arXiv 2203.02155, eq. 2, with k1); decoupled lambdas for the actor and the critic
  (VC-PPO arXiv 2503.01491), VAPO's length-adaptive actor lambda (arXiv
  2504.05118). The critic trains on the batch after the policy update.

A sample without a reward (its reward function failed or skipped it) gets no
advantage and leaves the batch; it never moves a baseline or a value target.

Every per-token figure here reads the batch's loss mask (`SequenceBatch.completion_mask`): in a
multi-turn row the environment's tokens are not in it, so the outcome reward sits on the model's
last token, the KL in the reward is charged on the model's tokens only, and GAE runs over the
model's tokens in order as if the environment's were not there (`objectives.value.gae` passes a
masked position through: V and A of the next model token carry over it, undiscounted; the critic's
values at environment positions are never read).
"""

from __future__ import annotations

import dataclasses

import torch

from reinforge.learner.critic import Critic
from reinforge.learner.forward import ForwardPlan
from reinforge.learner.sequences import SequenceBatch
from reinforge.objectives import AdvantagePipeline, AdvantageResult, ObjectiveSpec, advantage_kl_shift, shaped_rewards
from reinforge.objectives.kl import adaptive_kl_coef, reward_kl_terms
from reinforge.objectives.token_advantages import masked_whiten
from reinforge.objectives.value import decoupled_gae, gae, outcome_token_rewards, placed_token_rewards


class RewardKL:
    """The coefficient of a KL placed in the reward: fixed, or adapted toward a target KL
    (`train.kl_target`, objectives.kl.adaptive_kl_coef). Reports it as `kl_coef` and the
    batch's mean sequence KL (sum_t k_t with the spec's estimator, the penalty per unit of
    beta) as `kl_in_reward`."""

    def __init__(self, spec: ObjectiveSpec, target: float | None):
        self.active = spec.kl_placement == "in_reward" and spec.needs_reference
        self.estimator, self.clamp = spec.kl_estimator, spec.kl_clamp
        self.coef, self.target = spec.kl_coef, target

    def terms(self, old_logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """[N, T] sg(k_t), 0 on padding: what each token's reward is charged, per unit of beta."""
        return reward_kl_terms(self.estimator, old_logprobs, ref_logprobs, mask, self.clamp)

    def observe(self, old_logprobs: torch.Tensor | None, ref_logprobs: torch.Tensor | None, mask: torch.Tensor,
                valid: torch.Tensor) -> dict[str, float]:
        """After this batch's rewards are shaped with the current coefficient: adapt it for the next."""
        if not self.active:
            return {}
        kl = float(self.terms(old_logprobs, ref_logprobs, mask).sum(dim=1)[valid].mean()) if valid.any() else 0.0
        used = self.coef
        if self.target is not None:
            self.coef = adaptive_kl_coef(self.coef, kl, self.target)
        return {"kl_in_reward": kl, "kl_coef": used}


class GroupCredit:
    """Group-relative advantages [N] from the spec's estimator and transforms (state: EMA baselines)."""

    def __init__(self, spec: ObjectiveSpec, kl_target: float | None = None):
        self.spec = spec
        self.pipeline = AdvantagePipeline(spec.advantage, spec.advantage_params,
                                          [(t.name, t.params) for t in spec.advantage_transforms])
        self.reward_kl = RewardKL(spec, kl_target)
        self.metrics: dict[str, float] = {}        # of the last `assign`

    def assign(self, sequences: SequenceBatch, rewards: torch.Tensor, valid: torch.Tensor, group_ids: torch.Tensor,
               old_logprobs: torch.Tensor | None, ref_logprobs: torch.Tensor | None, generator: torch.Generator,
               token_rewards: torch.Tensor | None = None, baselines: torch.Tensor | None = None) -> AdvantageResult:
        """`token_rewards` (turn-credited episodes) are not read: a group advantage compares whole
        trajectories, by `rewards`, their sums (the config refuses that combination). `baselines` [N]:
        the reward of each row's prompt's greedy completion (ReMax), for an estimator that takes them.

        A KL in the reward is charged as the estimator asks: per token (REINFORCE++'s returns), by its
        sequence sum before the estimator (PPO's in-reward KL), or centred after it (T1's on-policy
        normalisation, `advantage_kl_shift`)."""
        spec = dataclasses.replace(self.spec, kl_coef=self.reward_kl.coef)
        mask = sequences.completion_mask
        per_token = "token_penalty" in self.pipeline.inputs
        shaped = rewards if per_token else shaped_rewards(spec, rewards, old_logprobs, ref_logprobs, mask)
        self.metrics = self.reward_kl.observe(old_logprobs, ref_logprobs, mask, valid)
        penalty = (self.reward_kl.coef * self.reward_kl.terms(old_logprobs, ref_logprobs, mask)
                   if per_token and self.reward_kl.active else None)                     # [N, T]
        rows = valid.nonzero().squeeze(1)
        inputs = {"baselines": baselines, "mask": mask, "token_penalty": penalty}
        part = self.pipeline(shaped[rows], group_ids[rows], generator=generator,
                             **{k: None if v is None else v[rows] for k, v in inputs.items()})
        advantages = part.advantages
        shift = advantage_kl_shift(spec, _rows(old_logprobs, rows), _rows(ref_logprobs, rows), mask[rows])
        if shift is not None:
            advantages = advantages - (shift if advantages.dim() == 1 else shift[:, None] * mask[rows])
        if len(rows) == len(valid):
            return AdvantageResult(advantages, part.keep)
        full = advantages.new_zeros((len(valid), *advantages.shape[1:])).index_copy_(0, rows, advantages)
        return AdvantageResult(full, torch.zeros_like(valid).index_copy_(0, rows, part.keep))

    def after_update(self, keep: torch.Tensor, generator: torch.Generator) -> dict[str, float]:
        return dict(self.metrics)

    def state_dict(self) -> dict:
        return {"advantage": self.pipeline.state_dict(), "kl_coef": self.reward_kl.coef}

    def load_state_dict(self, state: dict) -> None:
        self.pipeline.load_state_dict(state["advantage"])
        self.reward_kl.coef = state["kl_coef"]


def _rows(tensor: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor | None:
    return None if tensor is None else tensor[rows]


class CriticCredit:
    """Per-token GAE advantages [N, T] from a learned critic, which `after_update` trains."""

    def __init__(self, spec: ObjectiveSpec, critic: Critic, plan: ForwardPlan, *, epochs: int, mini_batches: int,
                 grad_clip: float, kl_target: float | None = None):
        self.spec, self.critic, self.plan = spec, critic, plan
        self.epochs, self.mini_batches, self.grad_clip = epochs, mini_batches, grad_clip
        self.reward_kl = RewardKL(spec, kl_target)
        self._pending: tuple[SequenceBatch, torch.Tensor, torch.Tensor, dict[str, float]] | None = None

    def assign(self, sequences: SequenceBatch, rewards: torch.Tensor, valid: torch.Tensor, group_ids: torch.Tensor,
               old_logprobs: torch.Tensor | None, ref_logprobs: torch.Tensor | None, generator: torch.Generator,
               token_rewards: torch.Tensor | None = None, baselines: torch.Tensor | None = None) -> AdvantageResult:
        """`baselines` are not read (GAE's baseline is the critic). `token_rewards` [N, T]: rewards already
        on their tokens (an environment crediting turn by turn:
        each turn's reward on its last token); None: each row's reward on its last token."""
        mask = sequences.completion_mask
        v = self.spec.value
        kl = self.reward_kl.terms(old_logprobs, ref_logprobs, mask) if self.reward_kl.active else None   # [N, T]
        if token_rewards is None:
            token_rewards = outcome_token_rewards(torch.where(valid, rewards, 0.0), mask, kl, self.reward_kl.coef)
        else:
            token_rewards = placed_token_rewards(torch.where(valid[:, None], token_rewards, 0.0)[:, : mask.shape[1]],
                                                 mask, kl, self.reward_kl.coef)
        kl_metrics = self.reward_kl.observe(old_logprobs, ref_logprobs, mask, valid)
        values = self.critic.values(sequences, self.plan)      # [N, T] V of the critic that sees this rollout
        out = decoupled_gae(token_rewards, values, mask, gamma=v.gamma, lam_actor=v.lam_actor, lam_critic=v.lam_critic,
                            length_adaptive_alpha=v.length_adaptive_alpha)
        self._pending = (sequences, values, out.returns, kl_metrics)
        advantages = out.advantages
        if self.spec.whiten_advantages:        # verl / OpenRLHF: over the tokens of the rows that train
            advantages = masked_whiten(advantages, mask.bool() & valid[:, None], unbiased=True)
        return AdvantageResult(advantages, valid.clone())

    def pretrain(self, sequences: SequenceBatch, rewards: torch.Tensor, valid: torch.Tensor,
                 generator: torch.Generator) -> dict[str, float]:
        """One step of value pre-training (VC-PPO, arXiv 2503.01491 sec. 4; VAPO): fit V to the
        Monte-Carlo returns (lambda = 1) of the initial policy's samples, before any policy update,
        so that the first advantages do not come from an untrained critic."""
        mask = sequences.completion_mask
        rows = valid.nonzero().squeeze(1)
        seq = sequences.rows(rows)
        width = seq.completion_ids.shape[1]
        token_rewards = outcome_token_rewards(rewards[rows], seq.completion_mask)
        values = self.critic.values(seq, self.plan)
        returns = gae(token_rewards, values, mask[rows, :width], gamma=self.spec.value.gamma, lam=1.0).returns
        return self.critic.update(seq, values, returns, clip=None, epochs=self.epochs, mini_batches=self.mini_batches,
                                  grad_clip=self.grad_clip, generator=generator, plan=self.plan)

    def after_update(self, keep: torch.Tensor, generator: torch.Generator) -> dict[str, float]:
        """Train the critic on the rows the policy trained on; its metrics."""
        sequences, values, returns, kl_metrics = self._pending
        self._pending = None
        rows = keep.nonzero().squeeze(1)
        if len(rows) == 0:
            return kl_metrics
        seq = sequences.rows(rows)
        width = seq.completion_ids.shape[1]
        return {**kl_metrics, **self.critic.update(
            seq, values[rows, :width], returns[rows, :width], clip=self.spec.value.value_clip, epochs=self.epochs,
            mini_batches=self.mini_batches, grad_clip=self.grad_clip, generator=generator, plan=self.plan)}

    def state_dict(self) -> dict:
        return {"critic": self.critic.state_dict(), "kl_coef": self.reward_kl.coef}

    def load_state_dict(self, state: dict) -> None:
        self.critic.load_state_dict(state["critic"])
        self.reward_kl.coef = state["kl_coef"]
