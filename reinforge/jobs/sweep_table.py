"""The comparison table of a sweep: each group's runs (one per seed) summarised as mean and sample std,
the note on which groups are told apart, and the table as rows, Markdown cells and CSV."""

from __future__ import annotations

import csv
import io
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

# The axes a group's runs differ in (the run's seed, or the RL stage's own seed from one SFT model);
# every other swept axis defines a group.
SEEDS = frozenset({"seed", "train.seed"})


@dataclass
class Stat:
    """Mean and sample standard deviation (ddof=1) of one number over the seeds of a group."""

    values: list[float]
    mean: float | None
    std: float | None        # None with fewer than two values: one seed says nothing about seed noise

    @classmethod
    def of(cls, values: list[float]) -> Stat:
        return cls(values=list(values), mean=statistics.fmean(values) if values else None,
                   std=statistics.stdev(values) if len(values) > 1 else None)

    def text(self, signed: bool = False) -> str:
        """`0.412 ± 0.031`, `0.412 ± n/a` (one seed) or `n/a` (none), as the table prints it."""
        if self.mean is None:
            return "n/a"
        mean = f"{self.mean:+.3f}" if signed else f"{self.mean:.3f}"
        return f"{mean} ± {'n/a' if self.std is None else f'{self.std:.3f}'}"


@dataclass
class SweepRun:
    name: str
    path: Path
    overrides: list[str]                 # the combination, plus what the sweep adds (threads, log.progress)
    axes: dict[str, str]                 # value of each swept axis
    status: Literal["done", "skipped", "failed"] = "done"   # skipped: finished by an earlier sweep
    seconds: float = 0.0
    error: str | None = None             # the tail of a failed run's output
    summary: dict | None = None


@dataclass
class SweepRow:
    """One group: the runs that differ only in their seed."""

    group: dict[str, str]                # swept axes except seed
    runs: list[str]                      # names of the group's runs
    n: int                               # finished runs (seeds)
    failed: int
    final_pass1: Stat                    # held-out pass@1 after RL
    delta_pass1: Stat                    # per seed: final pass@1 - start-of-RL pass@1
    greedy: Stat                         # held-out greedy accuracy after RL
    pass_at_k: dict[str, Stat] = field(default_factory=dict)   # final pass@k, keys as in summary.json

    @property
    def label(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.group.items()) or "all runs"


def summarise(runs: list[SweepRun], swept: list[str]) -> list[SweepRow]:
    """One row per group of runs that differ only in their seed, in grid order."""
    groups: dict[tuple, list[SweepRun]] = {}
    for run in runs:
        groups.setdefault(tuple((k, v) for k, v in run.axes.items() if k not in SEEDS), []).append(run)
    rows = []
    for key, members in groups.items():
        evals = [r.summary["eval"] for r in members if r.summary is not None]
        ks = sorted({k for ev in evals for k in ev["final"].get("pass@k", {})}, key=int)
        rows.append(SweepRow(
            group=dict(key), runs=[r.name for r in members], n=len(evals),
            failed=sum(r.status == "failed" for r in members),
            final_pass1=Stat.of([ev["final"]["pass@1"] for ev in evals]),
            delta_pass1=Stat.of([ev["final"]["pass@1"] - ev["start"]["pass@1"] for ev in evals]),
            greedy=Stat.of([ev["final"]["greedy_accuracy"] for ev in evals]),
            pass_at_k={k: Stat.of([ev["final"]["pass@k"][k] for ev in evals if k in ev["final"].get("pass@k", {})])
                       for k in ks},
        ))
    return rows


def separation_note(rows: list[SweepRow]) -> str:
    """Is the best group ahead of the second by more than seed noise? A rough hint, not a test.

    "separated" means the gap between the two best mean final pass@1 values
    exceeds the sum of their sample stds. That is a simple, conservative-looking
    rule of thumb; with few seeds the stds themselves are noisy, so neither
    verdict is a significance test.
    """
    ranked = sorted((r for r in rows if r.final_pass1.mean is not None), key=lambda r: -r.final_pass1.mean)
    if len(ranked) < 2:
        return ""
    best, second = ranked[0], ranked[1]
    gap = best.final_pass1.mean - second.final_pass1.mean
    head = (f"Best group ({best.label}, n={best.n}) leads the second ({second.label}, n={second.n}) "
            f"by {gap:.3f} final pass@1")
    if gap == 0:
        head = f"The two best groups ({best.label}; {second.label}) tie at {best.final_pass1.mean:.3f} final pass@1"
    if best.final_pass1.std is None or second.final_pass1.std is None:
        return head + "; with one seed in a group its seed noise is unknown: sweep seed=0,1,2 to compare."
    spread = best.final_pass1.std + second.final_pass1.std
    verdict = "separated" if gap > spread else "within seed noise"
    return (
        head + f"; the sum of their stds is {spread:.3f}: {verdict}. "
        "(Rule of thumb: gap > std1 + std2. A hint, not a significance test; with few seeds the stds are noisy too.)"
    )


def table(result_rows: list[SweepRow], swept: list[str]) -> tuple[list[str], list[list[str]]]:
    """Header and cells of the sweep table, as sweep.md and the console print it."""
    axes = [k for k in swept if k not in SEEDS]
    ks = sorted({k for r in result_rows for k in r.pass_at_k if k != "1"}, key=int)
    header = [*(axes or ["group"]), "n", "final pass@1", "Δ pass@1 (final − start)", "greedy accuracy",
              *(f"pass@{k}" for k in ks), "failed"]
    cells = [[*([row.group[k] for k in axes] if axes else [row.label]), str(row.n), row.final_pass1.text(),
              row.delta_pass1.text(signed=True), row.greedy.text(),
              *(row.pass_at_k[k].text() if k in row.pass_at_k else "n/a" for k in ks), str(row.failed)]
             for row in result_rows]
    return header, cells


def csv_text(rows: list[SweepRow], swept: list[str]) -> str:
    axes = [k for k in swept if k not in SEEDS]
    ks = sorted({k for r in rows for k in r.pass_at_k if k != "1"}, key=int)   # pass@1 has its own column
    stats = ["final_pass@1", "delta_pass@1", "greedy_accuracy", *(f"final_pass@{k}" for k in ks)]
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow([*axes, "n", "failed", *(f"{s}_{m}" for s in stats for m in ("mean", "std"))])
    for row in rows:
        values = [row.final_pass1, row.delta_pass1, row.greedy, *(row.pass_at_k.get(k, Stat.of([])) for k in ks)]
        writer.writerow([*(row.group[k] for k in axes), row.n, row.failed,
                         *("" if x is None else repr(x) for s in values for x in (s.mean, s.std))])
    return buffer.getvalue()
