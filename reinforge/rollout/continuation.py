"""Multi-turn continuation passes: finished rows going on from their stored keys/values.

A row that ended its turn (`DecodeSession.extend_many`) keeps its ids and every layer's keys/values
(`RowContext`); with an observation appended, only the tokens past what is cached go through the
decoder, each attending to its own stored keys as a prefix (`run_pass`'s shared-prompt geometry with
one prefix slot per row, pos0 = pre_len = cached). Rows whose new tokens number alike share a pass;
which rows share one changes no number (each attends to its own keys only, and the fused kernels sum
every output in one fixed order, tests/unit/rollout/test_native_continuation.py).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from reinforge.models.decoder import DecoderWeights, run_pass
from reinforge.models.positions import pass_geometry
from reinforge.rollout.passes import DecodePasses
from reinforge.rollout.rows import PromptBlock, RowContext

Row = tuple[RowContext, list[int], Any]    # (its context, its whole sequence's ids, its new turn's tag)


def continue_rows(engine: DecodePasses, weights: DecoderWeights, freqs: torch.Tensor, rows: list[Row],
                  device: torch.device) -> tuple[list[PromptBlock], torch.Tensor]:
    """Each row's block of its whole sequence's keys/values [1, kv, len(ids), D] and the rows' next-token
    logits [B, V], in the order of `rows`. Rows share a pass when their new tokens number alike (within a
    power of two: a long reply, say a tool's error message, does not pad every other row to its length),
    up to the engine's prefill budget in positions."""
    new = [len(ids) - context.cached for context, ids, _ in rows]     # >= 1: the turn's last token is not cached
    size = [math.ceil(math.log2(n)) for n in new]
    passes: list[list[int]] = []
    longest = 0     # the current pass's longest sequence
    for i in sorted(range(len(rows)), key=lambda i: (size[i], new[i])):
        current = passes[-1] if passes else None
        width = max(longest, len(rows[i][1]))
        if current is not None and size[current[0]] == size[i] and (len(current) + 1) * width <= engine.prefill_tokens:
            current.append(i)
            longest = width
        else:
            passes.append([i])
            longest = len(rows[i][1])
    blocks: list[PromptBlock] = [None] * len(rows)     # type: ignore[list-item]  (each filled below)
    logits: list[torch.Tensor] = [None] * len(rows)    # type: ignore[list-item]
    for members in passes:
        pass_blocks, pass_logits = _continue_pass(engine, weights, freqs, [rows[i] for i in members], device)
        for n, i in enumerate(members):
            blocks[i], logits[i] = pass_blocks[n], pass_logits[n : n + 1]
    return blocks, torch.cat(logits)


def _continue_pass(engine: DecodePasses, weights: DecoderWeights, freqs: torch.Tensor, rows: list[Row],
                   d: torch.device) -> tuple[list[PromptBlock], torch.Tensor]:
    """One pass of `continue_rows` over `rows` on device `d`."""
    b = len(rows)
    cached = [context.cached for context, _, _ in rows]
    fresh = [ids[c:] for (_, ids, _), c in zip(rows, cached, strict=True)]
    width, span = max(len(f) for f in fresh), max(cached)
    pad = engine.policy.tokenizer.pad_token_id or 0
    new = torch.tensor([f + [pad] * (width - len(f)) for f in fresh], dtype=torch.long, device=d)
    # run_pass reads prefixes token-major, [P, Lp, kv, D]: each row its own slot, zero past its length
    # (never read: pre_len stops there)
    prefix = (_token_major([c.keys for c, _, _ in rows], cached, span),
              _token_major([c.values for c, _, _ in rows], cached, span))
    at = torch.tensor(cached, device=d)
    geometry = pass_geometry(freqs, width, at, torch.arange(b, device=d), at)
    hidden, k, v = run_pass(engine.shape, weights, new, geometry, freqs, prefix, fused=engine.kernels is not None,
                            use="engine")
    blocks = []
    for i, ((context, ids, _), n) in enumerate(zip(rows, (len(f) for f in fresh), strict=True)):
        # [1, kv, len(ids), D] per layer: the stored keys/values, then the new tokens'
        keys = [torch.cat([old[None], nk[i, :n].transpose(0, 1)[None]], dim=2)
                for old, nk in zip(context.keys, k, strict=True)]
        values = [torch.cat([old[None], nv[i, :n].transpose(0, 1)[None]], dim=2)
                  for old, nv in zip(context.values, v, strict=True)]
        blocks.append(PromptBlock([ids], keys, values))
    last = torch.tensor([len(f) - 1 for f in fresh], device=d)
    return blocks, engine.head_logits(weights, hidden[torch.arange(b, device=d), last])


def _token_major(stored: list[list[torch.Tensor]], lengths: list[int], span: int) -> list[torch.Tensor]:
    """Rows' stored keys (or values), each layer [kv, length, D], as one prefix per layer [rows, span, kv, D]."""
    out = []
    for layer in range(len(stored[0])):
        first = stored[0][layer]
        padded = first.new_zeros(len(stored), span, first.shape[0], first.shape[2])
        for i, row in enumerate(stored):
            padded[i, : lengths[i]] = row[layer].transpose(0, 1)
        out.append(padded)
    return out
