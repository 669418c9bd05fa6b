"""Run an untrusted candidate Python program against assert tests in a sandbox.

Owns the test format, the sandbox, and the verdict. A model being trained with
RL optimises whatever makes this module say "passed", so the verdict must come
from something the candidate cannot influence except by being correct.

Test format
-----------
`tests` is Python source. Each top-level `assert` statement is one test case.
Every other top-level statement (imports, helper functions, constants) is
setup: all of it runs once, in source order, before any case. Each case runs
in its own copy of the setup namespace. A `try` block or a `check(f)` call at
top level is setup, not a case; put asserts at top level to count them.

Result channel: the candidate never runs in the process that judges
--------------------------------------------------------------------
Three processes: the caller (this module), a *judge*, and a *candidate*.

* The judge is a fresh interpreter that runs only our code and the trusted
  tests. It never executes a byte of candidate code.
* The candidate process execs the program, then serves remote calls: the
  judge binds every top-level callable of the program to a proxy; calling the
  proxy sends the (encoded) arguments over a pipe and gets back an encoded
  value. Values are plain data only (None, bool, int, float, complex, str,
  bytes, list, tuple, dict, set, frozenset), decoded strictly by the judge.
* The judge evaluates each `assert` itself, on real Python values, and writes
  one JSON line per case to *its own* stdout, tagged with a per-run random
  nonce the caller passed on its stdin. The caller counts a case as passed
  only from such a line, and `passed` needs a final "done" line and no timeout.
  The caller knows the number of cases itself (it splits the tests).

So the candidate can choose its answers and nothing else. It cannot see the
expected values (they stay in the judge), cannot write to the judge's stdout
(separate process, separate pipe), and nothing it prints or returns is parsed
as a verdict. `sys.exit`, `os._exit`, killing a parent, patching builtins or
`AssertionError`, printing fake verdicts and writing to every fd all leave
the judge's verdict at "failed". Returning an object whose `__eq__` is always
true does not work either: such objects cannot be encoded.

Sandbox layers (host protection), strongest first
-------------------------------------------------
1. Linux namespaces, when `unshare` works here (probed once, see
   `namespace_prefix`): a new PID namespace (the judge is PID 1; when it dies
   the kernel kills everything left, so a fork bomb cannot outlive the run,
   and host PIDs cannot be signalled) and a new network namespace (no
   interfaces up, loopback included). As root plain `unshare`; otherwise with
   `--user --map-root-user`.
2. Processes: the judge starts in a new session, and the caller kills the
   whole process group at the wall-clock timeout. The candidate is its own
   session leader, so it cannot `setsid` out of the group the judge kills.
   Both run `sys.executable -I -S` (no user site, no site-packages, PYTHON*
   ignored) in a fresh temporary cwd that is deleted afterwards, with a
   minimal environment (PATH and locale only: no secrets inherited).
3. rlimits set in the candidate before the program runs: CPU seconds, address
   space, file size (SIGXFSZ ignored so writes fail instead of killing), core
   0 and NPROC 0 (no fork and no threads). Linux never applies RLIMIT_NPROC to
   root, so as root layer 4 and the PID namespace carry that job.
4. An audit hook (PEP 578) in the candidate, installed before the program
   runs, refusing: process creation (fork, exec, spawn, system, Popen),
   signals to other processes (`os.kill`, `os.killpg`), every `socket.*` event
   (connect, bind, getaddrinfo...), `ctypes`, importing `_posixsubprocess`,
   chdir, raising rlimits, opening anything under /proc, and writes,
   removes, renames, mkdir, chmod... outside the temporary directory
   (symlinks, hard links and `dir_fd` variants are refused outright).
   Python-level hooks are NOT a kernel sandbox: code that reaches a fresh
   copy of a builtin module (`_imp.create_builtin`), or a C extension that
   makes syscalls directly, can get around them. Without namespaces and as
   root, that is the residual risk.
5. Output: the candidate's stdout and stderr go to one pipe that the judge
   drains, keeping the first `output_bytes` and dropping the rest; messages
   from the candidate over `MAX_MESSAGE_BYTES` fail the run.

Not guaranteed: the candidate may read any file the user running this can
read (it is not a read sandbox); the candidate's program sees only the
standard library; objects that are not plain data (class instances,
generators) cannot be returned to a test, so stateful-API tests are out of
scope.
"""

from __future__ import annotations

import ast
import functools
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

DEFAULT_MEMORY_BYTES = 512 * 2**20
DEFAULT_OUTPUT_BYTES = 64 * 2**10
DEFAULT_FILE_BYTES = 16 * 2**20
# One request or answer between judge and candidate; bounds the judge's memory.
MAX_MESSAGE_BYTES = 16 * 2**20
# Error strings in results are for people; long ones are cut.
MAX_ERROR_CHARS = 500
# Data values of top-level names larger than this (encoded) are not sent to the tests.
MAX_GLOBAL_VALUE_BYTES = 64 * 2**10


@dataclass(frozen=True)
class CodeResult:
    """Outcome of running one program against one test source."""

    passed: bool  # every case passed, the judge finished, and no timeout
    passed_count: int  # cases the judge reported passed (partial credit survives a timeout)
    total: int  # number of top-level asserts in the tests, counted by the caller
    error: str | None  # first reason for failure (program error, case error, timeout), else None
    seconds: float  # wall-clock time of the whole run, startup included
    timed_out: bool  # the run hit `timeout_s` and was killed
    output: str  # the first `output_bytes` of the candidate's stdout+stderr, for debugging


@dataclass(frozen=True)
class TestSuite:
    """`tests` split by `split_tests`: setup statements and one source string per case."""

    setup: str
    cases: tuple[str, ...]


def split_tests(tests: str) -> TestSuite:
    """Split test source into setup and cases (each top-level `assert` is one case).

    Raises SyntaxError on invalid tests: tests are trusted input, and a broken
    test must not read as a failing candidate.
    """
    setup: list[str] = []
    cases: list[str] = []
    for node in ast.parse(tests).body:
        (cases if isinstance(node, ast.Assert) else setup).append(ast.unparse(node))
    return TestSuite(setup="\n".join(setup), cases=tuple(cases))


@functools.lru_cache(maxsize=1)
def namespace_prefix() -> tuple[str, ...]:
    """The `unshare` command prefix that works on this machine, or () if none does.

    Probed once per process by running a trivial interpreter under it.
    """
    unshare = shutil.which("unshare")
    if unshare is None:
        return ()
    namespaces = ["--pid", "--fork", "--kill-child", "--net"]
    attempts = [[unshare, *namespaces]] if os.geteuid() == 0 else []
    attempts.append([unshare, "--user", "--map-root-user", *namespaces])
    for prefix in attempts:
        try:
            probe = subprocess.run(
                [*prefix, sys.executable, "-I", "-S", "-c", "pass"],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                timeout=10,
                env=_minimal_env(),
            )
        except (OSError, subprocess.TimeoutExpired):
            continue
        if probe.returncode == 0:
            return tuple(prefix)
    return ()


def _minimal_env() -> dict[str, str]:
    # Nothing from the parent environment: API keys and tokens live there.
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "LC_ALL": "C.UTF-8"}


def run_tests(
    program: str,
    tests: str,
    timeout_s: float = 5.0,
    *,
    memory_bytes: int = DEFAULT_MEMORY_BYTES,
    output_bytes: int = DEFAULT_OUTPUT_BYTES,
    file_bytes: int = DEFAULT_FILE_BYTES,
    namespaces: bool = True,
) -> CodeResult:
    """Run `program` against `tests` (format in the module docstring); never raises for bad programs.

    `timeout_s` is the wall-clock budget of the whole run, interpreter
    startup included; the candidate's CPU limit is its ceiling. `namespaces`
    False skips the `unshare` layer (for testing the other layers alone).
    """
    start = time.monotonic()
    suite = split_tests(tests)
    total = len(suite.cases)
    if total == 0:
        return CodeResult(False, 0, 0, "tests contain no top-level assert", 0.0, False, "")
    nonce = secrets.token_hex(16)
    payload = json.dumps(
        {
            "nonce": nonce,
            "program": program,
            "setup": suite.setup,
            "cases": list(suite.cases),
            "timeout_s": timeout_s,
            "memory_bytes": memory_bytes,
            "output_bytes": output_bytes,
            "file_bytes": file_bytes,
            "max_message": MAX_MESSAGE_BYTES,
            "max_global": MAX_GLOBAL_VALUE_BYTES,
            "max_error": MAX_ERROR_CHARS,
        }
    ).encode()
    prefix = namespace_prefix() if namespaces else ()
    workdir = tempfile.mkdtemp(prefix="reinforge-code-")
    timed_out = False
    try:
        judge = subprocess.Popen(
            [*prefix, sys.executable, "-I", "-S", "-c", _CODEC_SRC + _JUDGE_SRC],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=workdir,
            env=_minimal_env(),
            start_new_session=True,
            close_fds=True,
        )
        try:
            out, err = judge.communicate(payload, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(judge.pid)
            out, err = judge.communicate()
        records = _read_records(out, nonce)
        if timed_out and not prefix:
            # Without a PID namespace the candidate (its own session) outlives the judge.
            for rec in records:
                if rec.get("kind") == "pid" and isinstance(rec.get("pid"), int):
                    _kill_group(rec["pid"])
    finally:
        _remove_tree(workdir)
    return _verdict(
        records, total, timed_out, timeout_s, judge.returncode, err, time.monotonic() - start
    )


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _remove_tree(path: str) -> None:
    def make_writable_and_retry(func, failed_path, _exc_info) -> None:
        # The candidate may have chmod-ed its own files read-only.
        os.chmod(os.path.dirname(failed_path), 0o700)
        func(failed_path)

    shutil.rmtree(path, onerror=make_writable_and_retry)


def _read_records(out: bytes, nonce: str) -> list[dict]:
    # Only lines carrying this run's nonce count (defence in depth: only the
    # judge can write to this pipe in the first place).
    records = []
    for line in out.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and rec.get("nonce") == nonce:
            records.append(rec)
    return records


def _verdict(
    records: list[dict],
    total: int,
    timed_out: bool,
    timeout_s: float,
    returncode: int | None,
    stderr: bytes,
    seconds: float,
) -> CodeResult:
    passed_cases: set[int] = set()
    first_error: str | None = None
    done: dict | None = None
    for rec in records:
        kind, index = rec.get("kind"), rec.get("index")
        if kind == "case" and isinstance(index, int) and 0 <= index < total:
            if rec.get("ok") is True:
                passed_cases.add(index)
            elif first_error is None:
                first_error = f"case {index}: {rec.get('error')}"
        elif kind == "done":
            done = rec
    output = str(done.get("output", "")) if done else ""
    if timed_out:
        error = f"timed out after {timeout_s}s"
    elif done is None:
        tail = stderr.decode(errors="replace")[-MAX_ERROR_CHARS:]
        error = f"judge exited without a verdict (rc={returncode}): {tail}"
    elif done.get("error"):
        error = str(done["error"])
    else:
        error = first_error
    passed = done is not None and not timed_out and len(passed_cases) == total
    return CodeResult(
        passed, len(passed_cases), total, None if passed else error, seconds, timed_out, output
    )


def run_many(
    items: list[tuple[str, str]], timeout_s: float = 5.0, workers: int = 2, **kwargs
) -> list[CodeResult]:
    """`run_tests` over (program, tests) pairs, `workers` at a time; results in input order.

    Threads are enough: each run is its own sandboxed process tree.
    """
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        return list(pool.map(lambda item: run_tests(item[0], item[1], timeout_s, **kwargs), items))


_FENCED = re.compile(r"```[ \t]*(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL)


def extract_program(completion: str) -> str:
    """The last ```python (or bare ```) fenced block of `completion`, else the whole text."""
    blocks = _FENCED.findall(completion)
    return blocks[-1] if blocks else completion


def code_reward(completion: str, tests: str, timeout_s: float = 5.0) -> float:
    """1.0 if the program extracted from `completion` passes every case, else 0.0.

    All-or-nothing on purpose: a fractional reward pays for passing the easy
    cases (or special-casing visible ones), which is not the task.
    """
    return 1.0 if run_tests(extract_program(completion), tests, timeout_s).passed else 0.0


# ---------------------------------------------------------------------------
# Sources run in the subprocesses (as `python -I -S -c SRC`). The codec is
# shared: the candidate encodes with it, the judge decodes strictly with it.
# ---------------------------------------------------------------------------

_CODEC_SRC = r"""
import json as _json
import os as _os


class ProtocolError(Exception):
    pass


def encode(x, depth=0):
    if depth > 200:
        raise TypeError("value nested too deeply")
    if x is None:
        return ["N"]
    if isinstance(x, bool):
        return ["B", bool(x)]
    if isinstance(x, int):
        return ["I", hex(int(x))]  # hex: str(int) is capped at 4300 digits
    if isinstance(x, float):
        return ["F", float(x).hex()]  # exact, and covers inf and nan
    if isinstance(x, complex):
        return ["C", x.real.hex(), x.imag.hex()]
    if isinstance(x, str):
        return ["S", str.__str__(x)]
    if isinstance(x, (bytes, bytearray)):
        return ["Y", bytes(x).hex()]
    for kind, tag in ((tuple, "T"), (list, "L"), (frozenset, "Z"), (set, "E")):
        if isinstance(x, kind):
            return [tag, [encode(v, depth + 1) for v in x]]
    if isinstance(x, dict):
        return ["D", [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in x.items()]]
    raise TypeError(f"a {type(x).__name__} cannot cross the sandbox boundary (plain data only)")


def decode(x):
    # Strict: anything unexpected is a protocol error, never code.
    if type(x) is not list or not x or type(x[0]) is not str:
        raise ProtocolError("bad value")
    tag, rest = x[0], x[1:]
    try:
        if tag == "N" and not rest:
            return None
        if tag == "B" and type(rest[0]) is bool:
            return rest[0]
        if tag == "I":
            return int(rest[0], 16)
        if tag == "F":
            return float.fromhex(rest[0])
        if tag == "C":
            return complex(float.fromhex(rest[0]), float.fromhex(rest[1]))
        if tag == "S" and type(rest[0]) is str:
            return rest[0]
        if tag == "Y":
            return bytes.fromhex(rest[0])
        if tag in "TLZE" and len(tag) == 1 and type(rest[0]) is list:
            items = [decode(v) for v in rest[0]]
            return {"T": tuple, "L": list, "Z": frozenset, "E": set}[tag](items)
        if tag == "D" and type(rest[0]) is list:
            return {decode(k): decode(v) for k, v in rest[0]}
    except (IndexError, TypeError, ValueError, RecursionError) as exc:
        raise ProtocolError(f"bad {tag} value: {exc}") from None
    raise ProtocolError(f"bad tag {tag!r}")


def send(fd, obj):
    data = _json.dumps(obj).encode()
    data = len(data).to_bytes(8, "big") + data
    while data:
        data = data[_os.write(fd, data):]


def recv(fd, limit):
    def exactly(n):
        chunks, left = [], n
        while left:
            chunk = _os.read(fd, min(left, 1 << 20))
            if not chunk:
                raise EOFError("peer closed the pipe")
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)

    size = int.from_bytes(exactly(8), "big")
    if size > limit:
        raise ProtocolError(f"message of {size} bytes is over the {limit} byte limit")
    try:
        return _json.loads(exactly(size))
    except (ValueError, RecursionError) as exc:
        raise ProtocolError(f"bad message: {exc}") from None
"""

_CHILD_SRC = r"""
import sys, os


def _serve():
    import resource, _signal
    req_fd, resp_fd, cpu_s, mem, fsize, wall, limit, max_global, max_error = map(int, sys.argv[1:10])
    workdir = os.path.realpath(os.getcwd())
    for res, value in ((resource.RLIMIT_CPU, (cpu_s, cpu_s + 1)), (resource.RLIMIT_AS, (mem, mem)),
                       (resource.RLIMIT_FSIZE, (fsize, fsize)), (resource.RLIMIT_CORE, (0, 0)),
                       (resource.RLIMIT_NPROC, (0, 0))):
        resource.setrlimit(res, value)
    _signal.signal(_signal.SIGXFSZ, _signal.SIG_IGN)  # oversize writes fail, not kill
    _signal.alarm(wall)  # last resort if the judge is gone and nothing else kills us

    # Everything the hook uses is captured now: the program may patch modules later.
    _isinstance, _str, _bytes, _int, _fspath = isinstance, str, bytes, int, os.fspath
    _decode, _perm = bytes.decode, PermissionError
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
    refused = frozenset((
        "os.fork", "os.forkpty", "os.exec", "os.spawn", "os.posix_spawn", "os.system",
        "subprocess.Popen", "pty.spawn", "os.kill", "os.killpg", "os.chdir", "os.chroot",
        "os.link", "os.symlink", "resource.setrlimit", "resource.prlimit", "sys.addaudithook",
        "os.startfile", "os.lchmod", "os.chflags", "os.lchflags",
    ))
    refused_imports = frozenset(("ctypes", "_ctypes", "_posixsubprocess", "multiprocessing",
                                 "_multiprocessing"))
    # event -> (indexes of path arguments, indexes of dir_fd arguments)
    path_events = {
        "os.remove": ((0,), (1,)), "os.rmdir": ((0,), (1,)), "os.mkdir": ((0,), (2,)),
        "os.rename": ((0, 1), (2, 3)), "os.chmod": ((0,), (2,)), "os.chown": ((0,), (3,)),
        "os.utime": ((0,), (3,)), "os.truncate": ((0,), ()), "os.mkfifo": ((0,), (2,)),
        "os.mknod": ((0,), (3,)), "os.setxattr": ((0,), ()), "os.removexattr": ((0,), ()),
    }

    def absolute(path):
        if not _isinstance(path, (_str, _bytes)):
            path = _fspath(path)
        if _isinstance(path, _bytes):
            path = _decode(path, "utf-8", "surrogateescape")
        return path if path.startswith("/") else workdir + "/" + path

    def inside(path):
        if _isinstance(path, _int):
            return True  # an fd already held: it was checked when opened
        path = absolute(path)
        return ".." not in path.split("/") and (path == workdir or path.startswith(workdir + "/"))

    def hook(event, args):
        if event in refused or event.startswith(("socket.", "ctypes.")):
            raise _perm(f"sandbox: {event} is not allowed")
        if event == "import" and (args[0] in refused_imports or args[0].startswith("ctypes.")):
            raise _perm(f"sandbox: importing {args[0]} is not allowed")
        if event == "open":
            path, mode, flags = args
            if _isinstance(path, _int):
                return
            full = absolute(path)
            if full == "/proc" or full.startswith("/proc/"):
                raise _perm("sandbox: /proc is not readable")
            writing = (flags & write_flags) if _isinstance(flags, _int) else any(
                c in (mode or "") for c in "wax+")
            # os.open (mode None) may carry a dir_fd the event does not show: absolute paths only.
            relative_os_open = mode is None and absolute(path) != path
            if writing and (relative_os_open or not inside(path)):
                raise _perm(f"sandbox: writing {path!r} is not allowed")
            return
        spec = path_events.get(event)
        if spec is not None:
            paths, dir_fds = spec
            for i in dir_fds:
                if i < len(args) and args[i] is not None:
                    raise _perm(f"sandbox: {event} with dir_fd is not allowed")
            for i in paths:
                if not inside(args[i]):
                    raise _perm(f"sandbox: {event} outside the work directory is not allowed")

    sys.addaudithook(hook)

    def describe(exc):
        try:
            text = f"{type(exc).__name__}: {exc}"
        except BaseException:
            text = type(exc).__name__
        return text[:max_error]

    namespace = {"__name__": "__candidate__", "__builtins__": __builtins__}
    request = recv(req_fd, limit)
    try:
        exec(compile(request["program"], "<candidate>", "exec"), namespace)
    except BaseException as exc:
        send(resp_fd, {"id": request["id"], "ok": False, "error": describe(exc)})
        return
    names = {}
    for name, value in list(namespace.items()):
        if name.startswith("__"):
            continue
        if callable(value):
            names[name] = ["callable"]
            continue
        try:
            encoded = encode(value)
        except (TypeError, RecursionError):
            continue
        if len(_json.dumps(encoded)) <= max_global:
            names[name] = encoded
    send(resp_fd, {"id": request["id"], "ok": True, "names": names})
    while True:
        try:
            request = recv(req_fd, limit)
        except EOFError:
            return
        try:
            args = [decode(a) for a in request["args"]]
            kwargs = {k: decode(v) for k, v in request["kwargs"].items()}
            reply = {"ok": True, "value": encode(namespace[request["name"]](*args, **kwargs))}
        except BaseException as exc:
            reply = {"ok": False, "exc": type(exc).__name__, "error": describe(exc)}
        send(resp_fd, {"id": request["id"], **reply})


try:
    _serve()
finally:
    try:  # os._exit skips interpreter shutdown, so flush what the program printed
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:
        pass
    os._exit(0)
"""

_JUDGE_SRC = r'''
import builtins, json, math, os, resource, subprocess, sys, threading


class CandidateError(Exception):
    """The candidate raised an exception that is not a builtin Exception type."""


class CandidateGone(Exception):
    """The candidate process died or broke the protocol; no further calls are possible."""


def main():
    p = json.loads(sys.stdin.buffer.read())
    nonce, limit, max_error = p["nonce"], p["max_message"], p["max_error"]
    cpu_s = max(1, math.ceil(p["timeout_s"]))
    # The judge runs trusted code only; its limits just bound a runaway judge.
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s + 1, cpu_s + 1))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    def emit(**rec):
        rec["nonce"] = nonce
        data = (json.dumps(rec) + "\n").encode()
        while data:
            data = data[os.write(1, data):]

    req_r, req_w = os.pipe()
    resp_r, resp_w = os.pipe()
    child = subprocess.Popen(
        [sys.executable, "-I", "-S", "-c", CODEC_SRC + CHILD_SRC, str(req_r), str(resp_w),
         str(cpu_s), str(p["memory_bytes"]), str(p["file_bytes"]), str(cpu_s + 2), str(limit),
         str(p["max_global"]), str(max_error)],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        pass_fds=(req_r, resp_w), env={"PATH": "/usr/bin:/bin", "LC_ALL": "C.UTF-8"},
        start_new_session=True,  # a session leader cannot setsid() out of its group
    )
    os.close(req_r)
    os.close(resp_w)
    emit(kind="pid", pid=child.pid)

    head = bytearray()

    def drain():
        # Keep the first output_bytes, read and drop the rest so the candidate never blocks.
        while True:
            chunk = child.stdout.read1(1 << 16)
            if not chunk:
                return
            room = p["output_bytes"] - len(head)
            if room > 0:
                head.extend(chunk[:room])

    drainer = threading.Thread(target=drain, daemon=True)
    drainer.start()

    state = {"next_id": 0, "gone": None}

    def exchange(message):
        if state["gone"]:
            raise CandidateGone(state["gone"])
        message["id"] = state["next_id"]
        state["next_id"] += 1
        try:
            send(req_w, message)
            reply = recv(resp_r, limit)
            if type(reply) is not dict or reply.get("id") != message["id"]:
                raise ProtocolError("reply out of order")
        except (OSError, EOFError, ProtocolError) as exc:
            state["gone"] = f"candidate process gone: {exc}"
            raise CandidateGone(state["gone"]) from None
        return reply

    def proxy_for(name):
        def proxy(*args, **kwargs):
            reply = exchange({"name": name, "args": [encode(a) for a in args],
                              "kwargs": {str(k): encode(v) for k, v in kwargs.items()}})
            if reply.get("ok") is True:
                try:
                    return decode(reply.get("value"))
                except ProtocolError as exc:
                    state["gone"] = f"candidate process gone: {exc}"
                    raise CandidateGone(state["gone"]) from None
            # Re-raise builtin exception types by name so tests can catch e.g. ValueError.
            kind = getattr(builtins, str(reply.get("exc")), None)
            exc_type = kind if isinstance(kind, type) and issubclass(kind, Exception) \
                and kind is not AssertionError else CandidateError
            raise exc_type(str(reply.get("error"))[:max_error])
        proxy.__name__ = name
        return proxy

    def describe(exc):
        return f"{type(exc).__name__}: {exc}"[:max_error]

    def finish(error=None):
        os.close(req_w)  # the candidate sees EOF, flushes its output and exits
        try:
            child.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(child.pid, 9)
        except (ProcessLookupError, PermissionError):
            pass
        child.wait()
        drainer.join(timeout=1.0)
        emit(kind="done", error=error, output=bytes(head).decode("utf-8", "replace"))

    try:
        loaded = exchange({"program": p["program"]})
    except CandidateGone as exc:
        return finish(f"program did not load: {exc}")
    if loaded.get("ok") is not True:
        return finish(f"program raised: {str(loaded.get('error'))[:max_error]}")
    env = {"__name__": "__tests__", "__builtins__": builtins}
    names = loaded.get("names")
    for name, value in (names.items() if type(names) is dict else ()):
        try:
            env[name] = proxy_for(name) if value == ["callable"] else decode(value)
        except ProtocolError:
            continue
    try:
        exec(compile(p["setup"], "<tests setup>", "exec"), env)
    except Exception as exc:
        return finish(f"test setup raised: {describe(exc)}")
    for index, case in enumerate(p["cases"]):
        try:
            exec(compile(case, f"<case {index}>", "exec"), dict(env))
        except Exception as exc:
            emit(kind="case", index=index, ok=False, error=describe(exc))
        else:
            emit(kind="case", index=index, ok=True)
    finish()


main()
'''

# The judge builds the candidate's command line from these two sources.
_JUDGE_SRC = f"CODEC_SRC = {_CODEC_SRC!r}\nCHILD_SRC = {_CHILD_SRC!r}\n" + _JUDGE_SRC
