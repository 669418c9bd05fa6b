"""The synchronous RL loop: sample, reward, advantage, update, log.

It reads top to bottom; methods differ only in the objective spec they pass
(see `reinforge.objectives`), never by a branch in this file.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from reinforge.config import Config
from reinforge.learner import (
    ForwardPlan,
    LearnerBatch,
    Reference,
    build_optimizer,
    build_sequences,
    policy_update,
    token_logprobs,
    warmup_constant,
)
from reinforge.models import Policy
from reinforge.objectives import AdvantagePipeline, ObjectiveSpec, shaped_rewards
from reinforge.objectives.corrections import mismatch_metrics
from reinforge.rollout import Rollout, RolloutEngine, SamplingParams
from reinforge.tasks import Example, Task


class PromptStream:
    """Train examples in a seeded random order, reshuffled every epoch."""

    def __init__(self, examples: list[Example], seed: int):
        self.examples = examples
        self.rng = random.Random(seed)
        self.order: list[int] = []
        self.epoch = 0

    def next(self, n: int) -> list[Example]:
        out = []
        while len(out) < n:
            if not self.order:
                self.order = list(range(len(self.examples)))
                self.rng.shuffle(self.order)
                self.epoch += 1
            out.append(self.examples[self.order.pop()])
        return out


@dataclass
class RLResult:
    steps: int
    policy_version: int
    optimizer: torch.optim.Optimizer


@dataclass
class StepRecord:
    """One line of metrics.jsonl."""

    step: int
    metrics: dict[str, float]


def score(task: Task, examples: list[Example], rollout: Rollout, group_size: int) -> torch.Tensor:
    """Verifier rewards, [N]; row r belongs to examples[r // group_size]."""
    return torch.tensor(
        [task.reward(examples[r // group_size], text) for r, text in enumerate(rollout.texts)], dtype=torch.float32
    )


def rollout_metrics(rollout: Rollout, rewards: torch.Tensor, group_size: int) -> dict[str, float]:
    """What the batch looked like before the update: reward, length, degenerate groups."""
    grouped = rewards.view(-1, group_size)                                                 # [P, G]
    return {
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
        "response_length_mean": float(rollout.lengths.mean()),
        "response_length_max": float(rollout.lengths.max()),
        "truncation_rate": float(rollout.truncated.float().mean()),
        # Groups whose rewards are all equal have zero advantage: no gradient ("why is my loss 0").
        "zero_variance_groups": float((grouped.max(dim=1).values == grouped.min(dim=1).values).float().mean()),
    }


def train_rl(
    cfg: Config,
    policy: Policy,
    engine: RolloutEngine,
    task: Task,
    spec: ObjectiveSpec,
    on_step: Callable[[StepRecord], None],
) -> RLResult:
    model, tc = policy.model, cfg.train
    sampling = SamplingParams.from_config(cfg.rollout)
    forward = ForwardPlan.from_config(tc)
    # The reference starts as the policy as RL starts (after SFT); None when the loss has no KL term.
    reference = Reference.build(model, spec)
    advantage = AdvantagePipeline(spec.advantage, spec.advantage_params,
                                  [(t.name, t.params) for t in spec.advantage_transforms])
    optimizer = build_optimizer(model, tc.lr, tc.weight_decay)
    scheduler = warmup_constant(optimizer, tc.warmup_steps)
    prompts = PromptStream(task.train_split(tc.num_prompts), seed=cfg.seed)
    generator = torch.Generator().manual_seed(cfg.seed)
    version = 0
    old_before_update = tc.ppo_epochs * tc.mini_batches > 1 or (spec.kl_placement == "in_reward" and spec.needs_reference)
    model.train()
    for step in range(1, tc.steps + 1):
        t0 = time.perf_counter()
        # 1. sample
        examples = prompts.next(tc.prompts_per_step)
        rollout = engine.generate([e.prompt for e in examples], tc.group_size, sampling, policy_version=version)
        t_gen = time.perf_counter() - t0
        # 2. reward
        rewards = score(task, examples, rollout, tc.group_size)                        # [N]
        # 3. pi_old (the learner's own view of the rollout, fixed over all epochs) and the reference.
        #    With one optimizer step per batch and no KL in the reward, pi_old is the policy of that
        #    step's own forward: the update takes it there (one forward less; TRL does the same
        #    with num_iterations=1).
        sequences = build_sequences(rollout.prompt_ids, rollout.completion_ids, rollout.completion_mask,
                                    policy.tokenizer.pad_token_id, group_ids=rollout.group_ids)
        old_logprobs = token_logprobs(model, sequences, sampling.temperature, forward) if old_before_update else None
        ref_logprobs = reference.logprobs(sequences, sampling.temperature, forward) if reference is not None else None
        # 4. advantage (whole groups are here; the learner only consumes A); transforms may drop samples
        credit = advantage(shaped_rewards(spec, rewards, old_logprobs, ref_logprobs, rollout.completion_mask),
                           rollout.group_ids, generator=generator)
        batch = LearnerBatch(
            sequences=sequences, advantages=credit.advantages, old_logprobs=old_logprobs,
            sampler_logprobs=rollout.sampler_logprobs, group_ids=rollout.group_ids, ref_logprobs=ref_logprobs,
            correct=rewards > 0,     # the built-in verifiers give 1 for a correct answer, 0 otherwise
        ).select(credit.keep)
        # 5. update
        update = policy_update(
            model, optimizer, scheduler, batch, spec,
            ppo_epochs=tc.ppo_epochs, mini_batches=tc.mini_batches, grad_clip=tc.grad_clip,
            temperature=sampling.temperature, generator=generator, forward=forward,
            max_length=cfg.rollout.max_new_tokens,
        )
        if reference is not None:
            reference.after_update(model)
        version += update.optimizer_steps
        # 6. log
        seconds = time.perf_counter() - t0
        metrics = {
            **update.metrics,
            **rollout_metrics(rollout, rewards, tc.group_size),   # whole-batch values win
            # |p_sampler - p_learner| per token at the same weights, over the rows trained on
            # (ALGORITHMS.md, sampler-learner mismatch).
            **mismatch_metrics(update.old_logprobs, batch.sampler_logprobs, batch.sequences.completion_mask),
            "kept_frac": float(credit.keep.float().mean()),
            "lr": scheduler.get_last_lr()[0],
            "policy_version": version,
            "tokens_per_s": float(rollout.completion_mask.sum()) / seconds,
            "generation_seconds": t_gen,
            "step_seconds": seconds,
        }
        on_step(StepRecord(step=step, metrics=metrics))
    return RLResult(steps=tc.steps, policy_version=version, optimizer=optimizer)
