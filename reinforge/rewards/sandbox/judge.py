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


def main():
    non_dumpable = make_undumpable()
    p = json.loads(sys.stdin.buffer.read())
    nonce, limit, max_error = p["nonce"], p["max_message"], p["max_error"]
    cpu_s = max(1, math.ceil(p["timeout_s"]))
    # The judge runs trusted code only; its limits just bound a runaway judge.
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s + 1, cpu_s + 1))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    def emit(**rec):
        rec["nonce"] = nonce
        data = (json.dumps(rec) + "\n").encode()
        while data:
            data = data[os.write(1, data):]

    req_r, req_w = os.pipe()
    resp_r, resp_w = os.pipe()
    workdir = os.getcwd()
    child = subprocess.Popen(
        [*p["candidate_prefix"], sys.executable, "-I", "-S", "-B", "-c", p["candidate_src"],
         str(req_r), str(resp_w), str(cpu_s), str(p["memory_bytes"]), str(p["file_bytes"]),
         str(cpu_s + 2), str(limit), str(p["max_global"]), str(max_error), str(p["uid"])],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        pass_fds=(req_r, resp_w), cwd=workdir,
        env={"PATH": "/usr/bin:/bin", "LC_ALL": "C.UTF-8", "TMPDIR": workdir, "HOME": workdir},
        start_new_session=True,  # a session leader cannot setsid() out of its group
    )
    os.close(req_r)
    os.close(resp_w)
    emit(kind="pid", pid=child.pid)

    head = bytearray()

    def drain():
        # Keep the first output_bytes, read and drop the rest so the candidate never blocks.
        while True:
            chunk = child.stdout.read1(1 << 16)
            if not chunk:
                return
            room = p["output_bytes"] - len(head)
            if room > 0:
                head.extend(chunk[:room])

    drainer = threading.Thread(target=drain, daemon=True)
    drainer.start()

    state = {"next_id": 0, "gone": None}
    layers = {"non_dumpable": non_dumpable}

    def exchange(message):
        if state["gone"]:
            raise CandidateGone(state["gone"])
        message["id"] = state["next_id"]
        state["next_id"] += 1
        try:
            send(req_w, message)
            reply = recv(resp_r, limit)
            if type(reply) is not dict or reply.get("id") != message["id"]:
                raise ProtocolError("reply out of order")
        except (OSError, EOFError, ProtocolError) as exc:
            state["gone"] = f"candidate process gone: {exc}"
            raise CandidateGone(state["gone"]) from None
        return reply

    def proxy_for(name):
        def proxy(*args, **kwargs):
            reply = exchange({"name": name, "args": [encode(a) for a in args],
                              "kwargs": {str(k): encode(v) for k, v in kwargs.items()}})
            if reply.get("ok") is True:
                try:
                    return decode(reply.get("value"))
                except ProtocolError as exc:
                    state["gone"] = f"candidate process gone: {exc}"
                    raise CandidateGone(state["gone"]) from None
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

    def describe(exc):
        return f"{type(exc).__name__}: {exc}"[:max_error]

    def finish(error=None):
        os.close(req_w)  # the candidate sees EOF, flushes its output and exits
        try:
            child.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(child.pid, 9)
        except (ProcessLookupError, PermissionError):
            pass
        child.wait()
        drainer.join(timeout=1.0)
        emit(kind="done", error=error, output=bytes(head).decode("utf-8", "replace"),
             layers=layers)

    try:
        loaded = exchange({"program": p["program"], "names": p["names"]})
    except CandidateGone as exc:
        return finish(f"program did not load: {exc}")
    reported = loaded.get("layers")
    if type(reported) is dict:
        layers.update((k, v) for k, v in reported.items() if k in ("no_new_privs", "uid"))
    if loaded.get("ok") is not True:
        return finish(f"program raised: {str(loaded.get('error'))[:max_error]}")
    # Only the names the tests need and do not define themselves, builtins excluded (the
    # caller computed the list): the candidate can never replace `len` or a test helper.
    env = {"__name__": "__tests__", "__builtins__": builtins}
    names = loaded.get("names")
    for name in p["names"]:
        value = names.get(name) if type(names) is dict else None
        if value is None:
            continue
        try:
            if value == ["callable"]:
                env[name] = proxy_for(name)
            elif value == ["module"]:
                # The judge imports the module itself, and only under the name the (trusted)
                # tests use: MBPP-style tests call math.isclose relying on the program's import.
                env[name] = importlib.import_module(name)
            else:
                env[name] = decode(value)
        except (ProtocolError, ImportError):
            continue
    try:
        exec(compile(p["setup"], "<tests setup>", "exec"), env)
    except (Exception, CandidateAbort, CandidateGone) as exc:
        return finish(f"test setup raised: {describe(exc)}")
    if state["gone"]:
        return finish(f"test setup: {state['gone']}")
    for index, case in enumerate(p["cases"]):
        try:
            exec(compile(case, f"<case {index}>", "exec"), dict(env))
        except (Exception, CandidateAbort, CandidateGone) as exc:
            emit(kind="case", index=index, ok=False, error=describe(exc))
        else:
            if state["gone"]:  # the test caught CandidateGone (a bare except): still a failure
                emit(kind="case", index=index, ok=False, error=state["gone"])
            else:
                emit(kind="case", index=index, ok=True)
    finish()


if __name__ == "__main__":
    main()
