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

The code reads as the one-process algorithm. What a process holds of the
batch is `LearnerBatch.share` (a `BatchShare`): in one process `WHOLE`, the
identity; under data-parallel ranks, `distributed.data_parallel.RankShare`,
which maps each mini-batch of the one shuffle of the whole batch to this
rank's rows, reduces the aggregation's counts over the ranks, agrees on
skipping a step, and runs the zero-loss passes FSDP needs (see there).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch.distributed.fsdp import FSDPModule

from reinforge.learner.forward import ForwardPlan, token_stats
from reinforge.learner.sequences import SequenceBatch
from reinforge.models.factory import model_device
from reinforge.objectives import ObjectiveSpec, loss_weights, objective_loss
from reinforge.objectives.aggregation import BatchReduce, LocalReduce
from reinforge.objectives.corrections import mismatch_metrics
from reinforge.objectives.covariance import BATCH_SELECTIONS
from reinforge.settings import RolloutConfig, TrainConfig


class BatchShare(BatchReduce, Protocol):
    """What this process holds of an optimizer batch, and how its counts combine with the others'.

    `sum` / `cat` are the aggregation's reductions over every process holding rows (`BatchReduce`).
    """

    def order(self, rows: int, generator: torch.Generator) -> torch.Tensor:
        """[R] one shuffle of the WHOLE batch's rows (`rows`: this process's count)."""
        ...

    def mine(self, chunk: torch.Tensor) -> torch.Tensor:
        """This process's rows (indices into its own batch) among the whole-batch rows `chunk`."""
        ...

    def any_rows(self, mine: torch.Tensor) -> bool:
        """Some process holds rows of this mini-batch."""
        ...

    def all_finite(self, finite: bool) -> bool:
        """Every process's loss was finite."""
        ...

    def run_passes(self, micro: list[torch.Tensor], run: Callable[[torch.Tensor], None],
                   forward: Callable[[SequenceBatch], torch.Tensor]) -> None:
        """`run(m)` for each micro-batch `m` of a mini-batch (`forward`: the model's log-probs of a batch,
        for passes of its own that a sharded model needs)."""
        ...


class WholeBatch(LocalReduce):
    """One process holds the whole batch: every method is the identity."""

    def order(self, rows: int, generator: torch.Generator) -> torch.Tensor:
        return torch.randperm(rows, generator=generator)

    def mine(self, chunk: torch.Tensor) -> torch.Tensor:
        return chunk

    def any_rows(self, mine: torch.Tensor) -> bool:
        return len(mine) > 0

    def all_finite(self, finite: bool) -> bool:
        return finite

    def run_passes(self, micro: list[torch.Tensor], run: Callable[[torch.Tensor], None],
                   forward: Callable[[SequenceBatch], torch.Tensor]) -> None:
        for local in micro:
            run(local)


WHOLE = WholeBatch()


@dataclass
class LearnerBatch:
    """Everything the learner needs for one rollout batch; credit assignment is already done."""

    sequences: SequenceBatch
    advantages: torch.Tensor                 # [N] or [N, T]
    # [N, T] learner log-probs before this update (fixed over epochs). None: the update takes them itself,
    # the first mini-batch's from its own forward (no step has been taken yet), the other rows' from one
    # no-grad forward before the first optimizer step (`policy_update`).
    old_logprobs: torch.Tensor | None
    sampler_logprobs: torch.Tensor           # [N, T] rollout engine's log-probs
    group_ids: torch.Tensor                  # [N]
    ref_logprobs: torch.Tensor | None = None  # [N, T] reference policy, when the objective has a KL term
    correct: torch.Tensor | None = None       # [N] bool, verified-correct samples (for an NLL term)
    # [N, T, K] the sampler's log-probs of its top-K ids (sequences.top_ids), for DPPO's top-K divergence
    sampler_top_logprobs: torch.Tensor | None = None
    share: BatchShare = field(default=WHOLE)  # which rows of the whole batch these are (WHOLE: all of them)

    @property
    def rows(self) -> int:
        return self.sequences.input_ids.shape[0]

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
            correct=_slice_rows(self.correct, rows, width), share=self.share,
            sampler_top_logprobs=_slice_rows(self.sampler_top_logprobs, rows, width),
        )


@dataclass(frozen=True)
class UpdateSettings:
    """How a rollout batch is optimised (train.*, and the rollout's temperature and length limit)."""

    ppo_epochs: int = 1
    mini_batches: int = 1
    grad_clip: float = 1.0
    temperature: float = 1.0                 # the sampler's: log-probs of the tempered distribution
    old_logprobs: str = "auto"    # pi_old: "recompute" (the learner), "rollout" (the sampler), "auto" (loops/rl.py)
    forward: ForwardPlan = field(default_factory=ForwardPlan)
    # L_max of the Dr. GRPO normaliser; pass it under data-parallel ranks, or it is each rank's own padded width
    max_length: int | None = None

    @classmethod
    def from_config(cls, train: TrainConfig, rollout: RolloutConfig) -> UpdateSettings:
        return cls(
            ppo_epochs=train.ppo_epochs, mini_batches=train.mini_batches, grad_clip=train.grad_clip,
            temperature=rollout.temperature, old_logprobs=train.old_logprobs,
            forward=ForwardPlan.from_config(train, rollout),
            max_length=rollout.max_new_tokens,
        )


@dataclass
class UpdateStats:
    optimizer_steps: int                  # steps taken; skipped ones do not count
    skipped_steps: int                    # steps skipped because the loss or gradient was not finite
    # means over optimizer steps (grad_norm) and micro-batches (loss parts); the sampler-learner
    # mismatch (mismatch_*, is_weight_*) over the whole batch at pi_old
    metrics: dict[str, float]
    old_logprobs: torch.Tensor  # [N, T] the pi_old log-probs the update used


def _slice_rows(
    x: torch.Tensor | None, index: torch.Tensor, width: int, device: torch.device | None = None
) -> torch.Tensor | None:
    """Rows `index` of x ([N], [N, T] or [N, T, K], trimmed to `width` columns), on `device` (default x's)."""
    if x is None:
        return None
    x = x[index]
    x = x[:, :width] if x.dim() >= 2 else x
    return x if device is None else x.to(device)


class _Means:
    """Running means of per-micro-batch and per-step metrics."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)

    def add(self, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self.sums[key] += value
            self.counts[key] += 1

    def result(self) -> dict[str, float]:
        return {k: self.sums[k] / self.counts[k] for k in self.sums}


def policy_update(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    batch: LearnerBatch,
    spec: ObjectiveSpec,
    settings: UpdateSettings,
    generator: torch.Generator,
) -> UpdateStats:
    """ppo_epochs passes over `batch`, each cut into mini_batches optimizer steps from one shuffle of its rows."""
    if settings.forward.shared_prefix and isinstance(model, FSDPModule):
        raise NotImplementedError("the shared-prompt learner forward reads every layer's weights directly, past FSDP's "
                                  "per-layer all-gathers; set train.shared_prefix=false")
    # pi_old: given, or taken here at the weights before the first optimizer step. The first mini-batch's
    # rows take it from their own forward (detached: the same function at the same weights, one forward
    # less for them; TRL does the same with num_iterations=1), the other mini-batches' rows from one
    # no-grad forward before that step. Either way it is fixed over all epochs.
    lazy = batch.old_logprobs is None
    old_all = torch.zeros_like(batch.sequences.completion_mask) if lazy else batch.old_logprobs
    share, means = batch.share, _Means()
    steps = skipped = 0
    for epoch in range(settings.ppo_epochs):
        order = share.order(batch.rows, generator)
        chunks = torch.tensor_split(order, settings.mini_batches)
        if lazy and epoch == 0 and len(chunks) > 1:
            _fill_old_logprobs(model, batch, share.mine(torch.cat(chunks[1:])), old_all, settings)
        for i, chunk in enumerate(chunks):
            mb = share.mine(chunk)                    # this process's rows of the mini-batch
            if not share.any_rows(mb):
                continue
            optimizer.zero_grad(set_to_none=True)
            take_old = lazy and epoch == 0 and i == 0
            finite = share.all_finite(_accumulate(model, batch, mb, old_all, spec, settings, means, generator,
                                                  take_old))
            grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), settings.grad_clip))
            if not (finite and math.isfinite(grad_norm)):
                optimizer.zero_grad(set_to_none=True)
                skipped += 1
                continue
            optimizer.step()
            scheduler.step()
            means.add({"grad_norm": grad_norm})
            steps += 1
    metrics = means.result()
    metrics.setdefault("grad_norm", float("nan"))     # every step skipped
    # |p_sampler - p_learner| per token at the same weights, over the rows trained on (ALGORITHMS.md,
    # sampler-learner mismatch), and the IS weights pi_old / mu: once, over the whole batch.
    metrics.update(mismatch_metrics(old_all, batch.sampler_logprobs, batch.sequences.completion_mask))
    return UpdateStats(optimizer_steps=steps, skipped_steps=skipped, metrics=metrics, old_logprobs=old_all)


def _fill_old_logprobs(model: torch.nn.Module, batch: LearnerBatch, rows: torch.Tensor, old_all: torch.Tensor,
                       settings: UpdateSettings) -> None:
    """pi_old of `rows` (this process's) into `old_all`, from a no-grad forward at the current weights."""
    device, forward = model_device(model), settings.forward

    def record(local: torch.Tensor) -> None:
        seq = batch.sequences.rows(rows[local]).to(device)
        with torch.no_grad():
            logprobs = token_stats(model, seq, settings.temperature, forward).logprobs
        old_all[rows[local], : logprobs.shape[1]] = logprobs.to(old_all.device, old_all.dtype)

    batch.share.run_passes(forward.micro_batches(batch.sequences, rows, device), record,
                           lambda seq: token_stats(model, seq, settings.temperature, forward).logprobs)


def _accumulate(
    model: torch.nn.Module, batch: LearnerBatch, mb: torch.Tensor, old_all: torch.Tensor, spec: ObjectiveSpec,
    settings: UpdateSettings, means: _Means, generator: torch.Generator | None = None, take_old: bool = False,
) -> bool:
    """The gradient of mini-batch `mb`'s loss into `.grad`, micro-batch by micro-batch; whether the loss was finite.
    `take_old`: pi_old of these rows is taken from these forwards (no step has been taken yet on the batch)."""
    device, forward, temperature = model_device(model), settings.forward, settings.temperature
    mask_all = batch.sequences.completion_mask
    weights = loss_weights(
        spec.aggregation,
        mask_all[mb],
        group_ids=batch.group_ids[mb],
        max_length=settings.max_length,
        reduce=batch.share,
    )  # [M, T]
    selected = _batch_selection(model, batch, mb, None if take_old else old_all, spec, settings,
                                generator)  # [M, T] bool or None
    finite = True

    def run(local: torch.Tensor) -> None:
        nonlocal finite
        rows = mb[local]
        # The batch stays where the rollout put it (the CPU); each micro-batch goes to the model.
        seq = batch.sequences.rows(rows).to(device)
        width = seq.completion_ids.shape[1]
        stats = token_stats(model, seq, temperature, forward)
        if take_old:
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
            selected=None if selected is None else selected[local][:, :width].to(device),
            top_logprobs=stats.top_logprobs,
            sampler_top_logprobs=_slice_rows(batch.sampler_top_logprobs, rows, width, device),
        )
        finite &= bool(torch.isfinite(out.loss.detach()))
        out.loss.backward()
        means.add({**out.metrics, **stats.metrics})

    batch.share.run_passes(forward.micro_batches(batch.sequences, mb, device), run,
                           lambda seq: token_stats(model, seq, temperature, forward).logprobs)
    return finite


def _batch_selection(
    model: torch.nn.Module, batch: LearnerBatch, mb: torch.Tensor, old_all: torch.Tensor | None, spec: ObjectiveSpec,
    settings: UpdateSettings, generator: torch.Generator | None,
) -> torch.Tensor | None:
    """[M, T] bool: the token selection of a policy loss that needs one over the whole mini-batch
    (covariance.BATCH_SELECTIONS, e.g. KL-Cov's top-k by covariance), from a no-grad forward of all
    of `mb`'s rows at the current weights, before any of its micro-batches' gradient passes; None for
    the other losses. Computed once and sliced like the aggregation weights, it does not depend on
    micro-batching. A `None` old_all: pi_old is this policy (no step has been taken on the batch yet)."""
    select = BATCH_SELECTIONS.get(spec.policy_loss)
    if select is None:
        return None
    device, forward = model_device(model), settings.forward
    mask_all = batch.sequences.completion_mask
    current = torch.zeros(len(mb), mask_all.shape[1], dtype=torch.float32)

    def record(local: torch.Tensor) -> None:
        seq = batch.sequences.rows(mb[local]).to(device)
        with torch.no_grad():
            logprobs = token_stats(model, seq, settings.temperature, forward).logprobs
        current[local, : logprobs.shape[1]] = logprobs.float().cpu()

    batch.share.run_passes(forward.micro_batches(batch.sequences, mb, device), record,
                           lambda seq: token_stats(model, seq, settings.temperature, forward).logprobs)
    current = current.to(mask_all.dtype)
    anchors = {"old": None if old_all is None else old_all[mb], "sampler": batch.sampler_logprobs[mb]}
    anchor = anchors[spec.ratio_anchor]
    advantages = batch.advantages[mb]
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1).expand_as(current)
    return select(logprobs=current, old_logprobs=current if anchor is None else anchor, advantages=advantages,
                  mask=mask_all[mb], reduce=batch.share, generator=generator, **spec.policy_params)
