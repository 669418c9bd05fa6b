"""The one training loop: collect a batch, update, publish, log; and the state every loop carries.

RL (synchronous or asynchronous, one process or data-parallel learner ranks) and DPO run this same
loop; they differ in the batch source and the learner step they pass, and in the `after_update`
hook (publish the weights to rollout workers under train.mode=async), never by a branch here.
The sources and steps are built from the config at the edge (reinforge/jobs/rl.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import torch

from reinforge.curation.batches import PoolExhausted
from reinforge.distributed import full_optimizer_state, load_full_optimizer_state
from reinforge.telemetry.checkpoint import global_rng_state, set_global_rng_state
from reinforge.telemetry.samples import StepSamples

B = TypeVar("B")
B_contra = TypeVar("B_contra", contravariant=True)
S = TypeVar("S", bound="LoopState")


@dataclass
class StepRecord:
    """One line of metrics.jsonl."""

    step: int
    metrics: dict[str, float]
    stage: str = "rl"          # "value_pretrain": a critic pre-training step before RL (not an RL step)
    samples: StepSamples | None = None   # the step's trained batch, for samples.jsonl (None: no update this step)


@dataclass
class RLResult:
    steps: int                                  # steps completed
    policy_version: int
    optimizer: torch.optim.Optimizer
    stopped: str | None = None                  # why training ended before train.steps (every prompt retired)


class NonFiniteStop(RuntimeError):
    """Too many steps in a row had a NaN/inf loss or gradient (train.max_nonfinite_steps).

    `state` is the loop's state at the stop (the weights and optimizer of the last good step,
    since skipped updates changed nothing): what the caller checkpoints.
    """

    def __init__(self, message: str, state: LoopState):
        super().__init__(message)
        self.state = state


@dataclass(kw_only=True)
class LoopState:
    """What every loop carries from one step to the next and a checkpoint saves: the step, the
    optimizer and schedule, the guard's counts and torch's global RNGs (the sampler may draw from
    them). Subclasses add their own parts (`extra_state` / `load_extra_state`)."""

    step: int = 0                               # last completed step
    version: int = 0                            # policy version: optimizer steps taken
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    nonfinite_streak: int = 0                   # steps in a row with a skipped optimizer step
    skipped_total: int = 0                      # optimizer steps skipped over the run
    pending: list[int] = field(default_factory=list)   # train.mode=async: pool indices requested, not yet trained on
    # Data-parallel learner ranks: the FSDP-sharded model the optimizer steps (its state is gathered
    # into a full one in a checkpoint, so every rank must call state_dict); None in one process.
    sharded: torch.nn.Module | None = None

    def extra_state(self) -> dict:
        return {}

    def load_extra_state(self, state: dict) -> None:
        pass

    def record_update(self, taken: int, skipped: int) -> None:
        """An update took `taken` optimizer steps and skipped `skipped` (NaN/inf loss or gradient)."""
        self.version += taken
        self.skipped_total += skipped
        self.nonfinite_streak = self.nonfinite_streak + 1 if skipped else 0

    def check_finite(self, limit: int, what: str, hint: str) -> None:
        """NonFiniteStop once `limit` steps in a row had a skipped update (after the caller logged the last of them)."""
        if self.nonfinite_streak >= limit:
            raise NonFiniteStop(
                f"{what} step {self.step}: {self.nonfinite_streak} steps in a row had a NaN/inf loss or "
                "gradient, so their "
                f"updates were skipped (train.max_nonfinite_steps={limit}); the weights are still "
                f"those of the last good step. Lower train.lr, or look for NaN in {hint}.",
                self,
            )

    def state_dict(self) -> dict:
        optimizer = (
            self.optimizer.state_dict() if self.sharded is None else full_optimizer_state(self.sharded, self.optimizer)
        )
        return {
            "step": self.step,
            "version": self.version,
            "optimizer": optimizer,
            "scheduler": self.scheduler.state_dict(),
            **self.extra_state(),
            "global_rng": global_rng_state(),
            "nonfinite_streak": self.nonfinite_streak,
            "skipped_total": self.skipped_total,
            "pending": list(self.pending),
        }

    def load_state_dict(self, state: dict) -> None:
        self.step, self.version = state["step"], state["version"]
        if self.sharded is None:
            self.optimizer.load_state_dict(state["optimizer"])
        else:
            load_full_optimizer_state(self.sharded, self.optimizer, state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.load_extra_state(state)
        self.nonfinite_streak, self.skipped_total = state["nonfinite_streak"], state["skipped_total"]
        self.pending = list(state.get("pending", []))
        set_global_rng_state(state["global_rng"])


class BatchSource(Protocol[B]):
    """Where a loop's batches come from: sampled now (sync RL), streamed from rollout workers
    (async RL), preference pairs (DPO)."""

    def collect(self, version: int) -> B:
        """The next step's batch for the policy of `version`; PoolExhausted when the prompts run out."""
        ...

    def pending(self) -> list[int]:
        """Pool indices requested and not yet trained on (async): what a resumed run requests again first."""
        ...

    def step_metrics(self, batch: B) -> dict[str, float]:
        """The source's figures of the step that trained on `batch`, once `after_update` ran: timings,
        throughput, staleness."""
        ...


class StepLearner(Protocol[B_contra, S]):
    """From a batch to an update of the policy (and whatever else the method trains)."""

    model: torch.nn.Module        # the policy's plain model: what `after_update` publishes
    samples: StepSamples | None   # the latest step's batch, for samples.jsonl

    def step(self, state: S, batch: B_contra) -> dict[str, float]: ...

    def check_finite(self, state: S) -> None: ...


def no_publish(model: torch.nn.Module) -> None:
    """The `after_update` of a loop whose sampler reads the trained weights directly."""


def train_rl(
    steps: int,
    state: S,
    source: BatchSource[B],
    learner: StepLearner[B, S],
    on_step: Callable[[StepRecord, S], None],
    after_update: Callable[[torch.nn.Module], None] = no_publish,
) -> RLResult:
    """Steps state.step + 1 .. `steps`: each collects a batch, updates on it, hands the new weights to
    `after_update` and logs through `on_step` (which gets every step's record and the state after it,
    to log, evaluate and checkpoint). Raises NonFiniteStop after train.max_nonfinite_steps steps in a row
    with a skipped update, once `on_step` has seen the last of them.

    Under data-parallel learner ranks every rank runs this same loop, on the same batches."""
    for step in range(state.step + 1, steps + 1):
        state.step = step
        # 1-2. sample and reward (curated), or pairs
        try:
            batch = source.collect(state.version)
        except PoolExhausted as err:    # no-positive-resampling left fewer prompts than a batch: training ends here
            state.step = step - 1
            return RLResult(steps=state.step, policy_version=state.version, optimizer=state.optimizer, stopped=str(err))
        # 3-5. pi_old, reference, advantages, update
        metrics = learner.step(state, batch)
        # 6. new weights to the sampler
        after_update(learner.model)
        state.pending = source.pending()
        # 7. log
        on_step(
            StepRecord(step=step, metrics={**metrics, **source.step_metrics(batch)}, samples=learner.samples), state
        )
        learner.check_finite(state)
    return RLResult(steps=steps, policy_version=state.version, optimizer=state.optimizer)


class Timed:
    """A source's timings measured by the loop's own clock: `generation_seconds` (collect) and
    `step_seconds` (collect to log), and `tokens_per_s` (completion tokens of the step)."""

    def __init__(self) -> None:
        self.t0 = self.t_gen = 0.0

    def start(self) -> None:
        self.t0 = time.perf_counter()

    def collected(self) -> None:
        self.t_gen = time.perf_counter() - self.t0

    def timings(self, tokens: float | None) -> dict[str, float]:
        seconds = time.perf_counter() - self.t0
        out = {"generation_seconds": self.t_gen, "step_seconds": seconds}
        if tokens is not None:
            out["tokens_per_s"] = tokens / seconds
        return out
