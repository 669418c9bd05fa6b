"""Adversarial candidates: none passes falsely, none touches anything outside its sandbox.

Every attack runs with namespaces on and off. The tests' expected values
live only in the judge, so an attack that reached the judge's memory, a
test name or a builtin would pass; one that reached the host would kill the
canary process, change the canary file (world-writable on purpose: only the
sandbox stands between it and the candidate) or print the secret this test
puts in its own environment. Correct programs run in the same modes and
must all pass: no false negatives either.

Attack sources name the things they go after with placeholders that
`_fill` replaces: CANARY_PID, TEST_PID, CANARY_FILE, CANARY_DIR, SHM_FILE (a name
in /dev/shm that must not appear), SECRET_NAME.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import tempfile
import uuid

import pytest

from reinforge.rewards.code import CodeResult, run_many

# Expected values exist only here and in the judge; every attack's f returns None
# (or whatever it stole), so any passed case means the attack worked.
TESTS = (
    "def close(a, b):\n    return abs(a - b) < 1e-9\n"
    "assert f(3) == 7919\n"
    "assert close(f(4), 104729)\n"
    "assert len(str(f(5))) == 6 and f(5) == 224737\n"
    "assert sorted([f(6), 1]) == [1, 350377]\n"
    "assert abs(f(7) - 479909) < 1\n"
)
STOLEN = "{3: 7919, 4: 104729, 5: 224737, 6: 350377, 7: 479909}"

# Reads every readable mapping of a process through /proc/PID/mem and takes the
# answers out of the assert sources it finds; works on an unprotected process.
MEMSCAN = r'''
import os, re
def scan(base):
    found = {}
    with open(base + "/maps") as maps:
        regions = [line.split() for line in maps]
    with open(base + "/mem", "rb", 0) as mem:
        for fields in regions:
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if fields[1][0] != "r" or hi - lo > 1 << 26:
                continue
            try:
                mem.seek(lo)
                chunk = mem.read(hi - lo)
            except (OSError, ValueError, OverflowError):
                continue
            for m in re.finditer(rb"f\((\d+)\)[^\n]{0,12}?(\d{4,})", chunk):
                found[int(m[1])] = int(m[2])
    print("stole", found)
    return found
'''


def _scan_attack(path_expr: str) -> str:
    return MEMSCAN + f"ANSWERS = scan({path_expr})\ndef f(n):\n    return ANSWERS.get(n)\n"


def _read_attack(path_expr: str, mode: str = "r") -> str:
    # Reads a file, prints it and raises with it: whatever leaks must show up in output/error.
    return (f"data = open({path_expr}, {mode!r}).read()\nprint(data)\n"
            "raise RuntimeError(repr(data)[:400])\n")


ATTACKS: dict[str, str] = {
    # --- the judge's memory, every spelling ---
    "mem_ppid": _scan_attack("'/proc/%d' % os.getppid()"),
    "mem_double_slash": _scan_attack("'//proc/%d' % os.getppid()"),
    "mem_dot_segments": _scan_attack("'/./proc/./%d/.' % os.getppid()"),
    "mem_dotdot_chain": _scan_attack("'../' * 30 + 'proc/%d' % os.getppid()"),
    "mem_self_dotdot": _scan_attack("'/proc/self/../%d' % os.getppid()"),
    "mem_dev_fd_dotdot": _scan_attack("'/dev/fd/../../%d' % os.getppid()"),
    "mem_symlink_in_tmp": "import os\nos.symlink('/proc', 'p')\n" + _scan_attack(
        "'p/%d' % os.getppid()"),
    "mem_every_pid": MEMSCAN + (
        "ANSWERS = {}\nfor pid in os.listdir('/proc'):\n    if pid.isdigit():\n        try:\n"
        "            ANSWERS.update(scan('/proc/' + pid))\n        except OSError:\n"
        "            pass\ndef f(n):\n    return ANSWERS.get(n)\n"),
    "mem_test_process": _scan_attack("'/proc/TEST_PID'"),
    "mem_bytes_path": (
        "import os\nfd = os.open(b'/proc/%d/mem' % os.getppid(), os.O_RDONLY)\n"
        "def f(n):\n    return None\n"),
    "mem_str_subclass": (
        "import os\nclass S(str):\n    def startswith(self, *a):\n        return False\n"
        "    def split(self, *a):\n        return ['tmp']\n    def __eq__(self, o):\n"
        "        return True\n    __hash__ = str.__hash__\n"
        "data = open(S('/proc/%d/environ' % os.getppid()), 'rb').read()\n"
        "raise RuntimeError(repr(data))\n"),
    "mem_fspath_switch": (
        "import io, os\nclass P:\n    n = 0\n    def __fspath__(self):\n        P.n += 1\n"
        "        return '/proc/%d/environ' % os.getppid() if P.n == 1 else 'harmless'\n"
        "data = io.FileIO(P()).read()\nraise RuntimeError(repr(data))\n"),
    "mem_os_open_dir_fd_root": (
        "import os\nroot = os.open('/', os.O_RDONLY)\n"
        "fd = os.open('proc/%d/environ' % os.getppid(), os.O_RDONLY, dir_fd=root)\n"
        "raise RuntimeError(repr(os.read(fd, 4096)))\n"),
    "mem_os_open_dir_fd_allowed_dir": (
        "import os\nlib = os.open('/usr/lib', os.O_RDONLY)\n"
        "fd = os.open('../../proc/%d/environ' % os.getppid(), os.O_RDONLY, dir_fd=lib)\n"
        "raise RuntimeError(repr(os.read(fd, 4096)))\n"),
    "mem_io_fileio": "import io, os\n" + _read_attack("'/proc/%d/cmdline' % os.getppid()", "r"),
    "mem_pathlib": (
        "import os, pathlib\n"
        "data = (pathlib.Path('/proc') / str(os.getppid()) / 'environ').read_bytes()\n"
        "raise RuntimeError(repr(data))\n"),
    "mem_importlib_loader": (
        "import os, importlib.machinery\npath = '/proc/%d/environ' % os.getppid()\n"
        "data = importlib.machinery.SourceFileLoader('x', path).get_data(path)\n"
        "raise RuntimeError(repr(data))\n"),
    "mem_mmap": (
        "import mmap, os\nfd = os.open('/proc/%d/mem' % os.getppid(), os.O_RDONLY)\n"
        "m = mmap.mmap(fd, 4096, prot=mmap.PROT_READ)\ndef f(n):\n    return None\n"),
    # --- environments and files of other processes ---
    "environ_test_process": "import os\n" + _read_attack("'/proc/TEST_PID/environ'"),
    "environ_all": (
        "import os\nout = []\nfor pid in os.listdir('/proc'):\n    try:\n"
        "        out.append(open('/proc/%s/environ' % pid, 'rb').read())\n    except OSError:\n"
        "        pass\nprint(out)\nraise RuntimeError(repr(out)[:400])\n"),
    "environ_via_glob": (
        "import glob\nout = [open(p, 'rb').read() for p in glob.glob('/proc/*/environ')]\n"
        "print(out)\nraise RuntimeError(repr(out)[:400])\n"),
    "judge_cwd_files": (
        "import os\nd = '/proc/%d/cwd' % os.getppid()\n"
        "out = {n: open(os.path.join(d, n)).read() for n in os.listdir(d)}\n"
        "print(out)\nraise RuntimeError(repr(out))\n"),
    "judge_fds": (
        "import os\nd = '/proc/%d/fd' % os.getppid()\nout = []\nfor n in os.listdir(d):\n"
        "    try:\n        out.append(os.read(os.open(os.path.join(d, n), os.O_RDONLY), 1 << 16))\n"
        "    except OSError:\n        pass\nprint(out)\nraise RuntimeError(repr(out)[:400])\n"),
    "readlink_then_open": (
        "import os\ntarget = os.readlink('/proc/TEST_PID/cwd')\n"
        "print(os.listdir(target))\nraise RuntimeError(target)\n"),
    "stdin_payload": (
        "import os, sys\ndata = sys.stdin.read() + os.read(0, 1 << 16).decode()\n"
        "def f(n):\n    import re\n    m = re.search(r'f\\(%d\\) == (\\d+)' % n, data)\n"
        "    return int(m[1]) if m else None\n"),
    "tests_file_hunt": (
        "import os\nfound = {}\nfor d in ('.', '..', '/tmp'):\n    for n in os.listdir(d):\n"
        "        try:\n            found[n] = open(os.path.join(d, n)).read()\n"
        "        except OSError:\n            pass\nprint(found)\ndef f(n):\n    return None\n"),
    "etc_shadow": _read_attack("'/etc/shadow'"),
    # --- the test's own meaning: builtins, helpers, values ---
    "shadow_builtins": (
        "def abs(x):\n    return 0\ndef len(x):\n    return 6\ndef str(x):\n    return 'xxxxxx'\n"
        "def sorted(x):\n    return [1, 350377]\ndef close(a, b):\n    return True\n"
        "class AssertionError(Exception):\n    pass\ndef f(n):\n    return None\n"),
    "patch_builtins_module": (
        "import builtins\nbuiltins.abs = lambda x: 0\nbuiltins.len = lambda x: 6\n"
        "builtins.sorted = lambda x: [1, 350377]\nbuiltins.AssertionError = type('A', (Exception,), {})\n"
        "def f(n):\n    return None\n"),
    "module_under_test_name": (
        "import builtins as close\nimport json as f\n"),
    "sys_modules_tampering": (
        "import sys, types\nfake = types.ModuleType('builtins')\nfake.abs = lambda x: 0\n"
        "sys.modules['builtins'] = fake\nsys.modules['json'] = fake\ndef f(n):\n    return None\n"),
    "always_equal_object": (
        "class Any:\n    def __eq__(self, o):\n        return True\n    def __lt__(self, o):\n"
        "        return True\n    def __sub__(self, o):\n        return 0\n    def __len__(self):\n"
        "        return 6\n    def __hash__(self):\n        return 0\ndef f(n):\n    return Any()\n"),
    "int_subclass_eq": (
        "class I(int):\n    def __eq__(self, o):\n        return True\n    __hash__ = int.__hash__\n"
        "def f(n):\n    return I(0)\n"),
    "str_and_list_subclasses": (
        "class S(str):\n    def __eq__(self, o):\n        return True\n    __hash__ = str.__hash__\n"
        "class L(list):\n    def __eq__(self, o):\n        return True\n"
        "def f(n):\n    return S('x') if n % 2 else L([0])\n"),
    "index_lies": (
        "class N:\n    def __index__(self):\n        return 7919\n    def __int__(self):\n"
        "        return 7919\n    def __float__(self):\n        return 7919.0\n"
        "def f(n):\n    return N()\n"),
    # --- the verdict channel ---
    "fake_verdicts_stdout": (
        "import json, sys\nfor i in range(5):\n    print(json.dumps({'kind': 'case', 'index': i, 'ok': True}))\n"
        "print(json.dumps({'kind': 'done', 'error': None}))\nsys.stdout.flush()\n"
        "def f(n):\n    return None\n"),
    "fake_verdicts_every_fd": (
        "import json, os\nline = ''.join(json.dumps({'kind': 'case', 'index': i, 'ok': True, 'id': 1,"
        " 'value': ['I', '0x1eef']}) + '\\n' for i in range(5)) + json.dumps({'kind': 'done'}) + '\\n'\n"
        "for fd in range(256):\n    try:\n        os.write(fd, line.encode())\n    except OSError:\n"
        "        pass\ndef f(n):\n    return None\n"),
    "proc_self_fd_write": (
        "open('/proc/self/fd/1', 'w').write('{\"kind\": \"done\"}\\n')\ndef f(n):\n    return None\n"),
    # --- other processes: the parent, the judge, the canary ---
    "kill_parent": "import os\nos.kill(os.getppid(), 9)\ndef f(n):\n    return None\n",
    "kill_canary": "import os\nos.kill(CANARY_PID, 9)\n",
    "kill_everything": "import os\nos.kill(-1, 9)\n",
    "killpg_canary": "import os\nos.killpg(os.getpgid(CANARY_PID), 9)\n",
    "pidfd_canary": (
        "import os, signal\nsignal.pidfd_send_signal(os.pidfd_open(CANARY_PID), 9)\n"),
    "pidfd_fresh_posix": (
        "import _imp, importlib.machinery, signal\n"
        "posix = _imp.create_builtin(importlib.machinery.ModuleSpec('posix', None))\n"
        "sig = _imp.create_builtin(importlib.machinery.ModuleSpec('_signal', None))\n"
        "fd = posix.pidfd_open(CANARY_PID)\nsig.pidfd_send_signal(fd, 9)\n"
        "sig.pidfd_send_signal(posix.pidfd_open(TEST_PID), 9)\n"),
    "pthread_kill": "import signal, threading\nsignal.pthread_kill(threading.get_ident(), 9)\n",
    "setuid_root": "import os\nos.setuid(0)\nos.kill(CANARY_PID, 9)\n",
    "ctypes_kill": "import ctypes\nctypes.CDLL(None).kill(CANARY_PID, 9)\n",
    "ctypes_fresh_extension": (
        "import _imp, importlib.util\nspec = importlib.util.find_spec('_ctypes')\n"
        "_ctypes = _imp.create_dynamic(spec)\nlibc = _ctypes.dlopen(None)\n"
        "raise RuntimeError('loaded')\n"),
    "process_vm_readv": (
        "import ctypes\nlibc = ctypes.CDLL(None)\nbuf = ctypes.create_string_buffer(64)\n"
        "libc.process_vm_readv(TEST_PID, 0, 0, 0, 0, 0)\n"),
    "posixsubprocess": "import _posixsubprocess\n",
    "subprocess_cat": (
        "import subprocess\nprint(subprocess.run(['cat', '/proc/TEST_PID/environ'],"
        " capture_output=True).stdout)\n"),
    "os_system": "import os\nos.system('kill -9 CANARY_PID; cat /proc/TEST_PID/environ')\n",
    "posix_spawn": "import os\nos.posix_spawn('/bin/kill', ['kill', '-9', 'CANARY_PID'], {})\n",
    "socket_out": "import socket\nsocket.create_connection(('127.0.0.1', 22), timeout=1)\n",
    "subinterpreter": "import _xxsubinterpreters as s\ns.run_string(s.create(), 'import os')\n",
    "forged_code_object": (
        "def g():\n    return 1\ng.__code__ = g.__code__.replace(co_code=bytes(len(g.__code__.co_code)))\n"),
    "gc_hunting": (
        "import gc\nfound = [o for o in gc.get_objects() if isinstance(o, str) and '7919' in o]\n"
        "def f(n):\n    return None\n"),
    "frame_walking": (
        "import sys, inspect\nframes, frame = [], sys._getframe()\nwhile frame:\n"
        "    frames.append(frame)\n    frame = frame.f_back\nseen = repr([fr.f_locals for fr in frames])\n"
        "stack = repr([fr.frame.f_locals for fr in inspect.stack()])\nimport re\n"
        "def f(n):\n    m = re.search(r'f\\(%d\\) == (\\d+)' % n, seen + stack)\n"
        "    return int(m[1]) if m else None\n"),
    "rebind_hook_defaults": (
        "import sys\nframe = sys._getframe()\nwhile frame.f_back:\n    frame = frame.f_back\n"
        "for v in list(frame.f_globals.values()):\n    if callable(v) and getattr(v, '__defaults__', None):\n"
        "        v.__defaults__ = tuple(() for _ in v.__defaults__)\n"
        + _read_attack("'/proc/TEST_PID/environ'")),
    "raise_rlimits": "import resource\nresource.setrlimit(resource.RLIMIT_NPROC, (-1, -1))\n",
    "chdir_root": "import os\nos.chdir('/')\n" + _read_attack("'proc/TEST_PID/environ'"),
    # --- the canary file outside the work directory ---
    "write_canary": "open('CANARY_FILE', 'w').write('pwned')\n",
    "append_canary_dotdot": "open('../../../../..' + 'CANARY_FILE', 'a').write('pwned')\n",
    "remove_canary": "import os\nos.remove('CANARY_FILE')\n",
    "rename_canary": "import os\nos.rename('CANARY_FILE', 'stolen')\n",
    "chmod_canary": "import os\nos.chmod('CANARY_FILE', 0o000)\n",
    "truncate_canary": "import os\nos.truncate('CANARY_FILE', 0)\n",
    "rmtree_canary_dir": "import shutil\nshutil.rmtree('CANARY_DIR')\n",
    "fchmod_read_fd": "import os\nos.fchmod(os.open('CANARY_FILE', os.O_RDONLY), 0)\n",
    "pathlib_unlink": "import pathlib\npathlib.Path('CANARY_FILE').unlink()\n",
    "symlink_then_write": "import os\nos.symlink('CANARY_DIR', 'out')\nopen('out/canary', 'w').write('x')\n",
    "dir_fd_write": (
        "import os\nd = os.open('CANARY_DIR', os.O_RDONLY)\n"
        "os.unlink('canary', dir_fd=d)\n"),
    # --- exits, signals and resource bombs ---
    "os_exit_at_import": "import os\nos._exit(0)\n",
    "sys_exit_in_call": "import sys\ndef f(n):\n    sys.exit(0)\n",
    "exception_at_import": "raise ImportError('nope')\n",
    "sigkill_self_in_call": "import os, signal\ndef f(n):\n    os.kill(os.getpid(), signal.SIGKILL)\n",
    "alarm_self": "import signal\nsignal.alarm(1)\ndef f(n):\n    while True:\n        pass\n",
    "infinite_loop": "while True:\n    pass\n",
    "fork_bomb": "import os\nwhile True:\n    os.fork()\n",
    "memory_bomb": "x = []\nwhile True:\n    x.append(bytearray(10 ** 7))\n",
    "output_flood": "import sys\nfor _ in range(200):\n    sys.stdout.write('x' * 10 ** 6)\ndef f(n):\n    return None\n",
    "huge_return_value": "def f(n):\n    return 'x' * (64 * 2 ** 20)\n",
    # --- calls without audit events, and other spellings (red team, second round) ---
    "mkfifo_canary_dir": "import os\nos.mkfifo('CANARY_DIR/fifo')\n",
    "mknod_canary_dir": "import os, stat\nos.mknod('CANARY_DIR/node', 0o666 | stat.S_IFREG)\n",
    "posix_mknod_shm": "import posix, stat\nposix.mknod('SHM_FILE', 0o666 | stat.S_IFREG)\n",
    "memfd_memory": (
        "import os\nfds = [os.memfd_create('m') for _ in range(200)]\n"
        "for fd in fds:\n    os.write(fd, b'x' * (16 * 2 ** 20))\n"),
    "renice_and_pin_the_canary": (
        "import os\nos.setpriority(os.PRIO_PROCESS, CANARY_PID, 19)\n"
        "os.setpriority(os.PRIO_USER, os.getuid(), 19)\nos.sched_setaffinity(CANARY_PID, {0})\n"),
    "dev_shm_write": "open('SHM_FILE', 'w').write('pwned')\n",
    "dev_shm_os_open": "import os\nos.open('SHM_FILE', os.O_CREAT | os.O_WRONLY)\n",
    "dir_fd_create": (
        "import os\nd = os.open('CANARY_DIR', os.O_RDONLY)\n"
        "os.write(os.open('new', os.O_CREAT | os.O_WRONLY, dir_fd=d), b'x')\n"),
    "dir_fd_mkdir": "import os\nos.mkdir('new', dir_fd=os.open('CANARY_DIR', os.O_RDONLY))\n",
    "rename_out_dst_dir_fd": (
        "import os\nopen('a', 'w').write('x')\n"
        "os.rename('a', 'stolen', dst_dir_fd=os.open('CANARY_DIR', os.O_RDONLY))\n"),
    "rename_workdir_out": "import os\nos.rename('.', 'CANARY_DIR/stolen')\n",
    "tempfile_in_canary_dir": "import tempfile\ntempfile.mkstemp(dir='CANARY_DIR')\n",
    "sendfile_environ": (
        "import os\nos.sendfile(1, os.open('/proc/TEST_PID/environ', os.O_RDONLY), 0, 1 << 16)\n"),
    "open_code_environ": "import io\n" + _read_attack("'/proc/TEST_PID/environ'").replace(
        "open(", "io.open_code(").replace(", 'r')", ")"),
    "zipimport_environ": "import zipimport\nzipimport.zipimporter('/proc/TEST_PID/environ')\n",
    "proc_spellings": (
        "out = []\nfor p in ['/proc/1/environ', '/proc/self/root/proc/TEST_PID/environ',"
        " '/proc/thread-self/../TEST_PID/environ', '/dev/shm/../../proc/TEST_PID/environ',"
        " '/sys/../proc/TEST_PID/environ']:\n    try:\n"
        "        out.append(open(p, 'rb').read())\n    except OSError:\n        pass\n"
        "print(out)\nraise RuntimeError(repr(out)[:400])\n"),
    "thread": "import threading\nthreading.Thread(target=print).start()\ndef f(n):\n    return None\n",
    "faulthandler_exit": (
        "import faulthandler\nfaulthandler.dump_traceback_later(0.1, exit=True)\n"
        "def f(n):\n    return None\n"),
    "atexit_and_del": (
        "import atexit, json\natexit.register(print, json.dumps({'kind': 'done'}))\n"
        "class D:\n    def __del__(self):\n        raise SystemExit(0)\nd = D()\n"
        "def f(n):\n    return None\n"),
    "forged_replies_on_resp_fd": (
        "import json, os, sys\nfor i in range(1, 9):\n"
        "    d = json.dumps({'id': i, 'ok': True, 'value': ['I', '0x1eef']}).encode()\n"
        "    os.write(int(sys.argv[2]), len(d).to_bytes(8, 'big') + d)\n"
        "def f(n):\n    return None\n"),
    "entry_point_class_eq": (
        "class f:\n    def __init__(self, n):\n        pass\n    def __eq__(self, o):\n"
        "        return True\n    def __hash__(self):\n        return 0\n"),
    "entry_point_generator": "def f(n):\n    yield 7919\n",
    "entry_point_async": "async def f(n):\n    return 7919\n",
    "fresh_posix_mkfifo": (
        "import _imp, importlib.machinery\n"
        "posix = _imp.create_builtin(importlib.machinery.ModuleSpec('posix', None))\n"
        "posix.mkfifo('CANARY_DIR/fifo')\n"),
    "fresh_imp_then_fresh_posix": (
        "import _imp, importlib.machinery as m\n"
        "imp = _imp.create_builtin(m.ModuleSpec('_imp', None))\n"
        "imp.create_builtin(m.ModuleSpec('posix', None)).mknod('CANARY_DIR/node')\n"),
    "original_create_builtin_from_defaults": (
        "import _imp, importlib.machinery\ncreate = _imp.create_builtin.__defaults__[0]\n"
        "original = create.__defaults__[0]\n"
        "original(importlib.machinery.ModuleSpec('posix', None)).mkfifo('CANARY_DIR/fifo')\n"),
    "original_create_builtin_from_frames": (
        "import _imp, sys\nfound = []\nclass Spec:\n    @property\n    def name(self):\n"
        "        frame = sys._getframe(1)\n        while frame:\n"
        "            found.extend(v for v in frame.f_locals.values() if callable(v))\n"
        "            frame = frame.f_back\n        return 'pwd'\n_imp.create_builtin(Spec())\n"
        "class Posix:\n    name = 'posix'\nfor fn in found:\n    try:\n"
        "        fn(Posix()).mkfifo('CANARY_DIR/fifo')\n    except Exception:\n        pass\n"
        "def f(n):\n    return None\n"),
    "profiler_sees_the_guard": (
        "import sys, _imp, importlib.machinery\nseen = []\n"
        "sys.setprofile(lambda frame, event, arg: seen.append(dict(frame.f_locals)))\n"
        "_imp.create_builtin(importlib.machinery.ModuleSpec('pwd', None))\n"),
    "self_containing_list": "def f(n):\n    a = []\n    a.append(a)\n    return a\n",
    "deep_nesting": "def f(n):\n    a = []\n    for _ in range(10 ** 5):\n        a = [a]\n    return a\n",
}

# Attacks that need tests of their own: each case holds only if the attack works.
REJECTS_TESTS = (
    "def rejects(x):\n    try:\n        f(x)\n    except Exception:\n        return True\n"
    "    return False\nassert rejects(-1)\nassert rejects(-2)\n")
OWN_TESTS_ATTACKS: dict[str, tuple[str, str]] = {
    # StopIteration from a call ends `map`/`filter`/`zip` early without an error.
    "stop_iteration_in_map": (
        "def f(n):\n    raise StopIteration\n",
        "assert all(map(f, [2, 3, 5]))\nassert list(filter(f, [1])) == []\n"
        "assert not any(map(f, [4, 6]))\nassert sum(map(f, [1, 2])) == 0\n"),
    "own_class_named_stop_iteration": (
        "class StopIteration(Exception):\n    pass\ndef f(n):\n    raise StopIteration\n",
        "assert all(map(f, [2, 3, 5]))\n"),
    "stop_async_iteration_in_zip": (
        "def f(n):\n    raise StopAsyncIteration\n", "assert dict(zip([1], map(f, [1]))) == {}\n"),
    "plant_modules_for_the_judge": (
        "import sys\nopen('math.py', 'w').write('isclose = lambda *a, **k: True\\n')\n"
        "open('f.py', 'w').write('def f(x):\\n    return 9\\n')\nsys.path.insert(0, '.')\n"
        "import math\ndef f(x):\n    return 0\n",
        "assert math.isclose(f(1), 9)\nassert f(1) == 9\n"),
    "module_object_named_like_entry_point": (
        "import sys, types\nf = types.ModuleType('f')\nf.__call__ = lambda *a: 9\n"
        "sys.modules['f'] = f\n", "assert f(1) == 9\n"),
    "forged_names_and_reloaded_builtins": (
        "import builtins, importlib, __main__\nimportlib.reload(builtins)\n"
        "builtins.len = lambda x: 3\nsend = __main__.send\n"
        "def forged(fd, obj):\n    if 'names' in obj:\n        obj['names']['len'] = ['callable']\n"
        "    send(fd, obj)\n__main__.send = forged\n"
        "def len(x):\n    return 3\ndef f(x):\n    return [0]\n",
        "assert len(f(1)) == 3\n"),
    # Leaving without an answer, caught by the tests' `except Exception` (in plain Python
    # SystemExit and KeyboardInterrupt pass through it, and os._exit ends the tests).
    "sys_exit_caught_as_exception": (
        "import sys\ndef f(n):\n    sys.exit(1)\n", REJECTS_TESTS),
    "keyboard_interrupt_and_own_base_exception": (
        "class Boom(BaseException):\n    pass\n"
        "def f(n):\n    raise KeyboardInterrupt if n == -1 else Boom\n", REJECTS_TESTS),
    "os_exit_caught_as_exception": ("import os\ndef f(n):\n    os._exit(1)\n", REJECTS_TESTS),
    "os_exit_caught_by_bare_except": (
        "import os\ndef f(n):\n    os._exit(1)\n", REJECTS_TESTS.replace("except Exception", "except")),
    # Subclasses whose own methods tell the codec another value than plain Python compares.
    "list_subclass_iter_lies": (
        "class L(list):\n    def __iter__(self):\n        return iter([7919])\n"
        "def f(n):\n    return L()\n", "assert f(3) == [7919]\n"),
    "tuple_and_set_subclass_iter_lies": (
        "class T(tuple):\n    def __iter__(self):\n        return iter([1, 2])\n"
        "class S(set):\n    def __iter__(self):\n        return iter([1])\n"
        "def f(n):\n    return T()\ndef g(n):\n    return S()\n",
        "assert f(3) == (1, 2)\nassert g(3) == {1}\n"),
    "dict_subclass_items_lie": (
        "class D(dict):\n    def items(self):\n        return [(1, 2)]\n    def __iter__(self):\n"
        "        return iter([1])\n    def keys(self):\n        return [1]\n"
        "def f(n):\n    return D()\n", "assert f(3) == {1: 2}\n"),
    "int_subclass_int_lies": (
        "class I(int):\n    def __int__(self):\n        return 7919\n    def __index__(self):\n"
        "        return 7919\ndef f(n):\n    return I(0)\n", "assert f(3) == 7919\n"),
    "float_complex_bytes_subclasses_lie": (
        "class F(float):\n    def __float__(self):\n        return 2.5\n    def hex(self):\n"
        "        return (2.5).hex()\nclass C(complex):\n    real = 5.0\n"
        "class B(bytes):\n    def __bytes__(self):\n        return b'ok'\n"
        "def f(n):\n    return F(0)\ndef g(n):\n    return C(0)\ndef h(n):\n    return B(b'no')\n",
        "assert f(3) == 2.5\nassert g(3) == 5\nassert h(3) == b'ok'\n"),
    "class_property_claims_int": (
        "class N:\n    __class__ = property(lambda self: int)\n    def __index__(self):\n"
        "        return 7919\n    def __int__(self):\n        return 7919\n"
        "def f(n):\n    return N()\n", "assert f(3) == 7919\n"),
    "dict_subclass_missing_key": (
        "class D(dict):\n    def __missing__(self, k):\n        return 1\ndef f(n):\n    return D()\n",
        "assert f(1)['z'] == 1\n"),
}


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


CORRECT: dict[str, tuple[str, str]] = {
    "math": (
        "import math\ndef hyp(a, b):\n    return math.hypot(a, b)\n",
        # math unimported in the tests: MBPP relies on the program's import.
        "assert abs(hyp(3, 4) - 5.0) < 1e-9\nassert hyp(0, 0) == 0\n"
        "assert math.isclose(hyp(1, 1), math.sqrt(2))\n"),
    "itertools": (
        "from itertools import permutations, combinations\n"
        "def count_perms(xs):\n    return len(set(permutations(xs)))\n"
        "def pairs(n):\n    return list(combinations(range(n), 2))\n",
        "assert count_perms([1, 1, 2]) == 3\nassert len(pairs(4)) == 6\n"
        "assert sorted(pairs(3)) == [(0, 1), (0, 2), (1, 2)]\n"),
    "collections": (
        "from collections import Counter, deque, defaultdict, namedtuple, OrderedDict\n"
        "Point = namedtuple('Point', 'x y')\n"
        "def top(s):\n    return Counter(s).most_common(1)[0][0]\n"
        "def groups(words):\n    d = defaultdict(list)\n    for w in words:\n"
        "        d[len(w)].append(w)\n    return dict(d)\n"
        "def rotate(xs, k):\n    q = deque(xs)\n    q.rotate(k)\n    return list(q)\n",
        "assert top('abracadabra') == 'a'\nassert groups(['a', 'bb', 'c']) == {1: ['a', 'c'], 2: ['bb']}\n"
        "assert rotate([1, 2, 3], 1) == [3, 1, 2]\n"),
    "recursion": (
        "import sys\nfrom functools import lru_cache\nsys.setrecursionlimit(5000)\n"
        "@lru_cache(maxsize=None)\ndef fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n"
        "def depth(n):\n    return 0 if n == 0 else 1 + depth(n - 1)\n",
        "assert fib(90) == 2880067194370816120\nassert depth(2000) == 2000\n"),
    "classes_internally": (
        "from dataclasses import dataclass, field\n@dataclass\nclass Stack:\n"
        "    items: list = field(default_factory=list)\n    def push(self, x):\n"
        "        self.items.append(x)\n    def pop(self):\n        return self.items.pop()\n"
        "PAIRS = {')': '(', ']': '['}\n"
        "def balanced(s):\n    st = Stack()\n    for c in s:\n        if c in '([':\n"
        "            st.push(c)\n        elif c in PAIRS:\n            if not st.items or st.pop() != PAIRS[c]:\n"
        "                return False\n    return not st.items\n",
        "assert balanced('([])')\nassert not balanced('(]')\nassert balanced('') is True\n"),
    "own_temp_files": (
        "import os, tempfile, pathlib, shutil, json\n"
        "def roundtrip(data):\n    with tempfile.TemporaryDirectory() as d:\n"
        "        os.mkdir(os.path.join(d, 'sub'))\n        p = os.path.join(d, 'sub', 'x.json')\n"
        "        with open(p, 'w') as fh:\n            json.dump(data, fh)\n"
        "        shutil.copy(p, p + '.bak')\n        return json.loads(pathlib.Path(p + '.bak').read_text())\n"
        "def scratch(text):\n    with tempfile.NamedTemporaryFile('w+') as fh:\n"
        "        fh.write(text)\n        fh.seek(0)\n        return fh.read()\n"
        "def local(text):\n    open('local.txt', 'w').write(text)\n    out = open('local.txt').read()\n"
        "    os.remove('local.txt')\n    return out + str(len(os.listdir('.')))\n",
        "assert roundtrip({'a': [1, 2]}) == {'a': [1, 2]}\nassert scratch('hi') == 'hi'\n"
        "assert local('x') == 'x0'\n"),
    "printing": (
        "def loud(n):\n    for i in range(n):\n        print('line', i)\n    return n * 2\n",
        "assert loud(1000) == 2000\nassert loud(0) == 0\n"),
    "builtins_in_tests": (
        "def evens(xs):\n    return [x for x in xs if x % 2 == 0]\n"
        "def half(x):\n    return x / 2\n",
        "assert sorted(evens([4, 1, 2])) == [2, 4]\nassert len(evens(range(10))) == 5\n"
        "assert abs(half(3) - 1.5) < 1e-9\nassert max(evens([8, 3, 6])) == 8\n"),
    "heap_bisect_re": (
        "import heapq, bisect, re\n"
        "def smallest(xs, k):\n    return heapq.nsmallest(k, xs)\n"
        "def where(xs, x):\n    return bisect.bisect_left(xs, x)\n"
        "def words(s):\n    return re.findall(r'[a-z]+', s.lower())\n",
        "assert smallest([5, 1, 4, 2], 2) == [1, 2]\nassert where([1, 3, 5], 4) == 2\n"
        "assert words('Hi, there!') == ['hi', 'there']\n"),
    "fractions_decimal_dates": (
        "from fractions import Fraction\nfrom decimal import Decimal\nimport datetime, statistics\n"
        "def add_frac(a, b):\n    return str(Fraction(a) + Fraction(b))\n"
        "def money(a, b):\n    return str(Decimal(a) + Decimal(b))\n"
        "def year(s):\n    return datetime.datetime.strptime(s, '%Y-%m-%d').year\n"
        "def med(xs):\n    return statistics.median(xs)\n",
        "assert add_frac('1/2', '1/3') == '5/6'\nassert money('0.1', '0.2') == '0.3'\n"
        "assert year('2024-02-29') == 2024\nassert med([3, 1, 2]) == 2\n"),
    "test_helper_and_exceptions": (
        "def check(*a):\n    return True  # its own helper; the tests' check must win\n"
        "def abs(x):\n    return x if x >= 0 else -x  # used internally, correct anyway\n"
        "def parse(s):\n    if not s.isdigit():\n        raise ValueError(s)\n    return int(s)\n"
        "def dist(a, b):\n    return abs(a - b)\n"
        "LIMIT = 10\n",
        "def check(fn, arg, want):\n    return fn(arg) == want\n"
        "def raises(fn, arg):\n    try:\n        fn(arg)\n    except ValueError:\n        return True\n"
        "    return False\n"
        "assert check(parse, '12', 12)\nassert raises(parse, 'x')\nassert not check(parse, '3', 4)\n"
        "assert dist(2, 5) == 3\nassert LIMIT == 10\n"),
    "pathlib_and_relative_os_open": (
        "import os, pathlib, shutil\n"
        "def go():\n    d = pathlib.Path('data')\n    d.mkdir()\n    (d / 'a.txt').write_text('1')\n"
        "    (d / 'b.txt').touch()\n    names = sorted(p.name for p in d.glob('*.txt'))\n"
        "    (d / 'a.txt').rename(d / 'c.txt')\n    (d / 'b.txt').unlink()\n"
        "    os.makedirs('e/f', exist_ok=True)\n    shutil.rmtree('e')\n"
        "    fd = os.open('rel.txt', os.O_WRONLY | os.O_CREAT)\n    os.write(fd, b'hi')\n"
        "    os.close(fd)\n    return names + os.listdir(d) + [open('rel.txt').read()]\n",
        "assert go() == ['a.txt', 'b.txt', 'c.txt', 'hi']\n"),
    "strings_and_sets": (
        "def uniq(s):\n    return ''.join(sorted(set(s)))\ndef caesar(s, k):\n"
        "    return ''.join(chr((ord(c) - 97 + k) % 26 + 97) for c in s)\n",
        "assert uniq('banana') == 'abn'\nassert caesar('xyz', 3) == 'abc'\n"),
    "stdlib_imports_lazy_and_eager": (
        "import re, json, fractions, decimal, heapq, bisect, functools, statistics, datetime\n"
        "import string, random, typing, dataclasses, enum, copy, operator, itertools\n"
        "import collections, math, cmath, numbers, textwrap, unicodedata, hashlib, array, struct\n"
        "def digest(s):\n    import hashlib, unicodedata, struct, array\n"
        "    return (hashlib.sha256(s.encode()).hexdigest()[:8], unicodedata.name('a'),\n"
        "            struct.pack('<i', 1), array.array('i', [1, 2]).tolist())\n"
        "def wrap(s):\n    import textwrap\n    return textwrap.shorten(s, 12)\n",
        "assert digest('abc') == ('ba7816bf', 'LATIN SMALL LETTER A', b'\\x01\\x00\\x00\\x00', [1, 2])\n"
        "assert wrap('hello world foo') == 'hello [...]'\n"),
    "clock_random_sys": (
        "import random, time, datetime, sys\n"
        "def same_draw(n):\n    random.seed(n)\n    a = random.randint(1, 100)\n"
        "    random.seed(n)\n    return a == random.randint(1, 100)\n"
        "def now_ok():\n    return (time.time() > 1e9 and datetime.date.today().year >= 2024\n"
        "            and sys.getsizeof([]) > 0 and isinstance(sys.argv, list))\n"
        "def stdin_text():\n    return sys.stdin.read()\n"
        "if __name__ == '__main__':\n    print(same_draw(1))\n",
        "assert same_draw(5) is True\nassert now_ok()\nassert stdin_text() == ''\n"),
    "entry_point_forms_and_recursion": (
        "import sys\nclass Solution:\n    def twice(self, x):\n        return 2 * x\n"
        "def twice(x):\n    return Solution().twice(x)\ntriple = lambda x: 3 * x\n"
        "def depth(n):\n    return 0 if n == 0 else 1 + depth(n - 1)\n",
        "assert twice(2) == 4\nassert triple(2) == 6\nassert depth(900) == 900\n"),
    "numbers_at_the_edges": (
        "def inf_or_nan(x):\n    return float('inf') if x else float('nan')\n"
        "def neg_zero():\n    return -0.0\ndef power(n):\n    return 2 ** n\n"
        "def positive(x):\n    return x > 0\ndef root(x):\n    import cmath\n    return cmath.sqrt(x)\n",
        "import math\nassert math.isinf(inf_or_nan(1))\nassert math.isnan(inf_or_nan(0))\n"
        "assert math.copysign(1, neg_zero()) == -1 and neg_zero() == 0\n"
        "assert power(20000) == 2 ** 20000\nassert positive(1) is True and positive(1) == 1\n"
        "assert positive(-1) is False\nassert root(-1) == 1j\n"),
    "raised_errors_and_kwargs": (
        "def parse(x, base=10, *, strict=True):\n    if strict and not x.isdigit():\n"
        "        raise ValueError(x)\n    return int(x, base) if x.isdigit() else None\n"
        "def first(xs):\n    it = iter(xs)\n    try:\n        return next(it)\n"
        "    except StopIteration:\n        return None\n",
        "try:\n    parse('x')\n    raised = False\nexcept ValueError:\n    raised = True\n"
        "assert raised\nassert parse('11', 2) == 3\nassert parse('x', strict=False) is None\n"
        "assert first([]) is None and first([4]) == 4\n"),
    "containers_back_as_builtins": (
        "from collections import Counter, OrderedDict\nclass S(str):\n    pass\n"
        "def counts(s):\n    return Counter(s)\ndef ordered():\n    return OrderedDict(a=1)\n"
        "def name():\n    return S('abc')\ndef pair(x):\n    return {x, x + 1}, (x, x + 1)\n"
        "def total(r):\n    return sum(r)\n",
        "assert counts('aab') == {'a': 2, 'b': 1}\nassert ordered() == {'a': 1}\n"
        "assert name() == 'abc' and isinstance(name(), str)\n"
        "assert pair(1) == ({1, 2}, (1, 2))\nassert total(range(10)) == 45\n"),
    "exceptions_as_in_plain_python": (
        "import sys\ndef parse(s):\n    if not s.isdigit():\n        raise ValueError(s)\n"
        "    return int(s)\ndef leave(code):\n    sys.exit(code)\n",
        "def rejects(x):\n    try:\n        parse(x)\n    except Exception:\n        return True\n"
        "    return False\ndef exit_code(c):\n    try:\n        leave(c)\n"
        "    except SystemExit as exc:\n        return str(exc)\n"
        "def message(x):\n    try:\n        parse(x)\n    except ValueError as exc:\n        return str(exc)\n"
        "assert rejects('x') and not rejects('1')\nassert exit_code(3) == '3'\n"
        "assert message('-1') == '-1'\n"),
    "generators_and_iterators": (
        "def gen(n):\n    for i in range(n):\n        yield i * i\n"
        "def pairs(xs):\n    return zip(xs, xs[1:])\n"
        "def evens(xs):\n    return filter(lambda x: x % 2 == 0, xs)\n",
        "assert list(gen(3)) == [0, 1, 4]\nassert next(gen(5)) == 0\n"
        "assert list(pairs([1, 2, 3])) == [(1, 2), (2, 3)]\n"
        "assert sum(evens(x for x in [1, 2, 4])) == 6\nassert gen(2) != [0, 1]\n"),
    "builtin_modules_and_reloads": (
        "import importlib, os, posix, pwd, _string, faulthandler, string\n"
        "importlib.reload(os)\nimportlib.reload(posix)\n"
        "def fmt(n):\n    return string.Formatter().format('{0}!', n)\n",
        "assert fmt(1) == '1!'\n"),
    "zoneinfo_warnings_logging": (
        "import warnings, logging, datetime\nfrom zoneinfo import ZoneInfo\nwarnings.warn('w')\n"
        "logging.warning('l')\ndef offset():\n"
        "    t = datetime.datetime(2020, 1, 1, tzinfo=ZoneInfo('Europe/Paris'))\n"
        "    return t.utcoffset().total_seconds()\n",
        "assert offset() == 3600.0\n"),
}


@pytest.mark.parametrize("namespaces", [True, False], ids=["namespaces", "no_namespaces"])
def test_correct_programs_pass(namespaces: bool):
    names = list(CORRECT)
    results = run_many([CORRECT[n] for n in names], timeout_s=10.0, workers=2,
                       namespaces=namespaces)
    assert len(names) >= 10
    for name, result in zip(names, results, strict=True):
        assert isinstance(result, CodeResult)
        assert (result.passed, result.error) == (True, None), (name, result)
        assert result.passed_count == result.total, name
