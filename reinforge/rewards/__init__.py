"""Verifiers: pure functions from a completion (and gold data) to a 0/1 reward.

The heavier verifiers live in their own modules, imported on use:
`reinforge.rewards.math.verify` (math-verify based, safe off the main thread)
and `reinforge.rewards.code.run_tests` (a sandboxed test runner).
"""

from reinforge.rewards.arithmetic import verify_integer
from reinforge.rewards.countdown import verify_countdown

__all__ = ["verify_countdown", "verify_integer"]
