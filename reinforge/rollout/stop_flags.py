"""The stop flags of a decode step on their way to the host, for a session that decodes ahead of them
(rollout/session.py, `DecodeSession._step_ahead`): with decode graphs the host queues step k + 1
before it reads which rows step k ended, so it never waits for the step it just launched.

A step's flags are `generated * 2 + stopped` per live slot (int64: the row's tokens so far, and
whether its newest token is a stop token), computed on the device behind the step and, on CUDA,
copied into pinned host memory with an event to wait for; elsewhere (CPU tests of the same path)
copied at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class StopFlags:
    """One step's flags (`host`, int64, of the `live` slots of that step; on CUDA filled when `event`
    is done); `order`: the session's slots now, as indices into those (None: the same slots)."""

    host: torch.Tensor
    event: Any
    live: int
    order: torch.Tensor | None = None

    @property
    def slots(self) -> int:
        """The session's live slots these flags are of."""
        return self.live if self.order is None else len(self.order)

    @classmethod
    def send(cls, generated: torch.Tensor, last: torch.Tensor, eos: torch.Tensor, pinned: list[torch.Tensor],
             slots: int) -> StopFlags:
        """The flags of live rows with `generated` tokens [live] and newest tokens `last` [live], queued
        behind the work already on the device. `pinned`: two host buffers of `slots` entries, made here
        on first use and alternated (the other may still be read)."""
        live = len(generated)
        code = generated * 2 + torch.isin(last, eos)                  # [live] int64
        if code.device.type != "cuda":
            return cls(code.cpu(), None, live)
        if not pinned:
            pinned += [torch.empty(slots, dtype=torch.long, pin_memory=True) for _ in range(2)]
        pinned.reverse()
        host = pinned[0][:live]
        host.copy_(code, non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(code.device))          # the stream the copy is queued on
        return cls(host, event, live)

    def read(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens so far [slots] long, stopped [slots] bool) of the session's slots, once they are here."""
        if self.event is not None:
            self.event.synchronize()
        code = self.host[: self.live].clone()
        if self.order is not None:
            code = code[self.order]
        return code // 2, (code % 2).bool()

    def packed(self, done: torch.Tensor) -> StopFlags | None:
        """These flags after the session retired the slots `done` and packed the rows past them into the
        holes (`DecodeSession._retire` with no row waiting: the i-th hole takes the i-th kept row past the
        kept count); None when no row is left."""
        keep = torch.ones(self.live, dtype=torch.bool)
        keep[done] = False
        kept = int(keep.sum())
        if not kept:
            return None
        order = torch.arange(self.live)
        order[(~keep[:kept]).nonzero().squeeze(1)] = keep[kept:].nonzero().squeeze(1) + kept
        return StopFlags(self.host, self.event, self.live, order[:kept])
