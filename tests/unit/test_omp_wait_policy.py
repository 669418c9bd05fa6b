"""The CLI shortens how long OpenMP's waiting threads spin (GOMP_SPINCOUNT=1000) before torch loads libgomp,
and keeps a wait setting the user made (reinforge/cli.py says why)."""

from __future__ import annotations

import os
import subprocess
import sys

from repo_paths import REPO

PROBE = ("import sys, os, reinforge.cli; assert 'torch' not in sys.modules; import torch; "
         "print(os.environ.get('GOMP_SPINCOUNT'), os.environ.get('OMP_WAIT_POLICY'))")


def _settings(**env) -> str:
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = subprocess.run([sys.executable, "-c", PROBE], env={**clean, **env}, cwd=REPO, capture_output=True,
                         text=True, check=True)
    return out.stdout.strip()


def test_the_cli_shortens_the_spin_before_torch_loads_and_keeps_the_users_setting():
    assert _settings() == "1000 None"
    assert _settings(GOMP_SPINCOUNT="300000") == "300000 None"
    assert _settings(OMP_WAIT_POLICY="ACTIVE") == "None ACTIVE"
    assert _settings(OMP_WAIT_POLICY="PASSIVE") == "None PASSIVE"
