"""The candidate process: locks itself down, runs the untrusted program, and serves calls.

Runs as `python -I -S -B -c CODEC + GUARD + SECCOMP + KERNEL + CANDIDATE ARGS...` (as a code
object, see sandbox/__init__.py), started by
the judge (under `unshare` when namespaces are in use: then it is PID 1 of its
own PID namespace, with its own /proc, mount table, no network and no view of
the judge). Each step needs a privilege the next one gives up, so the order
matters (docs/security.md lists what each layer stops):

1. Every inherited descriptor but the two pipes is closed; rlimits (CPU,
   address space, file size, core 0, 256 descriptors, no new processes),
   SIGXFSZ ignored, an alarm as last resort; PR_SET_NO_NEW_PRIVS.
2. The program and the sandbox settings arrive (first request).
3. In its own mount namespace: every mount read-only, private tmpfs on /tmp,
   /var/tmp, /dev/shm and on the work directory (noexec).
4. If the stdlib cannot be reached by other users (Python under /root,
   say), it is opened now and imported through /proc/self/fd/N (see
   `stdlib_through_fds`): after step 6 its path would be closed.
5. Landlock: reads only from the stdlib, system libraries and the work
   directory, writes only there; no TCP; no signals out of the domain.
6. `_imp.create_builtin` and `create_dynamic` guarded; setgroups([]), setgid,
   setuid to the uid the caller chose for this run (unused by anything else),
   or, staying uid 0 of a user namespace, every capability dropped.
7. The seccomp filter (seccomp.py): no ptrace, other processes' memory or
   signals, sockets, mounts, namespaces, exec, new processes, memfd...
8. A last check that none of the interpreter's directories is writable
   now, and that the layers the caller requires are in place: otherwise
   the program is refused, never run.
9. ctypes leaves sys.modules and the guard (audit hook) goes in; calls that
   raise no audit event are removed from os/posix/signal.
10. The program runs as module `__candidate__` (registered in sys.modules,
   so dataclasses and pickle find it); the names the tests need are
   reported (a callable, a plain-data value, or a module imported under
   its own name); calls are served until the judge closes the pipe.
"""

import json
import os
import sys

try:  # in the sandbox these names come from the sibling sources, prepended to this one
    from .codec import decode, encode, recv, send
    from .guard import SYSTEM_READ_FILES, SYSTEM_READ_ROOTS, guard_imp, make_hook
    from .kernel import (
        FS_READ_FILE,
        FS_TRUNCATE,
        FS_WRITE_FILE,
        READ_RIGHTS,
        SHARED_WRITABLE,
        WORKDIR_RIGHTS,
        Libc,
        drop_capabilities,
        install_landlock,
        missing_layers,
        no_new_privs,
        read_only_mounts,
        writable_paths,
    )
    from .seccomp import install_seccomp, machine_arch
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


# Files the C library may read for the program (the dynamic loader's cache, the local time
# zone): the audit hook never sees them, Landlock must let them through.
LIBC_READ_FILES = ("/etc/ld.so.cache", "/etc/localtime")


def close_inherited_fds(keep):
    """Every descriptor above 2 except `keep` closed: nothing of the judge's leaks in."""
    top = 1 << 16
    low = 3
    for fd in sorted(keep):
        os.closerange(low, fd)
        low = fd + 1
    os.closerange(low, top)


def attempt(layers, name, step):
    """Run one layer's `step`; record True, or why it is missing."""
    try:
        step()
        layers[name] = True
    except Exception as exc:  # noqa: BLE001 - any failure means the layer is missing
        layers[name] = f"{type(exc).__name__}: {exc}"[:200]


def kernel_layers(libc, config, workdir, uid, stdlib):
    """Steps 3 to 7. Returns (layers, the fds of stdlib_through_fds, the read roots)."""
    layers = {}
    off = set(config.get("off", ()))

    def skipped(name):
        layers[name] = "turned off by the caller"

    if libc is None:
        for name in ("readonly_mounts", "landlock", "capabilities", "seccomp"):
            layers[name] = "ctypes is not available"
    if libc is not None and config.get("mount_namespace") and "readonly_mounts" not in off:
        options = f"size={config['workdir_bytes']},nr_inodes=4096,mode=0700"
        if uid >= 0:
            options += f",uid={uid},gid={uid}"
        attempt(layers, "readonly_mounts",
                lambda: read_only_mounts(libc, workdir, options, keep=stdlib))
    elif "readonly_mounts" not in layers:
        layers["readonly_mounts"] = ("no mount namespace" if "readonly_mounts" not in off
                                     else "turned off by the caller")
    layers["pid_namespace"] = True if os.getpid() == 1 else "no PID namespace"
    own_fds = stdlib_through_fds(stdlib) if uid >= 0 else ()
    read_roots = (workdir, *stdlib, *(os.path.realpath(p) for p in SYSTEM_READ_ROOTS))
    if libc is not None:
        if "landlock" in off:
            skipped("landlock")
        else:
            rules = [(workdir, WORKDIR_RIGHTS), *((r, READ_RIGHTS) for r in read_roots[1:]),
                     *((f, FS_READ_FILE) for f in (*SYSTEM_READ_FILES, *LIBC_READ_FILES)),
                     ("/dev/null", FS_READ_FILE | FS_WRITE_FILE | FS_TRUNCATE)]
            attempt(layers, "landlock", lambda: install_landlock(libc, rules))
    if uid >= 0:
        attempt(layers, "uid", lambda: drop_privileges(uid))
        if layers["uid"] is not True:
            raise PermissionError(f"could not drop privileges: {layers['uid']}")
    else:
        layers["uid"] = "not root: the candidate keeps the caller's uid"
        if libc is not None:
            attempt(layers, "capabilities", lambda: drop_capabilities(libc))
    if uid >= 0:
        layers["capabilities"] = True  # setuid from root to another uid clears them all
    if libc is not None:
        arch = machine_arch()
        if "seccomp" in off:
            skipped("seccomp")
        elif arch is None:
            layers["seccomp"] = f"no syscall table for {os.uname().machine}"
        else:
            attempt(layers, "seccomp", lambda: install_seccomp(libc, arch, os.getpid()))
    return layers, own_fds, read_roots


def run_program(program, namespace_name="__candidate__"):
    """Step 10: the program as a module registered under its name while it runs (dataclasses
    resolve string annotations through sys.modules, pickle finds classes there)."""
    module = type(sys)(namespace_name)
    module.__builtins__ = __builtins__
    sys.modules[namespace_name] = module
    exec(compile(program, "<candidate>", "exec"), module.__dict__)
    return module.__dict__


def serve():
    import signal

    (req_fd, resp_fd, cpu_s, mem, fsize, wall, limit, max_global, max_error,
     uid) = map(int, sys.argv[1:11])
    workdir = os.path.realpath(os.getcwd())
    close_inherited_fds((req_fd, resp_fd))
    limit_resources(cpu_s, mem, fsize, wall)
    try:
        libc = Libc()
    except Exception:  # noqa: BLE001 - no ctypes: every kernel layer reports itself missing
        libc = None
    layers = {}
    attempt(layers, "no_new_privs", lambda: no_new_privs(libc))

    request = recv(req_fd, limit)
    config = request.get("sandbox") or {}

    def refuse(error, key="error"):
        send(resp_fd, {"id": request["id"], "ok": False, "layers": layers, key: error})

    stdlib = [os.path.realpath(p) for p in sys.path if p]
    try:
        kernel, own_fds, read_roots = kernel_layers(libc, config, workdir, uid, stdlib)
    except OSError as exc:
        return refuse(f"sandbox: {exc}")
    layers.update(kernel)
    # "hook" off (tests only: the state a memory-corruption exploit would leave) turns off every
    # in-process guard: the audit hook, the _imp guards, the removal of unaudited calls.
    python_guards = "hook" not in config.get("off", ())
    guarded = guard_imp(sys.modules["_imp"], workdir, stdlib) if python_guards else ()
    # Step 8. The layers the caller requires; and never a writable interpreter, whatever the
    # caller allows.
    reasons = []
    missing = missing_layers(layers, config.get("required", ()))
    if missing:
        reasons.append("missing sandbox layers: " + "; ".join(missing))
    protected = config.get("protected", ())
    if layers.get("readonly_mounts") is True:  # the shared places are private tmpfs now
        protected = [d for d in protected if d in stdlib or not d.startswith(
            tuple(p + "/" for p in SHARED_WRITABLE)) and d not in SHARED_WRITABLE]
    writable = writable_paths(protected)
    if writable:
        reasons.append(f"the candidate could write to {', '.join(writable)} (no read-only mount, "
                       "Landlock rule or uid layer holds there); refusing to run untrusted code")
    if reasons:
        return refuse("; ".join(reasons), key="refused")

    libc = None  # the last reference to the ctypes objects of this process
    for name in [m for m in sys.modules if m == "ctypes" or m.startswith(("ctypes.", "_ctypes"))]:
        del sys.modules[name]
    if python_guards:
        sys.addaudithook(make_hook(workdir, read_roots, SYSTEM_READ_FILES, MAX_FD, own_fds,
                                   guarded, extension_roots=stdlib))
        remove_unaudited_calls(signal)
        layers["hook"] = True
    else:
        layers["hook"] = "turned off by the caller"
    send(resp_fd, {"id": request["id"], "ok": True, "layers": layers})  # before the program runs
    try:
        namespace = run_program(request["program"])
    except BaseException as exc:  # noqa: B036 - SystemExit and KeyboardInterrupt are failures too
        return send(resp_fd, {"id": request["id"], "ok": False, "error": describe(exc, max_error)})
    names = exported_names(namespace, request["names"], max_global)
    send(resp_fd, {"id": request["id"], "ok": True, "names": names})
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
