"""Verifier for integer answers (the arithmetic task).

Owns the exact acceptance rule for a bare-integer completion. It is strict on
purpose: RL optimises whatever the verifier accepts, so anything lenient here
(extra text, "46.0", "+46") becomes a behaviour the policy is rewarded for.
"""

from __future__ import annotations

import re

# ASCII digits only: `\d` would also match e.g. Arabic-Indic digits.
_INTEGER = re.compile(r"-?[0-9]+", re.ASCII)
# Longer strings are rejected before int(): avoids giant-int conversion cost.
MAX_INTEGER_CHARS = 20


def verify_integer(completion: str, gold: str) -> float:
    """1.0 iff `completion` is exactly the integer `gold`, else 0.0. Never raises.

    Surrounding whitespace is stripped. The rest must be a full match of
    `-?[0-9]+` of at most `MAX_INTEGER_CHARS` characters. The comparison is by
    integer value, so leading zeros ("0046") and "-0" are accepted: the value
    is what is being checked, not a canonical spelling. "+46", "46.0",
    "4 6" and "46abc" are rejected.
    """
    if not isinstance(completion, str) or not isinstance(gold, str):
        return 0.0
    text = completion.strip()
    if len(text) > MAX_INTEGER_CHARS or _INTEGER.fullmatch(text) is None:
        return 0.0
    gold_text = gold.strip()
    if len(gold_text) > MAX_INTEGER_CHARS or _INTEGER.fullmatch(gold_text) is None:
        return 0.0  # a malformed gold answer can never be matched
    return 1.0 if int(text) == int(gold_text) else 0.0
