"""The CLI makes OpenMP's waiting threads sleep (OMP_WAIT_POLICY=PASSIVE) before torch loads libgomp, and
keeps a value the user set (reinforge/cli.py says why)."""

from __future__ import annotations

import os
import subprocess
import sys

from repo_paths import REPO

PROBE = ("import sys, os, reinforge.cli; assert 'torch' not in sys.modules; import torch; "
         "print(os.environ['OMP_WAIT_POLICY'])")


def _policy(**env) -> str:
    clean = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run([sys.executable, "-c", PROBE], env={**clean, **env}, cwd=REPO, capture_output=True,
                         text=True, check=True)
    return out.stdout.strip()


def test_the_cli_sets_passive_before_torch_loads_and_keeps_the_users_value():
    assert _policy() == "PASSIVE"
    assert _policy(OMP_WAIT_POLICY="ACTIVE") == "ACTIVE"
