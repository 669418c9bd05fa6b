"""Rollout workers of the asynchronous loop: prompts go in, finished groups come out, while the
learner trains (AReaL, arXiv 2505.24298).

The driver (loops/async_rl.py) decides *what* to generate and when (the
staleness gate); workers only generate. Two kinds implement `RolloutWorkers`:
`LocalSampler` below (a thread of this process, the default) and
`distributed.ray_workers.RayRolloutWorkers` (Ray actors). Both take new
weights between decoding steps, either interrupting in-flight samples and
continuing them with the new weights (AReaL's interruptible rollout) or
letting them finish first (`train.in_flight`).
"""

from __future__ import annotations

import copy
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch

from reinforge.models import Policy
from reinforge.models.decoder import DecoderWeights
from reinforge.rollout.base import Rollout, SamplingParams
from reinforge.rollout.native import NativeEngine
from reinforge.rollout.probe import UNPUBLISHED, SamplerProbe, engine_logprobs
from reinforge.rollout.prompts import encode_prompts
from reinforge.rollout.rows import FinishedRow, rows_to_rollout

InFlight = Literal["interrupt", "finish"]


@dataclass(frozen=True)
class GroupRequest:
    """Sample `group_size` completions of one prompt; `seq` numbers requests in the order they were made.
    `key` keys the group's sampling streams (`rollout.sampling.keyed_uniforms`): whichever worker or
    thread decodes it, and when, the same weights give the same samples."""

    seq: int
    prompt: str
    key: int


@dataclass
class FinishedGroup:
    """The G samples of one request."""

    seq: int
    rollout: Rollout                 # G rows, group id 0
    versions: torch.Tensor           # [G, T] long: the weight version that sampled each token (0 on padding)

    def oldest_versions(self) -> torch.Tensor:
        """[G] per sample, the version of the oldest weights that sampled one of its tokens: what its
        staleness counts from (the group's policy_version for a sample without tokens). The model's
        tokens only: an environment token was sampled by no policy."""
        mask = self.rollout.trained_mask.bool()
        oldest = self.versions.masked_fill(~mask, torch.iinfo(torch.long).max).min(dim=1).values
        return torch.where(mask.any(dim=1), oldest, torch.full_like(oldest, self.rollout.policy_version))

    @property
    def oldest_version(self) -> int:
        """The oldest version among all its samples' tokens."""
        return int(self.oldest_versions().min())


@dataclass
class WorkerTimes:
    """Seconds the workers spent generating and waiting for work, and applying new weights, so far."""

    busy: float = 0.0
    idle: float = 0.0
    weight_sync: float = 0.0         # applying the last published weights (the worker's side)


class RolloutWorkers(Protocol):
    def submit(self, requests: list[GroupRequest]) -> None:
        """Queue requests; they start with the latest published weights (or newer)."""
        ...

    def get(self, timeout: float) -> FinishedGroup | None:
        """A finished group, or None when none finished within `timeout` seconds."""
        ...

    def publish(self, model: torch.nn.Module, version: int) -> None:
        """New weights, labelled `version`, for every sample started from now on."""
        ...

    def times(self) -> WorkerTimes: ...

    def probe(self, version: int, ids: torch.Tensor, timeout: float) -> list[SamplerProbe]:
        """Each worker's next-token log-probs at the probe `ids` [1, S] once it holds `version` (waiting up to `timeout`
        seconds; past it, with the version it holds): rollout/weight_sync.py."""
        ...

    def close(self) -> None: ...


@dataclass
class _Inbox:
    """What the driver hands the sampler thread, guarded by one condition."""

    requests: list[GroupRequest] = field(default_factory=list)
    weights: Any = None          # the published weights not yet applied, in the sampler's own form
    version: int = 0
    closed: bool = False


@dataclass(frozen=True)
class WorkerSettings:
    """How a rollout worker samples: what the edge (reinforge/jobs/rl.py) reads from the config."""

    sampling: SamplingParams
    group_size: int
    slots: int                  # rows decoded at once: rollout.max_batch_rows, else one batch's rows
    in_flight: InFlight = "interrupt"
    chat_template: str = "auto"
    cpu_kernels: bool = True

    def sampler(self, policy: Policy) -> LocalSampler:
        """A sampler thread of this process decoding `policy`'s own copy."""
        return LocalSampler(policy, self.sampling, self.group_size, slots=self.slots, in_flight=self.in_flight,
                            chat_template=self.chat_template, cpu_kernels=self.cpu_kernels)


class SamplerThread:
    """The driver's side of a rollout worker that is a thread of this process: requests go into an inbox,
    finished groups come out of an outbox, both under one condition; an error in the thread is raised to
    the driver by `get` (and by the subclass's `probe`). Subclasses start `self.thread` on their `_run`."""

    FAILED = "the rollout sampler thread failed"

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.inbox = _Inbox()
        self.outbox: deque[FinishedGroup] = deque()
        self.error: BaseException | None = None

    def submit(self, requests: list[GroupRequest]) -> None:
        with self.cond:
            self.inbox.requests.extend(requests)
            self.cond.notify_all()

    def get(self, timeout: float) -> FinishedGroup | None:
        deadline = time.monotonic() + timeout
        with self.cond:
            while not self.outbox and self.error is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self.cond.wait(left)
            self._raise()
            return self.outbox.popleft()

    def close(self) -> None:
        with self.cond:
            self.inbox.closed = True
            self.cond.notify_all()
        self.thread.join()

    def _raise(self) -> None:
        if self.error is not None:
            raise RuntimeError(self.FAILED) from self.error


class LocalSampler(SamplerThread):
    """The in-process rollout worker: a thread decoding one `DecodeSession` over its own copy of
    the policy (the learner changes its weights in place while the sampler decodes).

    Torch releases the GIL inside its kernels, so decoding and the learner's
    forward/backward overlap on separate cores. Each request brings its group's
    sampling key, so the draws do not depend on thread timing.
    """

    def __init__(self, policy: Policy, params: SamplingParams, group_size: int, slots: int,
                 in_flight: InFlight = "interrupt", chat_template: str = "auto", cpu_kernels: bool = True):
        super().__init__()
        self.model = copy.deepcopy(policy.model).eval()
        self.tokenizer, self.group_size, self.in_flight, self.chat_template = (
            policy.tokenizer,
            group_size,
            in_flight,
            chat_template,
        )
        engine = NativeEngine(
            Policy(self.model, policy.tokenizer), chat_template=chat_template, cpu_kernels=cpu_kernels
        )
        self.params, self.slots, self.version = params, slots, 0
        self.session = engine.session(params, slots=slots, version=0)
        self.fused = engine.kernels is not None     # the probe runs the kernels the decoder runs
        self.exact = engine.exact_logprobs(params)   # Rollout.logprobs_exact of its groups
        self._decoder(engine)
        self.partial: dict[int, dict[int, FinishedRow]] = {}
        self.prompts: dict[int, list[int]] = {}
        self._times = WorkerTimes()
        self._sync_seconds = 0.0
        # The version the decoder holds and the tensors it decodes with: what `probe` scores (UNPUBLISHED until
        # the first publication is applied; its samples are still labelled version 0).
        self.applied: tuple[int, DecoderWeights] = (UNPUBLISHED, self.session.weights)
        self.thread = threading.Thread(target=self._run, name="reinforge-sampler", daemon=True)
        self.thread.start()

    # ---- the driver's side (submit, get, close: SamplerThread)
    def publish(self, model: torch.nn.Module, version: int) -> None:
        # A snapshot: the learner's next update must not change weights under a running decode step.
        snapshot = {k: v.detach().clone() for k, v in model.state_dict().items()}
        with self.cond:
            self.inbox.weights, self.inbox.version = snapshot, version
            self.cond.notify_all()

    def times(self) -> WorkerTimes:
        with self.cond:
            return copy.copy(self._times)

    def probe(self, version: int, ids: torch.Tensor, timeout: float,
              name: str = "sampler thread") -> list[SamplerProbe]:
        """The probe scored with the tensors the sampler thread decodes with, once it applied `version` (or
        after `timeout` seconds, with what it holds then). Read-only: it runs in the caller's thread."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while self.applied[0] < version and self.error is None and (left := deadline - time.monotonic()) > 0:
                self.cond.wait(left)
            self._raise()
            held, weights = self.applied
        return [SamplerProbe(name, engine_logprobs(weights, self.model, ids, fused=self.fused), held)]

    # ---- the sampler thread
    def _run(self) -> None:
        try:
            while True:
                t0 = time.perf_counter()
                with self.cond:
                    while not self._has_work():
                        if self.inbox.closed:
                            return
                        self.cond.wait()
                    weights, version = self.inbox.weights, self.inbox.version
                    # New weights apply between steps: at once (interrupt), or once the samples in
                    # flight have finished (finish), new requests waiting until then.
                    apply = weights is not None and (self.in_flight == "interrupt" or not self._busy())
                    if apply:
                        self.inbox.weights = None
                    requests: list[GroupRequest] = []
                    if weights is None or apply:      # taken, and the inbox emptied, under the lock
                        requests, self.inbox.requests = self.inbox.requests, []
                    self._times.idle += time.perf_counter() - t0
                t1 = time.perf_counter()
                if apply:
                    self._load(weights, version)
                finished = self._work(requests)
                with self.cond:
                    self._times.busy += time.perf_counter() - t1
                    if apply:
                        self._times.weight_sync = self._sync_seconds
                    self.outbox.extend(finished)
                    if finished:
                        self.cond.notify_all()
        except BaseException as err:   # surfaced to the driver by get()
            with self.cond:
                self.error = err
                self.cond.notify_all()

    def _has_work(self) -> bool:
        inbox = self.inbox
        return self._busy() or bool(inbox.requests) or inbox.weights is not None

    # ---- what a kind of sampler changes: how requests are decoded
    def _decoder(self, engine: NativeEngine) -> None:
        """Set up decoding over `engine` (here: the session, made above)."""

    def _busy(self) -> bool:
        """Samples in flight between two `_work` calls."""
        return self.session.busy

    def _work(self, requests: list[GroupRequest]) -> list[FinishedGroup]:
        """Take `requests` in and decode a step: the groups that finished."""
        if requests:
            self._add(requests)
        return self._finish(self.session.step()) if self.session.busy else []

    @torch.no_grad()
    def _load(self, weights: dict[str, torch.Tensor], version: int) -> None:
        t0 = time.perf_counter()
        self.model.load_state_dict(weights)
        self.version = version
        if self.session.busy:
            self.session.reload(version)      # AReaL: recompute the in-flight keys/values with the new weights
        else:
            self.session.version = version
            self.session.weights = DecoderWeights.of(self.model)
        self._sync_seconds = time.perf_counter() - t0
        with self.cond:
            self.applied = (version, self.session.weights)
            self.cond.notify_all()

    def _add(self, requests: list[GroupRequest]) -> None:
        ids = encode_prompts(self.tokenizer, [r.prompt for r in requests], self.chat_template)
        g = self.group_size
        for r, prompt in zip(requests, ids, strict=True):
            self.partial[r.seq], self.prompts[r.seq] = {}, prompt
        self.session.add(ids, g, tags=[(r.seq, j) for r in requests for j in range(g)],
                         group_keys=torch.tensor([r.key for r in requests], dtype=torch.long))

    def _finish(self, rows: list[FinishedRow]) -> list[FinishedGroup]:
        """Groups whose last sample just ended."""
        out = []
        for row in rows:
            seq, j = row.tag
            self.partial[seq][j] = row
            if len(self.partial[seq]) == self.group_size:
                samples = self.partial.pop(seq)
                out.append(finished_group(seq, [samples[k] for k in range(self.group_size)], self.prompts.pop(seq),
                                          self.tokenizer, self.exact))
        return out


def finished_group(seq: int, rows: list[FinishedRow], prompt_ids: list[int], tokenizer,
                   exact: bool = False) -> FinishedGroup:
    """One request's rows (in sample order) as a FinishedGroup; `exact`: its log-probs are the learner's to
    rounding at its policy version, the oldest of its tokens' (`Rollout.logprobs_exact`)."""
    rollout = rows_to_rollout(rows, [prompt_ids] * len(rows), len(rows), tokenizer,
                              policy_version=min(int(r.versions.min()) for r in rows), exact=exact)
    versions = torch.zeros_like(rollout.completion_ids)
    for i, row in enumerate(rows):
        versions[i, : len(row.versions)] = row.versions
    return FinishedGroup(seq, rollout, versions)
