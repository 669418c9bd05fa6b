"""A reward function that interrupts its own run: on the Nth call with a whole step's batch it sends the
process the signal named in INTERRUPT_AT ("SIGINT 7 16": SIGINT during step 7, whose batch has 16
samples; "SIGINT 8 16 2": two of them, the second stopping at once). Used by tests/e2e/test_lifecycle.py,
in-process and in a subprocess; `reset()` starts the count over."""

from __future__ import annotations

import os
import signal

_CALLS = [0]


def reset() -> None:
    _CALLS[0] = 0


def interrupting_length(completions, **kwargs):
    """TRL style: the completion's length in characters (it varies, so RL has advantages to train on)."""
    name, step, batch, *times = os.environ.get("INTERRUPT_AT", "none 0 0").split()
    if len(completions) == int(batch):      # a step's batch (not a probe of a few rows)
        _CALLS[0] += 1
        if _CALLS[0] == int(step):
            for _ in range(int(times[0]) if times else 1):
                os.kill(os.getpid(), signal.Signals[name])
    return [float(len(c if isinstance(c, str) else c[0]["content"])) for c in completions]
