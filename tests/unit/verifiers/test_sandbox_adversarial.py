"""Adversarial candidates: none passes falsely, none touches anything outside its sandbox.

Every attack runs with namespaces on and off. The tests' expected values
live only in the judge, so an attack that reached the judge's memory, a
test name or a builtin would pass; one that reached the host would kill the
canary process, change the canary file (world-writable on purpose: only the
sandbox stands between it and the candidate) or print the secret this test
puts in its own environment. The programs are in sandbox_attack_programs.py;
correct programs (no false negatives) in test_sandbox_correct_programs.py.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import tempfile
import uuid

import pytest
from sandbox_attack_programs import ATTACKS, MEMSCAN, OWN_TESTS_ATTACKS, TESTS

from reinforge.verifiers.code import run_many


def _fill(source: str, values: dict[str, str]) -> str:
    for key, value in values.items():
        source = source.replace(key, value)
    return source


@pytest.fixture
def canaries(monkeypatch):
    """A process, a world-writable file outside /tmp's sandboxes, and a secret in os.environ."""
    secret = f"canary-secret-{uuid.uuid4().hex}"
    monkeypatch.setenv("REINFORGE_CANARY_SECRET", secret)
    canary_dir = tempfile.mkdtemp(prefix="reinforge-canary-")
    os.chmod(canary_dir, 0o777)
    canary_file = os.path.join(canary_dir, "canary")
    with open(canary_file, "w") as fh:
        fh.write("original")
    os.chmod(canary_file, 0o666)
    process = subprocess.Popen(["sleep", "300"])
    shm_file = f"/dev/shm/reinforge-canary-{uuid.uuid4().hex}"
    values = {"CANARY_PID": str(process.pid), "TEST_PID": str(os.getpid()),
              "CANARY_FILE": canary_file, "CANARY_DIR": canary_dir, "SHM_FILE": shm_file,
              "SECRET_NAME": "REINFORGE_CANARY_SECRET"}
    yield values, secret
    if os.path.exists(shm_file):
        os.remove(shm_file)
    process.kill()
    process.wait()
    for path in (canary_file, os.path.join(canary_dir, "stolen")):
        if os.path.exists(path):
            os.chmod(path, 0o600)
            os.remove(path)
    os.rmdir(canary_dir)


@pytest.mark.parametrize("namespaces", [True, False], ids=["namespaces", "no_namespaces"])
def test_attacks_never_pass_and_leave_the_host_alone(canaries, namespaces: bool):
    values, secret = canaries
    items = {n: (_fill(p, values), TESTS) for n, p in ATTACKS.items()}
    items.update((n, (_fill(p, values), t)) for n, (p, t) in OWN_TESTS_ATTACKS.items())
    names = list(items)
    results = run_many([items[n] for n in names], timeout_s=2.0, workers=2, namespaces=namespaces)
    assert len(names) >= 110
    for name, result in zip(names, results, strict=True):
        total = items[name][1].count("\nassert ") + items[name][1].startswith("assert ")
        assert (result.passed, result.passed_count, result.total) == (False, 0, total), (
            name, result)
        assert secret not in result.output and secret not in (result.error or ""), name
        assert len(result.output) <= 64 * 1024, name
    # The host: the canary process, the canary file (world-writable: only the sandbox guards it).
    canary_pid = int(values["CANARY_PID"])
    assert os.waitpid(canary_pid, os.WNOHANG) == (0, 0), "the canary process was killed"
    assert os.getpriority(os.PRIO_PROCESS, canary_pid) == os.getpriority(os.PRIO_PROCESS, 0)
    assert os.sched_getaffinity(canary_pid) == os.sched_getaffinity(0)
    with open(values["CANARY_FILE"]) as fh:
        assert fh.read() == "original"
    assert stat.S_IMODE(os.stat(values["CANARY_FILE"]).st_mode) == 0o666
    assert sorted(os.listdir(values["CANARY_DIR"])) == ["canary"]
    assert not os.path.exists(values["SHM_FILE"])


def test_the_memory_scan_attack_works_on_an_unprotected_process(tmp_path):
    # The attack is real: run directly (no sandbox) against a process holding the tests,
    # it takes the answers out. The sandbox is what stops it above.
    holder = subprocess.Popen(
        [sys.executable, "-c", f"import sys, time\ntests = {TESTS!r}\nprint('ready', flush=True)\n"
                          "time.sleep(30)"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "ready\n"
        script = MEMSCAN + f"print(sorted(scan('/proc/{holder.pid}').items()))\n"
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30)
    finally:
        holder.kill()
        holder.wait()
    assert "(3, 7919)" in out.stdout, out.stderr
