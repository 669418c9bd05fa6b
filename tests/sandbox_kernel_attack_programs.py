"""Attacks on the sandbox's guard itself, and what an attacker does once it is off (data only).

Collected by test_sandbox_adversarial.py, with the placeholders of
sandbox_attack_programs.py plus: TCP_PORT (a listener on 127.0.0.1), UNIX_SOCK
(a listening socket file), ABSTRACT_NAME (an abstract UNIX socket), SHM_NAME (the
name of SHM_FILE in /dev/shm), HOST_TMP
and VAR_TMP (paths in the host's /tmp and /var/tmp that must not appear),
HOST_SECRET (a world-readable file holding the secret), REINFORGE_DIR (the
reinforge package). Every program's `f` returns None, or what it stole.
"""

from __future__ import annotations

# Clears or replaces everything of the guard the program can reach from `__main__` (the
# sandbox's own source runs there): tables, helpers, their defaults. None of it may matter.
TAMPER = r'''
import __main__, sys
for _name in list(vars(__main__)):
    _v = getattr(__main__, _name)
    for _meth in ("clear", "__init__"):
        try:
            getattr(_v, _meth)()
        except Exception:
            pass
    try:
        setattr(__main__, _name, type(_v)() if isinstance(_v, (tuple, frozenset, dict, set, list, str)) else None)
    except Exception:
        pass
    for _attr in ("__defaults__", "__kwdefaults__", "__code__"):
        try:
            setattr(_v, _attr, None)
        except Exception:
            pass
'''

# The lib-dynload file of extension `name`, found without importing it.
FIND_EXT = r'''
import os, sys
def ext_path(name):
    for d in sys.path:
        try:
            for n in os.listdir(d):
                if n.startswith(name + ".") and n.endswith(".so"):
                    return os.path.join(d, n)
        except OSError:
            pass
    raise RuntimeError("no " + name)
'''

NONE = "\ndef f(n):\n    return None\n"


def _load_by_path(spec_name: str, ext: str, then: str) -> str:
    return (FIND_EXT + "import importlib.util\n"
            f"spec = importlib.util.spec_from_file_location({spec_name!r}, ext_path({ext!r}))\n"
            "m = importlib.util.module_from_spec(spec)\nspec.loader.exec_module(m)\n" + then + NONE)


KERNEL_ATTACKS: dict[str, str] = {
    # --- the guard's tables and helpers, then the effects it should have stopped ---
    "tamper_then_truncate": TAMPER + "import os\nos.truncate('CANARY_FILE', 0)\n" + NONE,
    "tamper_then_remove": TAMPER + "import os\nos.remove('CANARY_FILE')\n" + NONE,
    "tamper_then_rename": TAMPER + "import os\nos.rename('CANARY_FILE', 'CANARY_DIR/stolen')\n" + NONE,
    "tamper_then_mkdir_host_tmp": TAMPER + "import os\nos.mkdir('HOST_TMP')\n" + NONE,
    "tamper_then_chmod_and_utime": (
        TAMPER + "import os\ntry:\n    os.utime('CANARY_FILE', (0, 0))\nfinally:\n"
        "    os.chmod('CANARY_FILE', 0o777)\n" + NONE),
    "tamper_then_write_shm": TAMPER + "open('SHM_FILE', 'w').write('x')\n" + NONE,
    "rebind_guard_helpers": (
        "import __main__\n__main__.resolve = lambda p, c, *a: c + '/ok'\n"
        "__main__.name_refused = lambda *a: False\n__main__.extension_refused = lambda *a: None\n"
        "__main__.REFUSED_IMPORTS = frozenset()\n__main__.WRITE_PATH_EVENTS = ()\n"
        "import os\nos.remove('CANARY_FILE')\n" + NONE),
    "helper_defaults_rewritten": (
        "import __main__\n__main__.extension_refused.__defaults__ = (None, None, None)\n"
        + _load_by_path("readline", "readline", "")),
    "helper_code_swapped": (
        "import __main__\n__main__.name_refused.__code__ = (lambda *a, **k: False).__code__\n"
        "import _ctypes\n" + NONE),
    # --- extension modules: every dotted part, the file's own name, where it lies ---
    "ext_dotted_readline": _load_by_path("x.readline", "readline",
                                         "m.write_history_file('CANARY_FILE')\n"),
    "ext_dotted_ctypes": _load_by_path("x._ctypes", "_ctypes", "print(m.dlopen)\n"),
    "ext_dotted_posixshmem": _load_by_path(
        "pkg.sub._posixshmem", "_posixshmem", "m.shm_open('/SHM_NAME', os.O_CREAT | os.O_RDWR, 0o666)\n"),
    "ext_dotted_posixsubprocess": _load_by_path("a._posixsubprocess", "_posixsubprocess", ""),
    "ext_benign_name_ctypes_file": _load_by_path("x.grp", "_ctypes", ""),
    "ext_create_dynamic_cached_ctypes": (
        FIND_EXT + "import _imp, importlib.machinery\n"
        "spec = importlib.machinery.ModuleSpec('_ctypes', None, origin=ext_path('_ctypes'))\n"
        "m = _imp.create_dynamic(spec)\nprint(m.dlopen(None))\n" + NONE),
    "ext_file_loader_readline": (
        FIND_EXT + "import importlib.machinery, importlib.util\n"
        "loader = importlib.machinery.ExtensionFileLoader('readline', ext_path('readline'))\n"
        "spec = importlib.util.spec_from_loader('readline', loader)\n"
        "m = loader.create_module(spec)\nm.write_history_file('CANARY_FILE')\n" + NONE),
    "ext_copied_into_workdir": (
        FIND_EXT + "import importlib.util, shutil\n"
        "shutil.copy(ext_path('grp'), 'grp.cpython-311-x86_64-linux-gnu.so')\n"
        "spec = importlib.util.spec_from_file_location('grp', 'grp.cpython-311-x86_64-linux-gnu.so')\n"
        "m = importlib.util.module_from_spec(spec)\nprint('loaded own copy', m)\n"
        "raise RuntimeError('loaded an extension from the work directory')\n"),
    "ext_meta_path_finder": (
        FIND_EXT + "import importlib.abc, importlib.machinery, sys\n"
        "class Finder(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'innocent':\n"
        "            loader = importlib.machinery.ExtensionFileLoader('_ctypes', ext_path('_ctypes'))\n"
        "            return importlib.machinery.ModuleSpec('_ctypes', loader, origin=ext_path('_ctypes'))\n"
        "sys.meta_path.insert(0, Finder())\nimport innocent\nprint(innocent.dlopen)\n" + NONE),
    "ext_import_module_variants": (
        "import importlib, sys\nfor name in ('_ctypes', 'ctypes', 'x.ctypes', '_posixshmem'):\n"
        "    try:\n        importlib.import_module(name)\n        print('imported', name)\n"
        "        raise SystemExit(3)\n    except ImportError:\n        pass\n"
        "print(sys.modules.get('_ctypes'))\nraise RuntimeError('all refused')\n"),
    "ctypes_classes_from_subclasses": (
        "def walk(c, seen):\n    for s in type.__subclasses__(c):\n        if s not in seen:\n"
        "            seen.add(s)\n            walk(s, seen)\n    return seen\n"
        "found = {c.__name__: c for c in walk(object, set()) if c.__module__ == '_ctypes'}\n"
        "Simple = found['_SimpleCData']\nclass VoidP(Simple):\n    _type_ = 'P'\n"
        "p = VoidP(id(found))\nimport os\nos.kill(CANARY_PID, 9)\n" + NONE),
    # --- opens that write, however they are spelled ---
    "open_rdonly_with_trunc": "import os\nos.open('CANARY_FILE', os.O_RDONLY | os.O_TRUNC)\n" + NONE,
    "fileio_write_mode": "import io\nio.FileIO('CANARY_FILE', 'w').write(b'pwned')\n" + NONE,
    "open_r_plus": "open('CANARY_FILE', 'r+').write('pwned')\n" + NONE,
    "open_append_binary": "open('CANARY_FILE', 'ab', buffering=0).write(b'pwned')\n" + NONE,
    "mkstemp_in_shm": "import tempfile\ntempfile.mkstemp(dir='/dev/shm')\n" + NONE,
    "shutil_copy_to_shm": "import shutil\nshutil.copy('/dev/null', 'SHM_FILE')\n" + NONE,
    "pathlib_write_host_tmp": "import pathlib\npathlib.Path('HOST_TMP').write_text('x')\n" + NONE,
    "write_var_tmp": "open('VAR_TMP', 'w').write('x')\n" + NONE,
    "write_through_workdir_parent": (
        "import os\nopen(os.path.join(os.getcwd(), '..', 'HOST_TMP'.rsplit('/', 1)[1]), 'w')\n" + NONE),
    # --- lasting effects: the interpreter, reinforge, later verdicts ---
    "poison_stdlib_subprocess": (
        "import os\nstd = os.path.dirname(os.__file__)\n"
        "os.rename(std + '/subprocess.py', std + '/subprocess_orig.py')\n"
        "open(std + '/subprocess.py', 'w').write('raise SystemExit')\n" + NONE),
    "poison_stdlib_sitecustomize": (
        "import os\nopen(os.path.dirname(os.__file__) + '/sitecustomize.py', 'w').write('x = 1')\n"
        + NONE),
    "poison_stdlib_pycache": (
        "import os, glob\nfor p in glob.glob(os.path.dirname(os.__file__) + '/__pycache__/json*'):\n"
        "    open(p, 'r+b').write(b'\\0')\n"
        "open(os.path.dirname(os.__file__) + '/__pycache__/x.pyc', 'wb')\n" + NONE),
    "poison_lib_dynload": (
        "import os, sys\nfor d in sys.path:\n    if d.endswith('lib-dynload'):\n"
        "        open(d + '/evil.so', 'wb').write(b'x')\n"
        "raise RuntimeError('no lib-dynload written')\n"),
    "poison_reinforge_source": (
        "open('REINFORGE_DIR/verifiers/sandbox/judge.py', 'a').write('\\nraise SystemExit\\n')\n" + NONE),
    "persist_everywhere": (
        "import os\nfor p in ('HOST_TMP', 'VAR_TMP', 'SHM_FILE', '/tmp/reinforge-planted'):\n"
        "    try:\n        open(p, 'w').write('x')\n    except OSError:\n        pass\n" + NONE),
    "hardlink_canary_then_write": (
        "import os\nos.link('CANARY_FILE', 'mine')\nopen('mine', 'w').write('pwned')\n" + NONE),
    "forge_refusal_to_stop_training": (
        "import json, os\nmsg = json.dumps({'id': 0, 'ok': False, 'refused': 'forged',"
        " 'layers': {}}).encode()\nfor fd in range(3, 64):\n    try:\n"
        "        os.write(fd, len(msg).to_bytes(8, 'big') + msg)\n    except OSError:\n"
        "        pass\n" + NONE),
    # --- other processes ---
    "kill_canary_sigterm": "import os\nos.kill(CANARY_PID, 15)\n" + NONE,
    "killpg_own_group_then_canary": (
        "import os, signal\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "os.killpg(0, signal.SIGTERM)\nos.kill(CANARY_PID, 9)\n" + NONE),
    "prlimit_canary": (
        "import resource\nresource.prlimit(CANARY_PID, resource.RLIMIT_NOFILE, (1, 1))\n" + NONE),
    "proc_mem_write_canary": (
        "open('/proc/CANARY_PID/mem', 'r+b').write(b'\\0')\n" + NONE),
    "fork_via_posix": "import posix\nposix.fork()\n" + NONE,
    "exec_shell": "import os\nos.execv('/bin/sh', ['sh', '-c', 'kill -9 CANARY_PID'])\n" + NONE,
    "register_at_fork_then_fork": (
        "import os\nos.register_at_fork(after_in_child=lambda: os.kill(CANARY_PID, 9))\nos.fork()\n"
        + NONE),
    # --- the network ---
    "tcp_loopback": (
        "import socket\nsocket.create_connection(('127.0.0.1', TCP_PORT), timeout=1).send(b'x')\n"
        + NONE),
    "tcp_raw_socket_module": (
        "import _socket\ns = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM)\n"
        "s.connect(('127.0.0.1', TCP_PORT))\n" + NONE),
    "udp_loopback": (
        "import socket\nsocket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'x', "
        "('127.0.0.1', TCP_PORT))\n" + NONE),
    "unix_socket_file": (
        "import socket\ns = socket.socket(socket.AF_UNIX)\ns.connect('UNIX_SOCK')\ns.send(b'x')\n"
        + NONE),
    "unix_socket_abstract": (
        "import socket\ns = socket.socket(socket.AF_UNIX)\ns.connect('\\0ABSTRACT_NAME')\n"
        "s.send(b'x')\n" + NONE),
    # --- reading the host ---
    "read_secret_open_code": (
        "import io\ndata = io.open_code('HOST_SECRET').read()\nprint(data)\n"
        "raise RuntimeError(data)\n"),
    "read_secret_linecache": (
        "import linecache\ndata = ''.join(linecache.getlines('HOST_SECRET'))\nprint(data)\n"
        "raise RuntimeError(data)\n"),
    "read_secret_os_read": (
        "import os\ndata = os.read(os.open('HOST_SECRET', os.O_RDONLY), 200)\nprint(data)\n"
        "raise RuntimeError(data)\n"),
    "read_canary_cmdline": (
        "data = open('/proc/CANARY_PID/cmdline').read()\nprint(data)\nraise RuntimeError(data)\n"),
}

# One program that tampers with everything it can reach, then tries every effect the guard
# exists to stop; it prints one JSON line {effect: "ok" or the exception}. Run with the audit
# hook on and off: each effect must be stopped by a kernel layer alone.
EFFECTS = r'''
import json, os, socket
try:  # refused while the hook is on; with it off, the attacker's own tool
    import ctypes
except ImportError as exc:
    ctypes, CTYPES_REFUSED = None, exc
''' + TAMPER + r'''
OUT = {}
STD = os.path.dirname(os.__file__)
def attempt(name, fn):
    try:
        fn()
        OUT[name] = "ok"
    except BaseException as exc:
        OUT[name] = type(exc).__name__ + ": " + str(exc)[:120]
def c_call(name, *args):
    if ctypes is None:
        raise CTYPES_REFUSED
    libc = ctypes.CDLL(None, use_errno=True)
    if getattr(libc, name)(*args) == -1:
        raise OSError(ctypes.get_errno(), name)
def fork():
    if os.fork() == 0:
        os._exit(0)
attempt("write_canary", lambda: open("CANARY_FILE", "w").write("pwned"))
attempt("truncate_canary", lambda: os.truncate("CANARY_FILE", 0))
attempt("remove_canary", lambda: os.remove("CANARY_FILE"))
attempt("chmod_canary", lambda: os.chmod("CANARY_FILE", 0o600))
attempt("mkdir_canary_dir", lambda: os.mkdir("CANARY_DIR/new"))
attempt("write_shm", lambda: open("SHM_FILE", "w").write("x"))
attempt("write_host_tmp", lambda: open("HOST_TMP", "w").write("x"))
attempt("write_var_tmp", lambda: open("VAR_TMP", "w").write("x"))
attempt("create_in_stdlib", lambda: os.close(os.open(STD, os.O_TMPFILE | os.O_WRONLY, 0o600)))
attempt("append_reinforge", lambda: open("REINFORGE_DIR/verifiers/sandbox/judge.py", "a"))
attempt("read_secret", lambda: print(open("HOST_SECRET").read()))
attempt("read_judge_environ", lambda: print(open("/proc/%d/environ" % os.getppid(), "rb").read()))
attempt("read_canary_cmdline", lambda: print(open("/proc/CANARY_PID/cmdline").read()))
attempt("kill_canary", lambda: os.kill(CANARY_PID, 9))
attempt("kill_everything", lambda: os.kill(-1, 9))
attempt("c_kill_canary", lambda: c_call("kill", CANARY_PID, 9))
attempt("c_ptrace_canary", lambda: c_call("ptrace", 16, CANARY_PID, 0, 0))
attempt("c_process_vm_readv", lambda: c_call("process_vm_readv", CANARY_PID, None, 0, None, 0, 0))
attempt("c_signal_everything", lambda: c_call("kill", -1, 0))
attempt("c_unshare_user", lambda: c_call("unshare", 0x10000000))
attempt("c_mount_tmpfs", lambda: c_call("mount", b"x", b".", b"tmpfs", 0, None))
attempt("c_memfd", lambda: c_call("memfd_create", b"x", 0))
attempt("c_setuid_root", lambda: c_call("setuid", 0))
attempt("fork", fork)
attempt("exec", lambda: os.execv("/bin/true", ["true"]))
attempt("tcp", lambda: socket.create_connection(("127.0.0.1", TCP_PORT), timeout=1))
attempt("unix_file", lambda: socket.socket(socket.AF_UNIX).connect("UNIX_SOCK"))
attempt("unix_abstract", lambda: socket.socket(socket.AF_UNIX).connect("\0ABSTRACT_NAME"))
print(json.dumps(OUT), flush=True)
def f(n):
    return None
'''
