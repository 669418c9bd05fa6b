"""The synchronous RL loop: sample, reward, advantage, update, log.

It reads top to bottom; methods differ only in the objective spec they pass
(see `reinforge.objectives`), never by a branch in this file.
"""

from __future__ import annotations

import copy
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from reinforge.config import Config
from reinforge.learner import (
    LearnerBatch,
    SequenceBatch,
    build_optimizer,
    build_sequences,
    completion_token_stats,
    policy_update,
    warmup_constant,
)
from reinforge.models import Policy
from reinforge.objectives import ObjectiveSpec, compute_advantages
from reinforge.objectives.aggregation import masked_mean
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


@torch.no_grad()
def token_logprobs(model: torch.nn.Module, seq: SequenceBatch, temperature: float, micro_batch_size: int) -> torch.Tensor:
    """Log-probs of the completion tokens under `model`, without gradient, [N, T]."""
    out = torch.zeros_like(seq.completion_mask)
    for rows in torch.split(torch.arange(seq.input_ids.shape[0]), micro_batch_size):
        part = seq.rows(rows)
        out[rows, : part.completion_ids.shape[1]] = completion_token_stats(model, part, temperature).logprobs
    return out


def rollout_metrics(rollout: Rollout, rewards: torch.Tensor, old_logprobs: torch.Tensor, group_size: int) -> dict[str, float]:
    """What the batch looked like before the update: reward, length, degenerate groups, mismatch."""
    grouped = rewards.view(-1, group_size)                                                 # [P, G]
    return {
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
        "response_length_mean": float(rollout.lengths.mean()),
        "response_length_max": float(rollout.lengths.max()),
        "truncation_rate": float(rollout.truncated.float().mean()),
        # Groups whose rewards are all equal have zero advantage: no gradient ("why is my loss 0").
        "zero_variance_groups": float((grouped.max(dim=1).values == grouped.min(dim=1).values).float().mean()),
        # |p_sampler - p_learner| per token at the same weights (ALGORITHMS.md, sampler-learner mismatch).
        "sampler_learner_abs_diff_mean": float(
            masked_mean((rollout.sampler_logprobs.exp() - old_logprobs.exp()).abs(), rollout.completion_mask)
        ),
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
    # The reference is the policy as RL starts (after SFT), frozen.
    reference = copy.deepcopy(model).eval().requires_grad_(False) if spec.needs_reference else None
    optimizer = build_optimizer(model, tc.lr, tc.weight_decay)
    scheduler = warmup_constant(optimizer, tc.warmup_steps)
    prompts = PromptStream(task.train_split(tc.num_prompts), seed=cfg.seed)
    generator = torch.Generator().manual_seed(cfg.seed)
    version = 0
    model.train()
    for step in range(1, tc.steps + 1):
        t0 = time.perf_counter()
        # 1. sample
        examples = prompts.next(tc.prompts_per_step)
        rollout = engine.generate([e.prompt for e in examples], tc.group_size, sampling, policy_version=version)
        t_gen = time.perf_counter() - t0
        # 2. reward
        rewards = score(task, examples, rollout, tc.group_size)                        # [N]
        # 3. advantage (whole groups are here; the learner only consumes A)
        advantages = compute_advantages(spec.advantage, rewards, rollout.group_ids, **spec.advantage_params)
        # 4. update; pi_old is the learner's own view of the rollout, fixed over all epochs
        sequences = build_sequences(rollout.prompt_ids, rollout.completion_ids, rollout.completion_mask, policy.tokenizer.pad_token_id)
        old_logprobs = token_logprobs(model, sequences, sampling.temperature, tc.micro_batch_size)
        ref_logprobs = token_logprobs(reference, sequences, sampling.temperature, tc.micro_batch_size) if reference is not None else None
        batch = LearnerBatch(
            sequences=sequences, advantages=advantages, old_logprobs=old_logprobs,
            sampler_logprobs=rollout.sampler_logprobs, group_ids=rollout.group_ids, ref_logprobs=ref_logprobs,
        )
        update = policy_update(
            model, optimizer, scheduler, batch, spec,
            ppo_epochs=tc.ppo_epochs, mini_batches=tc.mini_batches, micro_batch_size=tc.micro_batch_size,
            grad_clip=tc.grad_clip, temperature=sampling.temperature, generator=generator,
            max_length=cfg.rollout.max_new_tokens,
        )
        version += update.optimizer_steps
        # 5. log
        seconds = time.perf_counter() - t0
        metrics = {
            **rollout_metrics(rollout, rewards, old_logprobs, tc.group_size),
            **update.metrics,
            "lr": scheduler.get_last_lr()[0],
            "policy_version": version,
            "tokens_per_s": float(rollout.completion_mask.sum()) / seconds,
            "generation_seconds": t_gen,
            "step_seconds": seconds,
        }
        on_step(StepRecord(step=step, metrics=metrics))
    return RLResult(steps=tc.steps, policy_version=version, optimizer=optimizer)
