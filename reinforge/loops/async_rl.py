"""Asynchronous RL (`train.mode=async`): the batch source of the one loop (loops/loop.py) when
rollout workers keep generating while the learner trains, with bounded staleness (AReaL, arXiv
2505.24298; ALGORITHMS.md, "Asynchronous training").

Synchronous RL waits for the slowest completion of every batch, and the
sampler waits for the learner. Here requests for prompt groups go to rollout
workers (`rollout.stream`) as the staleness gate allows, finished groups come
back in any order, and each learner step takes the next B groups in request
order. Everything after that is the synchronous loop's own code: the same
loop, the same curation (`BatchCollector` over a different `GroupSource`),
the same `Learner` step; the loop's `after_update` hook publishes the new
weights to the workers (`StreamBatches.publish`).

Staleness. The version v is the number of learner steps taken; the workers
hold the weights of some version, and every token records the version that
sampled it. A request may be made only while floor(N / B) <= eta + v, N the
groups requested and not dropped (AReaL's accepted + running), v the version
the request will start with (workers start new requests with the latest
published weights). Since groups are taken in request order, a group's
place among the taken ones is at most its N, so it is trained by version at
most floor(N / B) <= eta + v: staleness (training version minus the oldest
version among its tokens) never exceeds eta. The taking step checks it
anyway and drops (and regenerates) a group that would exceed it
(`async/too_stale`, which stays 0). With eta = 0 nothing is requested before
the previous update, and the loop computes exactly what the synchronous loop
computes (tests/e2e/test_async.py).

The objective that corrects for stale samples is decoupled PPO
(recipe areal): its proximal policy is the learner's own log-probs before
the update, the behaviour policy the sampler's log-probs (objectives/policy.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from reinforge.curation.batches import (
    BatchCollector,
    CuratedBatch,
    PoolExhausted,
    PromptStream,
    pool_exhausted,
)
from reinforge.rollout import Rollout
from reinforge.rollout.base import concat_rollouts
from reinforge.rollout.sampling import draw_group_keys
from reinforge.rollout.stream import (
    FinishedGroup,
    GroupRequest,
    RolloutWorkers,
    WorkerTimes,
)
from reinforge.tasks import Example


@dataclass
class StalenessGate:
    """AReaL's admission rule: a new group may start only while floor(N / B) <= eta + v."""

    batch_size: int          # B: groups per learner step
    max_staleness: int       # eta
    first_version: int = 0   # the version the count starts from (a resumed run's step)
    counted: int = 0         # N: groups requested since then, less those dropped and replaced

    def may_start(self, version: int) -> bool:
        return self.counted // self.batch_size <= self.max_staleness + version - self.first_version

    def start(self) -> None:
        self.counted += 1

    def release(self, n: int) -> None:
        """`n` groups left without changing the policy (dropped, or consumed by a step with no update)."""
        self.counted -= n


class StreamSource:
    """The asynchronous `GroupSource`: the next groups in request order, from the workers.

    It makes requests as the gate allows (`top_up`), takes finished groups in
    request order (`draw`), and measures each sample's staleness.
    """

    def __init__(self, pool: PromptStream, workers: RolloutWorkers, gate: StalenessGate, version: int,
                 pending: list[int] | None = None, generator: torch.Generator | None = None):
        self.pool, self.workers, self.gate, self.version = pool, workers, gate, version
        self.generator = generator                        # each request's sampling key, in request order
        self.next_seq = 0                                 # the next request's number
        self.next_take = 0                                # the request the learner takes next
        self.examples: dict[int, Example] = {}            # requested and not yet taken
        self.done: dict[int, FinishedGroup] = {}          # finished and not yet taken
        self.replay = [pool.examples[i] for i in pending or []]   # a resumed run's requests, made again first
        self.taken: list[FinishedGroup] = []              # since the last `step_metrics`
        self.too_stale = self.duplicates = self.consumed = 0
        self.idle = 0.0
        self.exhausted = False                            # every prompt has left the pool

    def top_up(self) -> None:
        """Request every group the gate allows now."""
        requests = []
        while self.gate.may_start(self.version) and not self.exhausted:
            # the learner raises it when it needs a group never requested
            if not self.replay and self.pool.size < self.gate.batch_size:
                self.exhausted = True
                break
            example = self.replay.pop(0) if self.replay else self.pool.next(1)[0]
            self.examples[self.next_seq] = example
            # The key is drawn here, in request order, as the synchronous loop draws one per prompt.
            requests.append(GroupRequest(self.next_seq, example.prompt, int(draw_group_keys(1, self.generator))))
            self.next_seq += 1
            self.gate.start()
        if requests:
            self.workers.submit(requests)

    def draw(self, n: int, policy_version: int) -> tuple[list[Example], Rollout]:
        taken: list[tuple[Example, FinishedGroup]] = []
        while len(taken) < n:
            self.top_up()
            if self.exhausted and self.next_take >= self.next_seq:
                raise PoolExhausted(pool_exhausted(self.pool, self.gate.batch_size))
            while self.next_take not in self.done:
                t0 = time.perf_counter()
                group = self.workers.get(timeout=1.0)
                self.idle += time.perf_counter() - t0
                if group is None:
                    continue
                if group.seq < self.next_take or group.seq in self.done:   # a re-queued request that came back twice
                    self.duplicates += 1
                    continue
                self.done[group.seq] = group
            group, example = self.done.pop(self.next_take), self.examples.pop(self.next_take)
            self.next_take += 1
            self.consumed += 1
            # never expected: see the module docstring
            if self.version - group.oldest_version > self.gate.max_staleness:
                self.too_stale += 1
                self.gate.release(1)
                continue
            taken.append((example, group))
        self.taken.extend(group for _, group in taken)
        rollout = concat_rollouts([group.rollout for _, group in taken])
        # The sampler's log-probs are pi_old's only for tokens of the weights the learner holds now
        rollout.logprobs_exact = rollout.logprobs_exact and rollout.policy_version == self.version
        return [example for example, _ in taken], rollout

    def publish(self, model: torch.nn.Module) -> float:
        """The learner took a step: new weights to the workers, and the requests they allow. Seconds spent."""
        t0 = time.perf_counter()
        self.version += 1
        self.workers.publish(model, self.version)
        self.top_up()
        return time.perf_counter() - t0

    def release(self, n: int) -> None:
        """Curation drops `n` taken groups and draws others: they leave the gate's count, so the others
        can be requested (the staleness bound still holds: see the module docstring)."""
        self.gate.release(n)

    def release_consumed(self) -> None:
        """The groups taken since the last call trained no policy (critic pre-training): they do not
        count towards staleness."""
        self.gate.release(self.consumed)
        self.consumed = 0

    def pending(self) -> list[int]:
        """Pool indices of the prompts requested and not yet trained on, in request order: what a resumed
        run requests again first."""
        index = {id(e): i for i, e in enumerate(self.pool.examples)}
        return [index[id(self.examples[s])] for s in sorted(self.examples)] + [index[id(e)] for e in self.replay]

    def step_metrics(self) -> dict[str, float]:
        """The staleness of the samples taken since the last call: per-sample histogram, mean, max."""
        if not self.taken:
            return {}
        stale = torch.cat([staleness(self.version, group) for group in self.taken])
        self.taken = []
        metrics = {"async/staleness_mean": float(stale.float().mean()), "async/staleness_max": float(stale.max())}
        for k in range(self.gate.max_staleness + 1):
            metrics[f"async/staleness_{k}"] = float((stale == k).float().mean())
        metrics.update(
            {
                "async/too_stale_total": float(self.too_stale),
                "async/duplicates_total": float(self.duplicates),
                "async/requested_untrained": float(len(self.examples)),
            }
        )
        return metrics


def staleness(version: int, group: FinishedGroup) -> torch.Tensor:
    """[G] per sample: the training version minus the oldest version that sampled one of its tokens."""
    return version - group.oldest_versions()


class StreamBatches:
    """The asynchronous batch source of the loop: curated batches (`BatchCollector`) over a
    `StreamSource`, and, as the loop's `after_update` hook, `publish`: the new weights to the workers.

    Its step figures: the staleness of the samples trained on, the learner's idle (waiting for the
    workers) and busy time, the workers' busy and idle time, and the weight sync's. A step's time
    runs from the previous step's end (after publishing) to this one's.
    """

    def __init__(self, collector: BatchCollector, source: StreamSource, workers: RolloutWorkers):
        self.collector, self.source, self.workers = collector, source, workers
        self.times = workers.times()
        self.t_end = time.perf_counter()
        self.idle0 = source.idle
        self.sample_figures: dict[str, float] = {}
        self.sync_seconds = 0.0

    def collect(self, version: int) -> CuratedBatch:
        self.idle0 = self.source.idle
        self.source.top_up()
        return self.collector.collect(version)

    def publish(self, model: torch.nn.Module) -> None:
        """The learner took a step: the staleness of what it trained on (at the version that trained it), then the
        new weights to the workers, and the requests they allow."""
        self.sample_figures = self.source.step_metrics()
        self.sync_seconds = self.source.publish(model)

    def pending(self) -> list[int]:
        return self.source.pending()

    def step_metrics(self, batch: CuratedBatch) -> dict[str, float]:
        t0, self.t_end = self.t_end, time.perf_counter()
        now, seconds = self.workers.times(), self.t_end - t0
        learner_idle = self.source.idle - self.idle0
        rows = batch.rollout.num_rows if batch.rollout is not None else 0
        metrics = {
            **self.sample_figures,
            "samples_per_s": rows / seconds,
            "async/learner_idle_s": learner_idle,
            "async/learner_busy_s": seconds - learner_idle,
            "async/generation_busy_s": now.busy - self.times.busy,
            "async/generation_idle_s": now.idle - self.times.idle,
            "async/weight_sync_s": self.sync_seconds + now.weight_sync,
            "generation_seconds": learner_idle,
            "step_seconds": seconds,
        }
        self.times, self.sample_figures = now, {}
        return metrics


__all__ = ["StalenessGate", "StreamBatches", "StreamSource", "WorkerTimes"]
