"""The attack programs of test_sandbox_adversarial.py (data only; collected from there).

Attack sources name the things they go after with placeholders that the test's
`_fill` replaces: CANARY_PID, TEST_PID, CANARY_FILE, CANARY_DIR, SHM_FILE (a name
in /dev/shm that must not appear), SECRET_NAME.
"""

from __future__ import annotations

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
    "mem_symlink_in_tmp": "import os\nos.symlink('/proc', 'p')\n" + _scan_attack("'p/%d' % os.getppid()"),
    "mem_every_pid": MEMSCAN
    + (
        "ANSWERS = {}\nfor pid in os.listdir('/proc'):\n    if pid.isdigit():\n        try:\n"
        "            ANSWERS.update(scan('/proc/' + pid))\n        except OSError:\n"
        "            pass\ndef f(n):\n    return ANSWERS.get(n)\n"
    ),
    "mem_test_process": _scan_attack("'/proc/TEST_PID'"),
    "mem_bytes_path": (
        "import os\nfd = os.open(b'/proc/%d/mem' % os.getppid(), os.O_RDONLY)\ndef f(n):\n    return None\n"
    ),
    "mem_str_subclass": (
        "import os\nclass S(str):\n    def startswith(self, *a):\n        return False\n"
        "    def split(self, *a):\n        return ['tmp']\n    def __eq__(self, o):\n"
        "        return True\n    __hash__ = str.__hash__\n"
        "data = open(S('/proc/%d/environ' % os.getppid()), 'rb').read()\n"
        "raise RuntimeError(repr(data))\n"
    ),
    "mem_fspath_switch": (
        "import io, os\nclass P:\n    n = 0\n    def __fspath__(self):\n        P.n += 1\n"
        "        return '/proc/%d/environ' % os.getppid() if P.n == 1 else 'harmless'\n"
        "data = io.FileIO(P()).read()\nraise RuntimeError(repr(data))\n"
    ),
    "mem_os_open_dir_fd_root": (
        "import os\nroot = os.open('/', os.O_RDONLY)\n"
        "fd = os.open('proc/%d/environ' % os.getppid(), os.O_RDONLY, dir_fd=root)\n"
        "raise RuntimeError(repr(os.read(fd, 4096)))\n"
    ),
    "mem_os_open_dir_fd_allowed_dir": (
        "import os\nlib = os.open('/usr/lib', os.O_RDONLY)\n"
        "fd = os.open('../../proc/%d/environ' % os.getppid(), os.O_RDONLY, dir_fd=lib)\n"
        "raise RuntimeError(repr(os.read(fd, 4096)))\n"
    ),
    "mem_io_fileio": "import io, os\n" + _read_attack("'/proc/%d/cmdline' % os.getppid()", "r"),
    "mem_pathlib": (
        "import os, pathlib\n"
        "data = (pathlib.Path('/proc') / str(os.getppid()) / 'environ').read_bytes()\n"
        "raise RuntimeError(repr(data))\n"
    ),
    "mem_importlib_loader": (
        "import os, importlib.machinery\npath = '/proc/%d/environ' % os.getppid()\n"
        "data = importlib.machinery.SourceFileLoader('x', path).get_data(path)\n"
        "raise RuntimeError(repr(data))\n"
    ),
    "mem_mmap": (
        "import mmap, os\nfd = os.open('/proc/%d/mem' % os.getppid(), os.O_RDONLY)\n"
        "m = mmap.mmap(fd, 4096, prot=mmap.PROT_READ)\ndef f(n):\n    return None\n"
    ),
    # --- environments and files of other processes ---
    "environ_test_process": "import os\n" + _read_attack("'/proc/TEST_PID/environ'"),
    "environ_all": (
        "import os\nout = []\nfor pid in os.listdir('/proc'):\n    try:\n"
        "        out.append(open('/proc/%s/environ' % pid, 'rb').read())\n    except OSError:\n"
        "        pass\nprint(out)\nraise RuntimeError(repr(out)[:400])\n"
    ),
    "environ_via_glob": (
        "import glob\nout = [open(p, 'rb').read() for p in glob.glob('/proc/*/environ')]\n"
        "print(out)\nraise RuntimeError(repr(out)[:400])\n"
    ),
    "judge_cwd_files": (
        "import os\nd = '/proc/%d/cwd' % os.getppid()\n"
        "out = {n: open(os.path.join(d, n)).read() for n in os.listdir(d)}\n"
        "print(out)\nraise RuntimeError(repr(out))\n"
    ),
    "judge_fds": (
        "import os\nd = '/proc/%d/fd' % os.getppid()\nout = []\nfor n in os.listdir(d):\n"
        "    try:\n        out.append(os.read(os.open(os.path.join(d, n), os.O_RDONLY), 1 << 16))\n"
        "    except OSError:\n        pass\nprint(out)\nraise RuntimeError(repr(out)[:400])\n"
    ),
    "readlink_then_open": (
        "import os\ntarget = os.readlink('/proc/TEST_PID/cwd')\nprint(os.listdir(target))\nraise RuntimeError(target)\n"
    ),
    "stdin_payload": (
        "import os, sys\ndata = sys.stdin.read() + os.read(0, 1 << 16).decode()\n"
        "def f(n):\n    import re\n    m = re.search(r'f\\(%d\\) == (\\d+)' % n, data)\n"
        "    return int(m[1]) if m else None\n"
    ),
    "tests_file_hunt": (
        "import os\nfound = {}\nfor d in ('.', '..', '/tmp'):\n    for n in os.listdir(d):\n"
        "        try:\n            found[n] = open(os.path.join(d, n)).read()\n"
        "        except OSError:\n            pass\nprint(found)\ndef f(n):\n    return None\n"
    ),
    "etc_shadow": _read_attack("'/etc/shadow'"),
    # --- the test's own meaning: builtins, helpers, values ---
    "shadow_builtins": (
        "def abs(x):\n    return 0\ndef len(x):\n    return 6\ndef str(x):\n    return 'xxxxxx'\n"
        "def sorted(x):\n    return [1, 350377]\ndef close(a, b):\n    return True\n"
        "class AssertionError(Exception):\n    pass\ndef f(n):\n    return None\n"
    ),
    "patch_builtins_module": (
        "import builtins\nbuiltins.abs = lambda x: 0\nbuiltins.len = lambda x: 6\n"
        "builtins.sorted = lambda x: [1, 350377]\nbuiltins.AssertionError = type('A', (Exception,), {})\n"
        "def f(n):\n    return None\n"
    ),
    "module_under_test_name": ("import builtins as close\nimport json as f\n"),
    "sys_modules_tampering": (
        "import sys, types\nfake = types.ModuleType('builtins')\nfake.abs = lambda x: 0\n"
        "sys.modules['builtins'] = fake\nsys.modules['json'] = fake\ndef f(n):\n    return None\n"
    ),
    "always_equal_object": (
        "class Any:\n    def __eq__(self, o):\n        return True\n    def __lt__(self, o):\n"
        "        return True\n    def __sub__(self, o):\n        return 0\n    def __len__(self):\n"
        "        return 6\n    def __hash__(self):\n        return 0\ndef f(n):\n    return Any()\n"
    ),
    "int_subclass_eq": (
        "class I(int):\n    def __eq__(self, o):\n        return True\n    __hash__ = int.__hash__\n"
        "def f(n):\n    return I(0)\n"
    ),
    "str_and_list_subclasses": (
        "class S(str):\n    def __eq__(self, o):\n        return True\n    __hash__ = str.__hash__\n"
        "class L(list):\n    def __eq__(self, o):\n        return True\n"
        "def f(n):\n    return S('x') if n % 2 else L([0])\n"
    ),
    "index_lies": (
        "class N:\n    def __index__(self):\n        return 7919\n    def __int__(self):\n"
        "        return 7919\n    def __float__(self):\n        return 7919.0\n"
        "def f(n):\n    return N()\n"
    ),
    # --- the verdict channel ---
    "fake_verdicts_stdout": (
        "import json, sys\nfor i in range(5):\n    print(json.dumps({'kind': 'case', 'index': i, 'ok': True}))\n"
        "print(json.dumps({'kind': 'done', 'error': None}))\nsys.stdout.flush()\n"
        "def f(n):\n    return None\n"
    ),
    "fake_verdicts_every_fd": (
        "import json, os\nline = ''.join(json.dumps({'kind': 'case', 'index': i, 'ok': True, 'id': 1,"
        " 'value': ['I', '0x1eef']}) + '\\n' for i in range(5)) + json.dumps({'kind': 'done'}) + '\\n'\n"
        "for fd in range(256):\n    try:\n        os.write(fd, line.encode())\n    except OSError:\n"
        "        pass\ndef f(n):\n    return None\n"
    ),
    "proc_self_fd_write": (
        "open('/proc/self/fd/1', 'w').write('{\"kind\": \"done\"}\\n')\ndef f(n):\n    return None\n"
    ),
    # --- other processes: the parent, the judge, the canary ---
    "kill_parent": "import os\nos.kill(os.getppid(), 9)\ndef f(n):\n    return None\n",
    "kill_canary": "import os\nos.kill(CANARY_PID, 9)\n",
    "kill_everything": "import os\nos.kill(-1, 9)\n",
    "killpg_canary": "import os\nos.killpg(os.getpgid(CANARY_PID), 9)\n",
    "pidfd_canary": ("import os, signal\nsignal.pidfd_send_signal(os.pidfd_open(CANARY_PID), 9)\n"),
    "pidfd_fresh_posix": (
        "import _imp, importlib.machinery, signal\n"
        "posix = _imp.create_builtin(importlib.machinery.ModuleSpec('posix', None))\n"
        "sig = _imp.create_builtin(importlib.machinery.ModuleSpec('_signal', None))\n"
        "fd = posix.pidfd_open(CANARY_PID)\nsig.pidfd_send_signal(fd, 9)\n"
        "sig.pidfd_send_signal(posix.pidfd_open(TEST_PID), 9)\n"
    ),
    "pthread_kill": "import signal, threading\nsignal.pthread_kill(threading.get_ident(), 9)\n",
    "setuid_root": "import os\nos.setuid(0)\nos.kill(CANARY_PID, 9)\n",
    "ctypes_kill": "import ctypes\nctypes.CDLL(None).kill(CANARY_PID, 9)\n",
    "ctypes_fresh_extension": (
        "import _imp, importlib.util\nspec = importlib.util.find_spec('_ctypes')\n"
        "_ctypes = _imp.create_dynamic(spec)\nlibc = _ctypes.dlopen(None)\n"
        "raise RuntimeError('loaded')\n"
    ),
    "process_vm_readv": (
        "import ctypes\nlibc = ctypes.CDLL(None)\nbuf = ctypes.create_string_buffer(64)\n"
        "libc.process_vm_readv(TEST_PID, 0, 0, 0, 0, 0)\n"
    ),
    "posixsubprocess": "import _posixsubprocess\n",
    "subprocess_cat": (
        "import subprocess\nprint(subprocess.run(['cat', '/proc/TEST_PID/environ'], capture_output=True).stdout)\n"
    ),
    "os_system": "import os\nos.system('kill -9 CANARY_PID; cat /proc/TEST_PID/environ')\n",
    "posix_spawn": "import os\nos.posix_spawn('/bin/kill', ['kill', '-9', 'CANARY_PID'], {})\n",
    "socket_out": "import socket\nsocket.create_connection(('127.0.0.1', 22), timeout=1)\n",
    "subinterpreter": "import _xxsubinterpreters as s\ns.run_string(s.create(), 'import os')\n",
    "forged_code_object": (
        "def g():\n    return 1\ng.__code__ = g.__code__.replace(co_code=bytes(len(g.__code__.co_code)))\n"
    ),
    "gc_hunting": (
        "import gc\nfound = [o for o in gc.get_objects() if isinstance(o, str) and '7919' in o]\n"
        "def f(n):\n    return None\n"
    ),
    "frame_walking": (
        "import sys, inspect\nframes, frame = [], sys._getframe()\nwhile frame:\n"
        "    frames.append(frame)\n    frame = frame.f_back\nseen = repr([fr.f_locals for fr in frames])\n"
        "stack = repr([fr.frame.f_locals for fr in inspect.stack()])\nimport re\n"
        "def f(n):\n    m = re.search(r'f\\(%d\\) == (\\d+)' % n, seen + stack)\n"
        "    return int(m[1]) if m else None\n"
    ),
    "rebind_hook_defaults": (
        "import sys\nframe = sys._getframe()\nwhile frame.f_back:\n    frame = frame.f_back\n"
        "for v in list(frame.f_globals.values()):\n    if callable(v) and getattr(v, '__defaults__', None):\n"
        "        v.__defaults__ = tuple(() for _ in v.__defaults__)\n" + _read_attack("'/proc/TEST_PID/environ'")
    ),
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
    "dir_fd_write": ("import os\nd = os.open('CANARY_DIR', os.O_RDONLY)\nos.unlink('canary', dir_fd=d)\n"),
    # --- exits, signals and resource bombs ---
    "os_exit_at_import": "import os\nos._exit(0)\n",
    "sys_exit_in_call": "import sys\ndef f(n):\n    sys.exit(0)\n",
    "exception_at_import": "raise ImportError('nope')\n",
    "sigkill_self_in_call": "import os, signal\ndef f(n):\n    os.kill(os.getpid(), signal.SIGKILL)\n",
    "alarm_self": "import signal\nsignal.alarm(1)\ndef f(n):\n    while True:\n        pass\n",
    "infinite_loop": "while True:\n    pass\n",
    "fork_bomb": "import os\nwhile True:\n    os.fork()\n",
    "memory_bomb": "x = []\nwhile True:\n    x.append(bytearray(10 ** 7))\n",
    "output_flood": (
        "import sys\nfor _ in range(200):\n    sys.stdout.write('x' * 10 ** 6)\n"
        "def f(n):\n    return None\n"
    ),
    "huge_return_value": "def f(n):\n    return 'x' * (64 * 2 ** 20)\n",
    # --- calls without audit events, and other spellings (red team, second round) ---
    "mkfifo_canary_dir": "import os\nos.mkfifo('CANARY_DIR/fifo')\n",
    "mknod_canary_dir": "import os, stat\nos.mknod('CANARY_DIR/node', 0o666 | stat.S_IFREG)\n",
    "posix_mknod_shm": "import posix, stat\nposix.mknod('SHM_FILE', 0o666 | stat.S_IFREG)\n",
    "memfd_memory": (
        "import os\nfds = [os.memfd_create('m') for _ in range(200)]\n"
        "for fd in fds:\n    os.write(fd, b'x' * (16 * 2 ** 20))\n"
    ),
    "renice_and_pin_the_canary": (
        "import os\nos.setpriority(os.PRIO_PROCESS, CANARY_PID, 19)\n"
        "os.setpriority(os.PRIO_USER, os.getuid(), 19)\nos.sched_setaffinity(CANARY_PID, {0})\n"
    ),
    "dev_shm_write": "open('SHM_FILE', 'w').write('pwned')\n",
    "dev_shm_os_open": "import os\nos.open('SHM_FILE', os.O_CREAT | os.O_WRONLY)\n",
    "dir_fd_create": (
        "import os\nd = os.open('CANARY_DIR', os.O_RDONLY)\n"
        "os.write(os.open('new', os.O_CREAT | os.O_WRONLY, dir_fd=d), b'x')\n"
    ),
    "dir_fd_mkdir": "import os\nos.mkdir('new', dir_fd=os.open('CANARY_DIR', os.O_RDONLY))\n",
    "rename_out_dst_dir_fd": (
        "import os\nopen('a', 'w').write('x')\n"
        "os.rename('a', 'stolen', dst_dir_fd=os.open('CANARY_DIR', os.O_RDONLY))\n"
    ),
    "rename_workdir_out": "import os\nos.rename('.', 'CANARY_DIR/stolen')\n",
    "tempfile_in_canary_dir": "import tempfile\ntempfile.mkstemp(dir='CANARY_DIR')\n",
    "sendfile_environ": ("import os\nos.sendfile(1, os.open('/proc/TEST_PID/environ', os.O_RDONLY), 0, 1 << 16)\n"),
    "open_code_environ": "import io\n"
    + _read_attack("'/proc/TEST_PID/environ'").replace("open(", "io.open_code(").replace(", 'r')", ")"),
    "zipimport_environ": "import zipimport\nzipimport.zipimporter('/proc/TEST_PID/environ')\n",
    "proc_spellings": (
        "out = []\nfor p in ['/proc/1/environ', '/proc/self/root/proc/TEST_PID/environ',"
        " '/proc/thread-self/../TEST_PID/environ', '/dev/shm/../../proc/TEST_PID/environ',"
        " '/sys/../proc/TEST_PID/environ']:\n    try:\n"
        "        out.append(open(p, 'rb').read())\n    except OSError:\n        pass\n"
        "print(out)\nraise RuntimeError(repr(out)[:400])\n"
    ),
    "thread": "import threading\nthreading.Thread(target=print).start()\ndef f(n):\n    return None\n",
    "faulthandler_exit": (
        "import faulthandler\nfaulthandler.dump_traceback_later(0.1, exit=True)\ndef f(n):\n    return None\n"
    ),
    "atexit_and_del": (
        "import atexit, json\natexit.register(print, json.dumps({'kind': 'done'}))\n"
        "class D:\n    def __del__(self):\n        raise SystemExit(0)\nd = D()\n"
        "def f(n):\n    return None\n"
    ),
    "forged_replies_on_resp_fd": (
        "import json, os, sys\nfor i in range(1, 9):\n"
        "    d = json.dumps({'id': i, 'ok': True, 'value': ['I', '0x1eef']}).encode()\n"
        "    os.write(int(sys.argv[2]), len(d).to_bytes(8, 'big') + d)\n"
        "def f(n):\n    return None\n"
    ),
    "entry_point_class_eq": (
        "class f:\n    def __init__(self, n):\n        pass\n    def __eq__(self, o):\n"
        "        return True\n    def __hash__(self):\n        return 0\n"
    ),
    "entry_point_generator": "def f(n):\n    yield 7919\n",
    "entry_point_async": "async def f(n):\n    return 7919\n",
    "fresh_posix_mkfifo": (
        "import _imp, importlib.machinery\n"
        "posix = _imp.create_builtin(importlib.machinery.ModuleSpec('posix', None))\n"
        "posix.mkfifo('CANARY_DIR/fifo')\n"
    ),
    "fresh_imp_then_fresh_posix": (
        "import _imp, importlib.machinery as m\n"
        "imp = _imp.create_builtin(m.ModuleSpec('_imp', None))\n"
        "imp.create_builtin(m.ModuleSpec('posix', None)).mknod('CANARY_DIR/node')\n"
    ),
    "original_create_builtin_from_defaults": (
        "import _imp, importlib.machinery\ncreate = _imp.create_builtin.__defaults__[0]\n"
        "original = create.__defaults__[0]\n"
        "original(importlib.machinery.ModuleSpec('posix', None)).mkfifo('CANARY_DIR/fifo')\n"
    ),
    "original_create_builtin_from_frames": (
        "import _imp, sys\nfound = []\nclass Spec:\n    @property\n    def name(self):\n"
        "        frame = sys._getframe(1)\n        while frame:\n"
        "            found.extend(v for v in frame.f_locals.values() if callable(v))\n"
        "            frame = frame.f_back\n        return 'pwd'\n_imp.create_builtin(Spec())\n"
        "class Posix:\n    name = 'posix'\nfor fn in found:\n    try:\n"
        "        fn(Posix()).mkfifo('CANARY_DIR/fifo')\n    except Exception:\n        pass\n"
        "def f(n):\n    return None\n"
    ),
    "guard_inner_function_with_overrides": (
        "import _imp, sys, importlib.machinery\ninner = []\nclass Spec:\n    @property\n"
        "    def name(self):\n        inner.extend(sys._getframe(1).f_locals.values())\n"
        "        return 'pwd'\n_imp.create_builtin(Spec())\n"
        "class Name(str):\n    def __hash__(self):\n        inner.extend(sys._getframe(1).f_locals.values())\n"
        "        return 0\n    def __eq__(self, other):\n        return False\n"
        "for fn in [v for v in inner if callable(v)]:\n"
        "    for call in (lambda: fn('posix', refused=frozenset()), lambda: fn(Name('posix'))):\n"
        "        try:\n            call().mkfifo('CANARY_DIR/fifo')\n        except Exception:\n"
        "            pass\n"
        "for fn in [v for v in inner if callable(v)]:\n    try:\n"
        "        fn(importlib.machinery.ModuleSpec('posix', None)).mknod('CANARY_DIR/node')\n"
        "    except Exception:\n        pass\n"
    ),
    "meta_path_finder_walks_frames_during_create": (
        "import sys, _imp, importlib.machinery\nfound = []\nclass Finder:\n"
        "    def find_spec(self, name, path=None, target=None):\n        frame = sys._getframe()\n"
        "        while frame:\n            found.extend(frame.f_locals.values())\n"
        "            frame = frame.f_back\nsys.meta_path.insert(0, Finder())\n"
        "for name in ('pwd', '_string', 'faulthandler', '_tracemalloc', 'xxsubtype'):\n"
        "    sys.modules.pop(name, None)\n"
        "    _imp.create_builtin(importlib.machinery.ModuleSpec(name, None))\n"
        "for fn in [v for v in found if callable(v)]:\n    try:\n"
        "        fn(importlib.machinery.ModuleSpec('posix', None)).mkfifo('CANARY_DIR/fifo')\n"
        "    except Exception:\n        pass\n"
    ),
    "abstract_unix_socket": (
        "import _socket\ns = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)\ns.connect(b'\\0reinforge')\n"
    ),
    "patch_int_eq_through_gc": (
        "import gc\ngc.get_referents(int.__dict__)[0]['__eq__'] = lambda a, b: True\ndef f(n):\n    return 0\n"
    ),
    "profiler_sees_the_guard": (
        "import sys, _imp, importlib.machinery\nseen = []\n"
        "sys.setprofile(lambda frame, event, arg: seen.append(dict(frame.f_locals)))\n"
        "_imp.create_builtin(importlib.machinery.ModuleSpec('pwd', None))\n"
    ),
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
    "planted_module_the_judge_would_import": (
        "import sys\nopen('statistics.py', 'w').write('mean = lambda xs: 7919\\n')\n"
        "sys.path.insert(0, '.')\nsys.modules.pop('statistics', None)\nimport statistics\n",
        "assert statistics.mean([1]) == 7919\n"),
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
