"""The code sandbox: correct programs pass, and no listed attack passes or harms the host.

Bad candidates run in parallel through `run_many` with short timeouts; every
run must also come back within its limit. The audit hook's path rules and
the rule for which names the tests see are tested directly here; the large
attack catalogue is in test_sandbox_adversarial.py.
"""

from __future__ import annotations

import os
import socket
import time
import uuid

import pytest

from reinforge.verifiers.code import (
    SANDBOX_UID_BASE,
    CodeResult,
    _remove_tree,
    candidate_names,
    code_reward,
    extract_program,
    namespace_prefix,
    run_many,
    run_tests,
    sandbox_plan,
    split_tests,
)
from reinforge.verifiers.sandbox import guard

ADD = "def add(a, b):\n    return a + b\n"
ADD_TESTS = "assert add(1, 2) == 3\nassert add(-1, 1) == 0\nassert add('a', 'b') == 'ab'\n"
# One second of budget plus process start-up and the judge's cleanup.
SLACK_S = 1.5


def assert_failed_in_time(result: CodeResult, timeout_s: float) -> None:
    assert not result.passed
    assert result.passed_count == 0
    assert result.seconds < timeout_s + SLACK_S


def test_split_tests_counts_top_level_asserts_only():
    suite = split_tests("import math\nassert f(1) == 1\ndef g():\n    assert False\nassert f(2)\n")
    assert suite.cases == ("assert f(1) == 1", "assert f(2)")
    assert "import math" in suite.setup and "def g():" in suite.setup


def test_candidate_names_are_what_the_tests_load_minus_what_they_bind_minus_builtins():
    tests = (
        "import math as m\nfrom os import path\nLIMIT = 3\n"
        "def check(fn, arg, *rest, want=None):\n    total = fn(arg)\n    return total == want\n"
        "class Box:\n    pass\n"
        "assert check(solve, 1, want=2)\n"
        "assert abs(solve(2) - m.pi) < 1e-9 and len(helper([x for x in range(K)])) == 3\n"
        "assert sorted(f'{LIMIT}') == ['3'] and (y := solve(0)) == y\n"
        "try:\n    solve(-1)\nexcept ValueError as err:\n    pass\n"
    )
    # Loaded: check solve abs m len helper x range K sorted LIMIT y ValueError fn arg total want;
    # bound: m path LIMIT check fn arg rest want total Box x y err; builtins: abs len range sorted
    # ValueError. What is left is exactly the candidate's part.
    assert candidate_names(tests) == ("K", "helper", "solve")


def test_a_candidate_cannot_replace_builtins_or_test_helpers():
    # Each shadowing name would make its case pass if it reached the tests.
    program = (
        "def abs(x):\n    return 0\ndef len(x):\n    return 3\ndef sorted(x):\n    return [1, 2]\n"
        "def close(a, b):\n    return True\nAssertionError = Exception\n"
        "def f(x):\n    return None\n"
    )
    tests = (
        "def close(a, b):\n    return a == b\n"
        "assert abs(f(3) - 1.5) < 1e-9\nassert len(f(1)) == 3\nassert sorted(f(2)) == [1, 2]\n"
        "assert close(f(0), 7)\n"
    )
    result = run_tests(program, tests, timeout_s=5.0)
    assert (result.passed, result.passed_count, result.total) == (False, 0, 4)


def test_correct_program_passes_and_partial_counts_cases():
    wrong_on_strings = "def add(a, b):\n    return a + b if isinstance(a, int) else None\n"
    good, partial = run_many([(ADD, ADD_TESTS), (wrong_on_strings, ADD_TESTS)], timeout_s=5.0)
    assert (good.passed, good.passed_count, good.total, good.error) == (True, 3, 3, None)
    assert (partial.passed, partial.passed_count, partial.total) == (False, 2, 3)
    assert partial.error is not None and partial.error.startswith("case 2:")


def test_setup_helpers_exceptions_and_values_cross_the_boundary():
    program = (
        "import math\nLIMIT = 10\n"
        "def roots(x):\n    if x < 0:\n        raise ValueError('negative')\n"
        "    return (math.sqrt(x), {'x': x, 'tags': {1, 2}}, b'ok', float('inf'))\n"
    )
    tests = (
        "def raises(fn, *args):\n    try:\n        fn(*args)\n    except ValueError:\n"
        "        return True\n    return False\n"
        "assert roots(4) == (2.0, {'x': 4, 'tags': {1, 2}}, b'ok', float('inf'))\n"
        "assert raises(roots, -1)\nassert LIMIT == 10\nassert roots(2 ** 200)[1]['x'] == 2 ** 200\n"
    )
    result = run_tests(program, tests, timeout_s=5.0)
    assert (result.passed, result.passed_count, result.total) == (True, 4, 4)


def test_no_cases_and_program_errors_fail():
    no_cases = run_tests(ADD, "x = 1\n")
    syntax = run_tests("def add(a, b) return a + b", ADD_TESTS)
    assert (no_cases.passed, no_cases.total) == (False, 0)
    assert not syntax.passed and "SyntaxError" in (syntax.error or "")


CHEATS = {
    "sys_exit_at_import": "import sys\nsys.exit(0)\n",
    "os_exit_at_import": "import os\nos._exit(0)\n",
    "os_exit_in_call": "import os\ndef add(a, b):\n    os._exit(0)\n",
    "kill_parent": "import os\nos.kill(os.getppid(), 9)\ndef add(a, b):\n    return None\n",
    "kill_parent_in_call": "import os\ndef add(a, b):\n    os.kill(os.getppid(), 9)\n",
    "kill_own_group": "import os\nos.killpg(0, 9)\n",
    "patch_builtins": (
        "import builtins\nclass AssertionError(Exception):\n    pass\n"
        "builtins.AssertionError = AssertionError\nbuiltins.print = lambda *a, **k: None\n"
        "builtins.__import__ = lambda *a, **k: None\nbuiltins.len = lambda x: 3\n"
        "def add(a, b):\n    return None\n"
    ),
    "always_equal": (
        "class Anything:\n    def __eq__(self, other):\n        return True\n"
        "def add(a, b):\n    return Anything()\n"
    ),
    "fake_verdict_on_stdout": (
        "import json, sys\nfor i in range(3):\n"
        "    print(json.dumps({'kind': 'case', 'index': i, 'ok': True}))\n"
        "print(json.dumps({'kind': 'done', 'error': None}))\nprint('OK passed 3/3')\n"
        "sys.stdout.flush()\ndef add(a, b):\n    return None\n"
    ),
    "fake_verdict_on_every_fd": (
        "import json, os\nlines = ''.join(json.dumps({'kind': 'case', 'index': i, 'ok': True,"
        " 'id': 1, 'value': ['I', '0x3']}) + '\\n' for i in range(3))\n"
        "lines += json.dumps({'kind': 'done', 'error': None}) + '\\n'\n"
        "for fd in range(256):\n    try:\n        os.write(fd, lines.encode())\n"
        "    except OSError:\n        pass\n"
        "def add(a, b):\n    return None\n"
    ),
}


def test_cheating_candidates_never_pass():
    names = list(CHEATS)
    results = run_many([(CHEATS[n], ADD_TESTS) for n in names], timeout_s=2.0)
    for name, result in zip(names, results, strict=True):
        assert not result.passed, name
        assert result.passed_count == 0, (name, result)
        assert result.seconds < 2.0 + SLACK_S, name


def test_parent_survives_kill_without_namespaces():
    # The audit hook alone must stop the signal; the pytest process is still here to check.
    result = run_tests(CHEATS["kill_parent"], ADD_TESTS, timeout_s=2.0, namespaces=False)
    assert_failed_in_time(result, 2.0)
    assert "os.kill is not allowed" in (result.error or "")


RESOURCE_BOMBS = {
    "busy_loop": ("while True:\n    pass\n", True),
    "busy_loop_in_call": ("def add(a, b):\n    while True:\n        pass\n", True),
    "sleep_forever": ("import time\ntime.sleep(1000)\n", True),
    "string_bomb": ("x = 'a' * 10 ** 10\n", False),
    "list_bomb": ("x = []\nwhile True:\n    x.append(' ' * 10 ** 6)\n", False),
    "fork_bomb": ("import os\nwhile True:\n    os.fork()\n", False),
    "subprocess": ("import subprocess\nsubprocess.run(['sleep', '1000'])\n", False),
    "posix_fork_exec": ("import _posixsubprocess\n", False),
    "ctypes": ("import ctypes\nctypes.CDLL(None).fork()\n", False),
    "output_flood": (
        "import sys\nfor _ in range(100):\n    sys.stdout.write('x' * 10 ** 6)\n",
        False,
    ),
    "big_file": ("open('big', 'w').write('x' * (10 ** 8))\n", False),
}


@pytest.mark.parametrize("namespaces", [True, False], ids=["namespaces", "hooks_and_rlimits"])
def test_resource_bombs_are_contained(namespaces: bool):
    names = list(RESOURCE_BOMBS)
    results = run_many(
        [(RESOURCE_BOMBS[n][0], ADD_TESTS) for n in names], timeout_s=3.0, namespaces=namespaces
    )
    # 3 s, not less: on a loaded 2-core CI machine a bomb that the limits stop can take over 1 s.
    for name, result in zip(names, results, strict=True):
        assert_failed_in_time(result, 3.0)
        expect_timeout = RESOURCE_BOMBS[name][1]
        assert result.timed_out == expect_timeout, (name, result)
    flood = results[names.index("output_flood")]
    assert len(flood.output) == 64 * 1024  # the cap, not 100 MB
    assert _leaked_sandbox_processes() == []


def _leaked_sandbox_processes(grace_s: float = 1.0) -> list[int]:
    """PIDs still running in a sandbox work directory that was already deleted.

    Runs still in progress (other tests, xdist) have a live directory, so they
    are not counted. A SIGKILLed process can take a moment to disappear.
    """
    deadline = time.monotonic() + grace_s
    while True:
        leaked = []
        for name in os.listdir("/proc"):
            try:
                cwd = os.readlink(f"/proc/{name}/cwd") if name.isdigit() else ""
            except OSError:
                continue
            if "reinforge-code-" in cwd and cwd.endswith("(deleted)"):
                leaked.append(int(name))
        if not leaked or time.monotonic() > deadline:
            return leaked
        time.sleep(0.05)


def test_writes_outside_the_work_directory_are_refused():
    outside = f"/tmp/reinforge-outside-{uuid.uuid4().hex}"
    in_home = os.path.join(os.path.expanduser("~"), f".reinforge-{uuid.uuid4().hex}")
    attacks = [
        f"open({outside!r}, 'w').write('x')\n",
        f"open({in_home!r}, 'w').write('x')\n",
        f"import os\nos.mkdir({outside!r})\n",
        f"import os\nfd = os.open({outside!r}, os.O_WRONLY | os.O_CREAT)\n",
        f"import os\nos.symlink('/tmp', 'link')\nopen('link/{os.path.basename(outside)}', 'w')\n",
        f"import os\nos.chdir('/tmp')\nopen({os.path.basename(outside)!r}, 'w')\n",
        f"open('../{os.path.basename(outside)}', 'w').write('x')\n",
        "import os\nd = os.open('/tmp', os.O_RDONLY)\n"
        f"os.open({os.path.basename(outside)!r}, os.O_WRONLY | os.O_CREAT, dir_fd=d)\n",
    ]
    results = run_many([(a + ADD, ADD_TESTS) for a in attacks], timeout_s=2.0)
    for attack, result in zip(attacks, results, strict=True):
        assert_failed_in_time(result, 2.0)
        assert "sandbox:" in (result.error or ""), attack
    assert not os.path.exists(outside) and not os.path.exists(in_home)


def test_work_directory_is_fresh_writable_and_deleted():
    program = (
        "import os\nprint(os.getcwd(), sorted(os.listdir('.')))\n"
        "open('scratch.txt', 'w').write('ok')\n"
        "def add(a, b):\n    return a + b\n"
    )
    first, second = run_many([(program, ADD_TESTS), (program, ADD_TESTS)])
    assert first.passed and second.passed
    cwd_1, listing_1 = first.output.split(" ", 1)
    cwd_2, _ = second.output.split(" ", 1)
    assert listing_1.strip() == "[]" and cwd_1 != cwd_2
    assert not os.path.exists(cwd_1) and not os.path.exists(cwd_2)


def test_parent_environment_is_not_visible(monkeypatch):
    monkeypatch.setenv("SECRET_TOKEN", "hunter2")
    program = "import os\ndef env():\n    return dict(os.environ)\n"
    result = run_tests(program, "assert 'SECRET_TOKEN' not in env()\nassert env()\n")
    assert (result.passed, result.passed_count) == (True, 2)


@pytest.mark.parametrize("namespaces", [True, False], ids=["namespaces", "hooks_only"])
def test_network_is_refused_by_the_sandbox(namespaces: bool):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        listener.settimeout(0.2)
        port = listener.getsockname()[1]
        program = (
            f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=1)\n" + ADD
        )
        result = run_tests(program, ADD_TESTS, timeout_s=2.0, namespaces=namespaces)
        with pytest.raises(TimeoutError):
            listener.accept()  # nobody connected
    assert_failed_in_time(result, 2.0)
    assert "sandbox: socket." in (result.error or "")


def test_timeout_keeps_credit_for_cases_already_judged():
    program = "def add(a, b):\n    while a == 'a':\n        pass\n    return a + b\n"
    start = time.monotonic()
    result = run_tests(program, ADD_TESTS, timeout_s=1.0)
    assert time.monotonic() - start < 1.0 + SLACK_S
    assert (result.passed, result.passed_count, result.timed_out) == (False, 2, True)


def test_code_reward_uses_last_python_block_all_or_nothing():
    completion = (
        "First try:\n```python\ndef add(a, b):\n    return a - b\n```\n"
        f"Fixed:\n```python\n{ADD}```\n"
    )
    assert extract_program(completion) == ADD
    assert extract_program(ADD) == ADD
    wrong_last = completion + "\n```python\ndef add(a, b):\n    return 0\n```"
    assert [code_reward(c, ADD_TESTS) for c in (completion, ADD, wrong_last)] == [1.0, 1.0, 0.0]


def test_namespace_layer_is_reported():
    # On Linux machines where unshare works (as root, or with user namespaces),
    # the PID and network namespaces are in use; elsewhere the prefix is empty.
    prefix = namespace_prefix()
    assert prefix == () or ("--pid" in prefix and "--net" in prefix)
    plan = sandbox_plan(True)
    assert plan.judge_prefix == prefix
    assert plan.candidate_prefix == () or "--mount-proc" in plan.candidate_prefix


def test_dict_views_cross_as_views_of_a_fresh_dict():
    import collections

    from reinforge.verifiers.sandbox import codec

    d = {"a": 1, "b": 2}
    keys, values, items = (codec.decode(codec.encode(v)) for v in (d.keys(), d.values(), d.items()))
    assert (type(keys), type(values), type(items)) == (type(d.keys()), type(d.values()), type(d.items()))
    assert keys == {"a", "b"} and items == {("a", 1), ("b", 2)}  # set-like, as in plain Python
    assert list(values) == [1, 2] and len(values) == 2
    assert list(codec.decode(codec.encode({"x": [1]}.values()))) == [[1]]
    with pytest.raises(codec.ProtocolError, match="not .key, value. pairs"):
        codec.decode(["W", [["I", "0x1"]]])
    with pytest.raises(TypeError, match="a deque cannot cross"):
        codec.encode(collections.deque([1]))


def test_resolve_follows_symlinks_and_dotdot_like_the_kernel(tmp_path):
    work = tmp_path / "work"
    (work / "sub").mkdir(parents=True)
    os.symlink("/proc", work / "p")
    os.symlink("../..", work / "sub" / "up")
    os.symlink("loop2", work / "loop1")
    os.symlink("loop1", work / "loop2")
    cwd = str(work)
    assert guard.resolve("p/1/mem", cwd) == "/proc/1/mem"
    assert guard.resolve("sub/up/x", cwd) == str(tmp_path / "x")  # .. after the link, not before
    assert guard.resolve("//proc/./1/../2/mem", cwd) == "/proc/2/mem"
    assert guard.resolve("../" * 20 + "etc/passwd", cwd) == "/etc/passwd"
    assert guard.resolve("new/../file", cwd) == str(work / "file")  # missing names kept as written
    with pytest.raises(PermissionError, match="too many levels"):
        guard.resolve("loop1", cwd)


def test_as_path_normalises_subclasses_and_refuses_other_objects():
    class Sneaky(str):
        def startswith(self, *args):
            return False

    normalised = guard.as_path(Sneaky("/proc/1/mem"), False)
    assert type(normalised) is str and normalised.startswith("/proc")
    assert guard.as_path(b"/tmp/x", False) == "/tmp/x"
    assert guard.as_path(3, False) is None  # a descriptor

    class Shifty:
        def __fspath__(self):
            return "/tmp/x"

    with pytest.raises(PermissionError, match="Shifty path is not allowed"):
        guard.as_path(Shifty(), False)
    assert guard.as_path(Shifty(), True) == "/tmp/x"  # listing only: a name list, not content


def test_the_hook_reads_no_globals_so_patching_modules_cannot_change_it():
    import dis

    hook = guard.make_hook("/tmp/w", ("/tmp/w",), ("/dev/null",), 8)
    for fn in (hook, guard.resolve, guard.as_path, guard.fd_path, guard.directory_fds,
               guard.name_refused, guard.extension_refused, guard.import_refused, guard.open_bases,
               guard.check_write_event, guard.check_path):
        loads = {i.opname for i in dis.get_instructions(fn)}
        assert not loads & {"LOAD_GLOBAL", "LOAD_NAME", "LOAD_DEREF"}, fn.__name__
        assert fn.__closure__ is None, fn.__name__


def test_work_directory_nested_past_the_recursion_limit_is_still_removed(tmp_path):
    # shutil.rmtree recurses per level and raises RecursionError on such a tree.
    work = tmp_path / "work"
    work.mkdir()
    fd = os.open(work, os.O_RDONLY)
    for _ in range(1200):
        os.mkdir("a", dir_fd=fd)
        deeper = os.open("a", os.O_RDONLY, dir_fd=fd)
        os.close(fd)
        fd = deeper
    os.close(fd)
    _remove_tree(str(work))
    assert not work.exists()


def test_create_builtin_guard_refuses_fresh_copies_and_hides_the_original():
    import dis
    import types

    calls = []
    imp = types.SimpleNamespace(create_builtin=lambda spec: calls.append(spec.name) or spec.name,
                                create_dynamic=lambda spec: calls.append(spec.origin) or spec.name)
    ids = guard.guard_imp(imp, "/tmp/w", ("/no-such-dir/dyn",))
    with pytest.raises(PermissionError, match="fresh copy of the posix module is not allowed"):
        imp.create_builtin(types.SimpleNamespace(name="posix"))

    class Name(str):  # a str subclass reaches the original as an exact str
        def __eq__(self, other):
            return False

        __hash__ = str.__hash__

    assert imp.create_builtin(types.SimpleNamespace(name=Name("pwd"))) == "pwd"
    assert calls == ["pwd"] and type(calls[0]) is str
    with pytest.raises(PermissionError, match="fresh copy of the _imp module"):
        imp.create_builtin(types.SimpleNamespace(name=Name("_imp")))
    create = imp.create_builtin.__defaults__[0]
    load = imp.create_dynamic.__defaults__[1]  # after `file`
    assert sorted(ids) == sorted([id(imp.create_builtin), id(create), id(imp.create_dynamic),
                                  id(load)])
    # Extensions: every dotted part of the name, the file's own name, and where the file lies.
    assert imp.create_dynamic(types.SimpleNamespace(name="x.grp", origin="/no-such-dir/dyn/grp.so")) \
        == "x.grp"
    refused = [("x._ctypes", "/no-such-dir/dyn/grp.so", "importing x._ctypes"),
               ("x.y", "/no-such-dir/dyn/_ctypes.cpython-311.so", "the _ctypes extension"),
               ("readline", "/no-such-dir/dyn/readline.so", "importing readline"),
               ("mine", "/tmp/w/mine.so", "from /tmp/w/mine.so"),
               ("mine", "/no-such-dir/dyn/../../tmp/w/mine.so", "from /tmp/w/mine.so")]
    for name, origin, match in refused:
        with pytest.raises(ImportError, match=match):
            imp.create_dynamic(types.SimpleNamespace(name=name, origin=origin))
    assert calls == ["pwd", "/no-such-dir/dyn/grp.so"]
    for fn in (imp.create_builtin, create, imp.create_dynamic, load):
        loads = {i.opname for i in dis.get_instructions(fn)}
        assert not loads & {"LOAD_GLOBAL", "LOAD_NAME", "LOAD_DEREF"}, fn.__name__
        assert fn.__closure__ is None, fn.__name__
    hook = guard.make_hook("/tmp/w", ("/tmp/w",), ("/dev/null",), 8, guarded_ids=ids)
    for attr in ("__defaults__", "__code__", "__kwdefaults__"):
        with pytest.raises(PermissionError, match=f"object.__getattr__ {attr} is not allowed"):
            hook("object.__getattr__", (create, attr))
    hook("object.__getattr__", (lambda: None, "__defaults__"))  # others' functions: allowed
    hook("object.__getattr__", (create, "__name__"))


def test_hook_decisions_on_resolved_paths(tmp_path):
    work = tmp_path / "w"
    work.mkdir()
    hook = guard.make_hook(str(work), (str(work), "/usr/lib"), ("/dev/null",), 8,
                           extension_roots=("/usr/lib",))
    hook("open", (str(work / "a.txt"), "w", os.O_WRONLY | os.O_CREAT))  # allowed: no exception
    hook("import", ("x.grp", "/usr/lib/grp.cpython-311.so", None, None, None))
    hook("open", ("/usr/lib/../lib/os-release", "r", os.O_RDONLY))
    refused = [
        ("open", ("//proc/1/environ", "r", os.O_RDONLY)),
        ("open", (f"{work}/../../../../proc/1/mem", "rb", os.O_RDONLY)),
        ("open", ("/usr/lib/x", "w", os.O_WRONLY)),  # readable is not writable
        ("os.remove", (str(tmp_path / "outside"), None)),
        ("os.chmod", (3, 0o777, None, True)),  # fchmod on a descriptor
        ("os.kill", (1, 9)),
        ("object.__setattr__", (guard.resolve, "__defaults__", ())),
        ("object.__delattr__", (guard.resolve, "__defaults__")),  # `f.__defaults__ = None`
        ("object.__delattr__", (guard.name_refused, "__kwdefaults__")),
        ("object.__setattr__", (guard.open_bases, "__code__", None)),     # the hook's parts are guarded too
        ("object.__getattr__", (guard.check_write_event, "__defaults__")),
        ("object.__delattr__", (guard.check_path, "__defaults__")),
    ]
    for event, args in refused:
        with pytest.raises(PermissionError, match="sandbox:"):
            hook(event, args)
    with pytest.raises(ImportError, match="importing ctypes is not allowed"):
        hook("import", ("ctypes", None, [], [], []))
    # Every dotted part, and an extension's file: its own name and where it lies.
    with pytest.raises(ImportError, match="importing x._posixshmem is not allowed"):
        hook("import", ("x._posixshmem", None, [], [], []))
    with pytest.raises(ImportError, match="loading the readline extension"):
        hook("import", ("x.y", "/usr/lib/readline.cpython-311.so", None, None, None))
    with pytest.raises(ImportError, match="loading an extension from"):
        hook("import", ("mine", str(work / "mine.so"), None, None, None))
    # A write is judged by the mode as well as the flags (an opener may report flags 0).
    for mode in ("w", "a", "x", "r+", "wb"):
        with pytest.raises(PermissionError, match="writing"):
            hook("open", ("/usr/lib/x", mode, 0))
    with pytest.raises(PermissionError, match="with this mode"):
        hook("open", ("/usr/lib/x", b"r", 0))
    hook("open", ("/usr/lib/x", "r", 0))
    hook("object.__setattr__", (lambda: None, "__defaults__", ()))  # others' functions: allowed


@pytest.mark.skipif(os.geteuid() != 0, reason="the uid drop needs real root")
@pytest.mark.parametrize("namespaces", [True, False], ids=["namespaces", "no_namespaces"])
def test_candidate_runs_as_its_own_unprivileged_uid(namespaces: bool):
    program = "import os\ndef ids():\n    return [os.getuid(), os.geteuid(), os.getgid(), os.getgroups()]\n"
    tests = f"assert ids()[0] >= {SANDBOX_UID_BASE}\nassert len(set(ids()[:3])) == 1\nassert ids()[3] == []\n"
    result = run_tests(program, tests, timeout_s=5.0, namespaces=namespaces)
    assert (result.passed, result.passed_count) == (True, 3), result
    assert sandbox_plan(namespaces).drop_uid
