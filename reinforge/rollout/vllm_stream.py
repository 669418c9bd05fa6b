"""The asynchronous loop's rollout worker over vLLM (train.mode=async with rollout.engine=vllm).

A thread of this process generates the requested groups with the run's vLLM engine
(rollout/vllm_engine.py) while the learner trains, as the native engine's sampler thread does
(rollout/stream.py). What differs:

- Weights. The learner publishes a snapshot of its tensors (cloned, in vLLM's layout) with each
  version; the thread hands it to vLLM between two `generate` calls. A call runs its requests to their
  end, so new weights apply once the samples in flight have finished (train.in_flight=finish; vLLM
  offers no way to swap weights under a running request here), and every token of a call is labelled
  with the version vLLM held for it.
- Sampling keys. Each request's group key seeds its G rows (one vLLM seed each), so which call
  carries a request does not change its samples.
- One engine. vLLM runs one engine a process: the driver's evaluation uses the same one, taking
  turns with the thread through the engine's lock. Evaluation publishes the learner's current
  weights first when they changed; the thread's next call then samples with weights at least as new
  as its label, so staleness is counted at most too high, never too low, and the sampler's log-probs
  (what the importance weights use) are those of the weights that drew.
"""

from __future__ import annotations

import threading
import time

import torch

from reinforge.rollout.base import SamplingParams, select_rows
from reinforge.rollout.probe import UNPUBLISHED, SamplerProbe
from reinforge.rollout.prompts import encode_prompts
from reinforge.rollout.stream import FinishedGroup, GroupRequest, SamplerThread, WorkerTimes
from reinforge.rollout.vllm_engine import VLLMEngine


def group_seeds(key: int, group_size: int) -> list[int]:
    """The vLLM seeds of one request's rows, from its group key."""
    return torch.randint(2**62, (group_size,), generator=torch.Generator().manual_seed(key)).tolist()


class VLLMSampler(SamplerThread):
    """`RolloutWorkers` (rollout/stream.py) as one thread driving `engine` (see the module docstring); its
    inbox's weights are `Weights` snapshots."""

    FAILED = "the vLLM sampler thread failed"

    def __init__(self, engine: VLLMEngine, params: SamplingParams, group_size: int, chat_template: str = "auto"):
        super().__init__()
        self.engine, self.params, self.group_size, self.chat_template = engine, params, group_size, chat_template
        self.applied = UNPUBLISHED             # the version vLLM holds (rollout/probe.py)
        self._times = WorkerTimes()
        self.thread = threading.Thread(target=self._run, name="reinforge-vllm-sampler", daemon=True)
        self.thread.start()

    # ---- the driver's side (submit, get, close: SamplerThread)
    def publish(self, model: torch.nn.Module, version: int) -> None:
        weights = self.engine.snapshot(model, copy=True)    # the learner's next update must not reach it
        with self.cond:
            self.inbox.weights, self.inbox.version = weights, version
            self.cond.notify_all()

    def times(self) -> WorkerTimes:
        with self.cond:
            return WorkerTimes(self._times.busy, self._times.idle, self._times.weight_sync)

    def probe(self, version: int, ids: torch.Tensor, timeout: float) -> list[SamplerProbe]:
        """The probe scored by vLLM once it holds `version` (or after `timeout` seconds, with what it holds)."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while self.applied < version and self.error is None and (left := deadline - time.monotonic()) > 0:
                self.cond.wait(left)
            self._raise()
            held = self.applied
        return [SamplerProbe("vllm engine", self.engine.probe_logprobs(ids), held)]

    # ---- the sampler thread
    def _run(self) -> None:
        try:
            while True:
                t0 = time.perf_counter()
                with self.cond:
                    while not (self.inbox.requests or self.inbox.weights is not None):
                        if self.inbox.closed:
                            return
                        self.cond.wait()
                    weights, version, self.inbox.weights = self.inbox.weights, self.inbox.version, None
                    requests, self.inbox.requests = self.inbox.requests, []
                    self._times.idle += time.perf_counter() - t0
                if weights is not None:
                    t1 = time.perf_counter()
                    self.engine.load(weights)
                    with self.cond:
                        self.applied = version
                        self._times.weight_sync = time.perf_counter() - t1
                        self.cond.notify_all()
                t2 = time.perf_counter()
                finished = self._generate(requests) if requests else []
                with self.cond:
                    self._times.busy += time.perf_counter() - t2
                    self.outbox.extend(finished)
                    self.cond.notify_all()
        except BaseException as err:   # surfaced to the driver by get() and probe()
            with self.cond:
                self.error = err
                self.cond.notify_all()

    def _generate(self, requests: list[GroupRequest]) -> list[FinishedGroup]:
        g, version = self.group_size, max(self.applied, 0)      # built weights sample as version 0
        prompt_ids = encode_prompts(self.engine.policy.tokenizer, [r.prompt for r in requests], self.chat_template)
        seeds = [s for r in requests for s in group_seeds(r.key, g)]
        rollout = self.engine.generate_ids(prompt_ids, g, self.params, version, seeds=seeds, sync=False)
        out = []
        for i, request in enumerate(requests):
            part = select_rows(rollout, torch.arange(i * g, (i + 1) * g))
            versions = torch.where(part.completion_mask.bool(), version, 0).long()
            out.append(FinishedGroup(request.seq, part, versions))
        return out
