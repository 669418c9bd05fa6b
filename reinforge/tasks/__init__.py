"""Tasks: problem generators with verifiable rewards, and their registry."""

from __future__ import annotations

import difflib

from reinforge.tasks.arithmetic import ArithmeticTask
from reinforge.tasks.base import TASKS, Example, SFTExample, Task
from reinforge.tasks.chain_sum import ChainSumTask
from reinforge.tasks.countdown import CountdownTask
from reinforge.tasks.dataset import DatasetTask
from reinforge.tasks.mix import MixTask
from reinforge.tasks.multiply_tool import MultiplyToolTask
from reinforge.tasks.reasoning_gym import ReasoningGymTask
from reinforge.tasks.verifiers_taskset import VerifiersTasksetTask

TASKS.update({
    ArithmeticTask.name: ArithmeticTask,
    ChainSumTask.name: ChainSumTask,
    CountdownTask.name: CountdownTask,
    DatasetTask.name: DatasetTask,
    MultiplyToolTask.name: MultiplyToolTask,
    MixTask.name: MixTask,
    ReasoningGymTask.name: ReasoningGymTask,
    VerifiersTasksetTask.name: VerifiersTasksetTask,
})


def build_task(name: str, **options: object) -> Task:
    """Instantiate the registered task `name` with its constructor `options`."""
    if name not in TASKS:
        valid = ", ".join(sorted(TASKS))
        close = difflib.get_close_matches(name, TASKS, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ";"
        raise ValueError(f"unknown task {name!r}{hint} valid: {valid}")
    return TASKS[name](**options)


__all__ = ["TASKS", "Example", "SFTExample", "Task", "build_task"]
