"""Short RL runs where held-out pass@1 must rise: the loop (loops/loop.py) teaches the policy
something, synchronously and with asynchronous rollout workers (tests/learning.py has the task).
The two-rank run under torchrun is in test_torchrun.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from learning import MIN_PASS_RATE, constant_answer_task, held_out_pass_rates, train_rewards

from reinforge.config import build_config
from reinforge.jobs.train import run


@pytest.mark.parametrize("mode", ["train.mode=sync", "train.mode=async"])
def test_held_out_pass_rate_rises(tmp_path: Path, mode: str) -> None:
    out = tmp_path / "run"
    run(
        build_config(
            [*constant_answer_task(tmp_path), "recipe=grpo", mode, "train.max_staleness=1", f"output_dir={out}"]
        )
    )
    start, final = held_out_pass_rates(out)
    assert start <= 0.05                         # the untrained model answers "7" about 1 time in 40
    assert final >= start + MIN_PASS_RATE       # seeds 0 / 1 / 2: 0.92 / 0.98 / 1.00 (sync), 0.98 / 0.99 / 0.98 (async)
    rewards = train_rewards(out)
    assert len(rewards) == 16
    assert sum(rewards[-4:]) / 4 >= sum(rewards[:4]) / 4 + MIN_PASS_RATE   # the train reward rose too (>= 0.92)
