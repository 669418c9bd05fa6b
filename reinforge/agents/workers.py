"""The asynchronous loop's rollout worker for episodes (train.mode=async with tools or an environment).

It is the local sampler thread (reinforge/rollout/stream.py) with another way of decoding: each
batch of requested groups is played to its end by the agent rollout over the thread's own copy of
the weights, and new weights apply between batches. So an episode's turns all come from one version
(in flight episodes finish with the weights they started with, as train.in_flight=finish does);
each token still records its version, and staleness is counted from the model's tokens as for groups.
"""

from __future__ import annotations

import torch

from reinforge.agents.rollout import AgentEngine
from reinforge.rollout.base import select_rows
from reinforge.rollout.native import NativeEngine
from reinforge.rollout.stream import FinishedGroup, GroupRequest, LocalSampler, WorkerSettings


class AgentSampler(LocalSampler):
    """A sampler thread that plays episodes of `agent` (its engine replaced by the thread's own)."""

    def __init__(self, policy, agent: AgentEngine, settings: WorkerSettings):
        self.template = agent
        super().__init__(policy, settings.sampling, settings.group_size, slots=settings.slots, in_flight="finish",
                         chat_template=settings.chat_template, cpu_kernels=settings.cpu_kernels)

    def _decoder(self, engine: NativeEngine) -> None:
        engine.max_batch_rows = self.slots
        self.agent = self.template.over(engine)

    def _busy(self) -> bool:
        return False            # a batch of episodes is played within one `_work` call

    def _work(self, requests: list[GroupRequest]) -> list[FinishedGroup]:
        if not requests:
            return []
        g = self.group_size
        keys = torch.tensor([r.key for r in requests], dtype=torch.long)
        rollout = self.agent.generate([r.prompt for r in requests], g, self.params, self.version, group_keys=keys)
        out = []
        for i, request in enumerate(requests):
            rows = torch.arange(i * g, (i + 1) * g)
            part = select_rows(rollout, rows)
            versions = torch.zeros_like(part.completion_ids)
            for j, episode in enumerate(part.episodes):
                row = episode.result.trajectory.versions()
                versions[j, : len(row)] = row
            out.append(FinishedGroup(request.seq, part, versions))
        return out
