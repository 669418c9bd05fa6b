"""The decoder layer's pointwise work through `torch.compile` (train.compile): fewer, fused kernels.

On a GPU the learner's own decoder forward (`models.decoder.decoder_layers`) launches one kernel per
small op of every layer (RMSNorm, rotary, SwiGLU, residual adds, dtype copies) and as many again in the
backward: at a 0.5B model most of an update's time is launches, not arithmetic. Here each layer runs as
two compiled functions around the attention, which stays eager (it owns the keys and values):

- `attention_inputs`: input RMSNorm, the fused q/k/v projection, Qwen3's per-head q/k norms, rotary;
- `layer_rest`: output projection and residual, post-attention RMSNorm, gate/up, SwiGLU, down and residual.

Both are compiled once per attention shape (`layer_steps`), with dynamic shapes so that batches of other
rows and lengths reuse the compiled code. Rotary runs on (cos, sin) pairs in real arithmetic (the same
products as `decoder._rope`'s complex multiply; inductor generates no code for complex tensors). The
numbers are the eager layer's within the model dtype's rounding (tests/e2e/test_device_paths.py,
tests/unit/models/test_compiled_layers.py). If compiling raises, the layers run eagerly from then on,
with one logged warning.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)
# Whether the compiled layers are still used in this process (off after compiling failed once).
_COMPILED = {"on": True}


def rope_real(x: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
    """Rotary of x [B, S, H, D] with adjacent (real, imaginary) pairs, rot [B, S, 1, D/2, 2] the (cos, sin)
    of each pair: (a cos - b sin, a sin + b cos) in fp32, back in x's dtype (`decoder._rope` without complex)."""
    pairs = x.float().unflatten(-1, (-1, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    cos, sin = rot[..., 0], rot[..., 1]
    return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2).to(x.dtype)


class LayerSteps:
    """One attention shape's two halves of a SwiGLU decoder layer (see the module docstring), compiled;
    each half runs its own function eagerly once compiling has failed."""

    def __init__(self, heads: int, kv_heads: int, head_dim: int, eps: float):
        def attention_inputs(x, norm, qkv_weight, qkv_bias, q_norm, k_norm, rot):
            """x [B S, E], rot [B, S, 1, D/2, 2] -> rotated q [B, S, H, D], k [B, S, kv, D], v [B, S, kv, D]."""
            b, s = rot.shape[0], rot.shape[1]
            h = F.rms_norm(x, (x.shape[-1],), norm, eps)
            qkv = F.linear(h, qkv_weight, qkv_bias).view(b, s, heads + 2 * kv_heads, head_dim)
            q, k = qkv[:, :, :heads], qkv[:, :, heads : heads + kv_heads]
            if q_norm is not None:      # Qwen3: RMSNorm of each head's queries and keys before rotary
                q = F.rms_norm(q, (head_dim,), q_norm, eps)
                k = F.rms_norm(k, (head_dim,), k_norm, eps)
            return rope_real(q, rot), rope_real(k, rot), qkv[:, :, heads + kv_heads :]

        def layer_rest(x, out, o, o_bias, post_norm, gate_up, down):
            """x [B S, E] and the attention's output [B S, H D] -> the layer's output [B S, E]."""
            x = torch.addmm(x, out, o.t()) if o_bias is None else x + F.linear(out, o, o_bias)
            gate, up = F.linear(F.rms_norm(x, (x.shape[-1],), post_norm, eps), gate_up).chunk(2, dim=-1)
            return torch.addmm(x, F.silu(gate) * up, down.t())

        self._eager = (attention_inputs, layer_rest)
        # dynamic: rows and positions vary from pass to pass; the shape above is a constant of the code
        self._compiled = tuple(torch.compile(fn, dynamic=True) for fn in self._eager)

    def attention_inputs(self, *args) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return _run(0, self, args)

    def layer_rest(self, *args) -> torch.Tensor:
        return _run(1, self, args)


def _run(half: int, steps: LayerSteps, args: tuple):
    """The compiled half, or its eager function from now on when compiling raises (one logged warning)."""
    if _COMPILED["on"]:
        try:
            return steps._compiled[half](*args)
        except Exception as err:    # noqa: BLE001 - any compiler failure: the eager function computes the same
            _COMPILED["on"] = False
            log.warning("train.compile: compiling the decoder layers failed (%s: %s); running them eagerly",
                        type(err).__name__, str(err)[:300])
    return steps._eager[half](*args)


_STEPS: dict[tuple[int, int, int, float], LayerSteps] = {}


def layer_steps(heads: int, kv_heads: int, head_dim: int, eps: float) -> LayerSteps:
    """The compiled halves for this attention shape and RMSNorm epsilon, built once per process."""
    key = (heads, kv_heads, head_dim, eps)
    if key not in _STEPS:
        # Every shape's functions share one code object, whose compiled versions (each shape, dtype, and
        # rows or positions of 1, which dynamic shapes specialise) count against dynamo's limit of 8; past
        # it dynamo runs the function eagerly without a word. A process rarely needs more than a few.
        config = torch._dynamo.config
        name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
        setattr(config, name, max(getattr(config, name), 64))
        _STEPS[key] = LayerSteps(*key)
    return _STEPS[key]


def compiled_layers_on() -> bool:
    """Whether compiled layers are still in use (False once compiling failed in this process)."""
    return _COMPILED["on"]
