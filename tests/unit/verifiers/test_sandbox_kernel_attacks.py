"""Attacks on the guard itself, as root and as an unprivileged user, namespaces on and off.

The programs (sandbox_kernel_attack_programs.py) tamper with every table of the
audit hook they can reach, load refused extensions by dotted names and by
file, write through every spelling of open, try to leave files behind (host
/tmp, /var/tmp, /dev/shm, the stdlib, reinforge's own source), reach other
processes and the network. None may pass, and the host must be untouched:
the canary process, file and directory, listeners that count connections, the
interpreter's directories, and the verdicts of later runs.

`EFFECTS` runs once with the hook and once with the hook turned off (the
state a memory-corruption exploit would leave): each effect must then be
stopped by a kernel layer alone.

As the unprivileged user (`nobody`) the sandbox runs from an interpreter that
user owns and can write (a copy of the system Python): the case where a
candidate that got past the hook could plant a module for every later run.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import uuid

import pytest
from repo_paths import REPO as REPO_PATH
from sandbox_attack_programs import TESTS
from sandbox_kernel_attack_programs import EFFECTS, KERNEL_ATTACKS

import reinforge
from reinforge.verifiers.code import SandboxUnavailableError, run_many, run_tests

REPO = str(REPO_PATH)
TESTS_DIR = os.path.join(REPO, "tests")
NOBODY = 65534
SYSTEM_PYTHON = "/usr/bin/python3.11"
CORRECT = ("def f(n):\n    return {3: 7919, 4: 104729, 5: 224737, 6: 350377, 7: 479909}[n]\n", TESTS)


def _fill(source: str, values: dict[str, str]) -> str:
    for key, value in values.items():
        source = source.replace(key, value)
    return source


def _tree_digest(path: str) -> str:
    """Names, sizes, modes and times of what the stdlib directory, its __pycache__ and
    lib-dynload hold (where a planted module or extension would go), and subprocess.py."""
    h = hashlib.sha256()
    for where in (path, os.path.join(path, "__pycache__"), os.path.join(path, "lib-dynload")):
        if os.path.isdir(where):
            for name in sorted(os.listdir(where)):
                st = os.lstat(os.path.join(where, name))
                h.update(f"{where}/{name} {st.st_size} {st.st_mode} {st.st_mtime_ns}\n".encode())
    with open(os.path.join(path, "subprocess.py"), "rb") as fh:
        h.update(fh.read())
    return h.hexdigest()


class Host:
    """What the attacks go after, and the check that none of it changed."""

    def __init__(self, owner: int, stdlib: str):
        self.secret = f"canary-secret-{uuid.uuid4().hex}"
        self.dir = tempfile.mkdtemp(prefix="reinforge-canary-", dir="/var/tmp")
        os.chmod(self.dir, 0o777)
        self.file = os.path.join(self.dir, "canary")
        self._write(self.file, "original", 0o666)
        self.secret_file = os.path.join(self.dir, "secret")
        self._write(self.secret_file, self.secret, 0o644)
        self.unix_path = os.path.join(self.dir, "sock")
        self.unix = socket.socket(socket.AF_UNIX)
        self.unix.bind(self.unix_path)
        os.chmod(self.unix_path, 0o777)
        self.abstract_name = f"reinforge-canary-{uuid.uuid4().hex}"
        self.abstract = socket.socket(socket.AF_UNIX)
        self.abstract.bind("\0" + self.abstract_name)
        self.tcp = socket.socket()
        self.tcp.bind(("127.0.0.1", 0))
        for listener in (self.unix, self.abstract, self.tcp):
            listener.listen(16)
            listener.setblocking(False)
        user = {} if owner == os.geteuid() else {"user": owner, "group": owner, "extra_groups": []}
        self.process = subprocess.Popen(["sleep", "300"], **user)
        self.shm_name = f"reinforge-canary-{uuid.uuid4().hex}"
        self.host_tmp = f"/tmp/reinforge-persist-{uuid.uuid4().hex}"
        self.var_tmp = f"/var/tmp/reinforge-persist-{uuid.uuid4().hex}"
        self.stdlib = stdlib
        self.stdlib_digest = _tree_digest(stdlib)
        self.judge_src = os.path.join(reinforge.__path__[0], "verifiers", "sandbox", "judge.py")
        with open(self.judge_src, "rb") as fh:
            self.judge_digest = hashlib.sha256(fh.read()).hexdigest()
        self.values = {
            "CANARY_PID": str(self.process.pid), "TEST_PID": str(os.getpid()),
            "CANARY_FILE": self.file, "CANARY_DIR": self.dir, "HOST_SECRET": self.secret_file,
            "SHM_FILE": f"/dev/shm/{self.shm_name}", "SHM_NAME": self.shm_name,
            "TCP_PORT": str(self.tcp.getsockname()[1]), "UNIX_SOCK": self.unix_path,
            "ABSTRACT_NAME": self.abstract_name, "HOST_TMP": self.host_tmp,
            "VAR_TMP": self.var_tmp, "REINFORGE_DIR": reinforge.__path__[0],
        }

    @staticmethod
    def _write(path: str, text: str, mode: int) -> None:
        with open(path, "w") as fh:
            fh.write(text)
        os.chmod(path, mode)

    def programs(self) -> dict[str, str]:
        return {name: _fill(src, self.values) for name, src in KERNEL_ATTACKS.items()}

    def effects(self) -> str:
        return _fill(EFFECTS, self.values)

    def assert_untouched(self) -> None:
        assert self.process.poll() is None, "the canary process was killed"
        assert os.getpriority(os.PRIO_PROCESS, self.process.pid) == os.getpriority(os.PRIO_PROCESS, 0)
        with open(self.file) as fh:
            assert fh.read() == "original"
        assert stat.S_IMODE(os.stat(self.file).st_mode) == 0o666
        assert sorted(os.listdir(self.dir)) == ["canary", "secret", "sock"]
        for path in (self.values["SHM_FILE"], self.host_tmp, self.var_tmp, "/tmp/reinforge-planted"):
            assert not os.path.lexists(path), path
        for listener in (self.tcp, self.unix, self.abstract):
            with pytest.raises(BlockingIOError):
                listener.accept()  # nobody connected
        assert _tree_digest(self.stdlib) == self.stdlib_digest, "the interpreter's stdlib changed"
        with open(self.judge_src, "rb") as fh:
            assert hashlib.sha256(fh.read()).hexdigest() == self.judge_digest

    def close(self) -> None:
        self.process.kill()
        self.process.wait()
        for listener in (self.tcp, self.unix, self.abstract):
            listener.close()
        for path in (self.values["SHM_FILE"], self.host_tmp, self.var_tmp, "/tmp/reinforge-planted"):
            if os.path.isdir(path):
                shutil.rmtree(path)
            elif os.path.lexists(path):
                os.remove(path)
        shutil.rmtree(self.dir)


def _assert_no_pass(names, results, secret: str) -> None:
    total = TESTS.count("\nassert ")
    for name, (passed, passed_count, result_total, output, error) in zip(names, results, strict=True):
        assert (passed, passed_count, result_total) == (False, 0, total), (name, output, error)
        assert secret not in output and secret not in (error or ""), name


def _effect_outcomes(output: str) -> dict[str, str]:
    line = next(ln for ln in output.splitlines() if ln.startswith("{"))
    return json.loads(line)


# ---- as root (the uid drop on), namespaces on and off ----------------------------------------


@pytest.fixture
def root_host():
    host = Host(os.geteuid(), os.path.dirname(os.__file__))
    yield host
    host.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="as root; the unprivileged runs are below")
@pytest.mark.parametrize("namespaces", [True, False], ids=["namespaces", "no_namespaces"])
def test_guard_attacks_as_root_never_pass_and_leave_the_host_alone(root_host, namespaces: bool):
    programs = root_host.programs()
    assert len(programs) >= 40
    names = list(programs)
    results = run_many([(programs[n], TESTS) for n in names], timeout_s=3.0, workers=2,
                       namespaces=namespaces)
    _assert_no_pass(names, [(r.passed, r.passed_count, r.total, r.output, r.error) for r in results],
                    root_host.secret)
    root_host.assert_untouched()
    assert run_tests(*CORRECT, namespaces=namespaces).passed  # later verdicts are still right
    assert not run_tests(CORRECT[0].replace("7919", "7917"), TESTS, namespaces=namespaces).passed


@pytest.mark.skipif(os.geteuid() != 0, reason="as root; the unprivileged runs are below")
@pytest.mark.parametrize("hook", [True, False], ids=["hook", "hook_off"])
@pytest.mark.parametrize("namespaces", [True, False], ids=["namespaces", "no_namespaces"])
def test_every_effect_is_stopped_with_the_hook_tampered_or_off(root_host, namespaces, hook):
    off = () if hook else ("hook",)
    result = run_tests(root_host.effects(), TESTS, timeout_s=5.0, namespaces=namespaces,
                       allow_weak_sandbox=not hook, layers_off=off)
    outcomes = _effect_outcomes(result.output)
    assert len(outcomes) == 28
    assert {k: v for k, v in outcomes.items() if v == "ok"} == {}
    assert root_host.secret not in result.output
    if not hook:  # ctypes imported: the kernel, not the hook, refused each call
        assert outcomes["c_ptrace_canary"].startswith("PermissionError") or \
            outcomes["c_ptrace_canary"].startswith("OSError: [Errno 1]")
        assert "[Errno 1]" in outcomes["c_unshare_user"], outcomes
    root_host.assert_untouched()


def test_a_missing_required_layer_is_refused_unless_weak_is_allowed():
    with pytest.raises(SandboxUnavailableError, match=r"missing sandbox layers: seccomp \(seccomp: "
                                                      r"turned off by the caller\)"):
        run_tests(*CORRECT, layers_off=("seccomp",))
    assert run_tests(*CORRECT, layers_off=("seccomp",), allow_weak_sandbox=True).passed
    with pytest.raises(SandboxUnavailableError, match="filesystem .readonly_mounts: turned off"):
        run_tests(*CORRECT, layers_off=("readonly_mounts", "landlock"))
    with pytest.raises(ValueError, match="unknown layers"):
        run_tests(*CORRECT, layers_off=("uid",))
    with pytest.raises(ValueError, match="needs allow_weak_sandbox=True"):
        run_tests(*CORRECT, layers_off=("hook",))


def test_configured_default_allows_a_weak_sandbox():
    from reinforge.verifiers import code

    code.configure_sandbox(True)
    try:
        assert run_tests(*CORRECT, layers_off=("seccomp",)).passed
    finally:
        code.configure_sandbox(False)
    with pytest.raises(SandboxUnavailableError):
        run_tests(*CORRECT, layers_off=("seccomp",))


@pytest.mark.skipif(os.geteuid() != 0, reason="needs a uid drop to a uid that can write the dir")
def test_a_writable_interpreter_is_refused_even_with_a_weak_sandbox(monkeypatch):
    from reinforge.verifiers import code

    shared = tempfile.mkdtemp(prefix="reinforge-writable-", dir="/var/tmp")
    os.chmod(shared, 0o777)  # writable by the candidate's uid: like a user-owned interpreter
    try:
        monkeypatch.setattr(code, "protected_dirs", lambda: [shared])
        with pytest.raises(SandboxUnavailableError, match=f"could write to {shared}"):
            run_tests(*CORRECT, namespaces=False, allow_weak_sandbox=True, layers_off=("landlock",))
        # Any one file-system layer closes it: Landlock alone, or the read-only mounts alone
        # (which replace /tmp and /var/tmp by private tmpfs: those are not the host's any more).
        assert run_tests(*CORRECT, namespaces=False).passed
        monkeypatch.setattr(code, "protected_dirs", lambda: [shared, "/tmp", "/var/tmp"])
        assert run_tests(*CORRECT, layers_off=("landlock",)).passed
        assert os.listdir(shared) == []
    finally:
        shutil.rmtree(shared)


# ---- as an unprivileged user with a user-writable interpreter --------------------------------


@pytest.fixture(scope="module")
def nobody_python():
    """A copy of the system Python owned (and writable) by `nobody`."""
    if os.geteuid() != 0:
        pytest.skip("switching to another user needs root")
    if not os.path.exists(SYSTEM_PYTHON) or not os.path.isdir("/usr/lib/python3.11"):
        pytest.skip(f"{SYSTEM_PYTHON} and its stdlib are not installed")
    home = tempfile.mkdtemp(prefix="reinforge-nobody-python-", dir="/var/tmp")
    os.chmod(home, 0o755)
    os.makedirs(f"{home}/bin")
    os.makedirs(f"{home}/lib")
    shutil.copy2(SYSTEM_PYTHON, f"{home}/bin/python3.11")
    skip = shutil.ignore_patterns("test", "idlelib", "tkinter", "turtledemo", "ensurepip", "lib2to3",
                                  "config-3.11-*", "*.opt-1.pyc", "*.opt-2.pyc")
    shutil.copytree("/usr/lib/python3.11", f"{home}/lib/python3.11", ignore=skip, symlinks=True)
    subprocess.run(["chown", "-R", f"{NOBODY}:{NOBODY}", home], check=True)
    yield home
    shutil.rmtree(home)


DRIVER = r'''
import json, sys
sys.path.insert(0, sys.argv[1])
from sandbox_attack_programs import TESTS
from reinforge.verifiers.code import SandboxUnavailableError, run_many, run_tests
items, kwargs = json.loads(sys.stdin.read())
try:
    results = run_many([(p, TESTS) for p in items], timeout_s=5.0, workers=2, **kwargs)
except SandboxUnavailableError as err:
    print(json.dumps({"refused": str(err)}))
    raise SystemExit(0)
print(json.dumps({"results": [[r.passed, r.passed_count, r.total, r.output, r.error] for r in results]}))
'''


def _as_nobody(python: str, programs: list[str], **kwargs) -> dict:
    """Run `programs` through run_many as `nobody`, with `python` (owned by nobody)."""
    out = subprocess.run([f"{python}/bin/python3.11", "-c", DRIVER, TESTS_DIR],
                         input=json.dumps([programs, kwargs]), capture_output=True, text=True,
                         timeout=300, cwd="/", user=NOBODY, group=NOBODY, extra_groups=[],
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": REPO})
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


@pytest.fixture
def nobody_host(nobody_python):
    host = Host(NOBODY, f"{nobody_python}/lib/python3.11")
    yield host
    host.close()


@pytest.mark.parametrize("namespaces", [True, False], ids=["user_namespaces", "no_namespaces"])
def test_guard_attacks_as_an_unprivileged_user_never_pass(nobody_python, nobody_host, namespaces):
    programs = nobody_host.programs()
    names = list(programs)
    # Without namespaces a user gets no PID namespace and no uid of its own: Landlock and
    # seccomp carry the run (no opt-out needed where both hold).
    kwargs = {"namespaces": namespaces}
    got = _as_nobody(nobody_python, [programs[n] for n in names] + [nobody_host.effects()] * 2
                     + [CORRECT[0]], **kwargs)
    results = got["results"]
    _assert_no_pass(names, results[: len(names)], nobody_host.secret)
    for passed, _, _, output, _error in results[len(names):len(names) + 2]:
        assert not passed
        outcomes = _effect_outcomes(output)
        assert {k: v for k, v in outcomes.items() if v == "ok"} == {}, outcomes
    assert results[-1][0] is True, results[-1]  # a correct program still passes
    nobody_host.assert_untouched()


def test_unprivileged_runs_with_the_hook_off_are_held_by_the_kernel(nobody_python, nobody_host):
    got = _as_nobody(nobody_python, [nobody_host.effects()], layers_off=["hook"],
                     allow_weak_sandbox=True)
    outcomes = _effect_outcomes(got["results"][0][3])
    assert {k: v for k, v in outcomes.items() if v == "ok"} == {}, outcomes
    nobody_host.assert_untouched()


def test_doctor_prints_every_layer_and_whether_code_runs():
    from typer.testing import CliRunner

    from reinforge.cli import app
    from reinforge.verifiers.code_doctor import LAYERS

    result = CliRunner().invoke(app, ["doctor"])
    lines = result.output.splitlines()
    for name, _ in LAYERS:
        assert any(line.split()[0] == name for line in lines if line.strip()), name
    held = [line.split()[0] for line in lines if " available " in line]
    if result.exit_code == 0:
        assert "all held; candidate code runs here" in result.output
        assert {"seccomp", "no_new_privs"} <= set(held)
    else:  # a machine without a required layer: the line names it and the opt-out
        assert result.exit_code == 1
        assert "reward.code.allow_weak_sandbox=true" in result.output


def test_unprivileged_refusals_name_the_missing_layer(nobody_python):
    got = _as_nobody(nobody_python, [CORRECT[0]], namespaces=False, layers_off=["landlock"])
    assert "missing sandbox layers: filesystem (readonly_mounts: no mount namespace; landlock: " \
        "turned off by the caller); processes (pid_namespace: no PID namespace; uid: not root" \
        in got["refused"]
    assert f"could write to {nobody_python}/bin" in got["refused"]
    assert "reward.code.allow_weak_sandbox" not in got["refused"]  # the opt-out would not help
    got = _as_nobody(nobody_python, [CORRECT[0]], namespaces=True, layers_off=["seccomp"])
    assert "missing sandbox layers: seccomp (seccomp: turned off by the caller)" in got["refused"]
    assert "reward.code.allow_weak_sandbox=true" in got["refused"]
    # Opting out is not enough where the candidate could write to its own interpreter.
    got = _as_nobody(nobody_python, [CORRECT[0]], namespaces=False, allow_weak_sandbox=True,
                     layers_off=["landlock"])
    assert f"could write to {nobody_python}/bin" in got["refused"]
    assert "reward.code.allow_weak_sandbox" not in got["refused"]


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
