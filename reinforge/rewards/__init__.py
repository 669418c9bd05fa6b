"""Verifiers: pure functions from a completion (and gold data) to a 0/1 reward."""

from reinforge.rewards.arithmetic import verify_integer
from reinforge.rewards.countdown import verify_countdown

__all__ = ["verify_countdown", "verify_integer"]
