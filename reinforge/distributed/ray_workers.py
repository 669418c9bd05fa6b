"""Rollout workers as Ray actors (`backend=ray`): the asynchronous loop's generation spread over
`ray.num_workers` processes, on this machine or on a Ray cluster.

This module owns the actors, their placement, weight publication to them and
their restarts. Each actor runs the in-process worker of `rollout.stream`,
`LocalSampler` (a sampler thread decoding a `DecodeSession`), over a policy it
builds from the run's config; the driver side, `RayRolloutWorkers`, lives in
the learner's process and implements `RolloutWorkers` for asynchronous RL (loops/async_rl.py).

- Placement: one placement-group bundle per worker ({CPU, GPU} as
  `ray.num_cpus_per_worker` / `ray.num_gpus_per_worker`), strategy PACK.
- Weight sync is through the object store on every device today: one
  `ray.put` of a CPU copy of the state dict per published version, the same
  ObjectRef sent to every worker, applied between decoding steps as
  `train.in_flight` says. (On GPUs an NCCL broadcast from the learner would be
  the fast path; not built.)
- Requests go to the least loaded worker. The driver keeps each worker's
  requests in flight (sent, not yet returned) until their group comes back.
- A worker that dies is replaced by a fresh actor on its bundle (at most
  `ray.max_restarts` times per worker), given the latest weights and its
  requests in flight again, same `seq`: no request is lost, and since a
  request is returned only by the worker that holds it, none is returned twice.

The actors import reinforge: on a cluster, every node needs it installed.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections import deque
from dataclasses import dataclass, field

import ray
import torch
from ray.actor import ActorHandle
from ray.exceptions import RayActorError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from reinforge.models import Policy, load_policy
from reinforge.rollout.probe import SamplerProbe
from reinforge.rollout.stream import FinishedGroup, GroupRequest, WorkerSettings, WorkerTimes
from reinforge.settings import ModelConfig, RayConfig

logger = logging.getLogger(__name__)

# How long one `drain` call waits in the actor for a group to finish. Actor calls run in order,
# so a weight publication or a request sent meanwhile waits at most this long behind it.
POLL_WAIT_S = 0.05
# How long the cluster may take to find room for the workers' placement group.
PLACEMENT_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class RayWorkerSettings:
    """What a rollout actor builds its sampler from: the model to load (the driver's weights follow),
    its seed, the Ray resources and how to sample."""

    worker: WorkerSettings
    model: ModelConfig
    seed: int
    ray: RayConfig


@ray.remote
class RolloutActor:
    """One rollout worker: the run's policy, decoded by a `LocalSampler` thread of this actor."""

    def __init__(self, settings: RayWorkerSettings):
        torch.set_num_threads(max(1, int(settings.ray.num_cpus_per_worker)))
        # The worker's device is its Ray resources' (Ray shows an actor only the GPUs it was given),
        # whatever model.device the learner runs on.
        device = "cuda" if settings.ray.num_gpus_per_worker > 0 else "cpu"
        # the driver's weights follow
        policy = load_policy(settings.model.model_copy(update={"device": device}), settings.seed)
        # Each request brings its group's sampling key: a group's samples do not depend on which worker decodes it.
        self.sampler = settings.worker.sampler(policy)
        # The sampler decodes its own copy; this one receives published weights on the CPU, where they arrive.
        self.staging = policy.model.cpu()

    def submit(self, requests: list[GroupRequest]) -> None:
        self.sampler.submit(requests)

    @torch.no_grad()
    def load(self, weights: dict[str, torch.Tensor], version: int) -> None:
        self.staging.load_state_dict(weights)
        self.sampler.publish(self.staging, version)     # snapshots it; applied between decoding steps

    def drain(self, wait_s: float) -> list[FinishedGroup]:
        """The groups finished so far, waiting up to `wait_s` for the first; on the CPU."""
        groups = []
        group = self.sampler.get(wait_s)
        while group is not None:
            groups.append(_on_cpu(group))
            group = self.sampler.get(0.0)
        return groups

    def times(self) -> WorkerTimes:
        return self.sampler.times()

    def probe(self, version: int, ids: torch.Tensor, timeout: float, name: str) -> list[SamplerProbe]:
        """The probe scored by this actor's sampler once it applied `version` (rollout/weight_sync.py)."""
        return self.sampler.probe(version, ids, timeout, name=name)


def _on_cpu(group: FinishedGroup) -> FinishedGroup:
    rollout = group.rollout
    tensors = {f.name: getattr(rollout, f.name).cpu() for f in dataclasses.fields(rollout)
               if isinstance(getattr(rollout, f.name), torch.Tensor)}
    return FinishedGroup(group.seq, dataclasses.replace(rollout, **tensors), group.versions.cpu())


@dataclass
class _Worker:
    """The driver's view of one rollout actor."""

    index: int                                   # its placement-group bundle
    actor: ActorHandle
    inflight: dict[int, GroupRequest] = field(default_factory=dict)   # sent and not yet returned, by seq
    calls: list[ray.ObjectRef] = field(default_factory=list)          # submit/load calls not yet checked
    poll: ray.ObjectRef | None = None            # the outstanding `drain` call
    polled_calls: list[ray.ObjectRef] = field(default_factory=list)   # the calls made before it (done when it is)
    restarts: int = 0
    times: WorkerTimes = field(default_factory=WorkerTimes)           # its last report


class RayRolloutWorkers:
    """`RolloutWorkers` over `ray.num_workers` Ray actors (see the module docstring).

    `restarts` counts the workers replaced so far. `owns_ray`: this object started Ray, and
    `close` shuts it down.
    """

    def __init__(self, settings: RayWorkerSettings, owns_ray: bool = False):
        self.settings, self.owns_ray = settings, owns_ray
        rc = settings.ray
        bundle = {"CPU": rc.num_cpus_per_worker}
        if rc.num_gpus_per_worker > 0:
            bundle["GPU"] = rc.num_gpus_per_worker
        self.group = placement_group([bundle] * rc.num_workers, strategy="PACK")
        ready, _ = ray.wait([self.group.ready()], timeout=PLACEMENT_TIMEOUT_S)
        if not ready:
            remove_placement_group(self.group)
            raise RuntimeError(f"Ray found no room for {rc.num_workers} rollout workers of {bundle} in "
                               f"{PLACEMENT_TIMEOUT_S:.0f} s; the cluster has {ray.cluster_resources()}")
        self.workers = [_Worker(i, self._spawn(i)) for i in range(rc.num_workers)]
        self.ready: deque[FinishedGroup] = deque()     # returned by a worker, not yet by `get`
        self.weights: tuple[ray.ObjectRef, int] | None = None   # the latest publication, for restarts
        self.retired = WorkerTimes()                   # busy/idle seconds of replaced actors
        self.restarts = 0

    def _spawn(self, index: int) -> ActorHandle:
        rc = self.settings.ray
        strategy = PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=index)
        return RolloutActor.options(num_cpus=rc.num_cpus_per_worker, num_gpus=rc.num_gpus_per_worker,
                                    scheduling_strategy=strategy).remote(self.settings)

    def submit(self, requests: list[GroupRequest]) -> None:
        batches: dict[int, list[GroupRequest]] = {}
        for request in requests:
            worker = min(self.workers, key=lambda w: len(w.inflight))
            worker.inflight[request.seq] = request
            batches.setdefault(worker.index, []).append(request)
        for index, batch in batches.items():
            worker = self.workers[index]
            worker.calls.append(worker.actor.submit.remote(batch))

    def publish(self, model: torch.nn.Module, version: int) -> None:
        # ray.put serialises at once: the store holds a snapshot the learner's next update cannot change.
        ref = ray.put({k: v.detach().cpu() for k, v in model.state_dict().items()})
        self.weights = (ref, version)
        for worker in self.workers:
            worker.calls.append(worker.actor.load.remote(ref, version))

    def get(self, timeout: float) -> FinishedGroup | None:
        deadline = time.monotonic() + timeout
        while not self.ready:
            polls = {}
            for worker in self.workers:
                if worker.inflight and worker.poll is None:
                    worker.poll, worker.polled_calls, worker.calls = (
                        worker.actor.drain.remote(POLL_WAIT_S),
                        worker.calls,
                        [],
                    )
                if worker.poll is not None:
                    polls[worker.poll] = worker
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            if not polls:         # nothing in flight: nothing can come
                time.sleep(left)
                return None
            done, _ = ray.wait(list(polls), num_returns=1, timeout=left)
            for ref in done:
                self._collect(polls[ref])
        return self.ready.popleft()

    def _collect(self, worker: _Worker) -> None:
        """The groups of a finished `drain` call, or a restart if the worker died."""
        try:
            groups = ray.get(worker.poll)
            ray.get(worker.polled_calls)   # ran before the drain: raises what they raised
        except RayActorError as err:
            self._restart(worker, err)
            return
        worker.poll, worker.polled_calls = None, []
        for group in groups:
            # A request is returned at most once: only by the worker that holds it now.
            if worker.inflight.pop(group.seq, None) is not None:
                self.ready.append(group)

    def _restart(self, worker: _Worker, err: RayActorError) -> None:
        """A fresh actor on the dead one's bundle, with the latest weights and its requests in flight."""
        if worker.restarts >= self.settings.ray.max_restarts:
            raise RuntimeError(f"rollout worker {worker.index} died after {worker.restarts} restarts "
                               f"(ray.max_restarts={self.settings.ray.max_restarts})") from err
        logger.warning("rollout worker %d died (%s); restarting it with its %d requests in flight",
                       worker.index, type(err).__name__, len(worker.inflight))
        ray.kill(worker.actor)            # one that is only unreachable would keep its bundle
        worker.restarts += 1
        self.restarts += 1
        self.retired.busy += worker.times.busy
        self.retired.idle += worker.times.idle
        worker.times = WorkerTimes()
        worker.actor = self._spawn(worker.index)
        worker.poll, worker.polled_calls, worker.calls = None, [], []
        if self.weights is not None:
            worker.calls.append(worker.actor.load.remote(*self.weights))
        if worker.inflight:
            worker.calls.append(worker.actor.submit.remote([worker.inflight[s] for s in sorted(worker.inflight)]))

    def probe(self, version: int, ids: torch.Tensor, timeout: float) -> list[SamplerProbe]:
        """Every worker's probe, each asked after the weights sent to it (actor calls run in order). A worker
        that died is restarted (with the latest weights) and probed at the next publication."""
        refs = [worker.actor.probe.remote(version, ids, timeout, f"ray worker {worker.index}")
                for worker in self.workers]
        probes = []
        for worker, ref in zip(self.workers, refs, strict=True):
            try:
                probes += ray.get(ref)
            except RayActorError as err:
                self._restart(worker, err)
        return probes

    def times(self) -> WorkerTimes:
        """Busy and idle seconds summed over the workers (replaced ones included); the slowest
        worker's last weight apply."""
        refs = [worker.actor.times.remote() for worker in self.workers]
        for worker, ref in zip(self.workers, refs, strict=True):
            try:
                worker.times = ray.get(ref)
            except RayActorError as err:
                self._restart(worker, err)
        now = [worker.times for worker in self.workers]
        return WorkerTimes(
            busy=self.retired.busy + sum(t.busy for t in now),
            idle=self.retired.idle + sum(t.idle for t in now),
            weight_sync=max(t.weight_sync for t in now),
        )

    def close(self) -> None:
        for worker in self.workers:
            ray.kill(worker.actor)
        remove_placement_group(self.group)
        if self.owns_ray:
            ray.shutdown()


def ray_workers(settings: RayWorkerSettings, policy: Policy) -> RayRolloutWorkers:
    """The rollout workers of `backend=ray`, joining `ray.address` (or, when None, starting a Ray
    instance on this machine) unless this process has already initialised Ray.

    `policy` is not sent: the actors build it from `settings.model` and take the weights the loop
    publishes first, and sample from streams of their own.
    """
    owns_ray = not ray.is_initialized()
    if owns_ray:
        # A training run reports nothing to Ray's usage statistics unless the environment asks for it.
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        ray.init(address=settings.ray.address)
    try:
        return RayRolloutWorkers(settings, owns_ray=owns_ray)
    except BaseException:
        if owns_ray:
            ray.shutdown()
        raise
