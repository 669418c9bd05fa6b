"""Baselines from extra rollouts that are not trained on: ReMax's greedy baseline (the trainer
system "greedy_baseline", arXiv 2310.10505, Algorithm 1).

For every prompt of a generation round, one more completion is decoded greedily (argmax, the
temperature plays no part) with the same weights and scored by the same reward; its reward is
the baseline of each of that prompt's sampled rows (`Scores.baselines`), which the `remax`
estimator subtracts. The greedy completion itself never reaches the batch. It is a wrapper of
the round's reward function, so that curation, refill rounds and the loop stay as they are.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable

import torch

from reinforge.objectives.advantages import resolve_advantage
from reinforge.objectives.spec import ObjectiveSpec
from reinforge.objectives.value import CRITIC_ADVANTAGES
from reinforge.records import Scores
from reinforge.rollout import Rollout, RolloutEngine, SamplingParams
from reinforge.tasks import Example

Score = Callable[[list[Example], Rollout], Scores]


def takes_baselines(spec: object) -> bool:
    """The objective's advantage estimator takes `baselines` (ReMax): the run must generate them."""
    if not isinstance(spec, ObjectiveSpec) or spec.advantage in CRITIC_ADVANTAGES:
        return False
    return "baselines" in inspect.signature(resolve_advantage(spec.advantage)).parameters


def greedy_baselines(score: Score, greedy_score: Score, engine: RolloutEngine, sampling: SamplingParams,
                     group_size: int) -> Score:
    """`score` with `Scores.baselines` [N]: the reward (`greedy_score`, the same reward over groups of one)
    of a greedy completion of each row's prompt. A prompt whose greedy completion has no reward (its
    reward function failed or skipped it) has no baseline: its rows become invalid and leave the batch.
    Adds reward/greedy_baseline_mean (over the prompts with a baseline) and reward/greedy_pass_rate."""
    greedy = dataclasses.replace(sampling, greedy=True)

    def scored(examples: list[Example], rollout: Rollout) -> Scores:
        scores = score(examples, rollout)
        # a generator of its own: argmax decoding draws nothing that matters, and the sampler's stream
        # (and torch's global one) must not move because of it
        completions = engine.generate([e.prompt for e in examples], 1, greedy, policy_version=rollout.policy_version,
                                      generator=torch.Generator().manual_seed(0))
        base = greedy_score(examples, completions)
        per_prompt = torch.where(base.valid, base.rewards.to(scores.rewards.dtype), torch.nan)       # [P]
        baselines = per_prompt.repeat_interleave(group_size)                                           # [N]
        scored_prompts = per_prompt[~per_prompt.isnan()]
        metrics = {
            **scores.metrics,
            "reward/greedy_baseline_mean": float(scored_prompts.mean()) if scored_prompts.numel() else float("nan"),
            "reward/greedy_pass_rate": float(base.correct.float().mean()),
        }
        return dataclasses.replace(scores, valid=scores.valid & ~baselines.isnan(), baselines=baselines,
                                   metrics=metrics)

    return scored
