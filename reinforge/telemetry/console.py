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
