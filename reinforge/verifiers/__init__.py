"""Verifiers: functions from a completion (and gold data) to a score, below tasks and rewards.

Tasks call them to check their own examples; `reinforge.rewards` composes them with learned and
shaped rewards. The light ones are here; the heavier ones live in their own modules, imported on
use: `reinforge.verifiers.math.verify` (math-verify based, bounded in time from any thread, in
worker processes of `bounded.BoundedPool`) and `reinforge.verifiers.code.run_tests` (model-written
code in the sandbox of `verifiers/sandbox/`, with the kernel layers of `sandbox_layers`).
"""

from reinforge.verifiers.arithmetic import verify_integer
from reinforge.verifiers.countdown import verify_countdown

__all__ = ["verify_countdown", "verify_integer"]
