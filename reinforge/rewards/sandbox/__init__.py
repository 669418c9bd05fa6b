"""The sources that run in the sandbox's two subprocesses, as `python -c` strings.

`codec.py` (the value format and framing), `guard.py` (the candidate's audit
hook), `kernel.py` (seccomp, Landlock, mounts), `candidate.py` (privilege drop
and the call server) and `judge.py` (the process that holds the tests) are
ordinary modules so that linters and unit tests can read them, but in the
sandbox they run from source, without reinforge on the path: `JUDGE_SRC` is
codec + judge, `CANDIDATE_SRC` is codec + guard + kernel + candidate. Each file imports its siblings inside
`try/except ImportError`, which fails (no parent package) in the sandbox,
where the concatenation has already defined those names.
"""

from pathlib import Path

_HERE = Path(__file__).parent


def _source(*names: str) -> str:
    return "\n".join((_HERE / f"{name}.py").read_text() for name in names)


JUDGE_SRC = _source("codec", "judge")
CANDIDATE_SRC = _source("codec", "guard", "kernel", "candidate")
