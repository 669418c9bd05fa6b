"""`reinforge doctor`: which layers of the code sandbox this machine gives (docs/security.md).

Owns the report only: the layers are probed by running one trivial program
through the real sandbox (reinforge.verifiers.code.probe_layers), so what it
prints is what a run gets, not what the machine seems to offer.
"""

from __future__ import annotations

import os
import platform
import sys

from reinforge.verifiers.code import REQUIRED_LAYER_GROUPS, SandboxUnavailableError, probe_layers
from reinforge.verifiers.sandbox import kernel, seccomp

# layer -> what it stops, in a few words (docs/security.md has the whole story)
LAYERS = (
    ("pid_namespace", "own PID namespace: no host process can be seen or signalled"),
    ("readonly_mounts", "own mount namespace: every mount read-only, private /tmp, /dev/shm, work dir"),
    ("landlock", "Landlock: reads only the stdlib and work dir, writes only the work dir, no TCP"),
    ("seccomp", "seccomp-bpf: no ptrace, sockets, mounts, namespaces, exec, new processes, memfd"),
    ("no_new_privs", "no_new_privs: no exec can ever gain privileges"),
    ("uid", "an unused uid of its own (needs root): other users' files and processes out of reach"),
    ("capabilities", "no capabilities, even as uid 0 of a user namespace"),
    ("non_dumpable", "the judge (which holds the expected values) is not dumpable"),
    ("hook", "the audit hook: a fast first filter on opens, imports and events"),
)


def doctor_lines(namespaces: bool = True) -> tuple[list[str], bool]:
    """The report, one line each, and whether candidate code runs here without allow_weak_sandbox."""
    refused = None
    try:
        layers = probe_layers(namespaces)
    except SandboxUnavailableError as err:  # the interpreter is writable: refused whatever the config
        layers, refused = err.layers, str(err)
    lines = [f"machine: Linux {platform.release()} {platform.machine()}, uid {os.geteuid()}, "
             f"Python {platform.python_version()} at {sys.executable}"]
    try:
        abi = kernel.landlock_abi(kernel.Libc())
    except OSError:
        abi = 0
    lines.append(f"landlock ABI: {abi or 'none'}; seccomp syscall table: {seccomp.machine_arch() or 'none'}")
    for name, stops in LAYERS:
        state = layers.get(name, "not reported")
        mark = "available" if state is True else f"MISSING ({state})"
        lines.append(f"{name:16} {mark:12} {stops}" if state is True else f"{name:16} {mark}: {stops}")
    missing = kernel.missing_layers(layers, REQUIRED_LAYER_GROUPS)
    if refused is not None:
        lines.append(f"REFUSED: {refused}")
    elif missing:
        lines.append("required: " + "; ".join(missing))
        lines.append("candidate code is refused here unless reward.code.allow_weak_sandbox=true")
    else:
        lines.append(f"required ({', '.join(REQUIRED_LAYER_GROUPS)}): all held; candidate code runs here")
    return lines, not missing and refused is None
