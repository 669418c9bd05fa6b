"""The candidate process: locks itself down, runs the untrusted program, and serves calls.

Runs as `python -I -S -B -c CODEC + GUARD + CANDIDATE ARGS...`, started by the
judge (under `unshare` when namespaces are in use: then it is PID 1 of its
own PID namespace, with its own /proc, no network and no view of the judge).
Each step needs a privilege the next one gives up, so the order matters:

1. rlimits (CPU, address space, file size, core 0, 256 descriptors, no new
   processes), SIGXFSZ ignored (an oversize write fails instead of killing),
   an alarm as last resort.
2. prctl(PR_SET_NO_NEW_PRIVS) through ctypes, then ctypes is dropped from
   sys.modules: the program's own `import ctypes` raises the import event
   the guard refuses.
3. The program arrives (first request) and the guard (audit hook) goes in,
   with `_imp.create_builtin` guarded (no fresh copy of posix, _signal, _imp).
4. If the stdlib cannot be reached by other users (Python under /root,
   say), it is opened now and imported through /proc/self/fd/N (see
   `stdlib_through_fds`): after step 5 its path would be closed.
5. setgroups([]), setgid, setuid to the uid the caller chose for this run
   (unused by anything else): no capabilities, no access to other users'
   files or processes, /proc/<judge>/mem unreadable. Fails closed.
6. os.pidfd_open and signal.pidfd_send_signal (no audit events) are removed;
   os.mkfifo, mknod, memfd_create, setpriority and sched_set* (no audit events
   either) refuse.
7. The program runs; the names the tests need are reported (a callable,
   a plain-data value, or a module imported under its own name); calls
   are served until the judge closes the pipe.
"""

import json
import os
import sys

try:  # in the sandbox these names come from codec.py and guard.py, prepended to this source
    from .codec import decode, encode, recv, send
    from .guard import SYSTEM_READ_FILES, SYSTEM_READ_ROOTS, guard_create_builtin, make_hook
except ImportError:
    pass

MAX_FD = 256
# Calls that raise no audit event, so the guard never sees them: mkfifo and mknod create
# files anywhere the uid may write (/tmp, /dev/shm: outside the sandbox), memfd_create
# holds memory that RLIMIT_AS does not count, and the scheduling calls reach other
# processes of the same uid (without the uid drop: the trainer's own, PRIO_USER renices
# them all). Replaced by `refused` in os and posix.
UNAUDITED_CALLS = ("mkfifo", "mknod", "memfd_create", "setpriority", "sched_setaffinity",
                   "sched_setscheduler", "sched_setparam")


def refused(what):
    def call(*args, **kwargs):
        raise PermissionError(f"sandbox: {what} is not allowed")

    call.__name__ = what.rsplit(".", 1)[-1]
    return call


def no_new_privs():
    """True once exec can never again gain privileges (setuid binaries, file capabilities)."""
    try:
        import ctypes

        ok = ctypes.CDLL(None, use_errno=True).prctl(38, 1, 0, 0, 0) == 0  # PR_SET_NO_NEW_PRIVS
    except Exception:
        ok = False
    for name in [m for m in sys.modules if m == "ctypes" or m.startswith(("ctypes.", "_ctypes"))]:
        del sys.modules[name]
    return ok


def readable_by_others(path):
    """Whether a uid with no groups can reach `path`: x on every ancestor, r and x on it."""
    import stat

    path = os.path.realpath(path)
    try:
        if not os.stat(path).st_mode & stat.S_IROTH:
            return False
        while True:
            if not os.stat(path).st_mode & stat.S_IXOTH:
                return False
            if path == "/":
                return True
            path = os.path.dirname(path)
    except OSError:
        return True  # nothing there to import from


def stdlib_through_fds(stdlib):
    """Make stdlib directories the dropped uid cannot reach by path reachable through fds.

    Python may live under a directory only root can enter (/root/.pyenv).
    Each such sys.path entry is opened now, as root, and sys.path and the
    `__path__` of loaded packages are rewritten to /proc/self/fd/N/...: the
    kernel follows that magic link straight to the directory, so only the
    directory's own (world-readable) mode is checked. Returns the fds.
    """
    moved = {}
    for path in sorted(set(stdlib), key=len, reverse=True):
        if os.path.isdir(path) and not readable_by_others(path):
            moved[path] = f"/proc/self/fd/{os.open(path, os.O_RDONLY | os.O_DIRECTORY)}"
    if not moved:
        return ()

    def move(entry):
        for old, new in moved.items():  # longest first: lib-dynload before its parent
            if entry == old or entry.startswith(old + "/"):
                return new + entry[len(old):]
        return entry

    sys.path[:] = [move(os.path.realpath(p)) for p in sys.path]
    for module in list(sys.modules.values()):
        search = getattr(module, "__path__", None)
        if type(search) is list:
            search[:] = [move(os.path.realpath(p)) for p in search]
    sys.path_importer_cache.clear()
    return tuple(int(new.rsplit("/", 1)[1]) for new in moved.values())


def drop_privileges(uid):
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    if os.getuid() != uid or os.geteuid() != uid or os.getegid() != uid or os.getgroups():
        raise PermissionError(f"still uid {os.geteuid()} after dropping to {uid}")


def limit_resources(cpu_s, mem, fsize, wall):
    """Step 1: rlimits, SIGXFSZ ignored, the alarm."""
    import resource
    import signal

    for res, value in ((resource.RLIMIT_CPU, (cpu_s, cpu_s + 1)), (resource.RLIMIT_AS, (mem, mem)),
                       (resource.RLIMIT_FSIZE, (fsize, fsize)), (resource.RLIMIT_CORE, (0, 0)),
                       (resource.RLIMIT_NOFILE, (MAX_FD, MAX_FD)),
                       (resource.RLIMIT_NPROC, (0, 0))):
        resource.setrlimit(res, value)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    signal.alarm(wall)  # last resort if the judge is gone and nothing else kills us


def remove_unaudited_calls(signal):
    """Step 6: the calls that raise no audit event are removed or refuse. `signal`: the module as
    serve imported it, before the guard went in."""
    posix = sys.modules.get("posix")
    for module, name in ((os, "pidfd_open"), (posix, "pidfd_open"),
                         (signal, "pidfd_send_signal"),
                         (sys.modules.get("_signal"), "pidfd_send_signal")):
        if hasattr(module, name):
            delattr(module, name)
    for name in UNAUDITED_CALLS:
        for module in (os, posix):
            if hasattr(module, name):
                setattr(module, name, refused(f"os.{name}"))


def message(exc, max_error):
    try:
        return str.__str__(str(exc))[:max_error]
    except BaseException:  # noqa: B036 - str() of the program's exception may raise anything
        return ""


def describe(exc, max_error):
    return f"{type(exc).__name__}: {message(exc, max_error)}"[:max_error]


def exported_names(namespace, wanted, max_global):
    """Step 7, first part: the names the tests need, each a callable, a module imported under
    its own name, or a plain-data value (encoded, at most max_global characters of JSON)."""
    names = {}
    for name in wanted:
        if name not in namespace:
            continue
        value = namespace[name]
        if type(value) is type(sys) and value.__name__ == name:
            names[name] = ["module"]  # `import math` for tests that use math unimported
            continue
        if callable(value):
            names[name] = ["callable"]
            continue
        try:
            encoded = encode(value)
        except (TypeError, RecursionError):
            continue
        if len(json.dumps(encoded)) <= max_global:
            names[name] = encoded
    return names


def serve_calls(req_fd, resp_fd, namespace, limit, max_error):
    """Step 7, second part: the judge's calls, each answered, until it closes the pipe."""
    while True:
        try:
            request = recv(req_fd, limit)
        except EOFError:
            return
        try:
            args = [decode(a) for a in request["args"]]
            kwargs = {k: decode(v) for k, v in request["kwargs"].items()}
            reply = {"ok": True, "value": encode(namespace[request["name"]](*args, **kwargs))}
        except BaseException as exc:  # noqa: B036 - every failure of the program is reported
            # "base": not an Exception (SystemExit...), which the tests' `except Exception`
            # must not catch, as in plain Python.
            reply = {"ok": False, "exc": type(exc).__name__, "message": message(exc, max_error),
                     "base": not isinstance(exc, Exception)}
        send(resp_fd, {"id": request["id"], **reply})


def serve():
    import signal

    (req_fd, resp_fd, cpu_s, mem, fsize, wall, limit, max_global, max_error,
     uid) = map(int, sys.argv[1:11])
    workdir = os.path.realpath(os.getcwd())
    limit_resources(cpu_s, mem, fsize, wall)
    layers = {"no_new_privs": no_new_privs(), "uid": False}

    request = recv(req_fd, limit)
    stdlib = [os.path.realpath(p) for p in sys.path if p]
    read_roots = (workdir, *stdlib, *(os.path.realpath(p) for p in SYSTEM_READ_ROOTS))
    own_fds = stdlib_through_fds(stdlib) if uid >= 0 else ()
    guarded = guard_create_builtin(sys.modules["_imp"])
    sys.addaudithook(make_hook(workdir, read_roots, SYSTEM_READ_FILES, MAX_FD, own_fds, guarded))
    if uid >= 0:
        try:
            drop_privileges(uid)
        except OSError as exc:
            send(resp_fd, {"id": request["id"], "ok": False, "layers": layers,
                           "error": f"sandbox: could not drop privileges: {exc}"})
            return
        layers["uid"] = True
    remove_unaudited_calls(signal)

    namespace = {"__name__": "__candidate__", "__builtins__": __builtins__}
    try:
        exec(compile(request["program"], "<candidate>", "exec"), namespace)
    except BaseException as exc:  # noqa: B036 - SystemExit and KeyboardInterrupt are failures too
        send(resp_fd, {"id": request["id"], "ok": False, "error": describe(exc, max_error), "layers": layers})
        return
    names = exported_names(namespace, request["names"], max_global)
    send(resp_fd, {"id": request["id"], "ok": True, "names": names, "layers": layers})
    serve_calls(req_fd, resp_fd, namespace, limit, max_error)


if __name__ == "__main__":
    try:
        serve()
    finally:
        try:  # os._exit skips interpreter shutdown, so flush what the program printed
            sys.stdout.flush()
            sys.stderr.flush()
        except BaseException:  # noqa: B036 - the program may have replaced or closed them
            pass
        os._exit(0)
