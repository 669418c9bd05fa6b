"""`torchrun --nproc_per_node=2 -m reinforge.cli train ...`: two data-parallel FSDP learner ranks (gloo on
CPU, loopback only) train as one process does (distributed/data_parallel.py).

The ranks split each batch's generation and gather the whole rollout, the one a single process samples
(the native engine keys each prompt's samples), and each updates on its own prompt groups; mini-batches
are cut from one shuffle of the whole batch (learner/update.py), so the union of the ranks' rows is the
one-process mini-batch and the runs differ only by the order of the gradient sums (2 RL steps x 2
epochs x 2 mini-batches at lr 1e-3). Two epochs (train.ppo_epochs=2) make pi_old a forward before the
update, which each rank computes for its own rows and the ranks exchange; grpo's k3 KL runs a plain
reference copy on each rank.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import MICRO
from learning import MIN_PASS_RATE, constant_answer_task, held_out_pass_rates, train_rewards
from repo_paths import REPO
from safetensors.torch import load_file

from reinforge.config import build_config
from reinforge.errors import ConfigError
from reinforge.jobs.train import run
from reinforge.telemetry.recorder import TIMING_KEYS

# A format reward that about a quarter of the micro model's completions earn: groups with reward variance,
# so both RL steps move the weights (the verifier alone never rewards the micro model).
OVERRIDES = [
    *(o for o in MICRO if not o.startswith("train.steps=")),
    "train.steps=2", "train.shared_prefix=false", "train.mini_batches=2", "train.ppo_epochs=2", "train.lr=1e-3",
    "reward.functions=[{name: verifier}, {name: format, params: {pattern: '[0-4]', mode: search}}]",
    "checkpoint.every=1", "checkpoint.keep_last=2",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(*args: str, ranks: int = 2) -> None:
    launcher = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}", "--master_addr=127.0.0.1",
                f"--master_port={_free_port()}"]
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([*launcher, "-m", "reinforge.cli", "train", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]


def _rl_lines(out: Path) -> list[dict]:
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in x.items() if k not in TIMING_KEYS} for x in lines if x.get("stage") == "rl"]


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.slow
def test_two_learner_ranks_train_as_one_process_and_resume_exactly(tmp_path: Path) -> None:
    # One test, so that the two-rank run (the costly part) runs once whatever the xdist split.
    two_ranks, one = tmp_path / "two", tmp_path / "one"
    _torchrun(*OVERRIDES, f"output_dir={two_ranks}")
    run(build_config([*OVERRIDES, f"output_dir={one}"]))      # one process: the same code as `reinforge train`
    weights = load_file(two_ranks / "model" / "model.safetensors")
    assert _max_diff(weights, load_file(one / "model" / "model.safetensors")) <= 1e-5
    # RL moved them: its second step changed the weights of the step-1 checkpoint (rank 0 wrote both).
    after_step_1 = torch.load(two_ranks / "checkpoints" / "step-000001" / "state.pt", weights_only=True)["model"]
    assert _max_diff(weights, {k: after_step_1[k] for k in weights}) > 1e-4
    # The same batches (generation split across the ranks, gathered): the same reward figures, and the
    # same held-out evaluations (split too).
    two, single = _rl_lines(two_ranks), _rl_lines(one)
    (two_eval, one_eval) = (json.loads((out / "summary.json").read_text())["eval"] for out in (two_ranks, one))
    assert two_eval["start"] == one_eval["start"]
    # After RL the weights agree within 1e-5, not bitwise: at most one sample of the final evaluation may differ.
    final = one_eval["final"]
    assert abs(two_eval["final"]["pass@1"] - final["pass@1"]) <= 1 / (final["num_prompts"] * final["num_samples"])
    assert [x["step"] for x in two] == [1, 2]
    assert [x["reward_mean"] for x in two] == [x["reward_mean"] for x in single]
    assert all(x["reward_std"] > 0 for x in two)
    # After every publication each rank's plain copy (what the engine reads) scored the probe as the sharded
    # forward does (rollout/weight_sync.py), and the verdict was shared: no rank stopped.
    assert all(0 <= x["sync/probe_tv"] < 1e-5 for x in two)
    # 2 epochs x 2 mini-batches per step
    assert ([x["policy_version"] for x in two] == [x["policy_version"] for x in single] == [4, 8])
    for a, b in zip(two, single, strict=True):
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)     # global: the same up to rounding
        # A loss-part figure is a row-weighted mean of the ranks' means over their micro-batches: close
        # to the one-process mean, not equal, when the ranks' shares of a mini-batch differ.
        assert a["kl"] == pytest.approx(b["kl"], rel=0.25)

    # Resume under torchrun. An interrupted run: the last checkpoint, the final model and summary are not there yet.
    out = tmp_path / "resumed"
    shutil.copytree(two_ranks, out)
    for path in (out / "checkpoints" / "step-000002", out / "model"):
        shutil.rmtree(path)
    (out / "summary.json").unlink()
    _torchrun("--resume", str(out))
    assert json.loads((out / "summary.json").read_text())["resumed_from_step"] == 1
    # The optimizer's gathered state came back into the shards: bit-identical weights and metrics.
    expected, resumed = (
        load_file(two_ranks / "model" / "model.safetensors"),
        load_file(out / "model" / "model.safetensors"),
    )
    assert all(torch.equal(resumed[k], expected[k]) for k in expected)
    assert _rl_lines(out) == _rl_lines(two_ranks)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("train.shared_prefix=true", "set train.shared_prefix=false"),
        ("model.lora.r=4", "model.lora is not supported under torchrun"),
        ("recipe=ppo", "trains a critic"),
        ("recipe=dpo", "preference pairs"),
    ],
)
def test_unsupported_settings_are_refused_under_a_group_before_anything_is_written(
        tmp_path: Path, monkeypatch, override: str, message: str) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")      # what torchrun sets; refused before any process group is joined
    out = tmp_path / "run"
    cfg = build_config([*OVERRIDES, override, f"output_dir={out}"])
    with pytest.raises(ConfigError, match=message):
        run(cfg)
    assert not out.exists()
    assert not dist.is_initialized()


@pytest.mark.slow
def test_async_learner_ranks_learn_and_match_one_process(tmp_path: Path) -> None:
    """train.mode=async on two learner ranks: rank 0 runs the sampler and the staleness gate and sends
    each batch to both ranks (distributed/data_parallel.py, RankZeroSource).

    With max_staleness 1 generation runs ahead, and the held-out pass@1 of tests/learning.py's task
    rises as in one process. With max_staleness 0 (no sample ahead of the weights that take it) the
    batches are the one-process ones, so the rewards are equal and the weights agree up to the order
    of the gradient sums."""
    task = [*constant_answer_task(tmp_path), "recipe=grpo", "train.mode=async", "train.shared_prefix=false"]
    ahead = tmp_path / "ahead"
    _torchrun(*task, "train.max_staleness=1", f"output_dir={ahead}")
    start, final = held_out_pass_rates(ahead)
    # Measured 0.000 -> 0.953 (seed 0). One seed here (two ranks under torchrun are slow): the same task and
    # settings in one process measured 0.98 / 0.99 / 0.98 on seeds 0 / 1 / 2 (tests/learning.py), and the
    # ranks differ from it only by the order of the gradient sums (the max_staleness 0 check below).
    assert start <= 0.05 and final >= start + MIN_PASS_RATE
    stale = [x["async/staleness_max"] for x in _rl_lines(ahead)]
    assert max(stale) == 1 and len(stale) == 16                   # it did run ahead, within the bound

    in_step = [*task, "train.max_staleness=0", "train.steps=4"]
    two, one = tmp_path / "two", tmp_path / "one"
    _torchrun(*in_step, f"output_dir={two}")
    run(build_config([*in_step, f"output_dir={one}"]))
    assert train_rewards(two) == train_rewards(one)
    assert max(train_rewards(two)) > 0  # not vacuous: some steps had a gradient
    assert (
        _max_diff(load_file(two / "model" / "model.safetensors"), load_file(one / "model" / "model.safetensors"))
        <= 1e-5
    )
