"""The hang watchdog (telemetry/watchdog.py): a reward function that stops answering produces a stack dump
in the run directory naming its frame, and a hang alert; with stop_after the run stops."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from reinforge.config import build_config
from reinforge.errors import RunStopped
from reinforge.jobs.train import run
from reinforge.rewards.user import register
from reinforge.telemetry.watchdog import _descendants, child_stacks, hang_limit, stop_signal
from reinforge.verifiers.bounded import BoundedPool

CALLS = {"n": 0}


def stuck_reward(completions, **kwargs):
    """Answers the reward probe's call (before training) and the first two steps' calls, then sleeps far
    longer than a step (SLEEP)."""
    CALLS["n"] += 1
    if CALLS["n"] == 4:
        time.sleep(SLEEP["s"])
    return [float(len(c) % 2) for c in completions]


SLEEP = {"s": 0.0}
FAST = ["train.watchdog.factor=2", "train.watchdog.min_seconds=0.5", "train.watchdog.first_step_seconds=60"]


def test_hang_limit_hand_numbers():
    assert hang_limit([], 10, 300, 1800) == 1800                  # before the first step
    assert hang_limit([1.0, 9.0, 2.0], 10, 5, 1800) == 20         # 10 x median 2
    assert hang_limit([0.1, 0.1], 10, 5, 1800) == 5               # the floor


def _run(micro, tmp_path, sleep: float, *extra):
    CALLS["n"], SLEEP["s"] = 0, sleep
    name = register(stuck_reward)
    cfg = build_config([*micro, "sft.steps=0", f"reward.functions=[{{name: '{name}'}}]", "train.steps=4", *FAST,
                        *extra, f"output_dir={tmp_path}"])
    return run(cfg)


def _alerts(tmp_path) -> list[dict]:
    return [a for a in map(json.loads, (tmp_path / "alerts.jsonl").read_text().splitlines()) if a["alert"] == "hang"]


def test_stuck_reward_is_dumped_and_alerted_and_the_run_goes_on(micro_overrides, tmp_path):
    _run(micro_overrides, tmp_path, 4.0)
    dump = (tmp_path / "hang-3.txt").read_text()
    assert "in stuck_reward" in dump and "time.sleep(SLEEP" in dump          # the reward function's own frame
    assert "Thread MainThread" in dump
    alerts = _alerts(tmp_path)
    assert alerts and alerts[0]["step"] == 3
    # The main thread waits in reinforge's reward composer, inside the user's function.
    assert "MainThread at " in alerts[0]["message"] and "reinforge/rewards/" in alerts[0]["message"]
    assert "test_watchdog.py" in alerts[0]["message"] and "stuck_reward" in alerts[0]["message"]
    assert (tmp_path / "summary.json").exists()      # default: alert and dump, keep waiting; the run finished


def test_stop_after_stops_a_hung_run(micro_overrides, tmp_path):
    t0 = time.monotonic()
    with pytest.raises(RunStopped, match="hang watchdog: step 3 made no progress"):
        _run(micro_overrides, tmp_path, 600.0, "train.watchdog.stop_after=2")
    assert time.monotonic() - t0 < 60
    assert len(_alerts(tmp_path)) == 2 and (tmp_path / "hang-3.txt").exists()


def test_stop_after_stops_a_run_started_with_sigint_ignored(micro_overrides, tmp_path):
    # `nohup reinforge train ... &` from a script: the shell starts the job with SIGINT ignored, so the
    # watchdog's stop goes through SIGTERM, whose handler the run installs.
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        assert stop_signal() == signal.SIGTERM
        with pytest.raises(RunStopped, match="hang watchdog: step 3 made no progress"):
            _run(micro_overrides, tmp_path, 600.0, "train.watchdog.stop_after=2")
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN      # left as the shell set it
    finally:
        signal.signal(signal.SIGINT, previous)
    assert stop_signal() == (signal.SIGINT if previous is not signal.SIG_IGN else signal.SIGTERM)


def test_child_worker_stacks_come_back():
    """A bounded-call worker registers a SIGUSR1 handler: its stack, mid-call, is read back."""
    # Other tests of this process (pytest-xdist runs several per worker) may have children of their own.
    before = set(_descendants(os.getpid()))
    pool = BoundedPool(max_workers=1)
    try:
        assert pool.call(pow, (2, 3), timeout_s=30.0).value == 8        # started and registered
        stacks = {pid: text for pid, text in child_stacks().items() if pid not in before}
        assert len(stacks) == 1
        (text,) = stacks.values()
        assert "_serve" in text and "bounded.py" in text
        other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
        try:
            assert child_stacks()[other.pid] == "(no stack handler registered: not signalled)"
            assert other.poll() is None               # listed, never signalled
        finally:
            other.kill()
            other.wait()
    finally:
        pool.close()
