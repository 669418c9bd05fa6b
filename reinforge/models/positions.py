"""Where a pass's tokens sit: the rotary factors of their positions (`rotary_factors`), and a pass's
`PassGeometry` as the CPU kernels read it (`pass_geometry`) and as a boolean mask over its keys
(`allowed_keys`, for the PyTorch layers). Used by the decoder forward (models.decoder), the learner's
shared-prompt passes and the rollout engine's prefill, continuation and decoding."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from reinforge.kernels import PassGeometry
from reinforge.models.lora import base_model


def allowed_keys(geometry: PassGeometry, prefix_len: int, window: int | None = None) -> torch.Tensor:
    """`PassGeometry` as a boolean mask [B, S, prefix_len + S] over (prefix keys, own keys); with a
    sliding `window` (Mistral) a query sees only its own last `window` positions."""
    s = geometry.positions
    t = torch.arange(s, device=geometry.pos0.device)
    own = t[None, :] <= t[:, None]                                     # [S, S] causal
    if window is not None:
        own &= t[:, None] - t[None, :] < window
    own = own[None].expand(len(geometry.pos0), -1, -1)
    if geometry.slot is None:
        return own
    prefix = torch.arange(prefix_len, device=t.device)[None, None, :] < geometry.pre_len[:, None, None]
    return torch.cat([prefix.expand(-1, s, -1), own], dim=-1)


def pass_geometry(freqs: torch.Tensor, positions: int, pos0: torch.Tensor, slot: torch.Tensor | None = None,
                  pre_len: torch.Tensor | None = None) -> PassGeometry:
    """A `PassGeometry` of rows [B] (contiguous, as the kernels read them) with `freqs`' rotary table."""
    return PassGeometry(positions=positions, rot=torch.view_as_real(freqs).contiguous(), pos0=pos0.contiguous(),
                        slot=None if slot is None else slot.contiguous(),
                        pre_len=None if pre_len is None else pre_len.contiguous())


def rotary_factors(model: PreTrainedModel, head_dim: int, length: int) -> torch.Tensor:
    """Complex rotary factors of positions 0..length-1, [length, D/2], from the model's own rotary
    module (so rope scaling variants and attention scaling carry over)."""
    model = base_model(model)
    probe = torch.zeros(1, dtype=model.dtype, device=model.device)
    cos, sin = (t[0].float() for t in model.model.rotary_emb(probe, torch.arange(length, device=model.device)[None]))
    half = head_dim // 2
    return torch.complex(cos[:, :half], sin[:, :half])     # HF repeats each frequency twice along D
