"""Attention of the native forward (engine and learner): grouped-query attention with an additive mask.

On a CPU as plain matmuls; on a GPU through SDPA's fused kernels, with the two layouts that keep them
(a decode step's query heads grouped by key/value head; other passes with keys and values expanded to
every head), each turning itself off with a logged reason if SDPA refuses it.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

# Whether `attention` may run a decode step's grouped queries through plain SDPA (off after it failed once).
_GROUPED_DECODE = {"on": True}
# Whether `attention` may expand a pass's keys and values to every query head for SDPA (off after it failed once).
_EXPAND_KV = {"on": True}


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean attention mask as the additive one `attention` takes: 0 where allowed, -inf elsewhere.
    Built once per forward and shared by every layer."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, keys_last: bool = False
) -> torch.Tensor:
    """softmax(q k^T / sqrt(D) + bias) v, [B, H, S, D], for q [B, H, S, D], k and v [B, kv, L, D]
    (grouped-query attention: head h reads key/value head h // (H / kv), HF's repeat_kv order) and
    an additive bias broadcastable to [B, 1, S, L]. `keys_last`: k is given transposed, [B, kv, D, L].

    On CPU as plain matmuls: for the short rows of RL rollouts and learner passes they ran 1.3-3x
    faster than SDPA's CPU kernel (forward and backward); elsewhere SDPA's fused kernels (a decode
    step's query heads grouped by key/value head, `grouped_decode_attention`; other passes with the
    keys and values expanded to every head, as SDPA's fused kernels take no mask with its GQA option).
    """
    b, h, s, d = q.shape
    kv = k.shape[1]
    kt = k if keys_last else k.transpose(-1, -2)
    if q.device.type != "cpu":
        if s == 1 and kv != h and bias.shape[1] == 1 and bias.shape[2] == 1 and _GROUPED_DECODE["on"]:
            try:
                return grouped_decode_attention(q, kt.transpose(-1, -2), v, bias)
            except RuntimeError as err:
                _GROUPED_DECODE["on"] = False
                log.warning("decode attention: SDPA refused the grouped queries (%s: %s); using its GQA option",
                            type(err).__name__, str(err)[:200])
        if kv != h and _EXPAND_KV["on"]:
            # SDPA's GQA option with a mask runs its math fallback (fp32 scores [B, H, S, L], kept for the
            # backward); keys and values expanded to every head (HF's repeat_kv) keep the fused kernels.
            try:
                return expanded_attention(q, kt.transpose(-1, -2), v, bias)
            except RuntimeError as err:
                _EXPAND_KV["on"] = False
                log.warning("attention: SDPA refused the expanded keys and values (%s: %s); using its GQA option",
                            type(err).__name__, str(err)[:200])
        return F.scaled_dot_product_attention(q, kt.transpose(-1, -2), v, attn_mask=bias, enable_gqa=kv != h)
    q = q.reshape(b, kv, h // kv, s, d)                    # the query heads that share a key/value head
    scores = torch.matmul(q, kt.unsqueeze(2)).mul_(d ** -0.5).add_(bias.unsqueeze(2))
    return torch.matmul(scores.softmax(dim=-1), v.unsqueeze(2)).reshape(b, h, s, d)


def grouped_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """`attention` of one query position per row (a decode step) through SDPA without its GQA option: q
    [B, H, 1, D], k and v [B, kv, L, D], bias [B, 1, 1, L]. The H / kv query heads that share a key/value
    head (consecutive heads, HF's repeat_kv order) are that head's queries, [B, kv, H / kv, D], all seeing
    the row's allowed keys: the same attention, without expanding the keys and values to H heads (which
    SDPA's GQA option can do, in its math fallback, at every layer of every step)."""
    b, h, _, d = q.shape
    kv = k.shape[1]
    out = F.scaled_dot_product_attention(q.reshape(b, kv, h // kv, d), k, v, attn_mask=bias)   # [B, kv, H/kv, D]
    return out.reshape(b, h, 1, d)


def expanded_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """`attention` through SDPA with keys and values k, v [B, kv, L, D] expanded to q's H heads (head h reads
    key/value head h // (H / kv), HF's repeat_kv) and the additive bias broadcastable to [B, 1, S, L]."""
    group = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1),
                                          attn_mask=bias)
