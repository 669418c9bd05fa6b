"""The CLI sets how long OpenMP's waiting threads spin (GOMP_SPINCOUNT) before torch loads libgomp: long where the
cores were free at start-up, short where other threads wanted them; a wait setting the user made is kept
(reinforge/openmp.py says why)."""

from __future__ import annotations

import os
import subprocess
import sys

from repo_paths import REPO

from reinforge.openmp import openmp_spin

PROBE = ("import sys, os, reinforge.cli; assert 'torch' not in sys.modules; import torch; "
         "print(os.environ.get('GOMP_SPINCOUNT'), os.environ.get('OMP_WAIT_POLICY'))")


def _settings(**env) -> str:
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = subprocess.run([sys.executable, "-c", PROBE], env={**clean, **env}, cwd=REPO, capture_output=True,
                         text=True, check=True)
    return out.stdout.strip()


def test_the_cli_sets_the_spin_before_torch_loads_and_keeps_the_users_setting():
    assert _settings() in ("1000 None", "20000 None")     # which one: the load at its start-up (below)
    assert _settings(GOMP_SPINCOUNT="300000") == "300000 None"
    assert _settings(OMP_WAIT_POLICY="ACTIVE") == "None ACTIVE"
    assert _settings(OMP_WAIT_POLICY="PASSIVE") == "None PASSIVE"


def test_the_spin_is_long_only_where_no_other_thread_wanted_the_cores():
    assert openmp_spin([1, 1, 1, 1, 1], cpus=2, threads=2) == "20000"   # this process alone
    assert openmp_spin([3, 3, 3, 3, 3], cpus=2, threads=2) == "1000"    # a 2-thread job running too
    assert openmp_spin([2, 1, 1, 3, 1], cpus=2, threads=2) == "20000"   # the median: a passing kernel thread
    assert openmp_spin([2, 2, 2, 1, 2], cpus=2, threads=2) == "1000"    # one other thread, most of the time
    assert openmp_spin([3, 3, 3, 3, 3], cpus=8, threads=2) == "20000"   # others on the cores this one leaves free
    assert openmp_spin([8, 8, 8, 8, 8], cpus=8, threads=2) == "1000"
    assert openmp_spin([], cpus=2, threads=2) == "1000"                  # nothing to count (not Linux)
