"""The candidate's seccomp-bpf filter: which system calls it may not make, in BPF, and its install.

Runs inside the candidate process (this source is concatenated into the
candidate's, docs/security.md), installed after every other layer, just
before the audit hook; the caller, `reinforge doctor` and the tests import it
too. The filter only ever adds restrictions and is inherited by anything the
process could exec, so the candidate cannot undo it.

It is written here (about 230 BPF instructions) rather than through
libseccomp's Python binding: that binding is not on PyPI for our
interpreters, and the filter is small enough to read and to test call by
call (tests/unit/verifiers/test_sandbox_kernel.py, which also checks every syscall number
against the kernel headers when they are installed).
"""

import os as _sos
import struct as _sstruct

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
    machine = _sos.uname().machine
    machine = {"amd64": "x86_64", "arm64": "aarch64"}.get(machine, machine)
    return machine if machine in AUDIT_ARCH and _sstruct.calcsize("P") == 8 else None


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


PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2


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
