"""The sources that run in the sandbox's two subprocesses (`python -c` strings, and a code object).

`codec.py` (the value format and framing), `guard.py` (the candidate's audit
hook), `seccomp.py` (the syscall filter), `kernel.py` (Landlock, mounts,
capabilities), `candidate.py` (privilege drop
and the call server) and `judge.py` (the process that holds the tests) are
ordinary modules so that linters and unit tests can read them, but in the
sandbox they run from source, without reinforge on the path: `JUDGE_SRC` is
codec + judge, `CANDIDATE_SRC` is codec + guard + seccomp + kernel +
candidate. Each
file imports its siblings inside `try/except ImportError`, which fails (no
parent package) in the sandbox, where the concatenation has already defined
those names.

The candidate's source (about 60 kB) is compiled once here, by the caller,
and each candidate gets the code object (marshal, same interpreter) over its
request pipe: `CANDIDATE_BOOT` is all its `python -c` parses, which saves the
compilation on every run (a run costs tens of milliseconds in all).
"""

import marshal
from pathlib import Path

_HERE = Path(__file__).parent


def _source(*names: str) -> str:
    return "\n".join((_HERE / f"{name}.py").read_text() for name in names)


JUDGE_SRC = _source("codec", "judge")
CANDIDATE_SRC = _source("codec", "guard", "seccomp", "kernel", "candidate")
CANDIDATE_CODE = marshal.dumps(compile(CANDIDATE_SRC, "<sandbox candidate>", "exec"))
# Reads a length-prefixed code object from the request pipe (argv[1]) and runs it as __main__.
CANDIDATE_BOOT = (
    "import marshal, os, sys\n"
    "def _exactly(fd, n):\n"
    "    data = b''\n"
    "    while len(data) < n:\n"
    "        chunk = os.read(fd, n - len(data))\n"
    "        if not chunk:\n"
    "            raise SystemExit(1)\n"
    "        data += chunk\n"
    "    return data\n"
    "_fd = int(sys.argv[1])\n"
    "exec(marshal.loads(_exactly(_fd, int.from_bytes(_exactly(_fd, 8), 'big'))))\n"
)
