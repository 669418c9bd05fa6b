"""The native rollout engine: KV-cache decoding with continuous batching for
Llama-family decoders (Llama, Qwen2, Qwen3, Mistral).

Why not `generate`: per decoding step it pays for generality (cache objects,
mask builders, logits processors, stopping criteria) and keeps finished rows
in the batch until the last one ends. On small models and CPUs that overhead
is most of the rollout time, and in RL the completion lengths of one batch
are long-tailed. This engine

- runs the decoder's own modules (norms, projections, MLPs, rotary table), so
  it shares the training weights: an optimizer step is visible at the next
  call with no weight sync, and numerics match the learner's forward (a LoRA
  projection runs as W + (alpha / r) B A, `models.lora.linear_weight`);
- prefills each prompt once, however many samples it has (the G samples of a
  prompt copy its keys/values into their own cache slots);
- keeps a key/value cache per layer (doubled as rows grow, its memory kept between calls) and
  decodes only the live rows: a finished row's slot is refilled with a
  waiting row (continuous batching) or, when none waits, the live rows are
  packed to the front so the batch shrinks;
- samples with temperature / top-k / top-p, recording the log-prob of each
  token under the distribution it was drawn from (after temperature and
  filtering), which the TIS / MIS corrections need;
- draws each sample's uniforms from a counter-based stream keyed by its
  prompt (`keyed_uniforms`), so a prompt's samples do not depend on the rest
  of the batch, slot moves, the device or how learner ranks split a batch.

Greedy decoding gives the tokens `generate` gives; sampler log-probs equal
the learner's recomputed log-probs (fp32) within 1e-4 (tests/test_native_engine.py).
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from reinforge import kernels
from reinforge.errors import ConfigError
from reinforge.kernels import HEAD_DIMS, PassGeometry, load_cpu_kernels, rms_norm, swiglu
from reinforge.models import Policy
from reinforge.models.lora import base_model, linear_weight
from reinforge.models.model_dir import LLAMA_FAMILY, STATIC_ROPE_TYPES
from reinforge.rollout.base import Rollout, SamplingParams
from reinforge.rollout.prompts import encode_prompts
from reinforge.rollout.stopping import stop_string_end

SUPPORTED_MODEL_TYPES = LLAMA_FAMILY     # one list, readable without torch at config check (models/model_dir.py)


@dataclass(frozen=True)
class DecoderShape:
    """What the engine needs to know about the decoder's attention."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    sliding_window: int | None   # None: full attention


def check_native_model_type(model_dir: Path, feature: str = "rollout.engine=native", way_out: str = "rollout.engine=hf") -> None:
    """Refuse, before a run starts, a model directory whose architecture the native decoder does not run."""
    model_type = json.loads((model_dir / "config.json").read_text()).get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            f"{feature} supports {', '.join(SUPPORTED_MODEL_TYPES)} decoders, and {model_dir} is "
            f"'{model_type}': use {way_out}"
        )


def decoder_shape(model: PreTrainedModel) -> DecoderShape:
    """The attention shape of a supported decoder; NotImplementedError names what is not supported."""
    model = base_model(model)
    config = model.config
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise NotImplementedError(
            f"the native rollout engine supports {', '.join(SUPPORTED_MODEL_TYPES)} decoders, not "
            f"'{config.model_type}'; use rollout.engine=hf"
        )
    rope_type = getattr(model.model.rotary_emb, "rope_type", "default")
    if rope_type not in STATIC_ROPE_TYPES:
        raise NotImplementedError(f"the native rollout engine does not support rope_type '{rope_type}'; use rollout.engine=hf")
    if getattr(config, "final_logit_softcapping", None) is not None:
        raise NotImplementedError("the native rollout engine does not support logit soft-capping; use rollout.engine=hf")
    window = getattr(config, "sliding_window", None)
    if config.model_type in ("qwen2", "qwen3") and not getattr(config, "use_sliding_window", False):
        window = None
    if config.model_type in ("qwen2", "qwen3") and window is not None:
        # Qwen applies the window only to some layers (max_window_layers); not modelled here.
        raise NotImplementedError("the native rollout engine does not support Qwen's sliding-window layers; use rollout.engine=hf")
    num_heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    return DecoderShape(num_heads, getattr(config, "num_key_value_heads", None) or num_heads, head_dim, window)


def _interleave_heads(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Reorder each head's output dimensions from HF's half-split rotary layout (i pairs with
    i + D/2) to adjacent pairs (2i, 2i + 1), so that rotary becomes one complex multiply.
    Queries and keys are reordered alike, so every attention score is unchanged."""
    d = weight.shape[0] // heads
    order = torch.arange(d, device=weight.device).view(2, d // 2).t().reshape(-1)   # 0, D/2, 1, D/2 + 1, ...
    return weight.view(heads, d, *weight.shape[1:])[:, order].reshape(weight.shape)


def _rope(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding (RoFormer, arXiv 2104.09864) of x [..., D] with adjacent
    (real, imaginary) pairs: each pair times exp(i theta), freqs the complex [..., D/2] factors."""
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(pairs * freqs).flatten(-2).to(x.dtype)


@dataclass
class PackedProjections:
    """One layer's projection weights as the CPU kernels read them: 32-column panels (csrc/gemm.h, `pack_weight`)."""

    qkv: torch.Tensor
    o: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


@dataclass
class LayerWeights:
    """One decoder layer's weights, with q/k/v and gate/up fused into single matmuls."""

    input_norm: torch.Tensor
    qkv: torch.Tensor                   # [(H + 2 kv) D, E]
    qkv_bias: torch.Tensor | None       # Qwen2 has q/k/v biases
    q_norm: torch.Tensor | None         # Qwen3's per-head query/key RMSNorm
    k_norm: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up: torch.Tensor               # [2 I, E]
    down: torch.Tensor
    act: Callable[[torch.Tensor], torch.Tensor] | None   # None: SiLU (SwiGLU; fused on CPU, kernels.swiglu)


@dataclass
class DecoderWeights:
    """The decoder's weights for one `generate` call (or one learner forward).

    Built per call from the live model, so it always reflects the latest
    optimizer step. Fusing costs one copy of the layer weights while the call
    runs; it halves the matmul launches, which dominate decoding small models.
    On CPU the kernels add a packed copy (`packed`), and the learner's backward
    a second one.
    """

    embed: torch.Tensor
    layers: list[LayerWeights]
    final_norm: torch.Tensor
    head: torch.Tensor                  # [V, E] fp32: the learner's head precision (learner.logprobs, fp32_head)
    eps: float
    _packed: dict[bool, list[PackedProjections]] = field(default_factory=dict)

    def packed(self, ops, transposed: bool = False) -> list[PackedProjections]:
        """Each layer's projections packed for the CPU kernels (`ops.pack_weight`: 32-column panels),
        made on first use and kept with these weights: for products with w^T (the forward), or with
        `transposed` with w (the backward's input gradients). Snapshots: no gradient flows through them."""
        if transposed not in self._packed:
            self._packed[transposed] = [
                PackedProjections(*(ops.pack_weight(t.detach(), transposed) for t in (lw.qkv, lw.o, lw.gate_up, lw.down)))
                for lw in self.layers]
        return self._packed[transposed]

    @classmethod
    def of(cls, model: PreTrainedModel) -> DecoderWeights:
        """The weights of `model`, or of the decoder under a peft PeftModel: a LoRA projection
        contributes W + (alpha / r) B A (`models.lora.linear_weight`; W alone while its adapters are
        disabled), differentiable in A and B, so the learner's shared-prompt forward trains them."""
        def plain(module: torch.nn.Module, name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
            # (weight, bias) of a Linear or LoRA Linear; any other wrapper computes more than a weight.
            try:
                return linear_weight(module)
            except NotImplementedError as err:
                raise NotImplementedError(f"the native rollout engine cannot run {name}: {err}; use rollout.engine=hf") from None

        def bias(*projections: tuple[torch.Tensor, torch.Tensor | None]) -> torch.Tensor | None:
            if all(b is None for _, b in projections):
                return None
            return torch.cat([b if b is not None else w.new_zeros(w.shape[0]) for w, b in projections])

        model = base_model(model)
        embedding = model.get_input_embeddings()
        if type(embedding) is not torch.nn.Embedding:   # e.g. LoRA on the embedding: its .weight is not what it computes
            raise NotImplementedError(f"the native rollout engine needs a plain embedding, found {type(embedding).__name__}; "
                                      "use rollout.engine=hf")
        layers = []
        silu = getattr(model.config, "hidden_act", None) in ("silu", "swish")
        heads = model.config.num_attention_heads
        kv_heads = getattr(model.config, "num_key_value_heads", None) or heads
        for i, layer in enumerate(model.model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            qkv = [plain(getattr(attn, n), f"layer {i} {n}") for n in ("q_proj", "k_proj", "v_proj")]
            (q, _), (k, _), (v, _) = qkv
            (gate, gate_b), (up, up_b), (down, down_b) = (plain(getattr(mlp, n), f"layer {i} {n}")
                                                          for n in ("gate_proj", "up_proj", "down_proj"))
            if gate_b is not None or up_b is not None or down_b is not None:
                raise NotImplementedError("the native rollout engine does not support MLP biases; use rollout.engine=hf")
            o, o_bias = plain(attn.o_proj, f"layer {i} o_proj")
            fused_bias = bias(*qkv)
            if fused_bias is not None:
                q_out, k_out = q.shape[0], k.shape[0]
                fused_bias = torch.cat([_interleave_heads(fused_bias[:q_out], heads),
                                        _interleave_heads(fused_bias[q_out : q_out + k_out], kv_heads),
                                        fused_bias[q_out + k_out :]])
            layers.append(LayerWeights(
                input_norm=layer.input_layernorm.weight,
                qkv=torch.cat([_interleave_heads(q, heads), _interleave_heads(k, kv_heads), v]),
                qkv_bias=fused_bias,
                q_norm=_interleave_heads(attn.q_norm.weight, 1) if hasattr(attn, "q_norm") else None,
                k_norm=_interleave_heads(attn.k_norm.weight, 1) if hasattr(attn, "k_norm") else None,
                o=o,
                o_bias=o_bias,
                post_norm=layer.post_attention_layernorm.weight,
                gate_up=torch.cat([gate, up]),
                down=down,
                act=None if silu else mlp.act_fn,
            ))
        head, head_bias = plain(model.get_output_embeddings(), "the LM head")
        if head_bias is not None:
            raise NotImplementedError("the native rollout engine assumes an LM head without bias; use rollout.engine=hf")
        return cls(
            embed=embedding.weight,
            layers=layers,
            final_norm=model.model.norm.weight,
            head=head.float(),
            eps=model.config.rms_norm_eps,
        )


def decoder_layers(shape: DecoderShape, w: DecoderWeights, hidden: torch.Tensor, freqs: torch.Tensor, attend) -> torch.Tensor:
    """Run every decoder layer on hidden [B, S, E] and the final norm; differentiable when `w` is.

    `freqs`: complex rotary factors broadcastable to [B, S, 1, D/2]. `attend(layer, q [B, S, H, D],
    k [B, S, kv, D], v [B, S, kv, D]) -> [B, S, H * D]` is the attention, which owns the keys and
    values (a cache, a shared prompt); q and k are already rotated, in the interleaved layout.
    """
    (b, s, e), heads, kv = hidden.shape, shape.num_heads, shape.num_kv_heads
    # Tokens as rows [B S, E]: each residual add rides on its projection's GEMM (addmm), one pass
    # over the activations fewer per projection.
    # RMSNorm and SwiGLU go through `reinforge.kernels`: one fused kernel each way on CPU in fp32.
    x = hidden.reshape(b * s, e)
    for index, lw in enumerate(w.layers):
        h = rms_norm(x, lw.input_norm, w.eps)
        qkv = F.linear(h, lw.qkv, lw.qkv_bias).view(b, s, heads + 2 * kv, shape.head_dim)
        if lw.q_norm is None:
            qk = _rope(qkv[:, :, : heads + kv], freqs)      # queries and keys rotated together
            q, k = qk[:, :, :heads], qk[:, :, heads:]
        else:   # Qwen3: RMSNorm of each head's queries and keys before rotary
            q = _rope(F.rms_norm(qkv[:, :, :heads], (shape.head_dim,), lw.q_norm, w.eps), freqs)
            k = _rope(F.rms_norm(qkv[:, :, heads : heads + kv], (shape.head_dim,), lw.k_norm, w.eps), freqs)
        out = attend(index, q, k, qkv[:, :, heads + kv :]).reshape(b * s, -1)
        x = torch.addmm(x, out, lw.o.t()) if lw.o_bias is None else x + F.linear(out, lw.o, lw.o_bias)
        gate_up = F.linear(rms_norm(x, lw.post_norm, w.eps), lw.gate_up)
        x = torch.addmm(x, swiglu(gate_up, lw.act), lw.down.t())
    return rms_norm(x, w.final_norm, w.eps).view(b, s, e)


def run_pass(shape: DecoderShape, w: DecoderWeights, ids: torch.Tensor, geometry: PassGeometry, freqs: torch.Tensor,
             prefix: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None, padding_idx: int | None = None,
             fused: bool = True) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """The decoder on tokens ids [B, S] attending as `geometry` says (a prompt, whole rows, or
    completions after a shared prompt): (hidden states [B, S, E] after the final norm, every layer's
    rotated keys and values [B, S, kv, D]). `prefix`: every layer's keys and values [P, Lp, kv, D]
    of another pass, which `geometry.slot` indexes. `freqs`: the rotary factors of `rotary_factors`.

    On CPU in fp32 each layer is one fused op each way (`kernels.train_layer`) when `fused`, the
    kernels build and the layer is a plain SwiGLU one; otherwise `decoder_layers` with the geometry
    as an additive mask: the same numbers within float rounding (tests/test_shared_prefix.py).
    Sliding windows are applied on the second path only (the shared-prompt learner refuses them)."""
    b, s = ids.shape
    hidden = F.embedding(ids, w.embed, padding_idx)
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    if fused and shape.sliding_window is None and all(kernels.fused_layer_ok(lw, shape.head_dim, hidden) for lw in w.layers):
        x = hidden.reshape(b * s, -1)
        ops = load_cpu_kernels()
        packed = zip(w.packed(ops), w.packed(ops, transposed=True) if torch.is_grad_enabled() else [None] * len(w.layers), strict=True)
        for index, (lw, packs) in enumerate(zip(w.layers, packed, strict=True)):
            layer_prefix = (prefix[0][index], prefix[1][index]) if prefix is not None else None
            x, k, v = kernels.train_layer(x, lw, packs, geometry, layer_prefix, shape.num_heads, shape.num_kv_heads, w.eps)
            keys.append(k)
            values.append(v)
        return rms_norm(x, w.final_norm, w.eps).view(b, s, -1), keys, values
    prefix_len = prefix[0][0].shape[1] if prefix is not None else 0
    bias = additive_mask(allowed_keys(geometry, prefix_len, shape.sliding_window)[:, None], w.embed.dtype)  # [B, 1, S, Lp + S]

    def attend(layer: int, q, k, v):
        keys.append(k)
        values.append(v)
        if prefix is not None:
            k = torch.cat([prefix[0][layer][geometry.slot], k], dim=1)    # [B, Lp + S, kv, D]
            v = torch.cat([prefix[1][layer][geometry.slot], v], dim=1)
        out = attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), bias)   # [B, heads, S, D]
        return out.transpose(1, 2).flatten(2)

    at = geometry.pos0[:, None] + torch.arange(s, device=ids.device)[None, :]    # [B, S] rotary positions
    return decoder_layers(shape, w, hidden, freqs[at][:, :, None, :], attend), keys, values


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


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean attention mask as the additive one `attention` takes: 0 where allowed, -inf elsewhere.
    Built once per forward and shared by every layer."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, keys_last: bool = False) -> torch.Tensor:
    """softmax(q k^T / sqrt(D) + bias) v, [B, H, S, D], for q [B, H, S, D], k and v [B, kv, L, D]
    (grouped-query attention: head h reads key/value head h // (H / kv), HF's repeat_kv order) and
    an additive bias broadcastable to [B, 1, S, L]. `keys_last`: k is given transposed, [B, kv, D, L].

    On CPU as plain matmuls: for the short rows of RL rollouts and learner passes they ran 1.3-3x
    faster than SDPA's CPU kernel (forward and backward); elsewhere SDPA's fused kernels.
    """
    b, h, s, d = q.shape
    kv = k.shape[1]
    kt = k if keys_last else k.transpose(-1, -2)
    if q.device.type != "cpu":
        return F.scaled_dot_product_attention(q, kt.transpose(-1, -2), v, attn_mask=bias, enable_gqa=kv != h)
    q = q.reshape(b, kv, h // kv, s, d)                    # the query heads that share a key/value head
    scores = torch.matmul(q, kt.unsqueeze(2)).mul_(d ** -0.5).add_(bias.unsqueeze(2))
    return torch.matmul(scores.softmax(dim=-1), v.unsqueeze(2)).reshape(b, h, s, d)


def rotary_factors(model: PreTrainedModel, shape: DecoderShape, length: int) -> torch.Tensor:
    """Complex rotary factors of positions 0..length-1, [length, D/2], from the model's own rotary
    module (so rope scaling variants and attention scaling carry over)."""
    model = base_model(model)
    probe = torch.zeros(1, dtype=model.dtype, device=model.device)
    cos, sin = (t[0].float() for t in model.model.rotary_emb(probe, torch.arange(length, device=model.device)[None]))
    half = shape.head_dim // 2
    return torch.complex(cos[:, :half], sin[:, :half])     # HF repeats each frequency twice along D


def _buffer(size: tuple[int, ...], dtype: torch.dtype, device, spare: torch.Tensor | None) -> torch.Tensor:
    """A tensor of `size` on the memory of `spare` when it is large enough and alike, else zeros.
    Reused entries keep old keys/values: finite, which is all masked positions need."""
    numel = torch.Size(size).numel()
    if spare is not None and spare.numel() >= numel and spare.dtype == dtype and spare.device == torch.device(device):
        return spare.view(-1)[:numel].view(size)
    return torch.zeros(size, dtype=dtype, device=device)


class KVCache:
    """Keys and values of the live rows, per layer: values [slots, kv_heads, capacity, head_dim];
    keys the same, or on CPU transposed, [slots, kv_heads, head_dim, capacity] (`keys_last`), so
    that q k^T reads contiguous rows (~40% faster than through a transposed view on this CPU).

    Attention reads a slot's whole capacity (masked past its length), since a
    contiguous [live, kv_heads, capacity, head_dim] block runs faster through
    batched matmuls and SDPA than a strided slice of a larger cache. So the
    capacity starts small and doubles when a row needs more (up to `limit`,
    the longest possible row): the copies total at most the final size, and
    attention never reads more than twice what it needs. Entries start
    finite (zeros, or an earlier call's keys/values: `reuse`), as masked
    positions must be: 0 x NaN would leak into the output.
    """

    def __init__(self, num_layers: int, slots: int, shape: DecoderShape, initial: int, limit: int,
                 dtype: torch.dtype, device, keys_last: bool | None = None, reuse: KVCache | None = None):
        # ATen's CPU bmm falls back to a plain loop, ~5x slower here than its BLAS path, when
        # contraction x rows x cols < 400 (q k^T: D x group x keys; p v: keys x group x D): so a
        # slot holds at least 400 / (D x group) keys, in multiples of 8.
        group = shape.num_heads // shape.num_kv_heads
        self.floor = -(-400 // (shape.head_dim * group) // 8) * 8
        self.limit = max(limit, self.floor)
        self.keys_last = torch.device(device).type == "cpu" if keys_last is None else keys_last
        size = (slots, shape.num_kv_heads, min(max(initial, self.floor), self.limit), shape.head_dim)
        key_size = (*size[:2], size[3], size[2]) if self.keys_last else size
        self.k = [_buffer(key_size, dtype, device, reuse.k[i] if reuse else None) for i in range(num_layers)]
        self.v = [_buffer(size, dtype, device, reuse.v[i] if reuse else None) for i in range(num_layers)]

    @property
    def capacity(self) -> int:
        return self.v[0].shape[2]

    def keys(self, layer: int) -> torch.Tensor:
        """Layer `layer`'s keys as [slots, kv_heads, capacity, head_dim] (a view)."""
        return self.k[layer].transpose(-1, -2) if self.keys_last else self.k[layer]

    def reserve(self, width: int) -> None:
        """Make room for `width` positions per slot."""
        if width <= self.capacity:
            return
        old, new = self.capacity, min(self.limit, max(width, 2 * self.capacity))
        for cache, dim in ((self.k, 3 if self.keys_last else 2), (self.v, 2)):
            for layer, t in enumerate(cache):
                grown = t.new_zeros(*t.shape[:dim], new, *t.shape[dim + 1:])
                grown.narrow(dim, 0, old).copy_(t)
                cache[layer] = grown

    def fill(self, slots: torch.Tensor, prompt_k: list[torch.Tensor], prompt_v: list[torch.Tensor], prompts: torch.Tensor) -> None:
        """Copy the prefilled keys/values of `prompts` [m] into `slots` [m]."""
        width = prompt_k[0].shape[2]
        for layer in range(len(self.k)):
            self.keys(layer)[slots, :, :width] = prompt_k[layer][prompts]
            self.v[layer][slots, :, :width] = prompt_v[layer][prompts]

    def move(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy slots `src` onto slots `dst`: whole slots, each one contiguous block (a slot's first
        positions alone are a strided block, whose copy cost more than the positions past them)."""
        for cache in (self.k, self.v):
            for t in cache:
                t.index_copy_(0, dst, t.index_select(0, src))

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor) -> None:
        """Store k, v [m, kv_heads, head_dim] of `slots` [m] at their `positions` [m]."""
        if self.keys_last:
            self.k[layer][slots, :, :, positions] = k
        else:
            self.k[layer][slots, :, positions] = k
        self.v[layer][slots, :, positions] = v


def filter_logits(scores: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Top-k, then nucleus (top-p) filtering of [B, V] scores: removed tokens get -inf.

    Top-p keeps the smallest set of most likely tokens whose mass reaches p
    (Holtzman et al., arXiv 1904.09751); the most likely token always stays.
    """
    if top_k > 0 and top_k < scores.shape[-1]:
        kth = torch.topk(scores, top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        sorted_scores, order = torch.sort(scores, dim=-1, descending=True)
        probs = sorted_scores.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs      # mass of the strictly more likely tokens
        remove_sorted = mass_before >= top_p
        remove_sorted[..., 0] = False
        remove = torch.zeros_like(remove_sorted).scatter(-1, order, remove_sorted)
        scores = scores.masked_fill(remove, float("-inf"))
    return scores


def sample_tokens(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None,
                  uniforms: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row of fp32 logits [B, V], inverting each row's CDF at `uniforms` [B] when
    given, else at uniforms from `generator` (default torch's global one).

    Returns (tokens [B] long, log-probs [B] of the tokens under the distribution
    they were drawn from: softmax(filter(logits / T)); greedy: the untempered softmax).
    """
    if params.greedy:
        tokens = logits.argmax(dim=-1)
        logprobs = torch.log_softmax(logits, dim=-1)
    else:
        scores = filter_logits(logits / params.temperature, params.top_k, params.top_p)
        logprobs = torch.log_softmax(scores, dim=-1)
        tokens = _draw(logprobs.exp(), generator, uniforms)
    return tokens, logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)


def _draw(probs: torch.Tensor, generator: torch.Generator | None = None, uniforms: torch.Tensor | None = None) -> torch.Tensor:
    """One index per row of probs [B, V] by inverting the CDF at a uniform draw (torch.multinomial
    does the same job several times slower on CPU). The draw is scaled by each row's total, so
    rounding in the sum cannot step past the last token with mass. The uniforms are drawn on the CPU
    (`generator` is a CPU generator), so a seed gives the same draws on any device."""
    cdf = probs.cumsum(dim=-1)
    if uniforms is None:
        uniforms = torch.rand(probs.shape[0], dtype=cdf.dtype, generator=generator)
    u = uniforms.to(device=probs.device, dtype=cdf.dtype)[:, None] * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True).squeeze(1).clamp_(max=probs.shape[1] - 1)


# splitmix64 (Steele, Lea and Flood, "Fast splittable pseudorandom number generators", OOPSLA 2014):
# its state increment and finaliser constants, as int64 (two's complement; torch's int64 arithmetic wraps).
_GOLDEN = 0x9E3779B97F4A7C15 - 2**64
_MIX1 = 0xBF58476D1CE4E5B9 - 2**64
_MIX2 = 0x94D049BB133111EB - 2**64


def _shr(z: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic on signed ints)."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def mix64(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser: a bijection of int64 whose outputs for consecutive inputs look independent."""
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    return z ^ _shr(z, 31)


def draw_group_keys(n: int, generator: torch.Generator | None) -> torch.Tensor:
    """n prompts' sampling keys [n] int64, one draw each, in order, from `generator` (None: torch's
    global one). Whoever splits a call's prompts (learner ranks) draws them here, as the engine would."""
    return torch.cat([torch.randint(2**62, (1,), generator=generator) for _ in range(n)])


def row_keys(group_keys: torch.Tensor, group_size: int) -> torch.Tensor:
    """The key of sample j of each group [P] -> [P G]: a stream of its own per sample."""
    j = torch.arange(1, group_size + 1, device=group_keys.device).repeat(len(group_keys))
    return mix64(group_keys.repeat_interleave(group_size) + j * _GOLDEN)


def keyed_uniforms(keys: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """Uniforms in [0, 1) [n] of draw number `counters` [n] of the streams `keys` [n] (int64): the
    splitmix64 output at state key + (counter + 1) x increment, top 24 bits. A row's draws depend on
    its key alone: not on the rows beside it, the batch's order, slots, ranks or device."""
    z = mix64(keys + (counters + 1) * _GOLDEN)
    return _shr(z, 40).to(torch.float32) * 2.0**-24


class NativeEngine:
    """Batched KV-cache sampling with continuous batching (see the module docstring).

    `max_batch_rows` bounds the rows decoded at once (the cache's slots);
    None decodes all rows of a call at once. `prefill_tokens` bounds the
    prompt tokens of one prefill forward.
    """

    def __init__(self, policy: Policy, chat_template: str = "auto", max_batch_rows: int | None = None,
                 prefill_tokens: int = 16384, cpu_kernels: bool = True):
        self.policy = policy
        self.chat_template = chat_template
        self.max_batch_rows = max_batch_rows
        self.prefill_tokens = prefill_tokens
        # On CPU the cache's memory is kept for the next call: a fresh multi-MB cache per call went
        # back to the OS in between, and faulting it in again cost ~5% of a rollout here. (GPU
        # allocators keep freed blocks themselves, and the learner may need them.)
        self._spare: KVCache | None = None
        # Fail at construction, before any run starts: an unsupported shape or layer type raises here.
        self.shape = decoder_shape(policy.model)
        DecoderWeights.of(policy.model)
        # Decoding on CPU in fp32 with SwiGLU MLPs: the fused layer kernel where it builds, else None.
        model = base_model(policy.model)
        fusable = (cpu_kernels and model.device.type == "cpu" and model.dtype == torch.float32
                   and self.shape.head_dim in HEAD_DIMS
                   and getattr(model.config, "hidden_act", None) in ("silu", "swish"))
        self.kernels = load_cpu_kernels() if fusable else None

    @torch.no_grad()
    def generate(self, prompts: list[str], group_size: int, params: SamplingParams, policy_version: int = 0,
                 generator: torch.Generator | None = None, group_keys: torch.Tensor | None = None) -> Rollout:
        """`group_size` samples of each prompt. Each prompt's samples draw from a stream keyed by one
        int64 (`group_keys` [P], default one draw per prompt from `generator`, else torch's global
        generator): a prompt's samples depend on its key alone, not on the other prompts of the call."""
        tokenizer = self.policy.tokenizer
        prompt_ids = encode_prompts(tokenizer, prompts, self.chat_template)
        n_rows = len(prompts) * group_size
        session = self.session(params, slots=min(n_rows, self.max_batch_rows or n_rows), generator=generator,
                               version=policy_version)
        session.add(prompt_ids, group_size, tags=range(n_rows), group_keys=group_keys)
        rows: list[FinishedRow | None] = [None] * n_rows
        while session.busy:
            for row in session.step():
                rows[row.tag] = row
        if self.policy.model.device.type == "cpu":
            self._spare = session.cache
        return rows_to_rollout(rows, [ids for ids in prompt_ids for _ in range(group_size)], group_size,
                               tokenizer, policy_version)

    def session(self, params: SamplingParams, slots: int, generator: torch.Generator | None = None,
                version: int = 0) -> DecodeSession:
        """A decoding session over this engine's model with `slots` cache slots: prompts join it any
        time (`add`), each `step` decodes one token of every live row (the asynchronous loop's sampler)."""
        return DecodeSession(self, params, slots, generator, version)

    def _stop_strings(self, tokens: torch.Tensor, generated: torch.Tensor, stop: tuple[str, ...]) -> torch.Tensor:
        """[live] bool: which rows' text so far (tokens [live, T], `generated` of them) contains a stop string."""
        hits = [stop_string_end(self.policy.tokenizer, row[: int(g)].tolist(), stop) is not None
                for row, g in zip(tokens, generated, strict=True)]
        return torch.tensor(hits, dtype=torch.bool, device=tokens.device)

    def _prefill(self, w: DecoderWeights, prompt_ids: list[list[int]], freqs: torch.Tensor):
        """Each prompt once: its keys/values per layer ([P, kv_heads, width, D], right-padded) and the
        fp32 logits of its next token [P, V]."""
        width = max(len(p) for p in prompt_ids)
        rows_per_pass = max(1, self.prefill_tokens // width)
        keys: list[list[torch.Tensor]] = [[] for _ in w.layers]
        values: list[list[torch.Tensor]] = [[] for _ in w.layers]
        logits = [
            self._prefill_chunk(w, prompt_ids[start : start + rows_per_pass], width, keys, values, freqs)
            for start in range(0, len(prompt_ids), rows_per_pass)
        ]
        return [torch.cat(k) for k in keys], [torch.cat(v) for v in values], torch.cat(logits)

    def _prefill_chunk(self, w: DecoderWeights, chunk: list[list[int]], width: int, keys: list[list[torch.Tensor]],
                       values: list[list[torch.Tensor]], freqs: torch.Tensor) -> torch.Tensor:
        """Prefill prompts right-padded to `width`, appending each layer's keys/values; next-token logits [B, V]."""
        device = w.head.device
        ids = torch.full((len(chunk), width), self.policy.tokenizer.pad_token_id or 0, dtype=torch.long, device=device)
        lengths = torch.tensor([len(p) for p in chunk], device=device)
        for i, p in enumerate(chunk):
            ids[i, : len(p)] = torch.tensor(p, dtype=torch.long)
        # Right padding: query i sees keys j <= i (within the sliding window, if any), of its own prompt
        # for every real token; padded queries are never read.
        geometry = pass_geometry(freqs, width, torch.zeros_like(lengths))
        hidden, k, v = run_pass(self.shape, w, ids, geometry, freqs, fused=self.kernels is not None)
        for layer in range(len(w.layers)):
            keys[layer].append(k[layer].transpose(1, 2))      # [B, kv, S, D]
            values[layer].append(v[layer].transpose(1, 2))
        last = hidden[torch.arange(len(chunk), device=device), lengths - 1]   # [B, E]
        return last.float() @ w.head.t()

    def _window(self, allowed: torch.Tensor, query_pos: torch.Tensor, key_pos: torch.Tensor) -> torch.Tensor:
        """Mistral's sliding window: a query sees only the last `sliding_window` positions."""
        if self.shape.sliding_window is None:
            return allowed
        return allowed & (query_pos - key_pos < self.shape.sliding_window)

    def _decode(self, w: DecoderWeights, cache: KVCache, tokens: torch.Tensor, positions: torch.Tensor,
                freqs: torch.Tensor) -> torch.Tensor:
        """One token for each of the front slots: tokens [live] at positions [live] (their cache lengths).
        Writes their keys/values and returns fp32 next-token logits [live, V]."""
        live = tokens.shape[0]
        cache.reserve(int(positions.max()) + 1)
        if self.kernels is not None and cache.keys_last:
            return self._decode_fused(w, cache, tokens, positions, freqs)
        key_pos = torch.arange(cache.capacity, device=tokens.device)
        allowed = self._window(key_pos[None, :] <= positions[:, None], positions[:, None], key_pos[None, :])
        bias = additive_mask(allowed, cache.v[0].dtype)[:, None, None, :]   # [live, 1, 1, capacity]
        slots = torch.arange(live, device=tokens.device)

        def attend(layer: int, q, k, v):
            cache.write(layer, k[:, 0], v[:, 0], slots, positions)
            out = attention(q.transpose(1, 2), cache.k[layer][:live], cache.v[layer][:live], bias,
                            keys_last=cache.keys_last)   # [live, H, 1, D]
            return out.reshape(live, 1, -1)

        hidden = decoder_layers(self.shape, w, F.embedding(tokens[:, None], w.embed), freqs[positions][:, None, None, :], attend)
        return hidden[:, 0].float() @ w.head.t()

    def _decode_fused(self, w: DecoderWeights, cache: KVCache, tokens: torch.Tensor, positions: torch.Tensor,
                      freqs: torch.Tensor) -> torch.Tensor:
        """`_decode` as one call of the fused CPU kernel per layer (csrc/decode.cpp: the same
        operations as `decoder_layers` and `attention`, each row attending to its keys up to its
        position; the projections against weights packed once per `DecoderWeights`)."""
        shape, x = self.shape, F.embedding(tokens, w.embed)     # x [live, E], updated in place by each layer
        rot = torch.view_as_real(freqs[positions])              # [live, D/2, 2]: each row's (cos, sin) per pair
        for index, (lw, packed) in enumerate(zip(w.layers, w.packed(self.kernels), strict=True)):
            self.kernels.decode_layer(x, lw.input_norm, packed.qkv, lw.qkv_bias, lw.q_norm, lw.k_norm, packed.o, lw.o_bias,
                                      lw.post_norm, packed.gate_up, packed.down, rot, cache.k[index], cache.v[index],
                                      positions, shape.num_heads, w.eps, shape.sliding_window or 0)
        return rms_norm(x, w.final_norm, w.eps).float() @ w.head.t()


@dataclass
class FinishedRow:
    """One completed sample of a `DecodeSession`."""

    tag: Any                    # the caller's label, given to `add`
    tokens: torch.Tensor        # [L] long, eos (or the token completing a stop string) included
    logprobs: torch.Tensor      # [L] float, sampler log-prob of each token
    versions: torch.Tensor      # [L] long, the weight version that sampled each token
    truncated: bool             # no stop within max_new_tokens


@dataclass
class PromptBlock:
    """Prompts prefilled together: their keys/values per layer [P, kv_heads, width, D]."""

    prompt_ids: list[list[int]]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]


@dataclass
class WaitingRow:
    """A sample whose first token is drawn (from its prompt's prefill) and that waits for a cache slot."""

    tag: Any
    block: PromptBlock
    prompt: int                 # its prompt's index in the block
    token: int
    logprob: float
    version: int
    key: int                    # its sampling stream (`keyed_uniforms`)


class DecodeSession:
    """Rows decoding in `slots` cache slots; the live slots are always 0..live-1.

    `add` prefills prompts once each and draws every sample's first token; the
    samples wait for a slot. Each `step` admits waiting rows into free slots,
    retires rows that ended (their slots go to waiting rows: continuous
    batching; with nobody waiting the live slots are packed to the front, so
    the decoded batch shrinks) and decodes one token of every live row.
    `NativeEngine.generate` is one `add` and steps until the session is empty;
    the asynchronous loop keeps adding prompts while it steps.

    `reload` takes new weights mid-generation (AReaL's interruptible rollout,
    arXiv 2505.24298 sec. 4.1): the keys/values the old weights computed are
    recomputed with the new ones, and later tokens are sampled by the new
    weights; every token records the version that sampled it.
    """

    def __init__(self, engine: NativeEngine, params: SamplingParams, slots: int,
                 generator: torch.Generator | None, version: int):
        self.engine, self.params, self.count, self.generator, self.version = engine, params, slots, generator, version
        self.model = base_model(engine.policy.model)
        self.device = self.model.device
        self.weights = DecoderWeights.of(self.model)
        self.eos = torch.tensor(engine.policy.eos_token_ids, device=self.device)
        self.waiting: deque[WaitingRow] = deque()
        self.cache: KVCache | None = None
        self.freqs: torch.Tensor | None = None
        self.live = 0
        max_new, d = params.max_new_tokens, self.device
        self.tokens = torch.zeros(slots, max_new, dtype=torch.long, device=d)       # each slot's tokens so far
        self.logprobs = torch.zeros(slots, max_new, dtype=torch.float32, device=d)
        self.versions = torch.zeros(slots, max_new, dtype=torch.long, device=d)
        self.keys = torch.zeros(slots, dtype=torch.long, device=d)       # its sampling stream
        self.last = torch.zeros(slots, dtype=torch.long, device=d)       # its newest token (not yet cached)
        self.length = torch.zeros(slots, dtype=torch.long, device=d)     # positions in its cache
        self.generated = torch.zeros(slots, dtype=torch.long, device=d)  # its tokens so far (the last not yet cached)
        self.tags: list[Any] = [None] * slots
        self.prompts: list[list[int]] = [[] for _ in range(slots)]

    @property
    def busy(self) -> bool:
        return bool(self.live or self.waiting)

    @property
    def rows(self) -> int:
        """Samples in the session: decoding or waiting for a slot."""
        return self.live + len(self.waiting)

    @torch.no_grad()   # whichever thread calls it: grad mode is per thread
    def add(self, prompt_ids: list[list[int]], group_size: int, tags, group_keys: torch.Tensor | None = None) -> None:
        """`group_size` samples of each prompt; sample j of prompt i is labelled tags[i * group_size + j].
        `group_keys` [P]: each prompt's sampling key; default one draw per prompt, in order, from the
        session's generator (torch's global one when it has none)."""
        tags = list(tags)
        if group_keys is None:
            group_keys = draw_group_keys(len(prompt_ids), self.generator)
        keys = row_keys(group_keys.to(torch.long), group_size)
        self._make_room(max(len(p) for p in prompt_ids))
        block, logits = self._prefill(prompt_ids)
        first, first_lp = self._sample(logits.repeat_interleave(group_size, dim=0), keys, torch.zeros_like(keys))
        for r, (token, logprob, key) in enumerate(zip(first.tolist(), first_lp.tolist(), keys.tolist(), strict=True)):
            self.waiting.append(WaitingRow(tags[r], block, r // group_size, token, logprob, self.version, key))

    @torch.no_grad()   # whichever thread calls it: grad mode is per thread
    def step(self) -> list[FinishedRow]:
        """Admit, retire the rows that ended, decode one token of each live row; the rows that ended."""
        finished: list[FinishedRow] = []
        self._admit(torch.arange(self.live, min(self.count, self.live + len(self.waiting)), device=self.device))
        admitted = True
        while admitted and self.live:   # a newly admitted row may end on its first token
            live = self.live
            g = self.generated[:live]
            stopped = torch.isin(self.last[:live], self.eos)
            if self.params.stop:
                stopped |= self.engine._stop_strings(self.tokens[:live], g, self.params.stop)
            done = (stopped | (g >= self.params.max_new_tokens)).nonzero().squeeze(1)
            if not len(done):
                break
            # One gather per field (a copy: the slots are about to be reused), then views of its rows.
            tokens, logprobs, versions = (state[done].cpu() for state in (self.tokens, self.logprobs, self.versions))
            for i, (slot, n, stop) in enumerate(zip(done.tolist(), g[done].tolist(), stopped[done].tolist(), strict=True)):
                finished.append(FinishedRow(self.tags[slot], tokens[i, :n], logprobs[i, :n], versions[i, :n], truncated=not stop))
            admitted = self._retire(done)
        if self.live:
            live = self.live
            g, pos = self.generated[:live], self.length[:live]
            logits = self.engine._decode(self.weights, self.cache, self.last[:live], pos, self.freqs)
            self.length[:live] += 1
            token, logprob = self._sample(logits, self.keys[:live], g)
            rows = torch.arange(live, device=self.device)
            self.tokens[rows, g], self.logprobs[rows, g], self.versions[rows, g] = token, logprob, self.version
            self.last[:live] = token
            self.generated[:live] += 1
        return finished

    def _sample(self, logits: torch.Tensor, keys: torch.Tensor, counters: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens and sampler log-probs of logits [B, V] at draw `counters` of streams `keys`:
        `sample_tokens` with `keyed_uniforms`, or the fused CPU op for unfiltered sampling."""
        params, kernels = self.params, self.engine.kernels
        if kernels is None or params.top_k or params.top_p < 1.0 or logits.device.type != "cpu":
            return sample_tokens(logits, params, uniforms=keyed_uniforms(keys, counters))
        tokens, logprobs = torch.empty(len(logits), dtype=torch.long), torch.empty(len(logits))
        kernels.sample(tokens, logprobs, logits.contiguous(), 0.0 if params.greedy else params.temperature,
                       keys.contiguous(), counters.contiguous())
        return tokens, logprobs

    @torch.no_grad()   # whichever thread calls it: grad mode is per thread
    def reload(self, version: int) -> None:
        """Continue with the model's current weights, labelled `version` (interrupt and recompute)."""
        self.weights, self.version = DecoderWeights.of(self.model), version
        for block in {id(w.block): w.block for w in self.waiting}.values():
            fresh, _ = self._prefill(block.prompt_ids)
            block.keys, block.values = fresh.keys, fresh.values
        if self.live:
            live = self.live
            # Each live row's prompt and tokens but the last (not yet cached), prefilled as one sequence.
            sequences = [self.prompts[s] + self.tokens[s, : int(self.generated[s]) - 1].tolist() for s in range(live)]
            self.cache.reserve(max(len(q) for q in sequences))
            block, _ = self._prefill(sequences)
            rows = torch.arange(live, device=self.device)
            self.cache.fill(rows, block.keys, block.values, rows)

    def _make_room(self, prompt_len: int) -> None:
        """The cache and rotary table for prompts of `prompt_len` tokens: made afresh when the session is
        empty (sized as for one `generate` call), raised otherwise."""
        longest = prompt_len + self.params.max_new_tokens
        if self.cache is None or not self.busy:
            spare = self.cache or self.engine._spare
            self.cache = KVCache(len(self.weights.layers), self.count, self.engine.shape, initial=prompt_len + 64,
                                 limit=longest, dtype=self.model.dtype, device=self.device, reuse=spare)
            self.freqs = rotary_factors(self.model, self.engine.shape, longest)
        elif longest > self.cache.limit:
            self.cache.limit = longest
            self.freqs = rotary_factors(self.model, self.engine.shape, longest)

    def _prefill(self, prompt_ids: list[list[int]]) -> tuple[PromptBlock, torch.Tensor]:
        keys, values, logits = self.engine._prefill(self.weights, prompt_ids, self.freqs)
        return PromptBlock(prompt_ids, keys, values), logits

    def _admit(self, into: torch.Tensor) -> None:
        """Start waiting rows in the free slots `into`."""
        if not len(into):
            return
        rows = [self.waiting.popleft() for _ in range(len(into))]
        for block in {id(w.block): w.block for w in rows}.values():
            mine = [i for i, w in enumerate(rows) if w.block is block]
            prompts = torch.tensor([rows[i].prompt for i in mine], dtype=torch.long, device=self.device)
            self.cache.fill(into[mine], block.keys, block.values, prompts)
        for slot, w in zip(into.tolist(), rows, strict=True):
            self.tags[slot], self.prompts[slot] = w.tag, w.block.prompt_ids[w.prompt]
        d = self.device
        self.tokens[into, 0] = self.last[into] = torch.tensor([w.token for w in rows], device=d)
        self.logprobs[into, 0] = torch.tensor([w.logprob for w in rows], device=d)
        self.versions[into, 0] = torch.tensor([w.version for w in rows], device=d)
        self.keys[into] = torch.tensor([w.key for w in rows], dtype=torch.long, device=d)
        self.length[into] = torch.tensor([len(w.block.prompt_ids[w.prompt]) for w in rows], device=d)
        self.generated[into] = 1
        self.live = max(self.live, int(into.max()) + 1)

    def _retire(self, done: torch.Tensor) -> bool:
        """Free the live slots `done`: refill what the queue allows, pack the rest away.
        Returns whether rows were admitted (they may need checking before they decode)."""
        refill, rest = done[: len(self.waiting)], done[len(self.waiting):]
        if len(refill):
            self._admit(refill)
        if len(rest):
            keep = torch.ones(self.live, dtype=torch.bool, device=done.device)
            keep[rest] = False
            live = int(keep.sum())
            holes = (~keep[:live]).nonzero().squeeze(1)
            movers = keep[live:].nonzero().squeeze(1) + live
            if len(holes):
                self.cache.move(holes, movers)
                for state in (self.tokens, self.logprobs, self.versions, self.keys, self.last, self.length, self.generated):
                    state[holes] = state[movers]
                for h, m in zip(holes.tolist(), movers.tolist(), strict=True):
                    self.tags[h], self.prompts[h] = self.tags[m], self.prompts[m]
            self.live = live
        return bool(len(refill))


def rows_to_rollout(rows: list[FinishedRow], prompt_ids: list[list[int]], group_size: int, tokenizer,
                    policy_version: int) -> Rollout:
    """Finished rows, in order (row r is sample r % G of prompt r // G), as a right-padded Rollout."""
    pad = tokenizer.pad_token_id or 0
    width = max(max(len(r.tokens) for r in rows), 1)
    completion_ids = torch.full((len(rows), width), pad, dtype=torch.long)
    sampler_logprobs = torch.zeros(len(rows), width)
    mask = torch.zeros(len(rows), width)
    for i, row in enumerate(rows):
        n = len(row.tokens)
        completion_ids[i, :n], sampler_logprobs[i, :n], mask[i, :n] = row.tokens, row.logprobs, 1.0
    return Rollout(
        prompt_ids=prompt_ids,
        completion_ids=completion_ids,
        completion_mask=mask,
        sampler_logprobs=sampler_logprobs,
        truncated=torch.tensor([r.truncated for r in rows], dtype=torch.bool),
        group_ids=torch.arange(len(rows) // group_size).repeat_interleave(group_size),
        policy_version=policy_version,
        texts=tokenizer.batch_decode(completion_ids, skip_special_tokens=True),
    )
