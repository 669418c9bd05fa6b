"""The fused projection weights of `models.decoder.DecoderWeights`: q/k/v as one matrix in the rotary layout the
kernels read, gate/up as another.

Each is a copy of the model's own projections, made per call so that it sees the latest optimizer step. Within
one RL step the rollout engine and the learner call at the same weights; where the learner replays the engine's
record (models/replay.py), it takes the engine's copies instead of making its own (`fused_projection`'s `built`,
through `_Borrowed` for the gradient).
"""

from __future__ import annotations

import torch

Spare = dict[tuple[int, ...], list[torch.Tensor]]


def interleave_heads(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Reorder each head's output dimensions from HF's half-split rotary layout (i pairs with
    i + D/2) to adjacent pairs (2i, 2i + 1), so that rotary becomes one complex multiply.
    Queries and keys are reordered alike, so every attention score is unchanged."""
    d = weight.shape[0] // heads
    # Output row (h, 2i + half) is input row (h, half * D/2 + i): a transpose of the (half, i) grid, so a
    # copy whose backward is a copy too (an index with a permutation cost an index_put per call in the
    # backward: ~2% of a tiny model's RL step, as the learner builds these weights every forward).
    return weight.view(heads, 2, d // 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def deinterleave_heads(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of `interleave_heads`: adjacent rotary pairs back to HF's half-split layout."""
    d = weight.shape[0] // heads
    return weight.view(heads, d // 2, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def take_spare(spare: Spare | None, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor | None:
    """A tensor of `shape` and `like`'s dtype and device from `spare` (tensors no longer used, by shape), to be
    written into; None when there is none."""
    free = (spare or {}).get(shape)
    return free.pop() if free and (free[-1].dtype, free[-1].device) == (like.dtype, like.device) else None


def fused_projection(parts: list[torch.Tensor], heads: list[int | None], spare: Spare | None = None,
                     built: torch.Tensor | None = None) -> torch.Tensor:
    """torch.cat of `parts` (one fused projection's weight or bias), each part with `heads` given in the rotary
    layout (`interleave_heads`). Without a gradient it is written into a tensor of its shape from `spare` where one
    is free. `built`: this very tensor, made by an earlier call from the same parts at their current values
    without a gradient; it is returned instead of a new copy, and with grad enabled the parts' gradient flows
    through `_Borrowed`."""
    if built is not None:
        if torch.is_grad_enabled() and any(p.requires_grad for p in parts):
            return _Borrowed.apply(built, tuple(heads), *parts)
        return built
    parts = [p if h is None else interleave_heads(p, h) for p, h in zip(parts, heads, strict=True)]
    shape = (sum(part.shape[0] for part in parts), *parts[0].shape[1:])
    into = None if torch.is_grad_enabled() else take_spare(spare, shape, parts[0])
    return torch.cat(parts) if into is None else torch.cat(parts, out=into)


class _Borrowed(torch.autograd.Function):
    """A fused projection made already (`fused_projection`'s `built`), as the differentiable function of its parts
    it is: the forward hands the made tensor back (no copy), the backward splits the gradient by part and puts each
    interleaved part's rows back in the model's order. On the RL step's shapes this replaces the learner's copy of
    every layer's q/k/v and gate/up (and the autograd nodes of the concatenation and the interleave) with the
    engine's, made at the same weights for the same step."""

    @staticmethod
    def forward(ctx, built: torch.Tensor, heads: tuple[int | None, ...], *parts: torch.Tensor) -> torch.Tensor:
        ctx.heads, ctx.sizes = heads, [p.shape[0] for p in parts]
        return built.detach()   # a new tensor over the same memory: the lender's own keeps no autograd state

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        pieces = grad.split(ctx.sizes)
        parts = (p if h is None else deinterleave_heads(p, h) for p, h in zip(pieces, ctx.heads, strict=True))
        return None, None, *parts
