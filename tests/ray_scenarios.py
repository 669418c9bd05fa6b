"""Runs of the Ray backend (distributed/ray_workers.py) for tests/e2e/test_ray.py, which starts this
script inside a network namespace with only loopback, so Ray binds nothing anyone else can reach.

usage: ray_scenarios.py SCENARIO (train, kill, learners or sync_break). The last line of stdout is the scenario's
results as a JSON object.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import ray
import torch
from conftest import MICRO
from ray.util import placement_group_table

from reinforge.config import build_config
from reinforge.jobs.rl import default_workers, run_rl
from reinforge.jobs.start import objective_spec
from reinforge.jobs.train import run
from reinforge.loops import async_rl
from reinforge.models import load_policy
from reinforge.rollout import build_engine
from reinforge.tasks import build_task

RAY = ["recipe=areal", "backend=ray", "ray.num_workers=2", "ray.num_cpus_per_worker=0.5"]


def train() -> dict:
    """The pipeline (SFT, then asynchronous RL on two Ray workers) for 3 steps, Ray started by the
    backend itself: the RL lines of metrics.jsonl, and whether Ray is still up afterwards."""
    cfg = build_config([*MICRO, *RAY, "train.steps=3"])
    with tempfile.TemporaryDirectory() as out:
        result = run(cfg.model_copy(update={"output_dir": out}))
        lines = [json.loads(line) for line in Path(result.output_dir, "metrics.jsonl").read_text().splitlines()]
    sft = next(line for line in lines if line.get("stage") == "sft")
    return {"eta": cfg.train.max_staleness, "sft_loss_change": sft["final_loss"] - sft["first_loss"],
            "rl": [line for line in lines if line.get("stage") == "rl"], "ray_up_after": ray.is_initialized()}


def kill() -> dict:
    """`run_rl` (train.mode=async) on two Ray workers of a Ray instance started here, the actor of the worker
    holding the oldest request in flight killed after the first step: the request numbers each
    step took, the groups the workers returned, the requests the dead worker held, per-step
    gradient norms and sampler/learner log-prob gaps, and what is left after `close`."""
    ray.init(num_cpus=2)
    # One group decoded at a time per worker: groups finish one by one, and some are in flight at the kill.
    # max_staleness=1: after step 1 at most requests 0..11 exist, all of them trained by step 4, so
    # whatever the dead worker held is needed later however fast the workers ran (with areal's 4,
    # fast workers could finish 0..19 first and the kill hit only requests no step takes).
    cfg = build_config(
        [
            *MICRO, *RAY, "train.steps=4", "sft.steps=0", "rollout.max_new_tokens=8", "rollout.max_batch_rows=4",
            "train.max_staleness=1",
        ]
    )
    torch.manual_seed(cfg.seed)
    policy = load_policy(cfg.model, cfg.seed)
    with torch.no_grad():   # weights the actors can only have from the driver
        for p in policy.model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.05)
    pools, taken, returned, killed, records = [], [], [], [], []

    def workers(policy):
        pool = default_workers(cfg)(policy)
        get = pool.get

        def recording_get(timeout):
            group = get(timeout)
            if group is not None:
                returned.append(group.seq)
            return group

        pool.get = recording_get
        pools.append(pool)
        return pool

    draw = async_rl.StreamSource.draw

    def recording_draw(self, n, policy_version):
        first = self.next_take
        out = draw(self, n, policy_version)
        taken.append(list(range(first, self.next_take)))
        return out

    def on_step(record, state):
        records.append(record.metrics)
        if record.step == 1:   # the worker holding the oldest request in flight, one a later step needs
            victim = min((w for w in pools[0].workers if w.inflight), key=lambda w: min(w.inflight))
            killed.extend(sorted(victim.inflight))
            ray.kill(victim.actor)

    async_rl.StreamSource.draw = recording_draw
    try:
        run_rl(cfg, policy, build_engine(cfg.rollout, policy), build_task(cfg.task.name, **cfg.task.options),
                       objective_spec(cfg), on_step, workers=workers)
    finally:
        async_rl.StreamSource.draw = draw
    # close() gave the bundles back (actors die asynchronously: wait a little for their CPUs).
    deadline = time.monotonic() + 10
    while ray.available_resources().get("CPU") != 2.0 and time.monotonic() < deadline:
        time.sleep(0.1)
    return {"steps": len(records), "batch": cfg.train.prompts_per_step, "taken": taken, "returned": returned,
            "killed_inflight": killed, "restarts": pools[0].restarts,
            "duplicates": [m["async/duplicates_total"] for m in records],
            "too_stale": [m["async/too_stale_total"] for m in records],
            "grad_norms": [m["grad_norm"] for m in records], "mismatch": [m["mismatch_abs_diff_max"] for m in records],
            "ray_up_after": ray.is_initialized(), "free_cpus_after": ray.available_resources().get("CPU"),
            "placement_groups_after": [g["state"] for g in placement_group_table().values()]}


def learners() -> dict:
    """Synchronous RL with two FSDP learner ranks launched as Ray actors (ray.learner_ranks=2), and
    the same run in one process: the largest weight difference and both runs' RL lines."""
    from safetensors.torch import load_file

    args = [*MICRO, "train.steps=2", "train.shared_prefix=false", "train.lr=1e-3",
            "reward.functions=[{name: verifier}, {name: format, params: {pattern: '1', mode: search}}]"]
    with tempfile.TemporaryDirectory() as out:
        two = run(build_config([*args, "backend=ray", "ray.learner_ranks=2", "ray.num_cpus_per_worker=0.5",
                                f"output_dir={out}/two"]))
        one = run(build_config([*args, f"output_dir={out}/one"]))
        a, b = (load_file(Path(r.output_dir, "model", "model.safetensors")) for r in (two, one))

        def rl(r):
            return [json.loads(x) for x in Path(r.output_dir, "metrics.jsonl").read_text().splitlines()
                    if json.loads(x).get("stage") == "rl"]

        return {"max_diff": max(float((a[k] - b[k]).abs().max()) for k in a), "rl_two": rl(two), "rl_one": rl(one),
                "ray_up_after": ray.is_initialized()}


def sync_break() -> dict:
    """The pipeline on two Ray workers whose publications after the first never leave the driver: the
    error the run stops with and its alerts (tests/unit/rollout/test_weight_sync.py's Ray case)."""
    from reinforge.distributed.ray_workers import RayRolloutWorkers
    from reinforge.errors import RunStopped

    publish = RayRolloutWorkers.publish
    RayRolloutWorkers.publish = lambda self, model, version: publish(self, model, version) if version == 0 else None
    cfg = build_config([*MICRO, *RAY, "train.steps=2", "sft.steps=0", "train.weight_sync.timeout_s=2"])
    with tempfile.TemporaryDirectory() as out:
        try:
            run(cfg.model_copy(update={"output_dir": out}))
            error = None
        except RunStopped as err:
            error = str(err)
        alerts = [json.loads(x) for x in Path(out, "alerts.jsonl").read_text().splitlines()]
    return {"error": error, "alerts": alerts, "ray_up_after": ray.is_initialized()}


SCENARIOS = {"train": train, "kill": kill, "learners": learners, "sync_break": sync_break}

if __name__ == "__main__":
    try:
        results = SCENARIOS[sys.argv[1]]()
    finally:
        ray.shutdown()
    print(json.dumps(results))
