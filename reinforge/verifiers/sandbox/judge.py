"""The judge process: holds the tests, starts the candidate, evaluates every assert itself.

Runs as `python -I -S -B -c CODEC + JUDGE` and reads one JSON payload on stdin
(program, setup, cases, names, limits, the candidate's command prefix and
uid, a nonce). It never executes a byte of candidate code: names the tests
need are bound to proxies that call into the candidate over a pipe, and
values come back through the strict codec. Verdict lines go to the judge's
own stdout, tagged with the nonce; the candidate writes to a different pipe.

The judge holds the expected values, so it makes itself non-dumpable first
(prctl): /proc/<judge>/mem, environ and fd are then closed to every process
without CAP_SYS_PTRACE, on top of the candidate running as another uid and,
with namespaces, not seeing the judge at all.
"""

import builtins
import importlib
import json
import math
import os
import resource
import subprocess
import sys
import threading

try:  # in the sandbox these names come from codec.py, prepended to this source
    from .codec import ProtocolError, decode, encode, recv, send
except ImportError:
    pass


# Exceptions a candidate call must never raise into the tests under their own type.
# AssertionError would read as the test's own failure message; StopIteration ends the
# iteration of `map`, `filter`, `zip` or `iter` early without an error, so
# `assert all(map(is_prime, [2, 3, 5]))` would hold for a candidate that only raises it.
UNTRANSLATED = (AssertionError, StopIteration, StopAsyncIteration)


class CandidateError(Exception):
    """The candidate raised an exception that is not a builtin Exception type."""


class CandidateAbort(BaseException):
    """The candidate raised SystemExit, KeyboardInterrupt or another non-Exception.

    A BaseException, as in plain Python: a test's `except Exception` does not catch it.
    """


# `except SystemExit` in the tests still catches the candidate's sys.exit().
ABORTS = {kind.__name__: type(kind.__name__, (kind, CandidateAbort), {})
          for kind in (SystemExit, KeyboardInterrupt, GeneratorExit)}


class CandidateGone(BaseException):
    """The candidate process died or broke the protocol; no further calls are possible.

    A BaseException so that a test's `except Exception` cannot turn `os._exit` into a
    pass (in plain Python it would end the tests); a case during which the candidate
    went away fails even if the test caught this.
    """


def make_undumpable():
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0) == 0  # PR_SET_DUMPABLE
    except Exception:
        return False


def verdict_writer(nonce):
    """`emit(**record)`: one JSON line on the judge's own stdout, tagged with the nonce."""
    def emit(**rec):
        rec["nonce"] = nonce
        data = (json.dumps(rec) + "\n").encode()
        while data:
            data = data[os.write(1, data):]

    return emit


def describe(exc, max_error):
    return f"{type(exc).__name__}: {exc}"[:max_error]


class Candidate:
    """The candidate process as the judge sees it: its pipes, the first output_bytes of what it
    prints, and the calls into it (`exchange`, and `proxy` for a name the tests call)."""

    def __init__(self, p, cpu_s, limit, max_error):
        req_r, req_w = os.pipe()
        resp_r, resp_w = os.pipe()
        workdir = os.getcwd()
        self.child = subprocess.Popen(
            [*p["candidate_prefix"], sys.executable, "-I", "-S", "-B", "-c", p["candidate_boot"],
             str(req_r), str(resp_w), str(cpu_s), str(p["memory_bytes"]), str(p["file_bytes"]),
             str(cpu_s + 2), str(limit), str(p["max_global"]), str(max_error), str(p["uid"])],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            pass_fds=(req_r, resp_w), cwd=workdir,
            env={"PATH": "/usr/bin:/bin", "LC_ALL": "C.UTF-8", "TMPDIR": workdir, "HOME": workdir},
            start_new_session=True,  # a session leader cannot setsid() out of its group
        )
        os.close(req_r)
        os.close(resp_w)
        self.req_w, self.resp_r, self.limit, self.max_error = req_w, resp_r, limit, max_error
        self.next_id, self.gone = 0, None
        code = bytes.fromhex(p["candidate_code"])  # the candidate's code object (CANDIDATE_BOOT)
        try:
            data = len(code).to_bytes(8, "big") + code
            while data:
                data = data[os.write(req_w, data):]
        except OSError as exc:
            self.gone = f"candidate process gone before it started: {exc}"
        self.head = bytearray()
        self.drainer = None

    def keep_output(self, output_bytes):
        """Keep the first output_bytes, read and drop the rest so the candidate never blocks."""
        def drain():
            while True:
                chunk = self.child.stdout.read1(1 << 16)
                if not chunk:
                    return
                room = output_bytes - len(self.head)
                if room > 0:
                    self.head.extend(chunk[:room])

        self.drainer = threading.Thread(target=drain, daemon=True)
        self.drainer.start()

    def exchange(self, message):
        if self.gone:
            raise CandidateGone(self.gone)
        message["id"] = self.next_id
        self.next_id += 1
        try:
            send(self.req_w, message)
        except OSError as exc:
            self.gone = f"candidate process gone: {exc}"
            raise CandidateGone(self.gone) from None
        return self.reply()

    def reply(self):
        """The next reply, which must answer the last request."""
        try:
            reply = recv(self.resp_r, self.limit)
            if type(reply) is not dict or reply.get("id") != self.next_id - 1:
                raise ProtocolError("reply out of order")
        except (OSError, EOFError, ProtocolError) as exc:
            self.gone = f"candidate process gone: {exc}"
            raise CandidateGone(self.gone) from None
        return reply

    def proxy(self, name):
        max_error = self.max_error

        def proxy(*args, **kwargs):
            reply = self.exchange({"name": name, "args": [encode(a) for a in args],
                                   "kwargs": {str(k): encode(v) for k, v in kwargs.items()}})
            if reply.get("ok") is True:
                try:
                    return decode(reply.get("value"))
                except ProtocolError as exc:
                    self.gone = f"candidate process gone: {exc}"
                    raise CandidateGone(self.gone) from None
            # Re-raise builtin exception types by name so tests can catch e.g. ValueError,
            # except those that steer control flow in the tests' own code (see UNTRANSLATED).
            kind = getattr(builtins, str(reply.get("exc")), None)
            exc_type = kind if isinstance(kind, type) and issubclass(kind, Exception) \
                and kind not in UNTRANSLATED else CandidateError
            if reply.get("base") is True:
                exc_type = ABORTS.get(str(reply.get("exc")), CandidateAbort)
            # Builtin types carry the program's own message, as `str(exc)` would read in
            # plain Python; the others name the program's type too.
            message = str(reply.get("message"))[:max_error]
            if exc_type is CandidateError or exc_type is CandidateAbort:
                message = f"{reply.get('exc')}: {message}"[:max_error]
            try:
                exc = exc_type(message)
            except Exception:  # e.g. UnicodeDecodeError wants five arguments
                exc = CandidateError(f"{reply.get('exc')}: {message}"[:max_error])
            raise exc
        proxy.__name__ = name
        return proxy

    def stop(self):
        """Close the request pipe, then kill what is left of the candidate's process group."""
        os.close(self.req_w)  # the candidate sees EOF, flushes its output and exits
        try:
            self.child.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(self.child.pid, 9)
        except (ProcessLookupError, PermissionError):
            pass
        self.child.wait()
        self.drainer.join(timeout=1.0)
        return bytes(self.head).decode("utf-8", "replace")


def tests_globals(candidate, wanted, names):
    """The tests' globals: only the names the tests need and do not define themselves, builtins
    excluded (the caller computed the list): the candidate can never replace `len` or a test helper."""
    env = {"__name__": "__tests__", "__builtins__": builtins}
    for name in wanted:
        value = names.get(name) if type(names) is dict else None
        if value is None:
            continue
        try:
            if value == ["callable"]:
                env[name] = candidate.proxy(name)
            elif value == ["module"]:
                # The judge imports the module itself, and only under the name the (trusted)
                # tests use: MBPP-style tests call math.isclose relying on the program's import.
                env[name] = importlib.import_module(name)
            else:
                env[name] = decode(value)
        except (ProtocolError, ImportError):
            continue
    return env


def run_cases(cases, env, candidate, emit, max_error):
    """Each case in a fresh copy of the tests' globals; one verdict line each."""
    for index, case in enumerate(cases):
        try:
            exec(compile(case, f"<case {index}>", "exec"), dict(env))
        except (Exception, CandidateAbort, CandidateGone) as exc:
            emit(kind="case", index=index, ok=False, error=describe(exc, max_error))
        else:
            if candidate.gone:  # the test caught CandidateGone (a bare except): still a failure
                emit(kind="case", index=index, ok=False, error=candidate.gone)
            else:
                emit(kind="case", index=index, ok=True)


def main():
    non_dumpable = make_undumpable()
    p = json.loads(sys.stdin.buffer.read())
    nonce, limit, max_error = p["nonce"], p["max_message"], p["max_error"]
    cpu_s = max(1, math.ceil(p["timeout_s"]))
    # The judge runs trusted code only; its limits just bound a runaway judge.
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s + 1, cpu_s + 1))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    emit = verdict_writer(nonce)
    candidate = Candidate(p, cpu_s, limit, max_error)
    emit(kind="pid", pid=candidate.child.pid)
    candidate.keep_output(p["output_bytes"])
    layers = {"non_dumpable": non_dumpable}

    def finish(error=None):
        output = candidate.stop()
        emit(kind="done", error=error, output=output, layers=layers)

    try:
        # The first reply reports the sandbox's layers; the candidate writes it before the
        # program runs, so the program cannot forge it (the pipe keeps the order).
        report = candidate.exchange({"program": p["program"], "names": p["names"],
                                     "sandbox": p["sandbox"]})
    except CandidateGone as exc:
        return finish(f"program did not load: {exc}")
    reported = report.get("layers")
    if type(reported) is dict:
        layers.update((str(k), v if type(v) is bool else str(v)[:200])
                      for k, v in reported.items())
    if report.get("refused") is not None:
        output = candidate.stop()
        return emit(kind="done", error="the sandbox refused to run the program", output=output,
                    layers=layers, refused=str(report.get("refused"))[:2000])
    if report.get("ok") is not True:
        return finish(str(report.get("error"))[:max_error])
    try:
        loaded = candidate.reply()
    except CandidateGone as exc:
        return finish(f"program did not load: {exc}")
    if loaded.get("ok") is not True:
        return finish(f"program raised: {str(loaded.get('error'))[:max_error]}")
    env = tests_globals(candidate, p["names"], loaded.get("names"))
    try:
        exec(compile(p["setup"], "<tests setup>", "exec"), env)
    except (Exception, CandidateAbort, CandidateGone) as exc:
        return finish(f"test setup raised: {describe(exc, max_error)}")
    if candidate.gone:
        return finish(f"test setup: {candidate.gone}")
    run_cases(p["cases"], env, candidate, emit, max_error)
    finish()


if __name__ == "__main__":
    main()
