"""A verifiers 0.4.0 environment for the tests (`task.agent=verifiers:vf-repeat-env`): a taskset of words to
repeat, scored by its rubric: 1.0 when the last reply is the word, plus 0.5 x (its length / 10)."""

from __future__ import annotations

import verifiers.v1 as vf

WORDS = ["cat", "dog", "sun", "tree", "bird", "fish", "moon", "star", "lake", "hill"]


class RepeatData(vf.TaskData):
    word: str


class RepeatTask(vf.Task[RepeatData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def repeated(self, trace: vf.Trace) -> float:
        return float(trace.last_reply == self.data.word)

    @vf.reward(weight=0.5)
    async def length(self, trace: vf.Trace) -> float:
        return len(trace.last_reply) / 10

    @vf.metric
    async def reply_chars(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply))


class RepeatTaskset(vf.Taskset[RepeatTask, vf.TasksetConfig]):
    def load(self):
        for word in WORDS:
            yield RepeatTask(RepeatData(prompt=f"Repeat: {word}", word=word), self.config.task)


__all__ = ["RepeatTaskset"]
