"""The OpenMP wait setting of a reinforge process: how long libgomp's idle threads spin before they sleep.

Set by the CLI (reinforge/cli.py) before torch loads libgomp, from the load it finds; measurements in
BENCHMARKS.md, "OpenMP's wait policy". Standard library only: it runs before any heavy import.
"""

from __future__ import annotations

import os
import time


def openmp_spin(runnable: list[int], cpus: int, threads: int) -> str:
    """libgomp's spin count (GOMP_SPINCOUNT) for this process's waiting threads (torch's pool, the CPU kernels),
    from the runnable threads counted at start-up (`runnable`, this one included; /proc/stat's procs_running).

    Its default spin (~300k iterations) holds a core the whole time: where other processes run, a thread that
    spins loses its core and every parallel op waits for it (RL step 3-17x slower on a loaded 2-core machine). A
    1,000-iteration spin sleeps almost at once: close to sleeping at once under load, but every parallel region
    then wakes its threads, and an RL step runs hundreds of short ones. So: 20,000 where no more threads wanted
    to run than the cores this process leaves free (the `vs_trl.py`-shaped RL step 0.084 -> 0.074 s on a quiet
    Intel Xeon), 1,000 where more did (under a competing 2-thread job the long spin was 8-25% slower there, and
    on an AMD EPYC 10,000 was 1.3-3.3x slower than 1,000). BENCHMARKS.md, "OpenMP's wait policy"."""
    if not runnable:
        return "1000"
    others = sorted(runnable)[len(runnable) // 2] - 1     # the median count, less this process
    return "20000" if others <= max(0, cpus - threads) else "1000"


def _runnable_now(samples: int = 5) -> list[int]:
    """procs_running of /proc/stat, `samples` times 2 ms apart; [] where there is none (not Linux)."""
    counts = []
    for i in range(samples):
        try:
            with open("/proc/stat") as stat:
                counts += [int(line.split()[1]) for line in stat if line.startswith("procs_running")]
        except (OSError, ValueError, IndexError):
            return []
        if i + 1 < samples:
            time.sleep(0.002)
    return counts


def set_spin_count() -> None:
    """GOMP_SPINCOUNT by `openmp_spin`, unless the user set it or OMP_WAIT_POLICY. libgomp reads it when it loads
    (with torch): call this before."""
    if "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ:
        return
    cpus = os.cpu_count() or 1
    threads = int(os.environ["OMP_NUM_THREADS"]) if os.environ.get("OMP_NUM_THREADS", "").isdigit() else cpus
    os.environ["GOMP_SPINCOUNT"] = openmp_spin(_runnable_now(), cpus, threads)
