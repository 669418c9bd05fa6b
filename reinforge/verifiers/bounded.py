"""Bounded calls: run a picklable function in a worker process, abandoned after a wall-clock limit.

Owns the time bound that holds whatever thread asks for it. `signal.alarm`
only works in the main thread and only between bytecodes, and a thread stuck
in a long C call (sympy on `9^{9^{9^{9}}}`) holds the GIL, so no bound inside
one process stops it from freezing every other thread. A worker process can
simply be killed.

`BoundedPool` keeps spawned worker processes alive between calls (a start
costs about a second: interpreter, imports, the caller's warm-up) and hands
each call to an idle one, starting another only when every worker is busy.
A worker that has not answered `timeout_s` after it received its call is
killed on the spot; its call comes back as `timed_out` and the next call
that needs a worker starts a fresh one. The waiting thread sleeps in
`Connection.poll`, so it holds no GIL and the rest of the process runs.

Lifetime: `close()` runs at interpreter exit, so no worker outlives a normal
exit; one whose parent was killed exits at its next read (EOF). After
`os.fork()` the child forgets the parent's workers (they are not its
children) and starts its own on first use.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from reinforge import stack_dumps

# A fresh interpreter, not a fork (a forked child of a process with threads, torch's or a
# tokenizer's, can deadlock) and not multiprocessing's spawn (which re-runs the caller's
# `__main__` script in the child, so a script without a main guard would run twice).
_BOOT = (
    "import json, sys; sys.path[:0] = json.loads(sys.argv[1]); "
    "from reinforge.verifiers.bounded import _serve; _serve(int(sys.argv[2]), sys.argv[3] or None)"
)


@dataclass(frozen=True)
class CallOutcome:
    """How one bounded call ended. Exactly one of ok / timed_out / crashed / raised holds."""

    status: str          # "ok", "timed_out" (killed past the bound), "crashed" (the worker died), "raised"
    value: Any = None    # the function's return value when status == "ok"
    error: str = ""      # "ExceptionType: message" when status == "raised"

    @property
    def ok(self) -> bool:
        return self.status == "ok"


@dataclass(eq=False)  # compared by identity: two workers are never the same worker
class _Worker:
    process: subprocess.Popen
    conn: Connection


def _serve(fd: int, dump_dir: str | None) -> None:
    """A worker's main loop: warm up, then answer calls until EOF or None."""
    # Ctrl-C reaches the whole process group; the parent decides when its workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # The hang watchdog can ask for this worker's stacks (SIGUSR1); where that cannot be set up safely,
    # the worker runs without it (a verifier must start whatever another user planted in the temp dir).
    stack_dumps.enable(dump_dir)
    conn = Connection(fd)
    warmup = conn.recv()
    # Warm-up first, so that a call's bound does not pay for imports and first-use caches.
    if warmup is not None:
        warmup()
    conn.send("ready")
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return  # the parent went away
        if message is None:
            return
        fn, args = message
        try:
            reply: tuple[str, Any] = ("ok", fn(*args))
        except Exception as err:  # the caller decides what a failed call means
            reply = ("raised", f"{type(err).__name__}: {err}")
        try:
            conn.send(reply)
        except OSError:
            return


def _stop(worker: _Worker, graceful: bool) -> None:
    if graceful:
        try:
            worker.conn.send(None)
        except OSError:
            pass
        try:
            worker.process.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            pass
    if worker.process.poll() is None:
        worker.process.kill()
    worker.process.wait()
    stack_dumps.forget(worker.process.pid)
    worker.conn.close()


class BoundedPool:
    """Persistent worker processes that run `fn(*args)` with a wall-clock bound; safe from any thread."""

    def __init__(self, warmup: Callable[[], object] | None = None, max_workers: int | None = None,
                 start_timeout_s: float = 120.0) -> None:
        self.warmup = warmup                                  # picklable, run once by each new worker
        self.max_workers = max_workers or os.cpu_count() or 1   # concurrent calls beyond this wait for a worker
        self.start_timeout_s = start_timeout_s                 # a worker not ready by then is a broken install
        self._lock = threading.Condition()
        self._idle: list[_Worker] = []
        self._busy: set[_Worker] = set()                      # workers lent to a call
        self._live: list[_Worker] = []                        # idle and busy
        self._starting = 0                                    # slots reserved by workers being started
        self.started = 0                                      # workers started so far (tests, metrics)
        self.calls = 0                                        # calls answered by a worker, any status
        _POOLS.add(self)

    def call(self, fn: Callable[..., Any], args: tuple, timeout_s: float) -> CallOutcome:
        """`fn(*args)` in a worker; `timed_out` if it has not answered `timeout_s` after the worker got it.

        Raises RuntimeError only when a worker cannot be started at all.
        """
        worker = self._acquire()
        try:
            self._send(worker, fn, args)
        except OSError:  # it died while idle: not this call's fault, so one retry on a fresh worker
            self._discard(worker)
            worker = self._acquire()
            self._send(worker, fn, args)
        try:
            if not worker.conn.poll(timeout_s):
                self._discard(worker)   # killed mid-call: nothing it computed can be trusted or waited for
                return self._answered(CallOutcome("timed_out"))
            status, payload = worker.conn.recv()
        except (EOFError, OSError, ValueError):  # died mid-call (segfault, out of memory), or close() at exit
            self._discard(worker)
            return self._answered(CallOutcome("crashed"))
        self._release(worker)
        if status == "ok":
            return self._answered(CallOutcome("ok", value=payload))
        return self._answered(CallOutcome("raised", error=payload))

    def close(self) -> None:
        """Stop every worker (each asked to exit, killed after 1 s); the pool can be used again."""
        with self._lock:
            workers, self._idle, self._live = self._live, [], []
            self._busy.clear()
            self._lock.notify_all()
        for worker in workers:
            _stop(worker, graceful=True)

    @property
    def size(self) -> int:
        """Worker processes alive now (idle or busy)."""
        with self._lock:
            return len(self._live)

    # ---- internals

    def _send(self, worker: _Worker, fn: Callable[..., Any], args: tuple) -> None:
        try:
            worker.conn.send((fn, args))
        except OSError:
            raise
        except BaseException:   # e.g. an unpicklable argument: nothing was written, the worker is fine
            self._release(worker)
            raise

    def _answered(self, outcome: CallOutcome) -> CallOutcome:
        with self._lock:
            self.calls += 1
        return outcome

    def _acquire(self) -> _Worker:
        with self._lock:
            while True:
                while self._idle:
                    worker = self._idle.pop()
                    if worker.process.poll() is None:
                        self._busy.add(worker)
                        return worker
                    self._live.remove(worker)
                    worker.conn.close()
                if len(self._live) + self._starting < self.max_workers:
                    self._starting += 1
                    break
                self._lock.wait()
        try:
            worker = self._start()   # outside the lock: other calls keep using the idle workers meanwhile
        finally:
            with self._lock:
                self._starting -= 1
                self._lock.notify_all()
        with self._lock:
            self._live.append(worker)
            self._busy.add(worker)
            self.started += 1
        return worker

    def _start(self) -> _Worker:
        ours, theirs = socket.socketpair()
        with ours, theirs:
            dump_dir = stack_dumps.private_dir()
            process = subprocess.Popen([sys.executable, "-c", _BOOT, json.dumps(sys.path), str(theirs.fileno()),
                                        "" if dump_dir is None else str(dump_dir)],
                                       pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
            worker = _Worker(process, Connection(os.dup(ours.fileno())))
        deadline = time.monotonic() + self.start_timeout_s
        try:
            worker.conn.send(self.warmup)
            ready = worker.conn.poll(max(deadline - time.monotonic(), 0.0)) and worker.conn.recv() == "ready"
        except (EOFError, OSError):
            ready = False
        if not ready:
            _stop(worker, graceful=False)
            raise RuntimeError(
                f"a bounded-call worker process did not start within {self.start_timeout_s:g} s "
                f"(exit code {process.returncode})"
            )
        return worker

    def _release(self, worker: _Worker) -> None:
        with self._lock:
            if worker in self._busy:   # close() may have taken it meanwhile
                self._busy.discard(worker)
                self._idle.append(worker)
                self._lock.notify_all()
                return
        _stop(worker, graceful=True)

    def _discard(self, worker: _Worker) -> None:
        with self._lock:
            self._busy.discard(worker)
            if worker in self._live:
                self._live.remove(worker)
            self._lock.notify_all()
        _stop(worker, graceful=False)

    def _forget(self) -> None:
        # In a forked child: the workers belong to the parent; never signal or join them from here.
        # Closing our copies of their sockets keeps a worker's EOF tied to the parent's exit alone.
        for worker in self._live:
            try:
                worker.conn.close()
            except OSError:
                pass
        self._lock = threading.Condition()
        self._idle, self._live, self._busy, self._starting = [], [], set(), 0


_POOLS: weakref.WeakSet[BoundedPool] = weakref.WeakSet()


def _close_all() -> None:
    for pool in list(_POOLS):
        pool.close()


def _forget_all() -> None:
    for pool in list(_POOLS):
        pool._forget()


atexit.register(_close_all)
os.register_at_fork(after_in_child=_forget_all)

__all__ = ["BoundedPool", "CallOutcome"]
