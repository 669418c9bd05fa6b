"""The one exception class for input a person can fix.

`UserError` (and its subclasses, ConfigError among them) is what the
command line turns into one line on stderr and exit status 2, with no
traceback. Raise it only where the message names the file, key or value at
fault and what to do; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class UserError(Exception):
    """Bad input the user can fix; the message (one line) names it and says how."""


class ConfigError(UserError, ValueError):
    """A configuration problem the user can fix; the message says how. (A ValueError too, for the
    callers that catch bad values as ValueError.)"""


class RunStopped(RuntimeError):
    """The run stopped itself (a guard); the message says why and where its last good checkpoint is."""


class RunInterrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM stopped the run, after saving what could be saved. The message is the one
    line to print: `stopped` (the step and what was saved), then the resume command for `run_dir`;
    `signum` the signal, whose 128 + signum the command line exits with (130 for Ctrl-C, 143 for
    SIGTERM). A KeyboardInterrupt, so that code catching Exception does not swallow it."""

    def __init__(self, stopped: str, run_dir: str, signum: int):
        super().__init__(f"{stopped}; resume with `reinforge train --resume {run_dir}`")
        self.stopped, self.run_dir, self.signum = stopped, run_dir, signum
