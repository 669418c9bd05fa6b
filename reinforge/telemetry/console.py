"""Console output that shares the terminal with tqdm progress bars.

A line printed straight to the terminal while a bar is drawn lands in the
middle of the bar and leaves a broken half-bar behind. Everything the run
prints while bars may be open (health alerts, stage summaries) goes through
`bar_safe_console()`: a rich Console whose every write is a `tqdm.write`,
which clears the open bars, prints the text above them and redraws them.
"""

from __future__ import annotations

import io
import sys
from typing import TextIO

from rich.console import Console
from rich.table import Table
from tqdm import tqdm


class BarSafeStream(io.TextIOBase):
    """A text stream whose writes go through `tqdm.write` to `target` (default: stderr, where the bars are)."""

    def __init__(self, target: TextIO | None = None):
        self._target = target

    @property
    def target(self) -> TextIO:
        return self._target if self._target is not None else sys.stderr   # looked up late: pytest swaps sys.stderr

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        if text:
            tqdm.write(text, file=self.target, end="")
        return len(text)

    def flush(self) -> None:
        self.target.flush()

    def isatty(self) -> bool:
        # rich decides on colours from this: the stream is as much a terminal as what it writes to.
        return bool(getattr(self.target, "isatty", lambda: False)())


def bar_safe_console(target: TextIO | None = None) -> Console:
    """A rich Console printing above the open tqdm bars (to `target`, default stderr)."""
    return Console(file=BarSafeStream(target), soft_wrap=True, highlight=False)


def print_run_summary(console: Console, output_dir: str, summary: dict) -> None:
    """The end of `reinforge train`: the held-out table, start of RL against after RL, and the run directory."""
    start, final = summary["eval"]["start"], summary["eval"]["final"]
    table = Table(title=f"held-out evaluation ({start['num_prompts']} prompts, {start['num_samples']} samples each)")
    table.add_column("metric")
    table.add_column("start of RL", justify="right")
    table.add_column("after RL", justify="right")
    table.add_column("change", justify="right")
    rows = [
        ("pass@1", start["pass@1"], final["pass@1"]),
        ("greedy accuracy", start["greedy_accuracy"], final["greedy_accuracy"]),
    ]
    rows += [(f"pass@{k}", start["pass@k"][k], final["pass@k"][k]) for k in start["pass@k"] if k != "1"]
    # a mix: each domain's pass@1 over its share of the held-out prompts
    rows += [(f"pass@1 {d} ({n['num_prompts']})", n["pass@1"], final["domains"][d]["pass@1"])
             for d, n in start.get("domains", {}).items()]
    # eval.token_budgets: pass@1 when generation is cut at B new tokens (test-time scaling)
    budgets = final.get("pass_at_budget", {})
    rows += [(f"pass@1 within {b} tokens", v, budgets[b]) for b, v in start.get("pass_at_budget", {}).items()
             if b in budgets]
    for name, a, b in rows:
        table.add_row(name, f"{a:.3f}", f"{b:.3f}", f"{b - a:+.3f}")
    console.print(table)
    alone = summary["eval"].get("final_without_tools")
    if alone is not None:     # a run with tools: the same model with none to call
        console.print(f"after RL without tools: pass@1 {alone['pass@1']:.3f}, greedy accuracy "
                      f"{alone['greedy_accuracy']:.3f}")
    console.print(f"run directory: {output_dir}  ({summary['wall_seconds']:.0f} s)")
