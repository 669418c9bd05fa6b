"""Kernel confinement of the candidate: a seccomp-bpf filter, Landlock, a read-only mount namespace.

Runs inside the candidate process (this source is concatenated into the
candidate's, docs/security.md) before the program and before the audit hook;
the caller and `reinforge doctor` import it too, to probe the machine. Every
layer here is enforced by the kernel on this process and whatever it could
exec, and none can be undone from inside: the seccomp filter and the Landlock
domain only ever add restrictions, the mounts need a capability the process
gives up (and `mount` is in the filter), and no_new_privs is one-way. So they
hold even where the audit hook (guard.py) is fooled or switched off, e.g. by
a memory-corruption bug in the interpreter.

System calls go through ctypes, which the candidate drops (and the hook
refuses) before the program runs; `Libc` holds the handful it needs.

The seccomp filter is written here (about 150 BPF instructions) rather than
through libseccomp's Python binding: that binding is not on PyPI for our
interpreters, and the filter is small enough to read and to test call by
call (tests/test_sandbox_kernel.py, which also checks every syscall number
against the kernel headers when they are installed).
"""

import os as _kos
import stat as _kstat
import struct as _struct

# ---- seccomp-bpf ------------------------------------------------------------------------------

# AUDIT_ARCH_* of the architectures whose syscall numbers are below (linux/audit.h).
AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
# x86_64 also accepts x32 syscalls (numbers with this bit set), which a deny-list keyed on the
# x86_64 numbers would let through: all of them are refused.
X32_SYSCALL_BIT = 0x40000000

# name: (x86_64 number, aarch64 number); None where the call does not exist on that architecture.
SYSCALLS = {
    # other processes' memory and state
    "ptrace": (101, 117), "process_vm_readv": (310, 270), "process_vm_writev": (311, 271),
    "kcmp": (312, 272), "process_madvise": (440, 440), "pidfd_getfd": (438, 438),
    "pidfd_open": (434, 434), "pidfd_send_signal": (424, 424),
    "migrate_pages": (256, 238), "move_pages": (279, 239),
    # signals: allowed to this process only (see _signal_rule)
    "kill": (62, 129), "tkill": (200, 130), "tgkill": (234, 131),
    "rt_sigqueueinfo": (129, 138), "rt_tgsigqueueinfo": (297, 240),
    # new processes and programs
    "fork": (57, None), "vfork": (58, None), "clone": (56, 220), "clone3": (435, 435),
    "execve": (59, 221), "execveat": (322, 281),
    # the network (socketpair is allowed for AF_UNIX only: an anonymous pair reaches nothing)
    "socket": (41, 198), "socketpair": (53, 199),
    # mounts and namespaces
    "mount": (165, 40), "umount2": (166, 39), "pivot_root": (155, 41), "chroot": (161, 51),
    "unshare": (272, 97), "setns": (308, 268), "open_tree": (428, 428),
    "move_mount": (429, 429), "fsopen": (430, 430), "fsconfig": (431, 431),
    "fsmount": (432, 432), "fspick": (433, 433), "mount_setattr": (442, 442),
    "name_to_handle_at": (303, 264), "open_by_handle_at": (304, 265),
    # identity and limits, set once by the sandbox
    "setuid": (105, 146), "setgid": (106, 144), "setreuid": (113, 145), "setregid": (114, 143),
    "setresuid": (117, 147), "setresgid": (119, 149), "setgroups": (116, 159),
    "setfsuid": (122, 151), "setfsgid": (123, 152), "setrlimit": (160, 164),
    "prlimit64": (302, 261),
    # memory outside RLIMIT_AS, files without a path, kernel objects
    "memfd_create": (319, 279), "memfd_secret": (447, 447), "userfaultfd": (323, 282),
    "mknod": (133, None), "mknodat": (259, 33), "symlink": (88, None), "symlinkat": (266, 36),
    "link": (86, None), "linkat": (265, 37),
    "keyctl": (250, 219), "add_key": (248, 217), "request_key": (249, 218), "bpf": (321, 280),
    "perf_event_open": (298, 241), "personality": (135, 92), "io_uring_setup": (425, 425),
    "io_uring_enter": (426, 426), "io_uring_register": (427, 427), "fanotify_init": (300, 262),
    # other processes' scheduling (the same uid's, without the uid drop)
    "setpriority": (141, 140), "sched_setaffinity": (203, 122), "sched_setscheduler": (144, 119),
    "sched_setparam": (142, 118), "sched_setattr": (314, 274), "ioprio_set": (251, 30),
    # the machine (need capabilities the candidate never has; refused anyway)
    "kexec_load": (246, 104), "kexec_file_load": (320, 294), "init_module": (175, 105),
    "finit_module": (313, 273), "delete_module": (176, 106), "acct": (163, 89),
    "swapon": (167, 224), "swapoff": (168, 225), "reboot": (169, 142), "syslog": (103, 116),
    "sethostname": (170, 161), "setdomainname": (171, 162), "settimeofday": (164, 170),
    "clock_settime": (227, 112), "adjtimex": (159, 171), "clock_adjtime": (305, 266),
    "quotactl": (179, 60), "lookup_dcookie": (212, 18), "vhangup": (153, 58),
    "iopl": (172, None), "ioperm": (173, None), "modify_ldt": (154, None), "uselib": (134, None),
    # terminal injection (checked by argument)
    "ioctl": (16, 29),
}
# Refused outright, whatever the arguments.
DENIED = (
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "process_madvise", "pidfd_getfd",
    "pidfd_open", "pidfd_send_signal", "migrate_pages", "move_pages",
    "fork", "vfork", "clone", "execve", "execveat", "socket",
    "mount", "umount2", "pivot_root", "chroot", "unshare", "setns", "open_tree", "move_mount",
    "fsopen", "fsconfig", "fsmount", "fspick", "mount_setattr", "name_to_handle_at",
    "open_by_handle_at",
    "setuid", "setgid", "setreuid", "setregid", "setresuid", "setresgid", "setgroups",
    "setfsuid", "setfsgid", "setrlimit",
    "memfd_create", "memfd_secret", "userfaultfd", "mknod", "mknodat", "symlink", "symlinkat",
    "link", "linkat", "keyctl", "add_key", "request_key", "bpf", "perf_event_open",
    "io_uring_setup", "io_uring_enter", "io_uring_register", "fanotify_init",
    "setpriority", "sched_setaffinity", "sched_setscheduler", "sched_setparam", "sched_setattr",
    "ioprio_set",
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module", "acct",
    "swapon", "swapoff", "reboot", "syslog", "sethostname", "setdomainname", "settimeofday",
    "clock_settime", "adjtimex", "clock_adjtime", "quotactl", "lookup_dcookie", "vhangup",
    "iopl", "ioperm", "modify_ldt", "uselib",
)
# Signals: the first argument (a pid, a tgid or a tid) must be this process (single-threaded:
# its tid is its pid). kill(0, ...) and kill(-1, ...) reach a group or everything: refused.
SIGNAL_CALLS = ("kill", "tkill", "tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo")
AF_UNIX = 1
TIOCSTI, TIOCLINUX = 0x5412, 0x541C  # push input into a terminal, console tricks
PERSONALITY_QUERY = 0xFFFFFFFF

EPERM, ENOSYS = 1, 38
RET_KILL_PROCESS, RET_ERRNO, RET_ALLOW = 0x80000000, 0x00050000, 0x7FFF0000
# struct seccomp_data: int nr; __u32 arch; __u64 instruction_pointer; __u64 args[6] (native
# endianness: both architectures here are little-endian, so an argument's low half comes first).
_NR, _ARCH, _ARGS = 0, 4, 16
_LD_ABS, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06


def machine_arch():
    """The architecture name of this process as SYSCALLS keys it, or None if it is not there."""
    machine = _kos.uname().machine
    machine = {"amd64": "x86_64", "arm64": "aarch64"}.get(machine, machine)
    return machine if machine in AUDIT_ARCH and _struct.calcsize("P") == 8 else None


def _arg_lo(i):
    return _ARGS + 8 * i


def seccomp_filter(arch, own_pid):
    """The BPF program (a list of (code, jt, jf, k)) for `arch`, allowing signals to `own_pid` only.

    Order: a wrong architecture kills the process (its numbers mean other calls); on x86_64 any
    x32 call is refused; then each rule below matches one syscall number and returns; anything
    else is allowed. Denied calls fail with EPERM, except clone3 with ENOSYS, so that the C
    library falls back to clone (whose flags, unlike clone3's, the filter can read; it refuses
    clone anyway: no new processes or threads).
    """
    index = 0 if arch == "x86_64" else 1
    deny = (_RET, 0, 0, RET_ERRNO | EPERM)
    allow = (_RET, 0, 0, RET_ALLOW)
    prog = [(_LD_ABS, 0, 0, _ARCH), (_JEQ, 1, 0, AUDIT_ARCH[arch]), (_RET, 0, 0, RET_KILL_PROCESS),
            (_LD_ABS, 0, 0, _NR)]
    if arch == "x86_64":
        prog += [(_JGE, 0, 1, X32_SYSCALL_BIT), deny]

    def number(name):
        return SYSCALLS[name][index]

    def rule(name, body):
        # `body` ends in a return on every path, so no rule needs the syscall number reloaded.
        nr = number(name)
        if nr is not None:
            prog.extend([(_JEQ, 0, len(body), nr), *body])

    for name in DENIED:
        rule(name, [deny])
    rule("clone3", [(_RET, 0, 0, RET_ERRNO | ENOSYS)])
    for name in SIGNAL_CALLS:
        rule(name, [(_LD_ABS, 0, 0, _arg_lo(0)), (_JEQ, 0, 1, own_pid & 0xFFFFFFFF), allow, deny])
    rule("socketpair", [(_LD_ABS, 0, 0, _arg_lo(0)), (_JEQ, 0, 1, AF_UNIX), allow, deny])
    # prlimit64(0, resource, NULL, old): reading this process's own limits, nothing else.
    rule("prlimit64", [(_LD_ABS, 0, 0, _arg_lo(0)), (_JEQ, 0, 5, 0),
                       (_LD_ABS, 0, 0, _arg_lo(2)), (_JEQ, 0, 3, 0),
                       (_LD_ABS, 0, 0, _arg_lo(2) + 4), (_JEQ, 0, 1, 0), allow, deny])
    rule("personality", [(_LD_ABS, 0, 0, _arg_lo(0)), (_JEQ, 0, 1, PERSONALITY_QUERY), allow, deny])
    rule("ioctl", [(_LD_ABS, 0, 0, _arg_lo(1)), (_JEQ, 1, 0, TIOCSTI), (_JEQ, 0, 1, TIOCLINUX),
                   deny, allow])
    prog.append(allow)
    for code, jt, jf, _k in prog:  # jumps are 8-bit: every rule above jumps within itself
        assert code != _JEQ or (jt < 256 and jf < 256)
    return prog


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

PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2
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


def install_seccomp(libc, arch, own_pid):
    """Install the filter of `seccomp_filter` on this process (no_new_privs must be set)."""
    ctypes = libc.ctypes
    prog = seccomp_filter(arch, own_pid)

    class SockFilter(ctypes.Structure):
        _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte),
                    ("k", ctypes.c_uint32)]

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(SockFilter))]

    insns = (SockFilter * len(prog))(*(SockFilter(*i) for i in prog))
    fprog = SockFprog(len(prog), insns)
    libc.check(libc.libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0),
               "prctl(PR_SET_SECCOMP)")
    return len(prog)


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
