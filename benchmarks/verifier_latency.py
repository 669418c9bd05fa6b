"""Time of a verdict: the code sandbox per program (namespaces on and off) and the math verifier's
bound on a parse bomb judged from a non-main thread while another thread keeps running.

    .venv/bin/python benchmarks/verifier_latency.py [--runs 25]

The sandbox figure is the median (and p90) wall time of `run_tests` on MBPP-style programs with
three asserts each, run one at a time, so it is the latency a reward worker sees, interpreter
start-up included, with every layer of docs/security.md (and, for comparison, without the
kernel layers: seccomp, Landlock, read-only mounts); the target is a median under 0.3 s. The
load average at the start and end is printed with it (the machine may be shared). The math
figure is how long a parse bomb (`\\boxed{9^{9^{9^{9^{9}}}}}`) takes to score from a thread
with `timeout_s=1`, and the longest pause a 1 ms ticker thread saw meanwhile (a frozen process
would show the whole call). The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time

from reinforge.verifiers.code import namespace_prefix, run_tests
from reinforge.verifiers.math import MathVerifier

PROGRAMS = [
    ("def f(n):\n    return n * n\n", "assert f(3) == 9\nassert f(0) == 0\nassert f(-2) == 4\n"),
    (
        "import math\ndef f(x):\n    return math.sqrt(x)\n",
        "assert abs(f(2.0) - 1.41421) < 1e-4\nassert f(4) == 2\nassert f(0) == 0\n",
    ),
    (
        "from collections import Counter\ndef f(s):\n    return Counter(s).most_common(1)[0][0]\n",
        "assert f('aab') == 'a'\nassert f('xyy') == 'y'\nassert f('z') == 'z'\n",
    ),
    (
        "def f(xs):\n    return sorted(set(xs))\n",
        "assert f([3, 1, 3]) == [1, 3]\nassert f([]) == []\nassert len(f([1, 1])) == 1\n",
    ),
]
BOMB = "\\boxed{9^{9^{9^{9^{9}}}}}"


KERNEL_LAYERS = ("seccomp", "landlock", "readonly_mounts")


def sandbox_times(runs: int, namespaces: bool, layers_off: tuple[str, ...] = ()) -> list[float]:
    times = []
    for i in range(runs):
        program, tests = PROGRAMS[i % len(PROGRAMS)]
        t0 = time.perf_counter()
        result = run_tests(program, tests, namespaces=namespaces, layers_off=layers_off,
                           allow_weak_sandbox=bool(layers_off))
        times.append(time.perf_counter() - t0)
        assert result.passed, result.error  # a correct program that fails would make the timing meaningless
    return times


def bomb_from_thread() -> tuple[float, float, float]:
    verifier, out = MathVerifier(timeout_s=1.0), {}
    verifier("\\boxed{1}", "1")  # start the worker process outside the timed call

    def judge() -> None:
        t0 = time.perf_counter()
        out["score"] = verifier(BOMB, "2")
        out["seconds"] = time.perf_counter() - t0

    worker = threading.Thread(target=judge)
    last, longest = time.perf_counter(), 0.0
    worker.start()
    while worker.is_alive():
        time.sleep(0.001)
        now = time.perf_counter()
        longest, last = max(longest, now - last), now
    return out["score"], out["seconds"], longest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=25)
    args = parser.parse_args()
    load_start = os.getloadavg()[0]
    with_ns = sandbox_times(args.runs, namespaces=True)
    without_ns = sandbox_times(args.runs, namespaces=False)
    no_kernel = sandbox_times(args.runs, namespaces=True, layers_off=KERNEL_LAYERS)
    load_end = os.getloadavg()[0]
    score, seconds, longest_gap = bomb_from_thread()
    print(json.dumps({
        "sandbox_median_s": round(statistics.median(with_ns), 4),
        "sandbox_p90_s": round(statistics.quantiles(with_ns, n=10)[-1], 4),
        "sandbox_no_namespaces_median_s": round(statistics.median(without_ns), 4),
        "sandbox_without_kernel_layers_median_s": round(statistics.median(no_kernel), 4),
        "load_1min_start_end": [load_start, load_end],
        "cpus": os.cpu_count(),
        "namespaces_available": bool(namespace_prefix()),
        "runs": args.runs,
        "math_bomb_score": score,
        "math_bomb_seconds": round(seconds, 3),
        "math_bomb_timeout_s": 1.0,
        "ticker_longest_gap_s": round(longest_gap, 4),
    }))


if __name__ == "__main__":
    main()
