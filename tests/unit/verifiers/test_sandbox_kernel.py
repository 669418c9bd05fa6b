"""The kernel layers of the code sandbox (reinforge/verifiers/sandbox/kernel.py), each alone.

Each layer is installed in a fresh subprocess (it cannot be removed again) and its
refusals are checked call by call; the syscall table is checked against the kernel
headers where they are installed.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import textwrap

import pytest
from repo_paths import REPO as REPO_PATH

from reinforge.verifiers.sandbox import kernel, seccomp

REPO = str(REPO_PATH)


# Prepended to each script: how one call ended, "ok" or the errno's name.
OUTCOME = """
import errno
def outcome(fn):
    try:
        fn()
        return "ok"
    except OSError as exc:
        return errno.errorcode[exc.errno]
"""


def _in_subprocess(script: str) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": REPO}
    return subprocess.run([sys.executable, "-c", OUTCOME + textwrap.dedent(script)],
                          capture_output=True, text=True, timeout=60, env=env)


def _header_numbers(path: str) -> dict[str, int]:
    with open(path) as fh:
        return {m[1]: int(m[2]) for m in re.finditer(r"#define __NR3?2?_(\w+)\s+(\d+)\b", fh.read())}


@pytest.mark.parametrize("arch,header", [
    ("x86_64", "/usr/include/x86_64-linux-gnu/asm/unistd_64.h"),
    ("aarch64", "/usr/include/asm-generic/unistd.h"),  # arm64 uses the generic table
])
def test_syscall_numbers_match_the_kernel_headers(arch: str, header: str):
    if not os.path.exists(header):
        pytest.skip(f"{header} is not installed")
    numbers = _header_numbers(header)
    index = 0 if arch == "x86_64" else 1
    checked = 0
    for name, pair in seccomp.SYSCALLS.items():
        if name in numbers:
            assert pair[index] == numbers[name], (arch, name)
            checked += 1
        else:
            assert pair[index] is None or name in ("memfd_secret",), (arch, name)
    assert checked >= 80


def test_filter_jumps_stay_inside_their_rule_and_end_in_allow():
    for arch in seccomp.AUDIT_ARCH:
        prog = seccomp.seccomp_filter(arch, 1234)
        assert prog[0] == (0x20, 0, 0, 4)  # load the architecture first
        assert prog[2] == (0x06, 0, 0, seccomp.RET_KILL_PROCESS)
        assert prog[-1] == (0x06, 0, 0, seccomp.RET_ALLOW)
        for i, (code, jt, jf, _k) in enumerate(prog):
            if code in (0x15, 0x35, 0x45):
                assert i + 1 + max(jt, jf) < len(prog)
    # every denied call has a rule on x86_64: count the JEQs on syscall numbers
    denied = {seccomp.SYSCALLS[n][0] for n in seccomp.DENIED}
    x86 = seccomp.seccomp_filter("x86_64", 1234)
    assert denied <= {k for code, _, _, k in x86 if code == 0x15}


@pytest.mark.skipif(seccomp.machine_arch() is None, reason="no syscall table for this machine")
def test_seccomp_filter_refuses_each_dangerous_call_and_allows_the_rest():
    result = _in_subprocess("""
        import ctypes, errno, os, resource, socket, sys
        from reinforge.verifiers.sandbox import kernel, seccomp
        libc = kernel.Libc()
        kernel.no_new_privs(libc)
        seccomp.install_seccomp(libc, seccomp.machine_arch(), os.getpid())
        raw = ctypes.CDLL(None, use_errno=True)
        raw.syscall.restype = ctypes.c_long
        def sys_call(nr, *args):
            def call():
                if raw.syscall(ctypes.c_long(nr), *[ctypes.c_long(a) for a in args]) < 0:
                    raise OSError(ctypes.get_errno(), "")
            return call
        nr = lambda name: seccomp.SYSCALLS[name][0 if seccomp.machine_arch() == "x86_64" else 1]
        checks = {
            "fork": outcome(os.fork),
            "exec": outcome(lambda: os.execv("/bin/true", ["true"])),
            "inet_socket": outcome(lambda: socket.socket(socket.AF_INET, socket.SOCK_STREAM)),
            "unix_socket": outcome(lambda: socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)),
            "unix_pair": outcome(lambda: [s.close() for s in socket.socketpair()]),
            "kill_self_0": outcome(lambda: os.kill(os.getpid(), 0)),
            "kill_init": outcome(lambda: os.kill(1, 0)),
            "kill_all": outcome(lambda: os.kill(-1, 0)),
            "kill_group": outcome(lambda: os.kill(0, 0)),
            "memfd": outcome(lambda: os.memfd_create("x")),
            "mkfifo": outcome(lambda: os.mkfifo("/nonexistent/fifo")),
            "symlink": outcome(lambda: os.symlink("/", "/nonexistent/link")),
            # a bad pointer: EFAULT if the filter let the call through
            "setrlimit": outcome(sys_call(nr("setrlimit"), 4, 8)),
            "prlimit_set": outcome(sys_call(nr("prlimit64"), 0, 4, 8, 0)),
            "getrlimit": outcome(lambda: resource.getrlimit(resource.RLIMIT_CORE)),
            "prlimit_other": outcome(lambda: resource.prlimit(1, resource.RLIMIT_CORE)),
            "setpriority": outcome(lambda: os.setpriority(os.PRIO_PROCESS, 0, 1)),
            "affinity": outcome(lambda: os.sched_setaffinity(0, {0})),
            "ptrace": outcome(sys_call(nr("ptrace"), 16, 1, 0, 0)),  # PTRACE_ATTACH init
            "unshare": outcome(sys_call(nr("unshare"), 0x20000)),
            "mount": outcome(sys_call(nr("mount"), 0, 0, 0, 0, 0)),
            "bpf": outcome(sys_call(nr("bpf"), 0, 0, 0)),
            "clone3": outcome(sys_call(nr("clone3"), 0, 0)),
            "personality_set": outcome(sys_call(nr("personality"), 0x0040000)),
            "personality_query": outcome(sys_call(nr("personality"), 0xFFFFFFFF)),
            "ioctl_tiocsti": outcome(sys_call(nr("ioctl"), 0, 0x5412, 0)),
            "ioctl_tiocsti_high_bits": outcome(sys_call(nr("ioctl"), 0, (1 << 32) | 0x5412, 0)),
            "getpid": outcome(sys_call(39 if seccomp.machine_arch() == "x86_64" else 172)),
        }
        if seccomp.machine_arch() == "x86_64":
            checks["x32_getpid"] = outcome(sys_call(0x40000000 | 39))
        print(checks)
    """)
    assert result.returncode == 0, result.stderr
    checks = eval(result.stdout)  # noqa: S307 - our own subprocess's dict of strings
    assert checks.pop("kill_self_0") == "ok"
    assert checks.pop("getrlimit") == "ok"
    assert checks.pop("unix_pair") == "ok"
    assert checks.pop("getpid") == "ok"
    assert checks.pop("personality_query") == "ok"
    assert checks.pop("clone3") == "ENOSYS"  # so that the C library falls back to clone
    # ioctl on fd 0 that is not a terminal: a call the filter lets through fails with ENOTTY.
    assert checks == {name: "EPERM" for name in checks}, checks


def _landlock_abi() -> int:
    try:
        return kernel.landlock_abi(kernel.Libc())
    except OSError:
        return 0


@pytest.mark.skipif(_landlock_abi() < 1, reason="Landlock is not available in this kernel")
def test_landlock_allows_reads_and_writes_only_where_granted(tmp_path):
    (tmp_path / "ro").mkdir()
    (tmp_path / "rw").mkdir()
    (tmp_path / "ro" / "f").write_text("readable")
    (tmp_path / "outside").write_text("secret")
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    try:
        result = _in_subprocess(f"""
            import errno, os, socket, sys
            from reinforge.verifiers.sandbox import kernel, seccomp
            libc = kernel.Libc()
            kernel.no_new_privs(libc)
            stdlib = [os.path.realpath(p) for p in sys.path if p and os.path.isdir(p)]
            rules = [({str(tmp_path / 'ro')!r}, kernel.READ_RIGHTS),
                     ({str(tmp_path / 'rw')!r}, kernel.WORKDIR_RIGHTS),
                     *((p, kernel.READ_RIGHTS) for p in stdlib)]
            abi = kernel.install_landlock(libc, rules)
            print({{
                "abi": abi,
                "read_ro": outcome(lambda: open({str(tmp_path / 'ro' / 'f')!r}).read()),
                "write_ro": outcome(lambda: open({str(tmp_path / 'ro' / 'g')!r}, "w")),
                "read_outside": outcome(lambda: open({str(tmp_path / 'outside')!r}).read()),
                "write_rw": outcome(lambda: open({str(tmp_path / 'rw' / 'g')!r}, "w").write("x")),
                "truncate_outside": outcome(lambda: os.truncate({str(tmp_path / 'outside')!r}, 0)),
                "remove_outside": outcome(lambda: os.remove({str(tmp_path / 'outside')!r})),
                "etc_passwd": outcome(lambda: open("/etc/passwd").read()),
                "tmpfile_in_ro": outcome(lambda: os.close(os.open({str(tmp_path / 'ro')!r},
                                                                  os.O_TMPFILE | os.O_WRONLY))),
                "tcp_connect": outcome(lambda: socket.create_connection(("127.0.0.1", {port}))),
                "signal_parent": outcome(lambda: os.kill(os.getppid(), 0)),
                "writable_paths": kernel.writable_paths([{str(tmp_path / 'ro')!r},
                                                         {str(tmp_path / 'rw')!r},
                                                         {str(tmp_path / 'ro' / 'f')!r},
                                                         {str(tmp_path / 'rw' / 'g')!r}]),
            }})
        """)
    finally:
        listener.close()
    assert result.returncode == 0, result.stderr
    got = eval(result.stdout)  # noqa: S307 - our own subprocess's dict
    abi = got.pop("abi")
    assert got.pop("read_ro") == "ok" and got.pop("write_rw") == "ok"
    assert got.pop("writable_paths") == [str(tmp_path / "rw"), str(tmp_path / "rw" / "g")]
    if abi < 4:
        assert got.pop("tcp_connect") == "ok"
    if abi < 6:
        assert got.pop("signal_parent") == "ok"
    if abi >= 6:
        assert got.pop("signal_parent") == "EPERM"  # scoped: the parent is outside the domain
    assert got == {name: "EACCES" for name in got}, got
    assert (tmp_path / "outside").read_text() == "secret"


def test_missing_layers_names_each_group_and_why():
    layers = {"seccomp": True, "no_new_privs": True, "readonly_mounts": "no mount namespace",
              "landlock": "Landlock is not available", "pid_namespace": True, "uid": "not root"}
    assert kernel.missing_layers(layers, ("seccomp", "no_new_privs", "processes")) == []
    assert kernel.missing_layers(layers, ("filesystem",)) == [
        "filesystem (readonly_mounts: no mount namespace; landlock: Landlock is not available)"]
    assert kernel.missing_layers({}, ("seccomp",)) == ["seccomp (seccomp: not attempted)"]
    # processes: a PID namespace, a uid of its own, or seccomp and Landlock together
    weak = {"seccomp": True, "landlock": True, "pid_namespace": "no PID namespace", "uid": "not root"}
    assert kernel.missing_layers(weak, ("processes",)) == []
    weak["landlock"] = "off"
    assert kernel.missing_layers(weak, ("processes",)) == [
        "processes (pid_namespace: no PID namespace; uid: not root; landlock: off)"]


@pytest.mark.skipif(os.geteuid() != 0, reason="a mount namespace of its own needs root here")
def test_remount_fallback_makes_every_mount_read_only():
    # Kernels before 5.12 have no mount_setattr: each mount is remounted read-only on its own.
    result = subprocess.run(
        ["unshare", "--mount", sys.executable, "-c", textwrap.dedent("""
            import errno, os
            from reinforge.verifiers.sandbox import kernel, seccomp
            libc = kernel.Libc()
            libc.mount(None, "/", None, kernel.MS_REC | kernel.MS_PRIVATE)
            kernel._remount_each_read_only(libc)
            out = []
            for path in ("/var/tmp/reinforge-ro-probe", "/dev/shm/reinforge-ro-probe"):
                try:
                    open(path, "w")
                    out.append("ok")
                except OSError as exc:
                    out.append(errno.errorcode[exc.errno])
            print(out)
        """)], capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": REPO})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "['EROFS', 'EROFS']"
    assert not os.path.exists("/var/tmp/reinforge-ro-probe")


def test_inside_the_sandbox_the_root_is_read_only_and_the_work_directory_noexec():
    from reinforge.verifiers.code import probe_layers, run_tests

    if probe_layers(True).get("readonly_mounts") is not True:
        pytest.skip("no mount namespace here")
    program = ("import os\ndef flags(p):\n    f = os.statvfs(p).f_flag\n"
               "    return [bool(f & os.ST_RDONLY), bool(f & os.ST_NOEXEC), bool(f & os.ST_NOSUID)]\n")
    tests = ("assert flags('/')[0] is True\nassert flags('.') == [False, True, True]\n"
             "assert flags('/tmp') == [False, True, True]\nassert flags('/dev/shm') == [False, True, True]\n")
    result = run_tests(program, tests)
    assert (result.passed, result.passed_count) == (True, 4), result
