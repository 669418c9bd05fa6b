"""A verifiers 0.4.0 environment whose rubric raises: its episodes fail, each with verifiers' reason."""

from __future__ import annotations

import verifiers.v1 as vf


class BrokenTask(vf.Task[vf.TaskData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def needs_a_field(self, trace: vf.Trace) -> float:
        return float(trace.info["answer"])


class BrokenTaskset(vf.Taskset[BrokenTask, vf.TasksetConfig]):
    def load(self):
        yield BrokenTask(vf.TaskData(prompt="Say anything"), self.config.task)


__all__ = ["BrokenTaskset"]
