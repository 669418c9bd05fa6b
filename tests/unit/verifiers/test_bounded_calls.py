"""Bounded calls in worker processes (verifiers/bounded.py): outcomes, replacement, no leaks at exit."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from reinforge.verifiers.bounded import BoundedPool, CallOutcome


@pytest.fixture
def pool():
    pool = BoundedPool(max_workers=1)
    yield pool
    pool.close()


def test_outcomes_and_a_killed_worker_is_replaced(pool: BoundedPool) -> None:
    assert pool.call(pow, (3, 4), timeout_s=30.0) == CallOutcome("ok", value=81)
    assert pool.call(int, ("x",), timeout_s=30.0) == CallOutcome(
        "raised", error="ValueError: invalid literal for int() with base 10: 'x'")
    with pytest.raises(AttributeError, match="Can't pickle local object"):
        pool.call(lambda: 1, (), timeout_s=30.0)
    assert pool.started == 1  # a call that raised, or could not be sent, leaves its worker usable

    t0 = time.monotonic()
    assert pool.call(time.sleep, (30,), timeout_s=0.5) == CallOutcome("timed_out")
    assert time.monotonic() - t0 < 0.5 + 2.0  # the bound plus the kill, not the 30 s sleep
    assert pool.size == 0

    assert pool.call(os._exit, (3,), timeout_s=30.0) == CallOutcome("crashed")
    assert pool.call(pow, (2, 10), timeout_s=30.0) == CallOutcome("ok", value=1024)
    assert (pool.started, pool.calls, pool.size) == (
        3,
        5,
        1,
    )  # a start per killed or dead worker; the unsent call uncounted


def test_workers_do_not_outlive_the_interpreter(tmp_path) -> None:
    # A call from a thread starts the worker; the script then just ends, without closing the pool.
    script = (
        "import threading\n"
        "from reinforge.verifiers.bounded import BoundedPool\n"
        "pool = BoundedPool()\n"
        "out = []\n"
        "t = threading.Thread(target=lambda: out.append(pool.call(pow, (2, 3), 30.0)))\n"
        "t.start(); t.join()\n"
        "print(out[0].value, *[w.process.pid for w in pool._live])\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    value, pid = done.stdout.split()
    assert value == "8"
    deadline = time.monotonic() + 5.0
    while _alive(int(pid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(int(pid))


def _alive(pid: int) -> bool:
    # A zombie (exited, not yet reaped by init) counts as gone.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_forked_child_starts_its_own_workers(pool: BoundedPool) -> None:
    assert pool.call(pow, (2, 2), timeout_s=30.0).value == 4
    parent_worker = pool._live[0].process.pid
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # the child: no workers of its own yet, and it must not touch the parent's
        os.write(write, f"{pool.size} {pool.started}".encode())
        os._exit(0)
    os.close(write)
    assert os.read(read, 100).decode() == "0 1"
    os.close(read)
    os.waitpid(child, 0)
    assert pool.call(pow, (2, 3), timeout_s=30.0).value == 8   # the parent's worker still serves it
    assert pool._live[0].process.pid == parent_worker and pool.started == 1
