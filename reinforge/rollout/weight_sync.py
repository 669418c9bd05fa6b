"""Weight-sync verification: after weight publications, the sampler must compute what the learner computes.

A sampler that silently keeps old weights trains nothing wrong-looking: rewards are noisy, losses are
finite, and the run goes on against the initial policy (a LoRA adapter that never reached the
inference engine did exactly this for two months in one verl user's run). This module owns the
check that catches it: a fixed probe sequence (`probe_ids`, a few token ids) is scored by

- the learner: the trained module's own forward (Hugging Face / peft / FSDP2 forward, `learner_logprobs`),
- the sampler: the tensors the rollout engine actually decodes with (`engine_logprobs` runs the
  native engine's decoder over a `DecoderWeights`, the object its sessions read; the HF engine's
  model forward). That side and its record `SamplerProbe` are reinforge/rollout/probe.py's, below
  this module, since the asynchronous samplers answer probes themselves,

and the largest total-variation distance between their fp32 next-token distributions, over the
probe's positions, is the step's `sync/probe_tv`:

    TV_t = 1/2 sum_v |p_learner(v | ids[:t+1]) - p_sampler(v | ids[:t+1])|,   sync/probe_tv = max_t TV_t.

Why distributions and not the probe tokens' log-probs: the probe's ids are fixed, so as training makes
the model confident they become very unlikely tokens, whose log-probs carry an fp32 rounding error that
grows with the logits' size (a fused decoder and the Hugging Face forward differed by 1.1e-4 on one of
them after 100 steps of the built-in task, with nothing out of sync). TV weighs every token by its
probability: rounding moves it by ~1e-6 in fp32, while a sampler on other weights moves it as much
as its samples change.
Where the sampler is another thread or process (train.mode=async: `LocalSampler`, Ray actors), each
worker also reports the weight version it holds, which must be the one just published. A difference
above `train.weight_sync.tolerance`, or a stale version, raises `WeightSyncError` (an alert, then the
run stops: pipeline.py). Probe distributions are used everywhere: every engine here can score a
sequence, so no parameter checksum (which says nothing about adapters or the fused layout the engine
really reads) is needed.

Sensitivity: a publication that is skipped once changes the probe by one update's worth, which may be
under the tolerance with a small learning rate; the version report catches a skipped apply at once,
and a sampler that keeps old weights drifts past the tolerance within a few steps.

When: after every publication where weights are handed over (vLLM, the async sampler, Ray workers, learner
ranks' plain copies). Where the engine reads the very tensors the optimizer steps (the native and HF
engines in one process) there is no handover that could fail at one step and not at another: the probe
checks that the engine's computation equals the learner's, so it runs after the first update and every
10th (`train.weight_sync.every` sets any period).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from reinforge.errors import RunStopped
from reinforge.models.decoder import DecoderWeights
from reinforge.models.lora import base_model
from reinforge.records import Alert
from reinforge.rollout.probe import SamplerProbe, engine_logprobs, next_token_logprobs

PROBE_LENGTH = 8
# train.weight_sync.every's default where the engine reads the trained tensors themselves (one process, no copy):
# the probe then checks the engine's computation, not a handover, and it cost ~7% of a tiny model's step.
READS_TRAINED_EVERY = 10


def probe_ids(vocab_size: int) -> torch.Tensor:
    """[1, PROBE_LENGTH] long: fixed token ids spread over the vocabulary (the same for every run of a vocabulary)."""
    return (torch.arange(PROBE_LENGTH, dtype=torch.long) * 7919 + 3)[None] % vocab_size


def total_variation(a: torch.Tensor, b: torch.Tensor) -> float:
    """max_t 1/2 sum_v |exp(a_tv) - exp(b_tv)| of two [S - 1, V] log-prob tables (NaN stays NaN)."""
    if a.shape != b.shape:
        return math.inf          # another vocabulary or probe: not the learner's model
    return float((0.5 * (a.exp() - b.exp()).abs().sum(dim=-1)).max())


@torch.no_grad()
def learner_logprobs(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """[S - 1, V] the probe's next-token log-probs under `model`'s own forward (eval mode: no dropout), on the CPU.
    Under FSDP2 `model` is the sharded one and every rank must call it."""
    was = model.training
    model.eval()
    try:
        device = next(model.parameters()).device
        return next_token_logprobs(model(input_ids=ids.to(device)).logits)
    finally:
        model.train(was)


def sampler_probe(engine, ids: torch.Tensor) -> SamplerProbe:
    """The probe scored by a synchronous rollout engine, through the weights it samples with: the native
    engine's `DecoderWeights` of its model (what its next session reads), the HF engine's model forward.
    Wrappers (learner ranks' `SplitAcrossRanks`, agent rollouts) are unwrapped to the engine they drive."""
    from reinforge.rollout.hf import HFEngine
    from reinforge.rollout.native import NativeEngine

    while not isinstance(engine, NativeEngine | HFEngine) and hasattr(engine, "engine"):
        engine = engine.engine
    if hasattr(engine, "probe_logprobs"):       # vLLM: its own copy of the weights, scored by vLLM itself
        return SamplerProbe("vllm engine", engine.probe_logprobs(ids))
    if isinstance(engine, NativeEngine):
        model = engine.policy.model
        # The weights before rollout.quantization rounds them: int8 sampling is a gap by design, measured
        # every step by the mismatch metrics and corrected by TIS/MIS, not a failed publication.
        return SamplerProbe("native engine", engine_logprobs(DecoderWeights.of(model), model, ids,
                                                             fused=engine.kernels is not None))
    if isinstance(engine, HFEngine):
        return SamplerProbe("hf engine", learner_logprobs(engine.policy.model, ids))
    raise NotImplementedError(
        f"train.weight_sync.verify: no probe for a rollout engine of type {type(engine).__name__}; "
        "set train.weight_sync.verify=false"
    )


class WeightSyncError(RunStopped):
    """The sampler's weights are not the learner's; `alert` is what alerts.jsonl records."""

    def __init__(self, alert: Alert):
        super().__init__(alert.message)
        self.alert = alert


def compare(step: int, version: int, learner: torch.Tensor, probes: Sequence[SamplerProbe],
            tolerance: float) -> tuple[float, Alert | None]:
    """The largest total variation between the learner's and a sampler's next-token distributions over every
    probe, and the alert when a sampler holds another version than `version` or differs by more than
    `tolerance` (None: all in sync)."""
    diffs = [total_variation(p.logprobs, learner) for p in probes]
    worst = max(diffs, default=0.0)
    stale = [p for p in probes if p.version is not None and p.version != version]
    off = [(p, d) for p, d in zip(probes, diffs, strict=True) if not d <= tolerance]   # NaN is off
    if not stale and not off:
        return worst, None
    parts = [f"{p.name} holds weight version {p.version}, not the published {version}" for p in stale]
    parts += [f"{p.name}'s next-token distributions on the probe differ from the learner's by total variation "
              f"{d:.3g} (> {tolerance:g})"
              for p, d in off if p not in stale]
    message = (f"step {step}: weight sync failed: {'; '.join(parts)} (the sampler is not sampling from the "
               "weights being trained; the run stops. Check how weights reach the engine: the publication, "
               "LoRA adapters, learner ranks' plain copy)")
    return worst, Alert(step, "weight_sync", message,
                        {"probe_tv": worst if math.isfinite(worst) else math.nan, "tolerance": tolerance,
                         "version": float(version)})


class WeightSyncCheck:
    """The `after_update` hook of the loop, verified: publish, then probe learner and sampler(s).

    `learner` is the module the optimizer steps (under learner ranks the sharded one); `samplers(version)`
    returns the probes of everything that samples after the publication. `reduce_max` makes the largest
    difference and the stale flag the same on every learner rank (so they all stop together); None in one
    process. `every`: the hook verifies the first step's publication and every `every`-th step's (`due`).
    `metrics()` gives the latest check's figures, merged into the step's metrics (none for a step that was
    not probed).
    """

    def __init__(self, learner: torch.nn.Module, ids: torch.Tensor, tolerance: float,
                 samplers: Callable[[int], list[SamplerProbe]],
                 reduce_max: Callable[[float], float] | None = None, every: int = 1):
        self.learner, self.ids, self.tolerance, self.samplers, self.reduce_max = (
            learner, ids, tolerance, samplers, reduce_max)
        self.every = every
        self.last: dict[str, float] = {}

    def verify(self, step: int, version: int) -> None:
        learner = learner_logprobs(self.learner, self.ids)
        worst, alert = compare(step, version, learner, self.samplers(version), self.tolerance)
        if self.reduce_max is not None:
            failed = self.reduce_max(1.0 if alert is not None else 0.0)
            worst = self.reduce_max(worst)
            if alert is None and failed:
                alert = Alert(step, "weight_sync", f"step {step}: weight sync failed on another learner rank "
                              f"(largest probe total variation {worst:.3g}); the run stops", {"probe_tv": worst})
        self.last = {"sync/probe_tv": worst}
        if alert is not None:
            raise WeightSyncError(alert)

    def metrics(self) -> dict[str, float]:
        out, self.last = self.last, {}
        return out

    def after(self, publish: Callable[[torch.nn.Module], None], step: Callable[[], int],
              version: Callable[[], int]) -> Callable[[torch.nn.Module], None]:
        """The loop's `after_update`: `publish`, then the check of step `step()`, published version `version()`."""
        def hook(model: torch.nn.Module) -> None:
            publish(model)
            if self.due(step()):
                self.verify(step(), version())
        return hook

    def due(self, step: int) -> bool:
        """Whether the update of (1-based) `step` is probed: the first and every `every`-th, by the run's step
        count, so that a resumed run probes (and logs) the steps the uninterrupted one does."""
        return step <= 1 or step % self.every == 0

    def on_step(self, on_step: Callable) -> Callable:
        """The loop's `on_step`, with this check's figures merged into each step's metrics."""
        def hook(record, state) -> None:
            record.metrics.update(self.metrics())
            on_step(record, state)
        return hook


def default_tolerance(model: torch.nn.Module) -> float:
    """Total variation 1e-3 for fp32 weights (rounding gives ~1e-6: the built-in task's runs stay under
    1e-5, at most 2.3e-5); 5e-2 for 16-bit ones, and for fp32 on a GPU whose fp32 matmuls may run in TF32
    (torch.get_float32_matmul_precision() other than "highest"), where engine and learner round differently."""
    parameter = next(model.parameters())
    reduced = parameter.device.type == "cuda" and torch.get_float32_matmul_precision() != "highest"
    return 1e-3 if parameter.dtype == torch.float32 and not reduced else 5e-2


def build_check(cfg, dp, samplers: Callable[[int], list[SamplerProbe]],
                reads_trained: bool = False) -> WeightSyncCheck | None:
    """The check of `cfg` (train.weight_sync) for a learner `dp` (distributed.DataParallel), or None when off.
    Under learner ranks each rank's plain copy (what the engine and the publication read) is probed too, and
    the verdict is the same on every rank. `reads_trained`: the samplers read the very tensors the optimizer
    steps (no handover), which sets train.weight_sync.every's default to READS_TRAINED_EVERY in one process."""
    if not cfg.verify:
        return None
    every = cfg.every or (READS_TRAINED_EVERY if reads_trained and dp.sharded is None else 1)
    plain = dp.plain
    ids = probe_ids(base_model(plain).config.vocab_size)
    tolerance = cfg.tolerance if cfg.tolerance is not None else default_tolerance(plain)
    reduce_max, rank = None, 0
    if dp.sharded is not None:
        import torch.distributed as dist

        rank = dp.group.rank

        def reduce_max(value: float) -> float:
            t = torch.tensor([value], dtype=torch.float64, device=dp.group.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            return float(t)

    def with_copy(version: int) -> list[SamplerProbe]:
        if dp.sharded is None:
            return samplers(version)
        copy = SamplerProbe(f"rank {rank} plain copy", engine_logprobs(DecoderWeights.of(plain), plain, ids))
        return [copy, *samplers(version)]

    return WeightSyncCheck(dp.model, ids, tolerance, with_copy, reduce_max, every)


def wire(check: WeightSyncCheck | None, publish: Callable, on_step: Callable, step: Callable[[], int],
         version: Callable[[], int]) -> tuple[Callable, Callable]:
    """(after_update, on_step) for the loop: verified and reporting when `check` is on, else as given."""
    if check is None:
        return publish, on_step
    return check.after(publish, step, version), check.on_step(on_step)
