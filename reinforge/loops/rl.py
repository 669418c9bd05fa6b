"""The synchronous RL loop: sample, reward, advantage, update, log.

It reads top to bottom; methods differ only in the objective spec they pass
(see `reinforge.objectives`), never by a branch in this file.
"""

from __future__ import annotations

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
from reinforge.loops.curation import BatchCollector, PromptStream, Scores
from reinforge.models import Policy
from reinforge.objectives import AdvantagePipeline, AdvantageResult, ObjectiveSpec, shaped_rewards
from reinforge.objectives.corrections import mismatch_metrics
from reinforge.rewards.compose import RewardComposer
from reinforge.rollout import Rollout, RolloutEngine, SamplingParams
from reinforge.tasks import Example, Task


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


def composed_scores(composer: RewardComposer, group_size: int) -> Callable[[list[Example], Rollout], Scores]:
    """The configured reward functions (cfg.reward) as the reward; row r belongs to examples[r // group_size]."""

    def score(examples: list[Example], rollout: Rollout) -> Scores:
        scored = composer.score(examples, rollout, group_size)       # RewardError past reward.max_error_rate
        # Pass rates and the NLL term need "the verifier accepted it" (NaN > 0 is False).
        correct = scored.parts["verifier"] > 0 if "verifier" in scored.parts else scored.total > 0
        return Scores(rewards=scored.total, valid=scored.valid, correct=correct, metrics=scored.metrics())

    return score


def valid_advantages(advantage: AdvantagePipeline, rewards: torch.Tensor, group_ids: torch.Tensor, valid: torch.Tensor,
                     generator: torch.Generator) -> AdvantageResult:
    """Advantages from the valid rows only: a sample without a reward (its reward function failed
    or skipped it) must not move its group's baseline; it gets A = 0 and leaves the batch."""
    if bool(valid.all()):
        return advantage(rewards, group_ids, generator=generator)
    rows = valid.nonzero().squeeze(1)
    part = advantage(rewards[rows], group_ids[rows], generator=generator)
    return AdvantageResult(rewards.new_zeros(len(rewards)).index_copy_(0, rows, part.advantages),
                           torch.zeros_like(valid).index_copy_(0, rows, part.keep))


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
    pool = PromptStream(task.train_split(tc.num_prompts), seed=cfg.seed)
    collector = BatchCollector(cfg.curation, pool, engine, composed_scores(RewardComposer.from_config(cfg, task), tc.group_size), tc.prompts_per_step,
                               tc.group_size, sampling)
    generator = torch.Generator().manual_seed(cfg.seed)
    version = 0
    old_before_update = tc.ppo_epochs * tc.mini_batches > 1 or (spec.kl_placement == "in_reward" and spec.needs_reference)
    model.train()
    for step in range(1, tc.steps + 1):
        t0 = time.perf_counter()
        # 1-2. sample and reward, in as many rounds as curation needs to fill the batch (curation.py)
        curated = collector.collect(version)
        t_gen = time.perf_counter() - t0
        if curated.rollout is None:    # every group was filtered out: nothing to learn from this step
            on_step(StepRecord(step=step, metrics={**curated.metrics, "policy_version": version, "generation_seconds": t_gen,
                                                   "step_seconds": time.perf_counter() - t0}))
            continue
        rollout, rewards = curated.rollout, curated.scores.rewards
        # 3. pi_old (the learner's own view of the rollout, fixed over all epochs) and the reference.
        #    With one optimizer step per batch and no KL in the reward, pi_old is the policy of that
        #    step's own forward: the update takes it there (one forward less; TRL does the same
        #    with num_iterations=1).
        sequences = build_sequences(rollout.prompt_ids, rollout.completion_ids, rollout.completion_mask,
                                    policy.tokenizer.pad_token_id, group_ids=rollout.group_ids)
        old_logprobs = token_logprobs(model, sequences, sampling.temperature, forward) if old_before_update else None
        ref_logprobs = reference.logprobs(sequences, sampling.temperature, forward) if reference is not None else None
        # 4. advantage (whole groups are here; the learner only consumes A); transforms may drop samples
        credit = valid_advantages(advantage, shaped_rewards(spec, rewards, old_logprobs, ref_logprobs, rollout.completion_mask),
                                  rollout.group_ids, curated.scores.valid, generator)
        batch = LearnerBatch(
            sequences=sequences, advantages=credit.advantages, old_logprobs=old_logprobs,
            sampler_logprobs=rollout.sampler_logprobs, group_ids=rollout.group_ids, ref_logprobs=ref_logprobs,
            correct=curated.scores.correct,
        ).select(credit.keep & curated.row_keep)    # advantage transforms and curation may drop rows
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
            **curated.metrics,   # the sampled rows' reward and length figures, and curation's counts
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
