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
