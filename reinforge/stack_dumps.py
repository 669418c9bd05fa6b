"""Private stack-dump files of the worker processes reinforge starts (read by the hang watchdog).

Owns the one place reinforge's workers write to outside a run directory. Each worker that registers a
`faulthandler` handler for SIGUSR1 writes its stacks to <dir>/<pid>.txt; the file's existence tells the
watchdog (telemetry/watchdog.py) that the process may be signalled.

<dir> is private to the process tree: made by `mkdtemp` (a fresh random name, mode 0700, created
atomically in the temp directory, so nothing planted there beforehand is ever followed), once per process
that starts workers, and handed down to them, which check it again (a real directory, owned by them, no
access for others) and create their file with O_CREAT|O_EXCL|O_NOFOLLOW through the checked directory's
descriptor. A predictable path such as <tmp>/reinforge-stacks/<pid>.txt would let another local user plant
a file there (every worker then fails to start) or a symlink (the next worker truncates whatever it points
to, with the trainer's rights). Anything that goes wrong here leaves a worker without a stack handler, never
without a start. The process that made the directory removes it at exit; a stopped worker's file is removed
when it stops (`forget`), so a later process given the same pid is never signalled by mistake.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import os
import shutil
import signal
import tempfile
from pathlib import Path

_dir: Path | None = None        # made or adopted by this process; None: not yet
_dir_owner: int | None = None   # pid of the process that made it (only that one removes it)


def current_dir() -> Path | None:
    """The directory made or adopted by this process so far, without making one."""
    return _dir


def private_dir() -> Path | None:
    """This process tree's private stack-dump directory (made on first use); None if none can be made,
    and then workers run without a stack handler (the watchdog lists them, never signals them)."""
    global _dir, _dir_owner
    if _dir is None:
        try:
            _dir = Path(tempfile.mkdtemp(prefix="reinforge-stacks-"))
        except OSError:
            return None
        _dir_owner = os.getpid()
    return _dir


def _private_dir_fd(directory: Path) -> int | None:
    """An open descriptor of `directory` if it is a real directory (not a symlink) owned by this user with
    no access for others, else None. The file is then created through the descriptor, so the directory
    checked is the one written to, whatever is renamed meanwhile."""
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    st = os.fstat(fd)
    if st.st_uid != os.geteuid() or st.st_mode & 0o077:
        os.close(fd)
        return None
    return fd


def open_dump_file(directory: str | os.PathLike) -> int | None:
    """A new file <directory>/<pid>.txt open for writing, or None when `directory` is not private to this
    user or the name exists already (whatever was there is never truncated or followed)."""
    dir_fd = _private_dir_fd(Path(directory))
    if dir_fd is None:
        return None
    try:
        return os.open(f"{os.getpid()}.txt", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                       0o600, dir_fd=dir_fd)
    except OSError:
        return None
    finally:
        os.close(dir_fd)


def enable(directory: str | os.PathLike | None) -> bool:
    """In a worker process: on SIGUSR1, every thread's stack to <directory>/<pid>.txt, `directory` being the
    parent's `private_dir()` (adopted, so the worker's own workers dump there too). False, and no handler,
    when the file cannot be made safely."""
    global _dir, _dir_owner
    if directory is None:
        return False
    fd = open_dump_file(directory)
    if fd is None:
        return False
    _dir, _dir_owner = Path(directory), None
    faulthandler.register(signal.SIGUSR1, file=os.fdopen(fd, "w"), all_threads=True)
    return True


def forget(pid: int) -> None:
    """Remove a stopped worker's dump file."""
    if _dir is not None:
        with contextlib.suppress(OSError):
            os.unlink(_dir / f"{pid}.txt")


def _remove_dir() -> None:
    if _dir is not None and _dir_owner == os.getpid():
        shutil.rmtree(_dir, ignore_errors=True)


def _forget_dir() -> None:
    # A forked child makes its own directory if it starts workers; the parent's is the parent's to remove.
    global _dir, _dir_owner
    _dir = _dir_owner = None


atexit.register(_remove_dir)
os.register_at_fork(after_in_child=_forget_dir)
