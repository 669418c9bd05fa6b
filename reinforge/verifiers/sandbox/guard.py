"""The candidate's audit hook (PEP 578): which paths it may open and which events it refuses.

Runs inside the candidate process (this source is concatenated into the
candidate's), installed last, just before the program runs. It is a fast first
filter with clear messages, not the boundary (docs/security.md): the kernel
layers (kernel.py: seccomp, Landlock, read-only mounts; own PID namespace with
a fresh /proc, an unused uid or no capabilities) hold even where this hook is
fooled or switched off, e.g. by a memory-corruption bug in the interpreter.

Paths are decided on where they lead, not on how they are written
-------------------------------------------------------------------
Every path in an event is resolved the way the kernel walks it: relative to
the work directory (the cwd; `chdir` is refused so it never moves), every
symlink followed, `..` applied after the symlink before it. Magic links
under /proc/self/fd resolve to what `readlink` says, so a pipe never lands on
an allowed path. `os.open` can take a `dir_fd` that its event does not show,
so a relative `os.open` must be allowed relative to the cwd *and* relative
to every directory the process holds open (found with fstat on each fd).

* Reading (open without write flags, listdir, scandir, getxattr): the
  resolved path is in the work directory, under a read-only root (the
  interpreter's stdlib, /usr/lib, /usr/share/zoneinfo...), or one of a few
  device files (/dev/null, /dev/urandom...). Everything else, /proc
  included, is refused: an allow-list, not a deny-list.
* Writing (write flags, remove, rename, mkdir, chmod, utime...): the
  resolved path is in the work directory (or is /dev/null). Symlinks and
  hard links cannot be made at all; path arguments must be str or bytes (a
  path object's `__fspath__` could answer differently to the hook and to the
  kernel); with a dir_fd the path is resolved from that directory; chmod,
  chown, utime and xattrs on a descriptor are refused (it may be open for reading only).

Tamper-proofing
---------------
The hook and its helpers read no globals and no builtins: everything they
call is bound as a default argument (C functions, tuples, frozensets, str),
so patching `os`, `builtins` or any module changes nothing here, and a
helper's defaults or code cannot be rebound without an `object.__setattr__`
event, which is refused for them. The hook itself is referenced by nothing
the program can reach (no frame, no global; gc hunting is refused), and
CPython pauses tracing inside audit hooks, so a tracer cannot jump in it. Arguments from
events are normalised to exact `str` before any method is called on them (a
`str` subclass could override `startswith`). Any exception inside the hook
aborts the audited operation: the hook fails closed.
"""

import os as _os
import stat as _stat

# Opening with any of these flags can change the file: judged by the write rule.
_WRITE_FLAGS = _os.O_WRONLY | _os.O_RDWR | _os.O_APPEND | _os.O_CREAT | _os.O_TRUNC
# "No dir_fd" as the events report it: None, or AT_FDCWD / -1 depending on the call.
_NO_DIR_FD = (None, -1, -100)

REFUSED_EVENTS = frozenset((
    # new processes, and signals to processes other than this one
    "os.fork", "os.forkpty", "os.exec", "os.spawn", "os.posix_spawn", "os.system",
    "subprocess.Popen", "pty.spawn", "os.startfile", "os.kill", "os.killpg",
    "signal.pthread_kill",
    # the cwd, the root, limits and hooks stay as the sandbox set them
    "os.chdir", "os.chroot", "resource.setrlimit", "resource.prlimit", "sys.addaudithook",
    # links could make a path inside the work directory lead outside it
    "os.link", "os.symlink", "os.lchmod", "os.chflags", "os.lchflags",
    # hunting objects, forging bytecode, interpreters without this hook
    "gc.get_objects", "gc.get_referrers", "gc.get_referents", "code.__new__",
    "cpython.PyInterpreterState_New", "cpython._PySys_ClearAuditHooks",
    # a tracer or profiler is handed the frame of every Python function it sees: it could
    # read the original `_imp.create_builtin` out of `guard_create_builtin`'s frame
    "sys.settrace", "sys.setprofile", "sys.monitoring.register_callback",
))
REFUSED_EVENT_PREFIXES = ("socket.", "ctypes.", "sqlite3.", "syslog.", "winreg.", "_winapi.")
# C modules that reach memory, processes, files or the network without audit events.
REFUSED_IMPORTS = frozenset((
    "ctypes", "_ctypes", "_ctypes_test", "_posixsubprocess", "multiprocessing",
    "_multiprocessing", "_posixshmem", "_xxsubinterpreters", "_xxinterpchannels",
    "_testcapi", "_testinternalcapi", "_testbuffer", "_testmultiphase",
    "_testimportmultiple", "_testclinic", "_xxtestfuzz", "sqlite3", "_sqlite3", "dbm",
    "_dbm", "_gdbm", "readline", "ssl", "_ssl", "syslog", "nis", "spwd", "ossaudiodev",
    "_tkinter",
))
# Attributes of the hook's helper functions whose rebinding or deletion would change what the
# hook does (dataclasses and others set them on their own functions, so only the helpers are
# guarded); reading them is refused too (the `_imp.create_builtin` guard keeps the original there).
REFUSED_SETATTR = frozenset(("__code__", "__defaults__", "__kwdefaults__"))
# Builtin modules whose fresh copy (`_imp.create_builtin`, no audit event) would bring back
# what the candidate removed: posix.mkfifo/mknod/memfd_create/pidfd_open,
# _signal.pidfd_send_signal, and _imp's own unguarded create_builtin.
FRESH_COPY_REFUSED = frozenset(("posix", "_signal", "_imp"))
# (event, ((index of a path argument, index of its dir_fd argument or -1), ...)); write rule.
# Tuples and frozensets only: every table here is reachable from the program (`import
# __main__`), so none may be an object it could change; the hook holds its own references.
WRITE_PATH_EVENTS = (
    ("os.remove", ((0, 1),)), ("os.rmdir", ((0, 1),)), ("os.mkdir", ((0, 2),)),
    ("os.rename", ((0, 2), (1, 3))), ("os.chmod", ((0, 2),)), ("os.chown", ((0, 3),)),
    ("os.utime", ((0, 3),)), ("os.truncate", ((0, -1),)), ("os.mkfifo", ((0, 2),)),
    ("os.mknod", ((0, 3),)), ("os.setxattr", ((0, -1),)), ("os.removexattr", ((0, -1),)),
)
READ_PATH_EVENTS = frozenset(("os.listdir", "os.scandir", "os.getxattr", "os.listxattr"))
# Read-only system locations a program may legitimately read, besides the stdlib.
SYSTEM_READ_ROOTS = ("/usr/lib", "/usr/lib64", "/usr/share/zoneinfo")
SYSTEM_READ_FILES = ("/dev/null", "/dev/zero", "/dev/urandom", "/dev/random")


def resolve(path, cwd, lstat=_os.lstat, readlink=_os.readlink, islink=_stat.S_ISLNK,
            oserror=OSError, perm=PermissionError):
    """Where the exact-str `path` leads from `cwd`: symlinks followed, `..` after them.

    A component that does not exist (or cannot be examined) is kept as
    written: the kernel would fail on it too, or create exactly that name.
    """
    if not path.startswith("/"):
        path = cwd + "/" + path
    pending = path.split("/")
    pending.reverse()
    resolved, links = "", 0
    while pending:
        name = pending.pop()
        if name == "" or name == ".":
            continue
        if name == "..":
            resolved = resolved[: resolved.rfind("/")]
            continue
        step = resolved + "/" + name
        try:
            link = islink(lstat(step).st_mode)
        except oserror:
            link = False
        if not link:
            resolved = step
            continue
        links += 1
        if links > 40:
            raise perm("sandbox: too many levels of symbolic links")
        try:
            target = readlink(step)
        except oserror:
            raise perm(f"sandbox: cannot tell where {step} leads") from None
        parts = target.split("/")
        parts.reverse()
        pending.extend(parts)
        if target.startswith("/"):
            resolved = ""
    return resolved or "/"


def as_path(obj, call_fspath, type_=type, issubclass_=issubclass, str_=str, bytes_=bytes,
            int_=int, to_str=str.__str__, decode=bytes.decode, fspath=_os.fspath,
            perm=PermissionError):
    """The exact-str path of an event argument, or None for a file descriptor.

    `type_` and `issubclass_`, not isinstance: an object can fake `__class__`.
    """
    kind = type_(obj)
    if issubclass_(kind, int_):
        return None
    if call_fspath and not issubclass_(kind, (str_, bytes_)):
        obj = fspath(obj)  # runs the object's __fspath__ once; its answer is what we judge
        kind = type_(obj)
    if issubclass_(kind, str_):
        return to_str(obj)
    if issubclass_(kind, bytes_):
        return decode(obj, "utf-8", "surrogateescape")
    raise perm(f"sandbox: a {kind.__name__} path is not allowed here (use str)")


def fd_path(fd, readlink=_os.readlink, oserror=OSError, perm=PermissionError):
    """Where descriptor `fd` (an exact int) of this process points, as the kernel names it."""
    try:
        return readlink(f"/proc/self/fd/{fd}")
    except oserror:
        raise perm(f"sandbox: cannot tell where descriptor {fd} points") from None


def directory_fds(max_fd, fstat=_os.fstat, isdir=_stat.S_ISDIR, range_=range, tuple_=tuple,
                  oserror=OSError, fd_path=fd_path):
    """(fd, path) of each directory this process holds open (any may be an os.open dir_fd)."""
    found = []
    for fd in range_(max_fd):
        try:
            is_dir = isdir(fstat(fd).st_mode)
        except oserror:
            continue
        if is_dir:
            found.append((fd, fd_path(fd)))
    return tuple_(found)


def name_refused(name, refused, to_str=str.__str__):
    """Whether any dotted part of module name `name` (exact str) is in `refused`: the loader takes
    an extension's init symbol from the last part (`x.readline` loads readline), the import
    system the package from the first."""
    for part in to_str(name).split("."):
        if part in refused:
            return True
    return False


def extension_refused(path, cwd, roots, refused, resolve=resolve, name_refused=name_refused,
                      rfind=str.rfind):
    """Why loading the extension file `path` (exact str) is refused, or None: it must lie under
    one of `roots` (the stdlib's directories, never the work directory, where the program could
    write its own machine code) and its file name must not be that of a refused module."""
    full = resolve(path, cwd)
    if not full.startswith(roots):
        return f"sandbox: loading an extension from {full} is not allowed"
    stem = full[rfind(full, "/") + 1:].split(".")[0]
    if name_refused(stem, refused):
        return f"sandbox: loading the {stem} extension is not allowed"
    return None


def import_refused(args, cwd, roots, refused, to_str=str.__str__, len_=len, as_path=as_path,
                   name_refused=name_refused, extension_refused=extension_refused):
    """Why the `import` event with `args` (name, an extension's file or None, ...) is refused,
    or None."""
    name = to_str(args[0])
    if name_refused(name, refused):
        return f"sandbox: importing {name} is not allowed"
    if len_(args) > 1 and args[1] is not None:  # an extension module's file
        return extension_refused(as_path(args[1], False), cwd, roots, refused)
    return None


def guard_imp(imp, cwd, extension_roots, refused_builtins=FRESH_COPY_REFUSED,
              refused_imports=REFUSED_IMPORTS):
    """Replace `imp.create_builtin` and `imp.create_dynamic` by guards.

    A fresh copy of a builtin module is made from the module's state at its first
    import, before the sandbox removed anything from it, and raises no audit event;
    `create_dynamic` raises none either for an extension already loaded once (the
    sandbox itself loaded `_ctypes`), under any name. The guards refuse fresh copies of
    `refused_builtins`, and extensions whose name has a refused part or whose file is
    outside `extension_roots` or named like a refused module.
    The originals are held only as defaults of the guards' inner functions (reading
    `__defaults__` or `__code__` of the returned functions is refused by the hook: pass
    their ids to `make_hook`), and no program code runs while an inner frame is live: it
    gets exact strs, and passes the original a `SimpleNamespace`, not the program's spec.
    Returns the ids of the four functions.
    """
    import types

    # Positional-only, `original` first: a caller (the program may reach `create` through
    # `create_builtin`'s frame) can replace `refused` only by replacing `original` too.
    # `to_str` first of all: a str subclass's `__hash__`/`__eq__` would run program code
    # (with this frame and `original` in reach) and could lie to `in refused`.
    def create(name, original=imp.create_builtin, refused=frozenset(refused_builtins),
               namespace=types.SimpleNamespace, perm=PermissionError, to_str=str.__str__, /):
        name = to_str(name)
        if name in refused:
            raise perm(f"sandbox: a fresh copy of the {name} module is not allowed")
        return original(namespace(name=name))

    def create_builtin(spec, create=create, getattr_=getattr, to_str=str.__str__):
        # Program code may run here (`spec.name` may be a property); this frame holds only
        # `create`, which enforces the rule itself.
        return create(to_str(getattr_(spec, "name")))

    def load(name, origin, original=imp.create_dynamic, refused=frozenset(refused_imports),
             roots=tuple(r + "/" for r in extension_roots), cwd=cwd,
             namespace=types.SimpleNamespace, perm=ImportError, to_str=str.__str__,
             name_refused=name_refused, extension_refused=extension_refused, /):
        name, origin = to_str(name), to_str(origin)
        if name_refused(name, refused):
            raise perm(f"sandbox: importing {name} is not allowed")
        why = extension_refused(origin, cwd, roots, refused)
        if why is not None:
            raise perm(why)
        return original(namespace(name=name, origin=origin))

    def create_dynamic(spec, file=None, load=load, getattr_=getattr, to_str=str.__str__):
        return load(to_str(getattr_(spec, "name")), to_str(getattr_(spec, "origin")))

    imp.create_builtin = create_builtin
    imp.create_dynamic = create_dynamic
    return (id(create), id(create_builtin), id(load), id(create_dynamic))


def open_bases(args, cwd, max_fd, own_fds, write_flags, write_modes, as_path=as_path,
               directory_fds=directory_fds, type_=type, int_type=int, str_type=str, perm=PermissionError):
    """What the `open` event with `args` (path, mode or None, flags) must pass: (path, bases), the
    exact-str path (None for a descriptor already held: judged when it was opened) and the
    (directory a relative path starts from, judged by the write rule) pairs it is resolved from."""
    path = as_path(args[0], False)
    if path is None:
        return None, ()
    # By the flags, and by the mode where there is one: a write is never judged as a
    # read even when an opener reports flags 0 with its mode string.
    mode = args[1]
    if mode is not None and type_(mode) is not str_type:
        raise perm("sandbox: open with this mode is not allowed")
    writing = type_(args[2]) is not int_type or (args[2] & write_flags) != 0
    if mode is not None:
        for c in write_modes:
            if c in mode:
                writing = True
    bases = ((cwd, writing),)  # (where a relative path starts, judged by the write rule)
    if args[1] is None and not path.startswith("/"):
        # os.open: the event does not show the dir_fd, so every open directory counts.
        for fd, where in directory_fds(max_fd):
            bases = (*bases, (where, writing and fd not in own_fds))
    return path, bases


def check_write_event(event, args, cwd, write_events, write_exact, write_prefix, no_dir_fd, as_path=as_path,
                      resolve=resolve, fd_path=fd_path, len_=len, type_=type, int_type=int, perm=PermissionError):
    """PermissionError unless every path argument of the write event `event` (one of `write_events`)
    leads into the work directory (`write_prefix`) or to one of `write_exact`, resolved from its dir_fd
    where the event has one; descriptors are refused (but ftruncate's)."""
    specs = ()
    for name, entry in write_events:
        if name == event:
            specs = entry
    for i, j in specs:
        path = as_path(args[i], False)
        if path is None:
            if event == "os.truncate":
                continue  # ftruncate needs a descriptor open for writing
            raise perm(f"sandbox: {event} on a file descriptor is not allowed")
        base = cwd
        if j >= 0 and j < len_(args) and args[j] not in no_dir_fd:
            if type_(args[j]) is not int_type:
                raise perm(f"sandbox: {event} with this dir_fd is not allowed")
            base = fd_path(args[j])
        full = resolve(path, base)
        if not (full in write_exact or full.startswith(write_prefix)):
            raise perm(f"sandbox: {event} outside the work directory is not allowed")


def check_path(path, bases, read_exact, read_prefixes, write_exact, write_prefix, resolve=resolve,
               perm=PermissionError):
    """PermissionError unless the exact-str `path`, resolved from each (base, writing) of `bases`,
    lands where the write rule (writing) or the read rule (not) allows."""
    for base, writing in bases:
        full = resolve(path, base)
        if writing:
            ok = full in write_exact or full.startswith(write_prefix)
        else:
            ok = full in read_exact or full.startswith(read_prefixes)
        if not ok:
            verb = "writing" if writing else "reading"
            raise perm(f"sandbox: {verb} {full} is not allowed")


def make_hook(workdir, read_roots, read_files, max_fd, own_fds=(), guarded_ids=(),
              extension_roots=()):
    """The audit hook for a candidate whose cwd is `workdir` (all paths already resolved).

    `own_fds` are the stdlib directories the sandbox holds open (only when the
    candidate runs as its own uid, see candidate.py): a relative os.open is
    resolved from them too, and must land on a readable path; the kernel
    refuses that uid any write there. `extension_roots`: the only directories
    extension modules may be loaded from.
    """
    helpers = (resolve, as_path, fd_path, directory_fds, name_refused, extension_refused,
               import_refused, open_bases, check_write_event, check_path)
    guarded_ids = [*guarded_ids, *(id(f) for f in helpers)]

    def hook(event, args, cwd=workdir, read_prefixes=tuple(r + "/" for r in read_roots),
             read_exact=frozenset((*read_roots, *read_files)), write_prefix=workdir + "/",
             write_exact=frozenset((workdir, "/dev/null")), refused=REFUSED_EVENTS,
             refused_prefixes=REFUSED_EVENT_PREFIXES, refused_imports=REFUSED_IMPORTS,
             refused_setattr=REFUSED_SETATTR,
             # `f.__defaults__ = None` is a delete, audited as object.__delattr__
             attr_events=frozenset(("object.__setattr__", "object.__getattr__",
                                    "object.__delattr__")),
             write_event_names=frozenset(e for e, _ in WRITE_PATH_EVENTS),
             write_events=WRITE_PATH_EVENTS, read_events=READ_PATH_EVENTS,
             no_dir_fd=_NO_DIR_FD, write_flags=_WRITE_FLAGS, write_modes="wax+",
             max_fd=max_fd, own_fds=frozenset(own_fds), as_path=as_path,
             import_refused=import_refused, open_bases=open_bases, check_write_event=check_write_event,
             check_path=check_path, extension_roots=tuple(r + "/" for r in extension_roots),
             guarded=frozenset(guarded_ids), id_=id, to_str=str.__str__,
             perm=PermissionError, import_error=ImportError):
        if event in refused or event.startswith(refused_prefixes):
            raise perm(f"sandbox: {event} is not allowed")
        if event == "import":
            why = import_refused(args, cwd, extension_roots, refused_imports)
            if why is not None:  # ImportError: `try: import x / except ImportError` still works
                raise import_error(why)
            return
        if event in attr_events:
            if id_(args[0]) in guarded and to_str(args[1]) in refused_setattr:
                raise perm(f"sandbox: {event} {to_str(args[1])} is not allowed")
            return
        if event == "open":
            path, bases = open_bases(args, cwd, max_fd, own_fds, write_flags, write_modes)
            if path is None:
                return  # a descriptor already held: judged when it was opened
        elif event in read_events:
            path = as_path("." if args[0] is None else args[0], True)
            if path is None:
                return
            bases = ((cwd, False),)
        elif event in write_event_names:
            check_write_event(event, args, cwd, write_events, write_exact, write_prefix, no_dir_fd)
            return
        else:
            return
        check_path(path, bases, read_exact, read_prefixes, write_exact, write_prefix)

    return hook
