"""The torch.distributed form of objectives.aggregation.BatchReduce.

Data-parallel learner ranks each hold some rows of an optimizer batch. The
aggregation's batch-wide counts (tokens, sequences, tokens per prompt) must
be those of the whole batch, or the gradient would depend on the number of
ranks (ALGORITHMS.md, "Aggregation"); these collectives provide them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor


class DistributedReduce:
    """all_reduce / all_gather over a process group (the default group when None)."""

    def __init__(self, group: dist.ProcessGroup | None = None):
        self.group = group

    def sum(self, values: Tensor) -> Tensor:
        out = values.detach().clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=self.group)
        return out

    def cat(self, values: Tensor) -> Tensor:
        # all_gather needs equal shapes: gather the row counts, pad to the largest, trim after.
        world = dist.get_world_size(self.group)
        count = torch.tensor([values.shape[0]], dtype=torch.long)
        counts = [torch.zeros_like(count) for _ in range(world)]
        dist.all_gather(counts, count, group=self.group)
        largest = int(max(c.item() for c in counts))
        padded = values.new_zeros((largest, *values.shape[1:]))
        padded[: values.shape[0]] = values.detach()
        chunks = [torch.empty_like(padded) for _ in range(world)]
        dist.all_gather(chunks, padded, group=self.group)
        return torch.cat([chunk[: int(c.item())] for chunk, c in zip(chunks, counts, strict=True)])
