"""Data-parallel RL learner ranks under torchrun (`torchrun --nproc_per_node=N -m reinforge.cli train ...`).

This module owns what the RL loop needs beyond one process: which configurations it refuses, the
sharded model each rank trains next to the plain one the rollout engine reads, each rank's share
of a batch (`RankShare`: its rows, the zero-loss passes FSDP needs), the exchange of the per-row
learner tensors, and the combination of per-rank metrics.

First version, and how it departs from a one-process run:

- Generation is split: each rank decodes a share of every RL batch's prompts and all ranks
  gather the whole rollout (`SplitAcrossRanks`); the native engine keys each prompt's samples,
  so the batch is the one a single process samples. Rewards are rank 0's, sent to every rank
  (`from_rank_0`: a reward's timeout must not differ between ranks), and every rank curates the
  same batch. With the HF engine rank 0 samples, scores and curates alone and sends the batch.
  The held-out evaluations are split the same way. With train.mode=async rank 0 alone runs the
  rollout workers and the stream of groups (one sampler, one staleness gate, one publication of
  the weights per step), and sends every curated batch to all ranks (`RankZeroSource`). SFT and
  advantages run on every rank with the same seeds (DUPLICATED, not split).
  The learner is split too: each rank holds the `rank_rows` of every
  rollout batch (whole prompt groups) and computes its share of the global-batch loss, and the
  trained model is FSDP2-sharded (`shard_model`), the optimizer stepping the shards.
- The rollout engine cannot run on DTensors (the native engine reads the weights directly), so
  every rank keeps a plain, full copy of the policy, refreshed from the shards after every update
  (`copy_full_weights`). pi_old and the reference (a frozen plain copy) are computed on the plain
  models, each rank on its own rows, with no collective; the rows are then summed over the ranks
  so that credit assignment sees the whole batch, as in one process.
- Only rank 0 writes (the run directory, logs, progress bars, checkpoints, the exported model);
  the checkpointed weights are the plain copy's, i.e. the gathered shards.

With one process (no torchrun) every method here is the identity and the loop runs as before.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

from reinforge.distributed.fsdp import LearnerGroup, copy_full_weights, rank_rows, shard_model
from reinforge.learner.sequences import SequenceBatch
from reinforge.learner.update import LearnerBatch
from reinforge.objectives import LOCAL, BatchReduce
from reinforge.rollout.base import Rollout, concat_rollouts
from reinforge.rollout.native import NativeEngine
from reinforge.rollout.sampling import draw_group_keys

T = TypeVar("T")


def on_rank_0(group: LearnerGroup, make: Callable[[], T]) -> T | None:
    """`make()` on rank 0 alone (None on the others); an error it raises, every rank raises (the same
    type and message), so that no rank goes on to wait for rank 0 at a collective. Every rank must call it."""
    if group.world_size == 1:
        return make()
    result, error = None, None
    if group.rank == 0:
        try:
            result = make()
        except Exception as err:   # handed to the other ranks, then raised here too
            error = err
    box = [error]
    dist.broadcast_object_list(box, src=0)
    if box[0] is not None:
        raise box[0] if error is None else error
    return result


def from_rank_0(group: LearnerGroup, make: Callable[[], T]) -> T:
    """`make()` on rank 0 alone, its result (or the error it raised) sent to every rank: all ranks hold
    rank 0's object, the same to the last bit, whatever their own computation would have given.
    Every rank must call it; one process just calls `make`."""
    if group.world_size == 1:
        return make()
    box: list = [None]
    if group.rank == 0:
        try:
            box[0] = (make(), None)
        except Exception as err:   # handed to the other ranks, then raised everywhere
            box[0] = (None, err)
    dist.broadcast_object_list(box, src=0)
    result, error = box[0]
    if error is not None:
        raise error
    return result


class SplitAcrossRanks:
    """A rollout engine whose prompts are split across the learner ranks: each rank decodes a
    contiguous share of them and every rank receives the whole rollout, in prompt order.

    The native engine samples each prompt from its own key (`rollout.sampling.keyed_uniforms`), one
    key per prompt drawn in order from the call's generator, as the engine itself would: so the
    gathered rollout has the tokens one process would sample (up to the rounding of the sampler
    log-probs in a smaller batch), and the generator advances alike on every rank.
    """

    def __init__(self, engine, group: LearnerGroup):
        self.engine, self.group = engine, group

    def generate(self, prompts: list[str], group_size: int, params, policy_version: int = 0,
                 generator: torch.Generator | None = None):
        keys = draw_group_keys(len(prompts), generator)
        world, rank = self.group.world_size, self.group.rank
        bounds = [len(prompts) * r // world for r in range(world + 1)]
        lo, hi = bounds[rank], bounds[rank + 1]
        part = (self.engine.generate(prompts[lo:hi], group_size, params, policy_version, group_keys=keys[lo:hi])
                if hi > lo else None)
        parts: list = [None] * world
        dist.all_gather_object(parts, part)
        return concat_rollouts([p for p in parts if p is not None])


def split_generation(engine, group: LearnerGroup | None):
    """`engine` with its prompts split across the learner ranks (`SplitAcrossRanks`), where it can key
    its samples by prompt (the native engine); else `engine` itself. Every rank must then call it alike."""
    if group is None or group.world_size == 1 or not isinstance(engine, NativeEngine):
        return engine
    return SplitAcrossRanks(engine, group)


class RankShare:
    """One learner rank's rows of an optimizer batch that all ranks hold together (learner/update.py's
    `BatchShare`): the update cuts its mini-batches from one shuffle of the WHOLE batch, each rank
    taking its own rows of each, so the optimizer steps see the mini-batches one process would.

    Each rank runs as many forward/backward passes per mini-batch as the busiest rank, its extra passes
    adding exactly zero loss: FSDP all-gathers each layer's weights inside every forward, so a rank
    that ran fewer would leave the others waiting. The ranks agree to skip a step when any of them saw
    a non-finite loss; the gradient norm is already global (the norm of the sharded gradients).
    """

    def __init__(self, reduce: BatchReduce, rows: Tensor, total: int):
        self.reduce, self.total = reduce, total
        # own[i]: the row of this rank's batch that is row i of the whole batch (-1: another rank's)
        self.own = torch.full((total,), -1, dtype=torch.long).index_copy_(0, rows, torch.arange(len(rows)))

    def sum(self, values: Tensor) -> Tensor:
        return self.reduce.sum(values)

    def cat(self, values: Tensor) -> Tensor:
        return self.reduce.cat(values)

    def order(self, rows: int, generator: torch.Generator) -> Tensor:
        return torch.randperm(self.total, generator=generator)

    def mine(self, chunk: Tensor) -> Tensor:
        rows = self.own[chunk]
        return rows[rows >= 0]

    def any_rows(self, mine: Tensor) -> bool:
        return int(self.reduce.sum(torch.tensor(len(mine)))) > 0

    def all_finite(self, finite: bool) -> bool:
        return int(self.reduce.sum(torch.tensor(int(not finite)))) == 0

    def run_passes(
        self, micro: list[Tensor], run: Callable[[Tensor], None], forward: Callable[[SequenceBatch], Tensor]
    ) -> None:
        idle = int(self.reduce.cat(torch.tensor([len(micro)])).max()) - len(micro)   # before any FSDP collective
        for local in micro:
            run(local)
        for _ in range(idle):
            (0.0 * forward(_idle_row()).sum()).backward()


def _idle_row() -> SequenceBatch:
    """The input of a rank's extra passes: one completion token after a one-token prompt, all token 0
    (in every vocabulary). Its loss is multiplied by 0: the pass is there for FSDP's collectives."""
    ids = torch.zeros(1, 2, dtype=torch.long)
    return SequenceBatch(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        starts=torch.ones(1, dtype=torch.long),
        completion_ids=ids[:, 1:],
        completion_mask=torch.ones(1, 1),
        group_ids=torch.zeros(1, dtype=torch.long),
    )


class RankZeroSource:
    """A batch source that rank 0 holds, as every rank sees it (`DataParallel.from_rank_0`)."""

    def __init__(self, group: LearnerGroup, source):
        self.group, self.source = group, source

    def collect(self, version: int):
        return from_rank_0(self.group, lambda: self.source.collect(version))

    def pending(self) -> list[int]:
        return self.source.pending() if self.source is not None else []

    def step_metrics(self, batch) -> dict[str, float]:
        return self.source.step_metrics(batch) if self.source is not None else {}


class DataParallel:
    """One learner rank's share of the work, around the plain policy model the rollout engine reads.

    `model` is what the optimizer steps: `plain` itself in a world of one, else `sharded`, an
    FSDP-sharded copy of it (in training mode), whose weights `sync` copies back into `plain` after
    every update.
    """

    def __init__(self, group: LearnerGroup | None, plain: torch.nn.Module):
        self.group, self.plain = group, plain
        self.sharded = shard_model(copy.deepcopy(plain).train()) if group is not None and group.world_size > 1 else None
        self.model = plain if self.sharded is None else self.sharded
        self.reduce = group.reduce if group is not None else LOCAL    # the aggregation's counts over all ranks
        self.split = False                    # generation split across the ranks (`rollout_parts`)

    def rollout_parts(self, engine, score: Callable[[list, Rollout], T]) -> tuple[object, Callable[[list, Rollout], T]]:
        """The engine and reward function the RL loop samples and scores with. One process: as given.
        Learner ranks with the native engine: generation split across the ranks (`SplitAcrossRanks`) and
        rank 0's rewards on every rank (a reward's timeout must not differ between ranks); every rank
        then curates the same batch. With another engine, which cannot key its samples by prompt,
        rank 0 samples, scores and curates alone (`collect`)."""
        split = split_generation(engine, self.group if self.sharded is not None else None)
        self.split = split is not engine
        if not self.split:
            return engine, score
        return split, lambda examples, rollout: from_rank_0(self.group, lambda: score(examples, rollout))

    def from_rank_0(self, source):
        """A batch source (loops/loop.py's `BatchSource`) that rank 0 alone holds (`source`; None on the
        others), as one every rank collects from: rank 0's batches, and its errors (the prompts ran out),
        sent to every rank. Its other figures are rank 0's (the only rank that writes). One process: `source`."""
        return source if self.sharded is None else RankZeroSource(self.group, source)

    def collect(self, collector, version: int):
        """One step's curated batch, the same on every rank (see `rollout_parts`)."""
        if self.sharded is None or self.split:
            return collector.collect(version)
        return from_rank_0(self.group, lambda: collector.collect(version))

    def rowwise(self, sequences: SequenceBatch, compute: Callable[[SequenceBatch], Tensor | None]) -> Tensor | None:
        """`compute` [N, T] of the whole batch, every rank computing it for its own rows (`rank_rows`: whole
        prompt groups) on the plain models, with no collective inside; the rows are then summed over the
        ranks (each row belongs to one rank), so that every rank holds the whole batch's. One process:
        `compute(sequences)`."""
        if self.sharded is None:
            return compute(sequences)
        mine = rank_rows(sequences.group_ids, self.group.rank, self.group.world_size)
        part = compute(sequences.rows(mine.nonzero().squeeze(1)))
        if part is None:
            return None
        out = torch.zeros(sequences.completion_mask.shape, dtype=part.dtype)
        out[mine.nonzero().squeeze(1), : part.shape[1]] = part
        dist.all_reduce(out)
        return out

    def share(self, batch: LearnerBatch, keep: Tensor) -> LearnerBatch:
        """The rows of the whole batch `batch` [N] that the learner trains on (`keep`), and of those this
        rank's (whole prompt groups), with a `RankShare` saying where they sit in the whole. One process:
        `batch.select(keep)`."""
        if self.sharded is None:
            return batch.select(keep)
        mine = rank_rows(batch.group_ids, self.group.rank, self.group.world_size)
        kept = keep.nonzero().squeeze(1)               # the rows trained on, by all ranks together
        own = batch.select(keep & mine)
        return dataclasses.replace(
            own, share=RankShare(self.reduce, rows=mine[kept].nonzero().squeeze(1), total=len(kept))
        )

    def sync(self) -> None:
        """The plain copy (the engine's weights, the reference's EMA target, the checkpoint) takes the
        sharded model's weights; every rank must call it."""
        if self.sharded is not None:
            copy_full_weights(self.sharded, self.plain)

    def combine(self, metrics: dict[str, float], rows: int) -> dict[str, float]:
        """Per-rank metrics as one figure for the whole batch, the same on every rank: keys ending in
        _max (_min) the maximum (minimum) over the ranks with rows, the others the mean of the ranks'
        values weighted by their rows (a rank without rows counts only where no rank has any).
        A NaN on any rank stays NaN. One process: `metrics`, unchanged."""
        if self.sharded is None:
            return metrics
        gathered: list[tuple[dict[str, float], int] | None] = [None] * self.group.world_size
        dist.all_gather_object(gathered, (metrics, rows))
        keys = dict.fromkeys(k for m, _ in gathered for k in m)     # in order of appearance
        out = {}
        for key in keys:
            pairs = [(m[key], n) for m, n in gathered if key in m]
            pairs = [(v, n) for v, n in pairs if n > 0] or pairs
            values = [v for v, _ in pairs]
            if any(math.isnan(v) for v in values):
                out[key] = math.nan
            elif key.endswith(("_max", "_min")):
                out[key] = max(values) if key.endswith("_max") else min(values)
            else:
                total = sum(n for _, n in pairs)
                out[key] = sum(v * n for v, n in pairs) / total if total else sum(values) / len(values)
        return out
