"""Kernel confinement of the candidate: Landlock, a read-only mount namespace, no capabilities.

Runs inside the candidate process (this source is concatenated into the
candidate's, docs/security.md) before the program and before the audit hook;
the caller and `reinforge doctor` import it too, to probe the machine. Every
layer here is enforced by the kernel on this process and whatever it could
exec, and none can be undone from inside: the Landlock domain (like the
seccomp filter of seccomp.py) only ever adds restrictions, the mounts need a
capability the process gives up (and `mount` is in the filter), and
no_new_privs is one-way. So they
hold even where the audit hook (guard.py) is fooled or switched off, e.g. by
a memory-corruption bug in the interpreter.

System calls go through ctypes, which the candidate drops (and the hook
refuses) before the program runs; `Libc` holds the handful it needs.
"""

import os as _kos
import stat as _kstat
import struct as _struct

# ---- Landlock (linux/landlock.h) --------------------------------------------------------------

LANDLOCK_CREATE_RULESET, LANDLOCK_ADD_RULE, LANDLOCK_RESTRICT_SELF = 444, 445, 446  # all arches
LANDLOCK_CREATE_RULESET_VERSION = 1
LANDLOCK_RULE_PATH_BENEATH = 1
FS_EXECUTE, FS_WRITE_FILE, FS_READ_FILE, FS_READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
FS_REMOVE_DIR, FS_REMOVE_FILE, FS_MAKE_CHAR, FS_MAKE_DIR = 1 << 4, 1 << 5, 1 << 6, 1 << 7
FS_MAKE_REG, FS_MAKE_SOCK, FS_MAKE_FIFO, FS_MAKE_BLOCK = 1 << 8, 1 << 9, 1 << 10, 1 << 11
FS_MAKE_SYM, FS_REFER, FS_TRUNCATE, FS_IOCTL_DEV = 1 << 12, 1 << 13, 1 << 14, 1 << 15
# Rights a rule on a file (not a directory) may carry.
FS_FILE_RIGHTS = FS_EXECUTE | FS_WRITE_FILE | FS_READ_FILE | FS_TRUNCATE | FS_IOCTL_DEV
READ_RIGHTS = FS_READ_FILE | FS_READ_DIR
# The work directory: everything but executing, device nodes, sockets, fifos and symlinks.
WORKDIR_RIGHTS = (FS_WRITE_FILE | FS_READ_FILE | FS_READ_DIR | FS_REMOVE_DIR | FS_REMOVE_FILE
                  | FS_MAKE_DIR | FS_MAKE_REG | FS_REFER | FS_TRUNCATE)
NET_BIND_TCP, NET_CONNECT_TCP = 1 << 0, 1 << 1
SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1 << 0, 1 << 1


def landlock_handled(abi):
    """(handled fs rights, handled net rights, scopes) for Landlock ABI version `abi`."""
    fs = (1 << 13) - 1  # ABI 1: EXECUTE .. MAKE_SYM
    if abi >= 2:
        fs |= FS_REFER
    if abi >= 3:
        fs |= FS_TRUNCATE
    if abi >= 5:
        fs |= FS_IOCTL_DEV
    net = NET_BIND_TCP | NET_CONNECT_TCP if abi >= 4 else 0
    scoped = SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL if abi >= 6 else 0
    return fs, net, scoped


# ---- mounts -----------------------------------------------------------------------------------

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 0x1, 0x2, 0x4, 0x8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 0x20, 0x1000, 0x4000, 1 << 18
MS_NOATIME, MS_NODIRATIME, MS_RELATIME = 0x400, 0x800, 1 << 21
AT_FDCWD, AT_RECURSIVE, MOUNT_ATTR_RDONLY = -100, 0x8000, 0x1
MOUNT_SETATTR = 442  # all arches
# Mount options that a remount must repeat (the kernel refuses to clear locked ones).
_LOCKED_OPTIONS = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC,
                   "noatime": MS_NOATIME, "nodiratime": MS_NODIRATIME, "relatime": MS_RELATIME}
# Places every user may write, each replaced by a small private tmpfs.
SHARED_WRITABLE = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")
SHARED_TMPFS_OPTIONS = "size=64k,nr_inodes=64,mode=1777"

PR_SET_NO_NEW_PRIVS = 38
PR_CAPBSET_DROP, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 24, 47, 4


class Libc:
    """The few C calls the layers need, through ctypes (imported here, dropped by the caller)."""

    def __init__(self):
        import ctypes

        self.ctypes = ctypes
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.libc.syscall.restype = ctypes.c_long

    def check(self, result, what):
        if result < 0:
            errno = self.ctypes.get_errno()
            raise OSError(errno, f"{what}: {_kos.strerror(errno)}")
        return result

    def prctl(self, *args):
        c_ulong = self.ctypes.c_ulong
        args = [*args, 0, 0, 0, 0][:5]
        return self.check(self.libc.prctl(*(c_ulong(a) for a in args)), f"prctl({args[0]})")

    def syscall(self, nr, *args, what="syscall"):
        return self.check(self.libc.syscall(self.ctypes.c_long(nr), *args), what)

    def mount(self, source, target, fstype, flags, data=None):
        def enc(s):
            return None if s is None else s.encode()

        result = self.libc.mount(enc(source), enc(target), enc(fstype),
                                 self.ctypes.c_ulong(flags), enc(data))
        return self.check(result, f"mount {target}")


def no_new_privs(libc):
    libc.prctl(PR_SET_NO_NEW_PRIVS, 1)


def landlock_abi(libc):
    """The Landlock ABI version this kernel offers, or 0 (not built in, or not enabled)."""
    try:
        return libc.syscall(LANDLOCK_CREATE_RULESET, None, libc.ctypes.c_size_t(0),
                            libc.ctypes.c_uint32(LANDLOCK_CREATE_RULESET_VERSION),
                            what="landlock_create_ruleset")
    except OSError:
        return 0


def install_landlock(libc, rules):
    """Restrict this process to `rules`, ((path, rights), ...): every handled right not granted by
    a rule on a path or one of its parents is refused; TCP bind and connect are refused (ABI 4),
    and signals and abstract UNIX sockets outside this domain (ABI 6). Returns the ABI version.
    """
    ctypes = libc.ctypes
    abi = landlock_abi(libc)
    if abi < 1:
        raise OSError("Landlock is not available in this kernel")
    fs, net, scoped = landlock_handled(abi)
    attr = _struct.pack("=QQQ", fs, net, scoped)[: 8 if abi < 4 else 16 if abi < 6 else 24]
    buf = ctypes.create_string_buffer(attr, len(attr))
    ruleset = libc.syscall(LANDLOCK_CREATE_RULESET, buf, ctypes.c_size_t(len(attr)),
                           ctypes.c_uint32(0), what="landlock_create_ruleset")
    try:
        for path, rights in rules:
            try:
                fd = _kos.open(path, _kos.O_PATH | _kos.O_CLOEXEC)
            except OSError:
                continue  # nothing there: nothing to grant
            try:
                if not _kstat.S_ISDIR(_kos.fstat(fd).st_mode):
                    rights &= FS_FILE_RIGHTS
                rule = ctypes.create_string_buffer(_struct.pack("=Qi", rights & fs, fd), 12)
                libc.syscall(LANDLOCK_ADD_RULE, ctypes.c_int(ruleset),
                             ctypes.c_int(LANDLOCK_RULE_PATH_BENEATH), rule, ctypes.c_uint32(0),
                             what=f"landlock_add_rule {path}")
            finally:
                _kos.close(fd)
        libc.syscall(LANDLOCK_RESTRICT_SELF, ctypes.c_int(ruleset), ctypes.c_uint32(0),
                     what="landlock_restrict_self")
    finally:
        _kos.close(ruleset)
    return abi


def _remount_each_read_only(libc):
    # Before mount_setattr (Linux 5.12): one bind remount per mount, keeping its locked flags.
    with open("/proc/self/mountinfo") as fh:
        mounts = [line.split() for line in fh]
    for fields in sorted(mounts, key=lambda f: len(f[4])):
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY
        for option in fields[5].split(","):
            flags |= _LOCKED_OPTIONS.get(option, 0)
        point = fields[4].replace("\\040", " ")
        try:
            libc.mount(None, point, None, flags)
        except OSError:
            if point == "/":
                raise


def _read_only(libc, path):
    attr = libc.ctypes.create_string_buffer(_struct.pack("=QQQQ", MOUNT_ATTR_RDONLY, 0, 0, 0), 32)
    libc.syscall(MOUNT_SETATTR, libc.ctypes.c_int(AT_FDCWD), path.encode(),
                 libc.ctypes.c_uint(AT_RECURSIVE), attr, libc.ctypes.c_size_t(32),
                 what=f"mount_setattr {path}")


def read_only_mounts(libc, workdir, workdir_options, keep=()):
    """In this process's own mount namespace: every mount read-only, then private tmpfs on the
    shared writable places and on `workdir` (noexec, nosuid, nodev), and the cwd moved into it.

    `keep`: directories (the interpreter's) that must stay visible where they lie under one of
    the places replaced (Python installed under /tmp or /var/tmp): bound back, read-only.
    Nothing is propagated back to the host (the namespace is private, as unshare made it); the
    tmpfs mounts vanish with the namespace.
    """
    libc.mount(None, "/", None, MS_REC | MS_PRIVATE)
    try:
        _read_only(libc, "/")
    except OSError:
        _remount_each_read_only(libc)
    private = MS_NOSUID | MS_NODEV | MS_NOEXEC
    for place in SHARED_WRITABLE:
        if not _kos.path.isdir(place) or _kos.path.islink(place):
            continue
        kept = sorted(d for d in keep if d.startswith(place + "/") and _kos.path.isdir(d))
        kept = [d for i, d in enumerate(kept) if not any(d.startswith(k + "/") for k in kept[:i])]
        fds = [_kos.open(d, _kos.O_PATH | _kos.O_DIRECTORY | _kos.O_CLOEXEC) for d in kept]
        try:
            libc.mount("tmpfs", place, "tmpfs", private, SHARED_TMPFS_OPTIONS)
            for d, fd in zip(kept, fds, strict=True):
                _kos.makedirs(d, 0o755, exist_ok=True)
                libc.mount(f"/proc/self/fd/{fd}", d, None, MS_BIND | MS_REC)
                _read_only(libc, d)
        finally:
            for fd in fds:
                _kos.close(fd)
    if not _kos.path.isdir(workdir):
        _kos.makedirs(workdir, 0o700)  # it was under one of the places just replaced
    libc.mount("tmpfs", workdir, "tmpfs", private, workdir_options)
    _kos.chdir(workdir)


def drop_capabilities(libc):
    """Every capability out of every set (bounding, ambient, effective, permitted, inheritable):
    what a process that stays uid 0 of its user namespace must give up, so that it can no longer
    remount, unshare or act as root over its namespaces."""
    ctypes = libc.ctypes
    try:
        libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL)
    except OSError:
        pass  # no ambient capabilities before Linux 4.3
    cap = 0
    while True:
        try:
            libc.prctl(PR_CAPBSET_DROP, cap)
        except OSError:
            break  # EINVAL past the last capability
        cap += 1
    header = ctypes.create_string_buffer(_struct.pack("=Ii", 0x20080522, 0), 8)  # version 3
    data = ctypes.create_string_buffer(bytes(24), 24)  # two empty cap_user_data_t
    libc.check(libc.libc.capset(header, data), "capset")


def writable_paths(paths):
    """Which of `paths` this process could change, tested for real: in a directory, an O_TMPFILE
    file (unnamed, gone when closed); a file is opened for appending and closed unwritten. That
    is what the kernel allows after every layer (a read-only mount, Landlock, the uid), where
    os.access would not see Landlock. Falls back to os.access where a directory's file system
    has no O_TMPFILE."""
    found = []
    tmpfile = getattr(_kos, "O_TMPFILE", 0)
    for path in paths:
        if _kos.path.isdir(path):
            flags = tmpfile | _kos.O_WRONLY | _kos.O_CLOEXEC
        elif _kos.path.isfile(path):
            flags = _kos.O_WRONLY | _kos.O_APPEND | _kos.O_CLOEXEC | _kos.O_NOFOLLOW
        else:
            continue
        try:
            _kos.close(_kos.open(path, flags, 0o600))
            found.append(path)
        except OSError as exc:
            if exc.errno in (1, 13, 30):  # EPERM, EACCES, EROFS: the layers hold
                continue
            if _kos.access(path, _kos.W_OK):
                found.append(path)
    return found


# ---- which layers a run needs -----------------------------------------------------------------

# Unless the caller allows a weak sandbox, each group must be held by one of its alternatives,
# each a set of layers that must all be held (a layer is held when the candidate reports it
# True; otherwise it reports why not). Other processes are out of reach in their own PID
# namespace, under another uid, or where seccomp (no signals out, no ptrace, no process_vm_*,
# no pidfd) and Landlock (no /proc/<pid> files) hold together.
REQUIRED_LAYERS = (
    ("seccomp", (("seccomp",),)),
    ("no_new_privs", (("no_new_privs",),)),
    ("filesystem", (("readonly_mounts",), ("landlock",))),
    ("processes", (("pid_namespace",), ("uid",), ("seccomp", "landlock"))),
)


def missing_layers(layers, required):
    """One line per group of `required` that no alternative holds, naming each layer and why it
    is not held."""
    missing = []
    for group, alternatives in REQUIRED_LAYERS:
        if group in required and not any(all(layers.get(m) is True for m in alt)
                                          for alt in alternatives):
            members = dict.fromkeys(m for alt in alternatives for m in alt)
            why = "; ".join(f"{m}: {layers.get(m, 'not attempted')}" for m in members
                            if layers.get(m) is not True)
            missing.append(f"{group} ({why})")
    return missing
