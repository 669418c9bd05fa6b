"""Batch curation: which sampled groups reach the gradient (ALGORITHMS.md, "Batch curation").

It sits between reward and advantage. One `collect` call runs generation
rounds until the step's batch is full or the round limit is hit:

1. draw prompts from the pool and sample G completions each;
2. score them (the reward composer: totals, which samples are valid, which are correct);
3. group filters decide which prompts' groups stay (`GROUP_FILTERS`, by name in
   `curation.filters`): `zero_variance` drops groups whose rewards are all equal,
   since their group-relative advantage is zero (DAPO dynamic sampling, ScaleRL,
   Olmo 3);
4. prompts whose pass rate reaches `retire_pass_rate` leave the pool for later
   epochs (ScaleRL's no-positive-resampling, 0.9);
5. refill: `none` trains on what is left (ScaleRL: filter without refill);
   `dynamic` samples a whole new batch of prompts per round (DAPO, arXiv
   2503.14476, up to `max_rounds` generation batches); `active` samples just
   the missing number of prompts (Olmo 3's active refill, arXiv 2512.13961).
   A batch still short at the round limit is trained on as it is, and the
   metrics say so (`curation/short`).

Sample-level masks leave rows in the advantage computation but out of the
loss: a sample whose reward function failed or skipped it (`valid` False),
and with `overlong_filter` a truncated sample (DAPO's overlong filtering).

The default configuration (no filters, no refill) is one round with every
group kept: plain GRPO sampling.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from reinforge.agents.rollout import agent_metrics
from reinforge.records import Scores
from reinforge.rollout import Rollout, RolloutEngine, SamplingParams
from reinforge.rollout.base import concat_rollouts, select_rows
from reinforge.settings import CurationConfig
from reinforge.tasks import Example


class PoolExhausted(RuntimeError):
    """Every train prompt has left the pool (curation.retire_pass_rate): RL cannot draw another batch."""


def pool_exhausted(pool: PromptStream, prompts_per_step: int) -> str:
    """Why RL cannot go on: fewer prompts left than a step needs, so a batch would repeat them (and
    training on a handful of hard prompts over and over undoes what RL learned)."""
    if not pool.retired:     # nothing retired: the train split itself is smaller than a step
        return (f"the train split has {pool.size} prompts, fewer than train.prompts_per_step={prompts_per_step}: "
                f"set train.prompts_per_step={pool.size} or less, or give it more prompts (train.num_prompts, data)")
    return (
        f"only {pool.size} of the {len(pool.examples)} train prompts are left in the pool (curation.retire_pass_rate), "
        f"fewer than train.prompts_per_step={prompts_per_step}: raise the threshold or train.num_prompts"
    )


class PromptStream:
    """The prompt pool: train examples in a seeded random order, reshuffled every epoch.

    Retired prompts (`retire`) are not drawn again from the next epoch on.
    """

    def __init__(self, examples: list[Example], seed: int):
        self.examples = examples
        self.rng = random.Random(seed)
        self.order: list[int] = []
        self.epoch = 0
        self.retired: set[int] = set()
        self._index = {id(e): i for i, e in enumerate(examples)}

    @property
    def size(self) -> int:
        """Prompts still in the pool."""
        return len(self.examples) - len(self.retired)

    def next(self, n: int) -> list[Example]:
        out = []
        while len(out) < n:
            if not self.order:
                self.order = [i for i in range(len(self.examples)) if i not in self.retired]
                if not self.order:
                    raise PoolExhausted(f"every one of the {len(self.examples)} train prompts has left the pool "
                                        "(curation.retire_pass_rate): raise the threshold or train.num_prompts")
                self.rng.shuffle(self.order)
                self.epoch += 1
            out.append(self.examples[self.order.pop()])
        return out

    def retire(self, example: Example) -> None:
        self.retired.add(self._index[id(example)])

    def state_dict(self) -> dict:
        """Where the stream is (JSON-able): the rest of this epoch's order, epoch, retired prompts, RNG."""
        version, internal, gauss = self.rng.getstate()
        return {"order": list(self.order), "epoch": self.epoch, "retired": sorted(self.retired),
                "rng": [version, list(internal), gauss], "num_examples": len(self.examples)}

    def load_state_dict(self, state: dict) -> None:
        if state["num_examples"] != len(self.examples):
            raise ValueError(
                f"the saved prompt pool had {state['num_examples']} prompts, this one has {len(self.examples)}"
            )
        self.order, self.epoch, self.retired = list(state["order"]), state["epoch"], set(state["retired"])
        version, internal, gauss = state["rng"]
        self.rng.setstate((version, tuple(internal), gauss))


@dataclass(frozen=True)
class Groups:
    """One round's samples as [P, G] views, what the group filters see."""

    rewards: torch.Tensor
    valid: torch.Tensor
    correct: torch.Tensor
    truncated: torch.Tensor
    # [P] bool: some row of the group has a non-zero per-token term from a reward source (a teacher's
    # reverse KL), an advantage of its own whatever the group's rewards; None: no source gives any
    token_signal: torch.Tensor | None = None


def zero_variance(groups: Groups) -> torch.Tensor:
    """[P] keep: the group's valid rewards are not all equal (fewer than two valid ones: equal), or a
    reward source placed terms on its tokens (on-policy distillation: equal rewards, still a gradient)."""
    high = groups.rewards.masked_fill(~groups.valid, float("-inf")).max(dim=1).values
    low = groups.rewards.masked_fill(~groups.valid, float("inf")).min(dim=1).values
    keep = (groups.valid.sum(dim=1) >= 2) & (high > low)
    return keep if groups.token_signal is None else keep | groups.token_signal


GROUP_FILTERS: dict[str, Callable[[Groups], torch.Tensor]] = {
    "zero_variance": zero_variance,
}


@dataclass
class CuratedBatch:
    """The step's training batch after curation, rows grouped by prompt; `rollout` None when no
    group survived (the step then has no update)."""

    examples: list[Example]          # [P]
    rollout: Rollout | None          # N = P x G rows, group ids 0..P-1
    scores: Scores | None            # [N]
    row_keep: torch.Tensor | None    # [N] bool: rows the loss sees (valid, not overlong-filtered)
    metrics: dict[str, float]        # reward and rollout figures of every sampled row, and curation counts


def rollout_metrics(rollout: Rollout, groups: Groups) -> dict[str, float]:
    """What the sampled batch looked like before curation: reward (of the valid samples), length (the
    model's tokens), degenerate groups; for multi-turn episodes their turns, tools and stops (env/*, tools/*)."""
    rewards = groups.rewards[groups.valid]
    lengths, correct = rollout.lengths.float(), groups.correct.flatten()
    episodes = agent_metrics(rollout.episodes, groups.rewards.flatten()) if rollout.episodes is not None else {}
    return {
        **episodes,
        "reward_mean": float(rewards.mean()) if rewards.numel() else float("nan"),
        "reward_std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
        # the verifier accepted (a reward model's or a teacher's run too: the verifier is then not its reward)
        "pass_rate": float(correct.float().mean()),
        "response_length_mean": float(lengths.mean()),
        "response_length_max": float(lengths.max()),
        # Length bias hides in the incorrect samples (Dr.GRPO, arXiv 2503.20783, sec. 3.1): watch both.
        # NaN when a step has none of one kind (logged as null).
        "response_length_correct_mean": float(lengths[correct].mean()) if correct.any() else float("nan"),
        "response_length_incorrect_mean": float(lengths[~correct].mean()) if (~correct).any() else float("nan"),
        "truncation_rate": float(rollout.truncated.float().mean()),
        # Groups whose rewards are all equal have zero advantage: no gradient ("why is my loss 0").
        "zero_variance_groups": float((~zero_variance(groups)).float().mean()),
    }


def domain_metrics(domains: list[str], scores: Scores) -> list[tuple[int, dict[str, float]]]:
    """Per domain of a mix, in order of first appearance: (its rows, figures over them), keys
    reward/domain/<d>/...: total_mean (over valid rows, NaN if none), pass_rate (the verifier accepted,
    over all its rows) and <part>_mean for each reward part that scored some of its rows (a function
    restricted to other domains has none: no key)."""
    out = []
    for d in dict.fromkeys(domains):
        rows = torch.tensor([x == d for x in domains])
        total = scores.rewards[rows & scores.valid]
        figures = {
            "total_mean": float(total.mean()) if total.numel() else float("nan"),
            "pass_rate": float(scores.correct[rows].float().mean()),
        }
        for key, values in scores.parts.items():
            scored = values[rows][~values[rows].isnan()]
            if scored.numel():
                figures[f"{key}_mean"] = float(scored.mean())
        out.append((int(rows.sum()), {f"reward/domain/{d}/{k}": v for k, v in figures.items()}))
    return out


class GroupSource(Protocol):
    """Where a step's groups come from: `draw(n, version)` returns n prompts and their G samples each."""

    def draw(self, n: int, policy_version: int) -> tuple[list[Example], Rollout]: ...

    def release(self, n: int) -> None:
        """`n` of the drawn groups will not be trained on and curation draws others in their place."""
        ...


class SampleNow:
    """The synchronous source: the next prompts of the pool, sampled now by the engine with the
    current weights, drawing from `generator`. `keep_activations`: an engine that can (the native one) keeps
    the decoding's activations for the learner's first backward (models/replay.py) in these calls only, not in
    the engine's other calls (evaluation)."""

    def __init__(self, pool: PromptStream, engine: RolloutEngine, group_size: int, sampling: SamplingParams,
                 generator: torch.Generator | None = None, keep_activations: bool = False):
        self.pool, self.engine, self.group_size, self.sampling, self.generator = (
            pool,
            engine,
            group_size,
            sampling,
            generator,
        )
        self.keep_activations = keep_activations and hasattr(engine, "keep_activations")

    def draw(self, n: int, policy_version: int) -> tuple[list[Example], Rollout]:
        examples = self.pool.next(n)
        if self.keep_activations:
            self.engine.keep_activations = True
        try:
            return examples, self.engine.generate([e.prompt for e in examples], self.group_size, self.sampling,
                                                  policy_version=policy_version, generator=self.generator)
        finally:
            if self.keep_activations:
                self.engine.keep_activations = False

    def release(self, n: int) -> None:
        """Nothing to do: the synchronous source samples on demand."""


class BatchCollector:
    """Runs the generation rounds of one step and curates their groups (see the module docstring)."""

    def __init__(self, cfg: CurationConfig, pool: PromptStream, source: GroupSource,
                 score: Callable[[list[Example], Rollout], Scores], prompts_per_step: int, group_size: int):
        self.cfg, self.pool, self.source, self.score = cfg, pool, source, score
        self.prompts, self.group_size = prompts_per_step, group_size
        self.filters = [(name, GROUP_FILTERS[name]) for name in cfg.filters]

    def collect(self, policy_version: int) -> CuratedBatch:
        if self.pool.size < self.prompts:
            raise PoolExhausted(pool_exhausted(self.pool, self.prompts))
        g, target = self.group_size, self.prompts
        kept: list[tuple[list[Example], Rollout, Scores]] = []
        counts = {"sampled": 0, "kept": 0, "retired": 0, **{f"dropped_{name}": 0 for name, _ in self.filters}}
        reward_metrics: list[tuple[int, dict[str, float]]] = []
        rounds = 0
        while True:
            want = target - counts["kept"] if self.cfg.refill == "active" else target
            examples, rollout = self.source.draw(want, policy_version)
            scores = self.score(examples, rollout)
            rounds += 1
            counts["sampled"] += len(examples)
            tokens = scores.token_advantages
            groups = Groups(scores.rewards.view(-1, g), scores.valid.view(-1, g), scores.correct.view(-1, g),
                            rollout.truncated.view(-1, g),
                            None if tokens is None else (tokens != 0).any(dim=1).view(-1, g).any(dim=1))
            reward_metrics.append((rollout.num_rows, {**scores.metrics, **rollout_metrics(rollout, groups)}))
            reward_metrics += scores.weighted_metrics
            keep = torch.ones(len(examples), dtype=torch.bool)
            for name, check in self.filters:
                passed = check(groups)
                counts[f"dropped_{name}"] += int((keep & ~passed).sum())
                keep &= passed
            if self.cfg.retire_pass_rate is not None:
                for p in (groups.correct.float().mean(dim=1) >= self.cfg.retire_pass_rate).nonzero().flatten().tolist():
                    self.pool.retire(examples[p])
                    counts["retired"] += 1
            take = keep.nonzero().flatten()[: target - counts["kept"]]  # a full batch, and no more
            # the rest are replaced by the next round's (async: the gate lets them be requested)
            if self.cfg.refill != "none":
                self.source.release(len(examples) - len(take))
            if len(take):
                rows = (take[:, None] * g + torch.arange(g)).flatten()
                kept.append(([examples[p] for p in take.tolist()], select_rows(rollout, rows), scores.rows(rows)))
                counts["kept"] += len(take)
            if counts["kept"] >= target or self.cfg.refill == "none" or rounds >= self.cfg.max_rounds:
                break
        rollout = concat_rollouts([r for _, r, _ in kept]) if kept else None
        scores = Scores.concat([s for _, _, s in kept]) if kept else None
        row_keep = None
        if kept:
            row_keep = scores.valid & ~rollout.truncated if self.cfg.overlong_filter else scores.valid
        metrics = {
            **_weighted_mean(reward_metrics),
            "curation/rounds": float(rounds),
            "curation/prompts_sampled": float(counts["sampled"]),
            "curation/prompts_kept": float(counts["kept"]),
            **{f"curation/{k}": float(v) for k, v in counts.items() if k.startswith("dropped_")},
            "curation/short": float(counts["kept"] < target),
            "curation/rows_masked": float((~row_keep).sum()) if kept else 0.0,
            "curation/pool_size": float(self.pool.size),
            "curation/retired": float(counts["retired"]),
        }
        return CuratedBatch([e for ex, _, _ in kept for e in ex], rollout, scores, row_keep, metrics)


def _weighted_mean(parts: list[tuple[int, dict[str, float]]]) -> dict[str, float]:
    """Per-key mean of the rounds' reward metrics, weighted by their rows; a round's NaN (nothing
    to measure there) is left out, a key NaN in every round stays NaN."""
    total: dict[str, float] = {}
    weight: dict[str, int] = {}
    for rows, metrics in parts:
        for key, value in metrics.items():
            total.setdefault(key, 0.0)
            weight.setdefault(key, 0)
            if not math.isnan(value):
                total[key] += rows * value
                weight[key] += rows
    return {key: total[key] / weight[key] if weight[key] else float("nan") for key in total}
