"""Which layers of the code sandbox a run gets on this machine, and which it must have.

Owns the probes of `unshare` (once per process), the plan of one run (the
judge's and the candidate's command prefixes, the uid drop), the policy of
required layers and its opt-out (`reward.code.allow_weak_sandbox`), the
directories a candidate must never be able to write, and the warnings for
missing layers. The layers themselves are installed by the candidate
(sandbox/candidate.py, kernel.py, seccomp.py); docs/security.md describes them.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass

log = logging.getLogger("reinforge.verifiers.code")

# The candidate's uid is drawn per run from [base, base + span): far above system and
# login uids and the usual subuid ranges, so no other process on the machine has it.
SANDBOX_UID_BASE = 2**30
SANDBOX_UID_SPAN = 2**29
# The candidate's own namespaces, nested inside the judge's: fresh /proc, no judge in view.
CANDIDATE_NAMESPACES = ("--pid", "--fork", "--kill-child", "--mount", "--mount-proc", "--net",
                        "--ipc")
# The layer groups a run needs (sandbox/kernel.py REQUIRED_LAYERS), unless weak is allowed.
REQUIRED_LAYER_GROUPS = ("seccomp", "no_new_privs", "filesystem", "processes")
# Layers a caller may turn off for tests of the others (each needs allow_weak_sandbox when
# it leaves a required group empty).
OPTIONAL_LAYERS = frozenset(("readonly_mounts", "landlock", "seccomp", "hook"))


class SandboxUnavailableError(RuntimeError):
    """This machine lacks a layer the code sandbox requires (the message names it); `layers` holds
    what the candidate reported."""

    layers: dict = {}

    @classmethod
    def refused(cls, why: str, layers: dict) -> SandboxUnavailableError:
        """The error for the candidate's refusal `why`; the opt-out is named where it applies."""
        advice = "" if "could write to" in why else (
            " Run where these layers exist (docs/security.md, `reinforge doctor`), or accept a "
            "weaker sandbox with reward.code.allow_weak_sandbox=true.")
        error = cls(f"code sandbox: {why}.{advice}")
        error.layers = layers
        return error


# Set once per process from `reward.code.allow_weak_sandbox` (configure_sandbox).
_settings = {"allow_weak_sandbox": False}


def configure_sandbox(allow_weak_sandbox: bool) -> None:
    """The process-wide default of `run_tests(allow_weak_sandbox=...)`, from the run's config."""
    _settings["allow_weak_sandbox"] = bool(allow_weak_sandbox)


def allow_weak_default() -> bool:
    return _settings["allow_weak_sandbox"]


@dataclass(frozen=True)
class SandboxPlan:
    """The layers one run uses on this machine (probed once per process)."""

    judge_prefix: tuple[str, ...]  # `unshare ...` for the judge, () without namespaces
    candidate_prefix: tuple[str, ...]  # `unshare ...` nested for the candidate, () if unavailable
    drop_uid: bool  # we are real root: the candidate runs as a fresh unprivileged uid


def minimal_env() -> dict[str, str]:
    # Nothing from the parent environment: API keys and tokens live there.
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "LC_ALL": "C.UTF-8"}


def _probe(command: list[str]) -> bool:
    try:
        probe = subprocess.run(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, timeout=10, env=minimal_env())
    except (OSError, subprocess.TimeoutExpired):
        return False
    return probe.returncode == 0


@functools.lru_cache(maxsize=1)
def namespace_prefix() -> tuple[str, ...]:
    """The judge's `unshare` command prefix that works on this machine, or () if none does.

    Probed once per process by running a trivial interpreter under it.
    """
    unshare = shutil.which("unshare")
    if unshare is None:
        return ()
    namespaces = ["--pid", "--fork", "--kill-child", "--net"]
    attempts = [[unshare, *namespaces]] if os.geteuid() == 0 else []
    attempts.append([unshare, "--user", "--map-root-user", *namespaces])
    for prefix in attempts:
        if _probe([*prefix, sys.executable, "-I", "-S", "-c", "pass"]):
            return tuple(prefix)
    return ()


@functools.lru_cache(maxsize=1)
def _candidate_prefix() -> tuple[str, ...]:
    judge = namespace_prefix()
    unshare = shutil.which("unshare")
    if not judge or unshare is None:
        return ()
    prefix = (unshare, *CANDIDATE_NAMESPACES)
    # PID 1 with nothing but itself in /proc: the namespace and the fresh /proc both work.
    check = "import os; assert os.getpid() == 1 and os.listdir('/proc').count('1') == 1"
    return prefix if _probe([*judge, *prefix, sys.executable, "-I", "-S", "-c", check]) else ()


_warned: set[str] = set()


def warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning("code sandbox: %s", message)


def sandbox_plan(namespaces: bool = True) -> SandboxPlan:
    """The layers a run gets here; logs each one that is missing, once per process."""
    judge = namespace_prefix() if namespaces else ()
    candidate = _candidate_prefix() if judge else ()
    drop_uid = os.geteuid() == 0 and "--user" not in judge
    if not judge:
        why = "disabled by the caller" if not namespaces else "unshare does not work here"
        warn_once(f"namespaces-{namespaces}", (
            f"PID/mount/network namespaces {why}: no read-only mounts, and the candidate sees "
            "the host's /proc and network stack" + ("; running as root, so the unprivileged uid, "
                                                    "seccomp, Landlock and the non-dumpable judge "
                                                    "carry the isolation" if drop_uid else "")))
    elif not candidate:
        warn_once("candidate-namespaces", "the candidate cannot get its own PID and mount "
                  "namespace (fresh /proc) here; it shares the judge's")
    if not drop_uid:
        warn_once("uid", "not real root: the candidate runs as this user, so other processes "
                  "and files of this user are protected by the namespaces, seccomp and Landlock")
    return SandboxPlan(judge, candidate, drop_uid)


def sandbox_settings(plan: SandboxPlan, layers_off, weak: bool, file_bytes: int,
                     protected: list[str]) -> dict:
    """The candidate's part of the payload: what to install, what to require, what to protect."""
    return {
        "mount_namespace": bool(plan.candidate_prefix),
        "off": sorted(layers_off),
        "required": [] if weak else list(REQUIRED_LAYER_GROUPS),
        "protected": protected,
        # the work directory's tmpfs (with a mount namespace): a few full-size files
        "workdir_bytes": 4 * file_bytes,
    }


def protected_dirs() -> list[str]:
    """What a later judge, trainer or `reinforge` command would import or run, and the candidate
    must never be able to change: the caller's sys.path, the interpreter's bin directory,
    reinforge's own package, and two files whose directory may be closed while they are not
    (the stdlib's os.py, the sandbox's own sources)."""
    here = os.path.dirname(__file__)
    dirs = [p for p in sys.path if p and os.path.isdir(p)]
    dirs += [os.path.dirname(sys.executable), os.path.dirname(here), os.__file__,
             os.path.join(here, "sandbox", "candidate.py")]
    return sorted({os.path.realpath(d) for d in dirs})


def warn_missing_layers(layers: dict, off: set[str]) -> None:
    """The line at start (once per process: the layers the first run held), then a warning for
    each missing layer, once."""
    if layers and "held" not in _warned:
        _warned.add("held")
        log.info("code sandbox: layers held: %s", ", ".join(sorted(k for k, v in layers.items() if v is True)))
    for name, state in sorted(layers.items()):
        if state is not True and name not in off and name not in ("uid", "capabilities"):
            warn_once(f"layer-{name}", f"layer {name} is missing: {state}")
