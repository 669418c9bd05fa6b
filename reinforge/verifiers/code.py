"""Run an untrusted candidate Python program against assert tests in a sandbox.

Owns the test format, which names the tests take from the candidate, the
choice of sandbox layers on this machine, and the verdict. A model trained
with RL optimises whatever makes this module say "passed", so the verdict
must come from something the candidate cannot influence except by being
correct. How each layer works, and what is not guaranteed: docs/security.md.

Test format
-----------
`tests` is Python source. Each top-level `assert` statement is one test case.
Every other top-level statement (imports, helper functions, constants) is
setup: all of it runs once, in source order, before any case. Each case runs
in its own copy of the setup namespace. A `try` block or a `check(f)` call at
top level is setup, not a case; put asserts at top level to count them.

Which names the tests see from the candidate
--------------------------------------------
Only `candidate_names(tests)`: the names the tests load (anywhere: cases, setup,
helper bodies) minus every name the tests bind themselves (assignments,
defs, imports, parameters, loop and comprehension variables, in any scope)
minus the builtins. A builtin the tests call is always the real one, and a
test helper is always the tests' own: a candidate that defines `abs`, `len`,
`sorted` or `check` changes nothing in the tests. A name the candidate binds
to a module of the same name (`import math`, for tests that call
`math.isclose` without importing it) is imported by the judge itself, so
only the real module under the tests' own name can appear. A task whose entry point
is named like a builtin (`def sum(...)`) cannot be tested under that name,
and tests that reach candidate names only through strings (`eval("f(1)")`,
`globals()["f"]`) do not see them.

Result channel: the candidate never runs in the process that judges
--------------------------------------------------------------------
Three processes: the caller (this module), a *judge* (sandbox/judge.py) and a
*candidate* (sandbox/candidate.py). The judge runs only our code and the
trusted tests; the names above are bound to proxies that call into the
candidate over a pipe and get back plain data (None, bool, int, float,
complex, str, bytes, range, list, tuple, dict, set, frozenset, dict views (as views
of a fresh dict: set-like comparisons hold as in plain Python), and iterators
as the items they yield), decoded strictly.
The judge evaluates each assert on real Python values and writes one JSON
line per case to its own stdout, tagged with a per-run random nonce that
only the caller and the judge know. The caller counts a case as passed only
from such a line, and `passed` needs a final "done" line and no timeout; it
knows the number of cases itself. So the candidate can choose its answers
and nothing else: an `__eq__` that is always true cannot be encoded, printed
verdicts land in another pipe, exiting or killing anything leaves "failed".

Host protection, in layers (docs/security.md; `reinforge doctor` lists them here)
-----------------------------------------------------------------------------------
1. Namespaces (`unshare`): the judge is PID 1 of a new PID and network
   namespace (its death kills everything left); the candidate is PID 1 of
   a further PID, mount (fresh /proc: no host process visible), network
   and IPC namespace, in which every mount is read-only and /tmp, /dev/shm
   and its work directory are private tmpfs.
2. Kernel layers the candidate cannot undo (sandbox/kernel.py, seccomp.py): a seccomp
   filter, Landlock, no_new_privs, no capabilities.
3. An unprivileged uid of its own for the candidate (when we are root), a
   non-dumpable judge: /proc/<judge>/mem, environ and fd are unreadable and
   other processes cannot be signalled even where a path slips through.
4. rlimits: CPU, address space, file size, no new processes, 256 fds.
5. An audit hook (sandbox/guard.py), a fast first filter deciding reads
   (allow-list) and writes (work directory only) on resolved paths, refusing
   process creation, signals, sockets, ctypes and object hunting.
6. A fresh work directory, a minimal environment (no secrets inherited),
   `-I -S -B` interpreters, no inherited descriptors, capped output, a
   wall-clock timeout that kills the whole process group.

A run needs seccomp, no_new_privs, a file-system layer (read-only mounts or
Landlock) and a process layer (PID namespace, uid, or seccomp with Landlock):
where one is missing,
`run_tests` raises `SandboxUnavailableError` naming it, unless the caller
opts out with `allow_weak_sandbox` (config `reward.code.allow_weak_sandbox`).
Whatever the opt-out, the candidate refuses to run when it could write to
the interpreter's or reinforge's directories.
"""

from __future__ import annotations

import ast
import builtins
import json
import logging
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

from reinforge.verifiers.sandbox import CANDIDATE_BOOT, CANDIDATE_CODE, JUDGE_SRC
from reinforge.verifiers.sandbox_layers import (  # noqa: F401 - namespace_prefix, sandbox_plan: public here
    OPTIONAL_LAYERS,
    REQUIRED_LAYER_GROUPS,
    SANDBOX_UID_BASE,
    SANDBOX_UID_SPAN,
    SandboxPlan,
    SandboxUnavailableError,
    allow_weak_default,
    configure_sandbox,
    minimal_env,
    namespace_prefix,
    protected_dirs,
    sandbox_plan,
    sandbox_settings,
    warn_missing_layers,
)

log = logging.getLogger(__name__)

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

def candidate_names(tests: str) -> tuple[str, ...]:
    """The names the tests take from the candidate (the rule is in the module docstring), sorted."""
    loaded: set[str] = set()
    bound: set[str] = set()
    for node in ast.walk(ast.parse(tests)):
        if isinstance(node, ast.Name):
            (loaded if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.alias):
            bound.add(node.asname or node.name.split(".")[0])
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
        elif isinstance(node, (ast.MatchAs, ast.MatchStar)) and node.name:
            bound.add(node.name)
        elif isinstance(node, ast.MatchMapping) and node.rest:
            bound.add(node.rest)
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            bound.update(node.names)
    return tuple(sorted(loaded - bound - set(dir(builtins))))

def run_tests(
    program: str,
    tests: str,
    timeout_s: float = 5.0,
    *,
    memory_bytes: int = DEFAULT_MEMORY_BYTES,
    output_bytes: int = DEFAULT_OUTPUT_BYTES,
    file_bytes: int = DEFAULT_FILE_BYTES,
    namespaces: bool = True,
    allow_weak_sandbox: bool | None = None,
    layers_off: frozenset[str] | tuple[str, ...] = (),
) -> CodeResult:
    """Run `program` against `tests` (format in the module docstring); never raises for bad programs.

    `timeout_s` is the wall-clock budget of the whole run, interpreter
    startup included; the candidate's CPU limit is its ceiling. `namespaces`
    False skips the `unshare` layers and `layers_off` names others to skip
    (OPTIONAL_LAYERS), for testing the remaining layers alone.
    Raises SandboxUnavailableError when a required layer is missing and
    `allow_weak_sandbox` (None: the configured default) is not True, and
    always when the candidate could write to the interpreter's directories.
    """
    return _run(program, tests, timeout_s, memory_bytes, output_bytes, file_bytes, namespaces,
                allow_weak_sandbox, layers_off)[0]


def _run(program, tests, timeout_s, memory_bytes, output_bytes, file_bytes, namespaces,
         allow_weak_sandbox, layers_off) -> tuple[CodeResult, dict]:
    start = time.monotonic()
    suite = split_tests(tests)
    total = len(suite.cases)
    if total == 0:
        return CodeResult(False, 0, 0, "tests contain no top-level assert", 0.0, False, ""), {}
    unknown = set(layers_off) - OPTIONAL_LAYERS
    if unknown:
        raise ValueError(f"layers_off: unknown layers {sorted(unknown)}; known: "
                         f"{sorted(OPTIONAL_LAYERS)}")
    weak = allow_weak_default() if allow_weak_sandbox is None else allow_weak_sandbox
    if "hook" in layers_off and not weak:
        raise ValueError("layers_off=('hook',) leaves the kernel layers alone: it needs "
                         "allow_weak_sandbox=True")
    plan = sandbox_plan(namespaces)
    uid = SANDBOX_UID_BASE + secrets.randbelow(SANDBOX_UID_SPAN) if plan.drop_uid else -1
    nonce = secrets.token_hex(16)
    payload = json.dumps(
        {
            "nonce": nonce,
            "program": program,
            "setup": suite.setup,
            "cases": list(suite.cases),
            "names": list(candidate_names(tests)),
            "timeout_s": timeout_s,
            "memory_bytes": memory_bytes,
            "output_bytes": output_bytes,
            "file_bytes": file_bytes,
            "max_message": MAX_MESSAGE_BYTES,
            "max_global": MAX_GLOBAL_VALUE_BYTES,
            "max_error": MAX_ERROR_CHARS,
            "candidate_prefix": list(plan.candidate_prefix),
            "candidate_boot": CANDIDATE_BOOT,
            "candidate_code": CANDIDATE_CODE.hex(),
            "uid": uid,
            "sandbox": sandbox_settings(plan, layers_off, weak, file_bytes, protected_dirs()),
        }
    ).encode()
    workdir = tempfile.mkdtemp(prefix="reinforge-code-")
    if uid >= 0:
        os.chown(workdir, uid, uid)  # the candidate's own directory, mode 0700 from mkdtemp
    timed_out = False
    try:
        judge = subprocess.Popen(
            [*plan.judge_prefix, sys.executable, "-I", "-S", "-B", "-c", JUDGE_SRC],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=workdir,
            env=minimal_env(),
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
        if timed_out and not plan.judge_prefix:
            # Without a PID namespace the candidate (its own session) outlives the judge.
            for rec in records:
                if rec.get("kind") == "pid" and isinstance(rec.get("pid"), int):
                    _kill_group(rec["pid"])
    finally:
        _remove_tree(workdir)
    done = next((r for r in records if r.get("kind") == "done"), None) or {}
    layers = done.get("layers") if isinstance(done.get("layers"), dict) else {}
    if done.get("refused") is not None:
        raise SandboxUnavailableError.refused(str(done["refused"]), layers)
    result = _verdict(
        records, total, timed_out, timeout_s, judge.returncode, err, time.monotonic() - start
    )
    warn_missing_layers(layers, set(layers_off))
    return result, layers

def probe_layers(namespaces: bool = True) -> dict:
    """Each layer of the sandbox on this machine: True, or why it is missing (a str).

    Runs one trivial program through the whole sandbox, with weak sandboxes allowed so
    that the missing layers are reported rather than refused.
    """
    return _run("pass", "assert True", 10.0, DEFAULT_MEMORY_BYTES, DEFAULT_OUTPUT_BYTES,
                DEFAULT_FILE_BYTES, namespaces, True, ())[1]

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

    try:
        shutil.rmtree(path, onerror=make_writable_and_retry)
    except (OSError, RecursionError):
        # shutil.rmtree recurses once per level: a tree the candidate nested deeper than the
        # recursion limit would raise here and stay behind. rm walks it iteratively.
        subprocess.run(["rm", "-rf", "--", path], stdin=subprocess.DEVNULL,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
        if os.path.lexists(path):
            log.warning("code sandbox: could not remove the work directory %s", path)

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
