"""Tool use as an environment: what `rollout.tools` plays when no `task.environment` is named.

A model turn with tool calls gets their results as the reply (role `tool`, one message per call;
a call the parser could not read gets an `Error: ...` message instead of running); a turn without
a call is the answer, which ends the episode and is scored by the run's reward functions, as a
single-turn completion is. So one rollout driver serves tools and environments alike.
"""

from __future__ import annotations

from typing import Any

from reinforge.agents.episode import Message
from reinforge.agents.tools import ToolBox, ToolStats
from reinforge.data.chat import Conversation


class ToolEnvironment:
    """One trajectory's tools: `box` (shared by the batch) and this trajectory's own counts."""

    def __init__(self, box: ToolBox, max_tool_calls: int):
        self.box, self.max_tool_calls = box, max_tool_calls
        self.stats = ToolStats()
        self.limit_hit = False     # the model asked for a call past max_tool_calls: the episode ended there

    def reset(self, row: dict[str, Any]) -> list[Message]:
        prompt = row["prompt"]
        return prompt.as_list() if isinstance(prompt, Conversation) else [{"role": "user", "content": str(prompt)}]

    def step(self, text: str) -> tuple[list[Message], float, bool]:
        turn = self.box.parse(text)
        self.stats.malformed += turn.malformed
        if not turn.calls and not turn.malformed:
            return [], 0.0, True                       # the answer
        room = self.max_tool_calls - self.stats.calls
        if room <= 0:
            self.limit_hit = True
            return [], 0.0, True
        reply = []
        for call in turn.calls[:room]:
            result = self.box.call(call)
            self.stats.record(result)
            reply.append(result.message())
        reply += [{"role": "tool", "name": "error", "content": f"Error: {error}"} for error in turn.errors]
        return reply, 0.0, False
