"""The Ray backend (distributed/ray_workers.py): a pipeline run trains on two rollout actors, a
killed actor loses and duplicates no request, and the default mode never imports Ray.

The runs are tests/ray_scenarios.py, started in a network namespace with only loopback
(`unshare -rn`), so that the Ray instances they start bind nothing reachable from outside.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys

import pytest
from repo_paths import TESTS


def _loopback_namespace_problem() -> str | None:
    """Why a loopback-only network namespace cannot be made here, or None."""
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return "needs unshare and ip (util-linux, iproute2)"
    try:
        subprocess.run(["unshare", "-rn", "sh", "-c", "ip link set lo up"], check=True, capture_output=True, timeout=30)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as err:
        return f"`unshare -rn` (a user and network namespace) is not permitted here: {err}"
    return None


def run_scenario(name: str) -> dict:
    pytest.importorskip("ray")
    problem = _loopback_namespace_problem()
    if problem:   # Ray must never bind an outside interface in tests (DEVELOPERS.md); CI's machines allow unshare -rn
        pytest.skip(f"Ray runs only inside a loopback-only network namespace, and {problem}")
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    command = ["unshare", "-rn", "sh", "-c", 'ip link set lo up && exec "$0" "$@"',
               sys.executable, str(TESTS / "ray_scenarios.py"), name]
    proc = subprocess.run(command, cwd=TESTS.parent, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_ray_run_trains_within_the_staleness_bound():
    out = run_scenario("train")
    rl = out["rl"]
    assert [line["step"] for line in rl] == [1, 2, 3]
    for line in rl:
        assert math.isfinite(line["policy_loss"])
        assert line["async/staleness_max"] <= out["eta"]
        assert line["async/too_stale_total"] == line["async/duplicates_total"] == 0
    # Requests 4..7 started with version 0 and were trained by version 1: generation ran ahead.
    assert rl[1]["async/staleness_max"] >= 1
    # The actors sample with the weights the driver publishes, not the ones they built: SFT moved
    # the weights, and the first step's samples (staleness 0) carry the learner's own log-probs.
    # (Without the publication the gap is ~4e-4 here.)
    assert out["sft_loss_change"] != 0
    assert rl[0]["mismatch_abs_diff_max"] < 1e-6
    # Every publication reached both workers: each scored the probe as the learner does (rollout/weight_sync.py).
    assert all(line["sync/probe_tv"] < 1e-5 for line in rl)
    assert not out["ray_up_after"]        # close() shut down the Ray instance the backend started


@pytest.mark.slow
def test_killed_worker_loses_and_duplicates_no_request():
    out = run_scenario("kill")
    b, steps = out["batch"], out["steps"]
    assert steps == 4 and out["restarts"] == 1
    trained = [seq for step in out["taken"] for seq in step]
    assert trained == list(range(steps * b))               # every request trained once, in request order
    assert len(out["returned"]) == len(set(out["returned"]))   # no group came back twice
    # The kill hit requests in flight, and those a later step needed were sent again and trained.
    assert set(out["killed_inflight"]) & set(trained)
    assert set(out["duplicates"]) == set(out["too_stale"]) == {0}
    # The replacement sampled with the latest weights: the driver's were perturbed away from those
    # the actors build, no update moved them (every reward of this untrained model is 0), so every
    # sample's log-probs are the learner's. (A replacement without them: a gap of ~6e-3.)
    assert set(out["grad_norms"]) == {0.0}
    assert max(out["mismatch"]) < 1e-6
    # close() removed the actors and their placement group, and left the caller's Ray up.
    assert out["ray_up_after"] and out["free_cpus_after"] == 2.0
    assert out["placement_groups_after"] == ["REMOVED"]


def test_default_mode_never_imports_ray():
    code = ("import sys, reinforge, reinforge.cli, reinforge.jobs.train, reinforge.distributed; "
            "print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert proc.stdout.strip() == "[]"


@pytest.mark.slow
def test_ray_launched_learner_ranks_train_as_one_process():
    """ray.learner_ranks=2: two FSDP learner ranks as Ray actors (torch.distributed over gloo inside)
    end where one process ends, on the same batches."""
    out = run_scenario("learners")
    assert [x["step"] for x in out["rl_two"]] == [1, 2]
    assert [x["reward_mean"] for x in out["rl_two"]] == [x["reward_mean"] for x in out["rl_one"]]
    assert out["max_diff"] <= 1e-5
    assert not out["ray_up_after"]          # the launcher started Ray, and shut it down


@pytest.mark.slow
def test_ray_workers_that_miss_a_publication_stop_the_run():
    out = run_scenario("sync_break")
    assert "ray worker 0 holds weight version 0, not the published 1" in out["error"]
    assert "ray worker 1 holds weight version 0" in out["error"]
    assert [a["alert"] for a in out["alerts"] if a["alert"] == "weight_sync"] == ["weight_sync"]
    assert not out["ray_up_after"]
