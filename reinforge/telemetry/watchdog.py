"""Hang watchdog: when a run stops making progress, where every thread and child process is waiting.

A reward function stuck on a lock, a collective that one rank never joins, a sandbox that never
answers: the run neither fails nor moves, and nothing says where it stands. This module owns a
thread that watches the progress points (`beat`: every RL step's end) and, once none came for

    limit = max(factor x median step time so far, min_seconds)      (first_step_seconds before the first step)

writes RUN_DIR/hang-<step>.txt (step: the step that has not ended) with

- every thread of this process (`sys._current_frames`), innermost frame last;
- every child process started by reinforge that registered a handler (`stack_dumps.enable`, called in
  the bounded-call workers of verifiers/bounded.py): it is sent SIGUSR1 and its `faulthandler` output is
  read back from its file in a directory private to the run's processes (reinforge/stack_dumps.py). A child
  without a handler is listed, never signalled (SIGUSR1 would kill it);

and raises a `hang` alert naming, for each thread, the innermost frame of reinforge's own code (and the
innermost frame overall, e.g. the user's reward function), file:line function. Time bounds that exist
(a reward's `timeout_s` in a bounded call) stop what they bound; the watchdog is for what is not bounded.

The default keeps waiting after a dump (a slow step is not a hang, and a run killed on a guess loses its
progress): it dumps again each further `limit` without progress. `stop_after` N stops the run after N
dumps of one hang by interrupting the main thread (a thread stuck in C code may not see it).
"""

from __future__ import annotations

import os
import signal
import statistics
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from reinforge import stack_dumps
from reinforge.telemetry.alerts import Alert

_PACKAGE = str(Path(__file__).resolve().parents[1])

def hang_limit(step_seconds: list[float], factor: float, min_seconds: float, first_step_seconds: float) -> float:
    """Seconds without progress that count as a hang (see the module docstring)."""
    if not step_seconds:
        return first_step_seconds
    return max(factor * statistics.median(step_seconds), min_seconds)


def _frame_line(frame: traceback.FrameSummary) -> str:
    return f"{frame.filename}:{frame.lineno} {frame.name}"


def thread_stacks(skip: int | None = None) -> dict[str, traceback.StackSummary]:
    """Every thread's stack but `skip`'s (a thread id), by 'name (id)'."""
    names = {t.ident: t.name for t in threading.enumerate()}
    return {f"{names.get(ident, '?')} ({ident})": traceback.extract_stack(frame)
            for ident, frame in sys._current_frames().items() if ident != skip}


def where(stack: traceback.StackSummary) -> str:
    """'innermost reinforge frame' (with the innermost frame too, when that is outside reinforge)."""
    ours = [f for f in stack if f.filename.startswith(_PACKAGE)]
    inner = stack[-1]
    if not ours:
        return _frame_line(inner)
    if ours[-1] is inner:
        return _frame_line(inner)
    return f"{_frame_line(ours[-1])}, in {_frame_line(inner)}"


def _descendants(pid: int) -> list[int]:
    """Child processes of `pid`, theirs, and so on (Linux /proc; [] elsewhere)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*/stat"):
        try:
            stat = entry.read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.parent.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def child_stacks(wait_s: float = 0.5) -> dict[int, str]:
    """The stacks of every descendant process: those with a handler signalled and read back; others named."""
    out, sizes = {}, {}
    directory = stack_dumps.current_dir()
    for pid in _descendants(os.getpid()):
        path = directory / f"{pid}.txt" if directory is not None else None
        if path is None or not path.exists():
            out[pid] = "(no stack handler registered: not signalled)"
            continue
        try:
            sizes[pid] = path.stat().st_size
            os.kill(pid, signal.SIGUSR1)
        except (OSError, ProcessLookupError):   # stopped meanwhile (its file is removed when it stops)
            sizes.pop(pid, None)
            out[pid] = "(exited)"
    time.sleep(wait_s if sizes else 0)
    for pid, size in sizes.items():
        try:
            with (directory / f"{pid}.txt").open() as f:
                f.seek(size)
                out[pid] = f.read() or "(no answer within the wait: stuck in C code with signals blocked?)"
        except OSError:   # the worker stopped meanwhile and its file was removed
            out[pid] = "(exited)"
    return out


def stop_signal() -> int:
    """The signal that stops this process's run at once: SIGINT, unless the shell started it ignored (a job in
    the background of a non-interactive shell, nohup ... &), then SIGTERM, whose handler the run installs too
    (jobs/lifecycle.py); either one, sent by the watchdog, ends the run with its reason."""
    return signal.SIGINT if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN else signal.SIGTERM


class Watchdog:
    """The watching thread (see the module docstring). `beat(step)` after each step's end; `close()` at the end.
    `alert(alerts)` records alerts (Recorder.alert). `stopped` holds the stop message once it stopped the run."""

    def __init__(self, cfg, run_dir: Path, alert: Callable[[list[Alert]], None], step: int = 0):
        self.cfg, self.run_dir, self.alert = cfg, Path(run_dir), alert
        self.step = step                 # the last step that ended
        self.step_seconds: list[float] = []
        self.last = time.monotonic()
        self.dumps = 0                   # dumps since the last progress
        self.stopped: str | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="reinforge-watchdog", daemon=True)
        self._thread.start()

    def beat(self, step: int) -> None:
        now = time.monotonic()
        self.step_seconds.append(now - self.last)
        self.step, self.last, self.dumps = step, now, 0

    def limit(self) -> float:
        c = self.cfg
        return hang_limit(self.step_seconds, c.factor, c.min_seconds, c.first_step_seconds)

    def close(self) -> None:
        self._done.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._done.wait(min(1.0, self.limit() / 4)):
            idle = time.monotonic() - self.last
            if idle < self.limit() * (self.dumps + 1):
                continue
            self.dumps += 1
            self.alert([self.dump(idle)])
            if self.cfg.stop_after and self.dumps >= self.cfg.stop_after:
                self.stopped = (f"hang watchdog: step {self.step + 1} made no progress for {idle:.0f} s after "
                                f"{self.dumps} dumps (train.watchdog.stop_after={self.cfg.stop_after}); stacks in "
                                f"{self.run_dir / f'hang-{self.step + 1}.txt'}")
                # A real signal wakes a main thread asleep in a system call (interrupt_main only sets a flag).
                os.kill(os.getpid(), stop_signal())
                return

    def dump(self, idle: float) -> Alert:
        """Write hang-<step>.txt (appending: a later dump of the same hang follows the earlier one) and the alert."""
        step, limit = self.step + 1, self.limit()
        threads = thread_stacks(skip=threading.get_ident())
        children = child_stacks()
        path = self.run_dir / f"hang-{step}.txt"
        lines = [f"step {step}: no progress for {idle:.1f} s (limit {limit:.1f} s), dump {self.dumps}", ""]
        for name, stack in threads.items():
            lines += [f"Thread {name}, waiting at {where(stack)}:", *"".join(stack.format()).rstrip().split("\n"), ""]
        for pid, text in children.items():
            lines += [f"Child process {pid}:", text.rstrip(), ""]
        with path.open("a") as f:
            f.write("\n".join(lines) + "\n")
        waits = "; ".join(f"{name.split(' (')[0]} at {where(stack)}" for name, stack in threads.items())
        return Alert(step, "hang",
                     f"step {step}: no progress for {idle:.0f} s (limit {limit:.0f} s, train.watchdog): {waits}"
                     f"{f'; {len(children)} child process(es)' if children else ''}; stacks in {path}",
                     {"idle_seconds": idle, "limit_seconds": limit, "dumps": float(self.dumps)})
