"""The learner group as Ray actors (`backend=ray ray.learner_ranks=N`, synchronous RL): Ray
launches the data-parallel FSDP2 ranks that torchrun would.

Each actor gets the environment torchrun gives a rank (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT, rank 0's node address and a free port
there) and runs the same job, `pipeline.run`, with `backend=local`: from there
on everything is distributed/data_parallel.py (what is duplicated, what is
sharded, what is refused); torch.distributed does the communication, Ray only
places the processes (one placement-group bundle per rank, PACK) and starts
them. Only rank 0 writes the run directory, so on a cluster `output_dir`
must be on rank 0's node or on shared storage.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from reinforge.settings import RayConfig

PLACEMENT_TIMEOUT_S = 120.0


@ray.remote
class LearnerRank:
    """One learner rank: a process of its own, running the pipeline under torch.distributed."""

    def address(self) -> tuple[str, int]:
        """This node's address and a port free on it (for rank 0's rendezvous)."""
        with socket.socket() as s:
            s.bind(("", 0))
            return ray.util.get_node_ip_address(), s.getsockname()[1]

    def run(self, job: Callable[..., Any], cfg: Any, rank: int, world: int, master: tuple[str, int], resume: bool,
            overwrite: bool) -> dict:
        # LOCAL_RANK 0: Ray gives each actor its own devices (CUDA_VISIBLE_DEVICES), so each sees one.
        os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": "0",
                           "MASTER_ADDR": master[0], "MASTER_PORT": str(master[1])})
        result = job(cfg, resume=resume, overwrite=overwrite)
        return {"output_dir": result.output_dir, "summary": result.summary}


def run_learner_group(job: Callable[..., Any], cfg: Any, ray_cfg: RayConfig, *, resume: bool = False,
                      overwrite: bool = False) -> dict:
    """`job(cfg, resume=, overwrite=)` (the train job, passed in so that this module stays below the jobs;
    Ray sends it by reference, so the actor imports it itself) on `ray_cfg.learner_ranks` Ray actors;
    rank 0's result ({output_dir, summary}). `cfg` passes through unread: it is the job's config, with
    backend=local (inside the group, the ranks are the job)."""
    started = not ray.is_initialized()
    if started:
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        ray.init(address=ray_cfg.address)
    world = ray_cfg.learner_ranks
    bundle = {
        "CPU": ray_cfg.num_cpus_per_worker,
        **({"GPU": ray_cfg.num_gpus_per_worker} if ray_cfg.num_gpus_per_worker else {}),
    }
    group = placement_group([bundle] * world, strategy="PACK")
    try:
        if not group.wait(PLACEMENT_TIMEOUT_S):
            raise RuntimeError(f"the Ray cluster found no room for {world} learner ranks of {bundle} in "
                               f"{PLACEMENT_TIMEOUT_S:.0f} s (cluster resources: {ray.cluster_resources()})")
        ranks = [
            LearnerRank.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=i),
                num_cpus=ray_cfg.num_cpus_per_worker,
                num_gpus=ray_cfg.num_gpus_per_worker,
            ).remote()
            for i in range(world)
        ]
        master = ray.get(ranks[0].address.remote())
        results = ray.get([r.run.remote(job, cfg, i, world, master, resume, overwrite) for i, r in enumerate(ranks)])
        for r in ranks:
            ray.kill(r)
        return results[0]
    finally:
        remove_placement_group(group)
        if started:
            ray.shutdown()
