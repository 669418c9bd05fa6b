"""One policy update on a rollout batch: ppo_epochs x mini-batches optimizer
steps, each accumulated over micro-batches.

Aggregation weights are computed once per optimizer mini-batch (the one
place that normalises: `objectives.loss_weights`), then sliced into
micro-batches (rows of similar length, `ForwardPlan.micro_batches`) whose
losses are summed, so the gradient does not depend on `micro_batch_size` or
`micro_batch_tokens`.

Guard: a mini-batch whose loss or gradient norm is NaN/inf takes no step:
its gradient is dropped and neither the weights, the optimizer's moments nor
the scheduler move (one bad batch must not poison Adam's state for good).
The caller counts these and decides when to stop.

Data-parallel ranks (reinforge.distributed.fsdp): each rank passes its own
rows of the rollout batch and `reduce`, the all-reduce form of the
aggregation's counts, so its loss is its share of the global-batch loss
(pass `max_length` then: without it the Dr. GRPO normaliser is each rank's
own padded width). An optimizer step's batch is the union of the ranks'
mini-batches. Each rank runs as many forward/backward passes per step as the
busiest rank, its extra passes adding exactly zero loss: FSDP all-gathers
each layer's weights inside every forward, so a rank that ran fewer would
leave the others waiting. The ranks agree to skip a step when any of them
saw a non-finite loss; the gradient norm is already global (the norm of the
sharded gradients).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

import torch
from torch.distributed.fsdp import FSDPModule

from reinforge.learner.forward import ForwardPlan, token_stats
from reinforge.learner.sequences import SequenceBatch
from reinforge.models.factory import model_device
from reinforge.objectives import LOCAL, BatchReduce, ObjectiveSpec, loss_weights, objective_loss


@dataclass
class LearnerBatch:
    """Everything the learner needs for one rollout batch; credit assignment is already done."""

    sequences: SequenceBatch
    advantages: torch.Tensor                 # [N] or [N, T]
    # [N, T] learner log-probs before this update (fixed over epochs). None: the update has one
    # optimizer step, so pi_old is the policy of that step's own forward; it is taken there, detached.
    old_logprobs: torch.Tensor | None
    sampler_logprobs: torch.Tensor           # [N, T] rollout engine's log-probs
    group_ids: torch.Tensor                  # [N]
    ref_logprobs: torch.Tensor | None = None  # [N, T] reference policy, when the objective has a KL term
    correct: torch.Tensor | None = None       # [N] bool, verified-correct samples (for an NLL term)

    def select(self, keep: torch.Tensor) -> LearnerBatch:
        """The rows where `keep` [N] (bool) is set: samples that curation or an advantage filter dropped leave
        the batch entirely, so they do not count in the aggregation's denominators either."""
        if bool(keep.all()):
            return self
        rows = keep.nonzero().squeeze(1)
        sequences = self.sequences.rows(rows)
        width = sequences.completion_ids.shape[1]
        return LearnerBatch(
            sequences=sequences, advantages=_slice_rows(self.advantages, rows, width),
            old_logprobs=_slice_rows(self.old_logprobs, rows, width),
            sampler_logprobs=_slice_rows(self.sampler_logprobs, rows, width),
            group_ids=self.group_ids[rows], ref_logprobs=_slice_rows(self.ref_logprobs, rows, width),
            correct=_slice_rows(self.correct, rows, width),
        )


@dataclass
class UpdateStats:
    optimizer_steps: int                  # steps taken; skipped ones do not count
    skipped_steps: int                    # steps skipped because the loss or gradient was not finite
    metrics: dict[str, float]  # means over optimizer steps (grad_norm) and micro-batches (loss parts)
    old_logprobs: torch.Tensor  # [N, T] the pi_old log-probs the update used


def _slice_rows(x: torch.Tensor | None, index: torch.Tensor, width: int, device: torch.device | None = None) -> torch.Tensor | None:
    """Rows `index` of x ([N] or [N, T], trimmed to `width` columns), on `device` (default x's)."""
    if x is None:
        return None
    x = x[index]
    x = x[:, :width] if x.dim() == 2 else x
    return x if device is None else x.to(device)


def _idle_row(device: torch.device) -> SequenceBatch:
    """The input of a rank's extra passes: one completion token after a one-token prompt, all token 0
    (in every vocabulary). Its loss is multiplied by 0: the pass is there for FSDP's collectives."""
    ids = torch.zeros(1, 2, dtype=torch.long, device=device)
    return SequenceBatch(input_ids=ids, attention_mask=torch.ones_like(ids), starts=torch.ones(1, dtype=torch.long, device=device),
                         completion_ids=ids[:, 1:], completion_mask=torch.ones(1, 1, device=device),
                         group_ids=torch.zeros(1, dtype=torch.long, device=device))


def policy_update(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    batch: LearnerBatch,
    spec: ObjectiveSpec,
    *,
    ppo_epochs: int,
    mini_batches: int,
    grad_clip: float,
    temperature: float,
    generator: torch.Generator,
    forward: ForwardPlan,
    max_length: int | None = None,
    reduce: BatchReduce = LOCAL,
    batch_rows: torch.Tensor | None = None,
    total_rows: int | None = None,
) -> UpdateStats:
    """`batch_rows` [n]: under data-parallel ranks, each of this rank's rows' place in the whole batch of
    `total_rows` (the same on every rank): mini-batches are cut from one shuffle of the whole batch,
    each rank taking its own rows of each, so the optimizer steps see the mini-batches one process
    would. None: this process holds the whole batch."""
    if forward.shared_prefix and isinstance(model, FSDPModule):
        raise NotImplementedError("the shared-prompt learner forward reads every layer's weights directly, past FSDP's "
                                  "per-layer all-gathers; set train.shared_prefix=false")
    n = batch.sequences.input_ids.shape[0]
    device = model_device(model)
    in_place = batch.old_logprobs is None
    if in_place and ppo_epochs * mini_batches != 1:
        raise ValueError("old_logprobs=None (pi_old from the update's own forward) needs ppo_epochs = mini_batches = 1")
    old_all = torch.zeros_like(batch.sequences.completion_mask) if in_place else batch.old_logprobs
    sums: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    steps = skipped = 0
    mask_all = batch.sequences.completion_mask
    total = n if batch_rows is None else total_rows
    # own[i]: the row of this rank's batch that is row i of the whole batch (-1: another rank's)
    own = torch.arange(n) if batch_rows is None else torch.full((total,), -1, dtype=torch.long).index_copy_(0, batch_rows, torch.arange(n))
    for _ in range(ppo_epochs):
        order = torch.randperm(total, generator=generator)
        for chunk in torch.tensor_split(order, mini_batches):
            mb = own[chunk]
            mb = mb[mb >= 0]                              # this rank's rows of the mini-batch
            if int(reduce.sum(torch.tensor(len(mb)))) == 0:   # no rank has rows here
                continue
            weights = loss_weights(spec.aggregation, mask_all[mb], group_ids=batch.group_ids[mb], max_length=max_length,
                                   reduce=reduce)  # [M, T]
            optimizer.zero_grad(set_to_none=True)
            finite = True
            micro = forward.micro_batches(batch.sequences, mb)
            idle_passes = int(reduce.cat(torch.tensor([len(micro)])).max()) - len(micro)
            for local in micro:
                rows = mb[local]
                # The batch stays where the rollout put it (the CPU); each micro-batch goes to the model.
                seq = batch.sequences.rows(rows).to(device)
                width = seq.completion_ids.shape[1]
                stats = token_stats(model, seq, temperature, forward)
                if in_place:   # no step has been taken yet: these weights are pi_old
                    old_all[rows, :width] = stats.logprobs.detach().to(old_all.device)
                out = objective_loss(
                    spec,
                    logprobs=stats.logprobs,
                    old_logprobs=_slice_rows(old_all, rows, width, device),
                    advantages=_slice_rows(batch.advantages, rows, width, device),
                    mask=seq.completion_mask,
                    weights=weights[local][:, :width].to(device),
                    ref_logprobs=_slice_rows(batch.ref_logprobs, rows, width, device),
                    sampler_logprobs=_slice_rows(batch.sampler_logprobs, rows, width, device),
                    entropy=stats.entropy,
                    correct=_slice_rows(batch.correct, rows, width, device),
                )
                finite &= bool(torch.isfinite(out.loss.detach()))
                out.loss.backward()
                for key, value in out.metrics.items():
                    sums[key] += value
                    counts[key] += 1
            for _ in range(idle_passes):
                idle = token_stats(model, _idle_row(mask_all.device), temperature, forward)
                (0.0 * idle.logprobs.sum()).backward()
            finite = int(reduce.sum(torch.tensor(int(not finite)))) == 0
            grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip))
            if not (finite and math.isfinite(grad_norm)):
                optimizer.zero_grad(set_to_none=True)
                skipped += 1
                continue
            optimizer.step()
            scheduler.step()
            sums["grad_norm"] += grad_norm
            counts["grad_norm"] += 1
            steps += 1
    metrics = {k: sums[k] / counts[k] for k in sums}
    metrics.setdefault("grad_norm", float("nan"))     # every step skipped
    return UpdateStats(optimizer_steps=steps, skipped_steps=skipped, metrics=metrics, old_logprobs=old_all)
