"""The Llama-family decoder forward (Llama, Qwen2, Qwen3, Mistral) that the native rollout engine
(rollout/native.py) and the learner's shared-prompt forward (learner/shared_prefix.py) both run.

It runs the decoder's own weights (norms, projections, MLPs, rotary table), so
it shares the training weights: an optimizer step is visible at the next call
with no weight sync, and numerics match the learner's forward (a LoRA
projection runs as W + (alpha / r) B A, `models.lora.linear_weight`).

This module owns which architectures it runs (`SUPPORTED_MODEL_TYPES`,
`decoder_shape`, `check_native_model_type`), the per-call fused weights
(`DecoderWeights`), rotary, attention and its masks, and one pass over the
layers (`run_pass`, `decoder_layers`; on CPU in fp32 through the fused
kernels of `reinforge.kernels`). Whoever calls it owns the keys and values
(the engine's KV cache, the learner's shared prompt): `decoder_layers` hands
them to its `attend` callback.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from reinforge import kernels
from reinforge.errors import ConfigError
from reinforge.kernels import PassGeometry, rms_norm, swiglu
from reinforge.models.attention import additive_mask, attention
from reinforge.models.compiled_layers import layer_steps
from reinforge.models.fused_pass import fused_pass
from reinforge.models.fused_weights import Spare, fused_projection, interleave_heads, take_spare
from reinforge.models.lora import base_model, linear_weight
from reinforge.models.model_dir import LLAMA_FAMILY, STATIC_ROPE_TYPES
from reinforge.models.moe import MOE_MODEL_TYPES, MoEWeights, moe_mlp
from reinforge.models.positions import allowed_keys

log = logging.getLogger(__name__)
# Whether `DecoderWeights.logits` may use the 16-bit GEMM with fp32 output (off after it failed once).
_FP32_OUT_MM = {"on": True}

# one list, readable without torch at config check (models/model_dir.py)
SUPPORTED_MODEL_TYPES = LLAMA_FAMILY + MOE_MODEL_TYPES


@dataclass(frozen=True)
class DecoderShape:
    """What the engine needs to know about the decoder's attention."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    sliding_window: int | None   # None: full attention


def check_native_model_type(
    model_dir: Path, feature: str = "rollout.engine=native", way_out: str = "rollout.engine=hf"
) -> None:
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
        raise NotImplementedError(
            f"the native rollout engine does not support rope_type '{rope_type}'; use rollout.engine=hf"
        )
    if getattr(config, "final_logit_softcapping", None) is not None:
        raise NotImplementedError(
            "the native rollout engine does not support logit soft-capping; use rollout.engine=hf"
        )
    window = getattr(config, "sliding_window", None)
    qwen = ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe")
    if config.model_type in qwen and not getattr(config, "use_sliding_window", False):
        window = None
    if config.model_type in qwen and window is not None:
        # Qwen applies the window only to some layers (max_window_layers); not modelled here.
        raise NotImplementedError(
            "the native rollout engine does not support Qwen's sliding-window layers; use rollout.engine=hf"
        )
    num_heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    return DecoderShape(num_heads, getattr(config, "num_key_value_heads", None) or num_heads, head_dim, window)


def _rope(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding (RoFormer, arXiv 2104.09864) of x [..., D] with adjacent
    (real, imaginary) pairs: each pair times exp(i theta), freqs the complex [..., D/2] factors."""
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(pairs * freqs).flatten(-2).to(x.dtype)


@dataclass
class PackedProjections:
    """One layer's projection weights as the CPU kernels' products read them (csrc/gemm.h, `product`): 32-column
    panels (`pack_weight`), or plain matrices that ATen multiplies (`DecoderWeights.packed`)."""

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
    gate_up: torch.Tensor | None        # [2 I, E]; None in an MoE layer
    down: torch.Tensor | None
    act: Callable[[torch.Tensor], torch.Tensor] | None   # None: SiLU (SwiGLU; fused on CPU, kernels.swiglu)
    moe: MoEWeights | None = None       # an MoE layer's router and experts (models/moe.py), in place of gate_up/down


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
    # [V, E] fp32: the learner's head precision (learner.logprobs, fp32_head); of(..., logits=False): the head's own
    # weight, for a caller that takes no logits from these weights (the learner's shared-prompt forward)
    head: torch.Tensor
    eps: float
    # [V, E] the head's own 16-bit weight on CUDA (`logits`); None elsewhere
    head16: torch.Tensor | None = None
    _packed: dict[tuple[bool, bool], list[PackedProjections]] = field(default_factory=dict)
    _packed_head: torch.Tensor | None = None
    # Panels of weights no longer used, by shape, that packing writes into instead of new memory (the native
    # engine hands over a finished session's, `reusable`): at a 0.5B model's widths, first writes to fresh pages
    # cost more than the packing itself.
    spare_panels: dict[tuple[int, ...], list[torch.Tensor]] = field(default_factory=dict)

    def _pack(self, ops, weight: torch.Tensor, transposed: bool) -> torch.Tensor:
        """`ops.pack_weight(weight, transposed)`, into a spare tensor of its shape when there is one."""
        n, k = weight.shape[::-1] if transposed else weight.shape
        into = take_spare(self.spare_panels, ((n + 31) // 32, k, 32), weight)     # 32-column panels (csrc/gemm.h)
        if into is None:
            return ops.pack_weight(weight, transposed)
        ops.pack_weight_into(into, weight, transposed)
        return into

    def reusable(self) -> dict[tuple[int, ...], list[torch.Tensor]]:
        """The tensors these weights made and own, by shape: the packed panels (`packed`, `packed_logits`) and
        the fused q/k/v and gate/up. For weights built once these are no longer used, to write into
        (`of`'s `spare`, `spare_panels`); nothing of the model's own is among them."""
        panels = [t for forms in self._packed.values() for projections in forms
                  for t in (projections.qkv, projections.o, projections.gate_up, projections.down) if t.dim() == 3]
        fused = [t for lw in self.layers for t in (lw.qkv, lw.gate_up) if t is not None and not t.requires_grad]
        by_shape: dict[tuple[int, ...], list[torch.Tensor]] = {}
        for t in panels + fused + ([self._packed_head] if self._packed_head is not None else []):
            by_shape.setdefault(tuple(t.shape), []).append(t)
        return by_shape

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 next-token logits [R, V] of hidden states [R, E] in the model's dtype: hidden.float() @ head^T.
        On CUDA with a bf16/fp16 model, cuBLAS's 16-bit GEMM with fp32 accumulation and output on the
        16-bit head: the products of 16-bit numbers are exact in fp32, so these are the same logits up to
        summation order, at the tensor cores' rate (an fp32 GEMM runs ~15x slower on an H100/H200; at 256
        rows and Qwen's 151,936 tokens it was most of a decode step's time). Without that GEMM in the
        installed torch: the fp32 product, with a logged warning."""
        if self.head16 is not None and hidden.dtype == self.head16.dtype and _FP32_OUT_MM["on"]:
            try:
                return torch.mm(hidden, self.head16.t(), out_dtype=torch.float32)
            except (RuntimeError, TypeError) as err:
                _FP32_OUT_MM["on"] = False
                log.warning("decoder head: the 16-bit GEMM with fp32 output is unavailable (%s: %s); computing "
                            "the logits in fp32", type(err).__name__, str(err)[:200])
        return hidden.float() @ self.head.t()

    def packed_logits(self, ops, hidden: torch.Tensor) -> torch.Tensor:
        """`logits` of fp32 hidden states [R, E] through the CPU kernels' packed product (csrc/gemm.h), the
        head packed on first use and kept with these weights. At a 0.5B model's decoding step (32 rows,
        Qwen's 151,936 tokens) this took half the time of torch's fp32 product on one thread (BENCHMARKS.md);
        the same sums in another order, so the logits agree with `logits` to float rounding."""
        return ops.packed_matmul(hidden.float().contiguous(), self.packed_head(ops), None, self.head.shape[0], 0)

    def packed_head(self, ops) -> torch.Tensor:
        """The head as `packed_logits` multiplies by it: packed on first use, kept with these weights."""
        if self._packed_head is None:
            self._packed_head = self._pack(ops, self.head.detach().float().contiguous(), False)
        return self._packed_head

    def packed(self, ops, transposed: bool = False, use: str = "learner") -> list[PackedProjections]:
        """Each layer's projections as the CPU kernels' products of `use` read them (csrc/gemm.h, `product`;
        "learner": its passes, "engine": the rollout engine's prefill and decoding), made on first use and kept
        with these weights: for products with w^T (the forward), or with `transposed` with w (the backward's
        input gradients). Packed into 32-column panels (`ops.pack_weight`), or where this machine runs the
        learner's products faster through ATen (kernels/tuning.py) the plain matrices themselves, detached (w, and its
        view w^T when transposed; no copy: o and down are the model's own tensors). No gradient flows through
        either, and both serve while the model's weights stand still, as they do within a generation (a
        session that takes new weights builds new DecoderWeights, `DecodeSession.reload`) and between a
        learner pass's forward and its backward."""
        plain = kernels.plain_products(use)
        if (transposed, plain) not in self._packed:
            def form(t: torch.Tensor) -> torch.Tensor:
                if plain:
                    return t.detach().t() if transposed else t.detach()
                return self._pack(ops, t.detach(), transposed)

            self._packed[transposed, plain] = [
                PackedProjections(*(form(t) for t in (lw.qkv, lw.o, lw.gate_up, lw.down))) for lw in self.layers
            ]
        return self._packed[transposed, plain]

    @classmethod
    def of(cls, model: PreTrainedModel, logits: bool = True, spare: Spare | None = None,
           fused_from: DecoderWeights | None = None) -> DecoderWeights:
        """The weights of `model`, or of the decoder under a peft PeftModel: a LoRA projection
        contributes W + (alpha / r) B A (`models.lora.linear_weight`; W alone while its adapters are
        disabled), differentiable in A and B, so the learner's shared-prompt forward trains them.
        `logits` False: `head` is the head's own weight, not an fp32 copy (545 MB for a bf16 Qwen head, on
        every call), for a caller that runs only the layers. `spare`: tensors for the fused projections to be
        written into. `fused_from`: weights `of` made earlier without a gradient from `model` as it is now (the
        rollout engine's, whose record the learner replays: the same `weights_key`); their fused projections are
        taken instead of new copies (`fused_weights.fused_projection`)."""
        model = base_model(model)
        embedding = model.get_input_embeddings()
        if type(embedding) is not torch.nn.Embedding:  # e.g. LoRA on the embedding: its .weight is not what it computes
            raise NotImplementedError(
                f"the native rollout engine needs a plain embedding, found {type(embedding).__name__}; "
                "use rollout.engine=hf"
            )
        config = model.config
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        silu = getattr(config, "hidden_act", None) in ("silu", "swish")
        lent = fused_from.layers if fused_from is not None else [None] * len(model.model.layers)
        layers = [_layer_weights(layer, i, heads, kv_heads, silu, spare, built)
                  for i, (layer, built) in enumerate(zip(model.model.layers, lent, strict=True))]
        head, head_bias = _plain(model.get_output_embeddings(), "the LM head")
        if head_bias is not None:
            raise NotImplementedError(
                "the native rollout engine assumes an LM head without bias; use rollout.engine=hf"
            )
        return cls(
            embed=embedding.weight,
            layers=layers,
            final_norm=model.model.norm.weight,
            head=head.float() if logits else head,
            eps=config.rms_norm_eps,
            head16=head if head.device.type == "cuda" and head.dtype in (torch.bfloat16, torch.float16) else None,
        )


def _plain(module: torch.nn.Module, name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight, bias) of a Linear or LoRA Linear; any other wrapper computes more than a weight."""
    try:
        return linear_weight(module)
    except NotImplementedError as err:
        raise NotImplementedError(
            f"the native rollout engine cannot run {name}: {err}; use rollout.engine=hf"
        ) from None


def _layer_weights(layer: torch.nn.Module, i: int, heads: int, kv_heads: int, silu: bool, spare: Spare | None,
                   built: LayerWeights | None) -> LayerWeights:
    """`DecoderWeights.of`'s weights of decoder layer `i`; `built`: the same layer's made earlier at the same
    weights, whose fused projections are taken."""
    attn, mlp = layer.self_attn, layer.mlp
    qkv = [_plain(getattr(attn, n), f"layer {i} {n}") for n in ("q_proj", "k_proj", "v_proj")]
    moe = MoEWeights.of(mlp)
    if moe is not None and not silu:
        raise NotImplementedError("the native rollout engine runs SiLU experts only; use rollout.engine=hf")
    (gate, gate_b), (up, up_b), (down, down_b) = (
        ((None, None),) * 3 if moe is not None
        else (_plain(getattr(mlp, n), f"layer {i} {n}") for n in ("gate_proj", "up_proj", "down_proj")))
    if gate_b is not None or up_b is not None or down_b is not None:
        raise NotImplementedError("the native rollout engine does not support MLP biases; use rollout.engine=hf")
    o, o_bias = _plain(attn.o_proj, f"layer {i} o_proj")
    rotary = [heads, kv_heads, None]    # queries and keys in the kernels' rotary layout
    fused_bias = None if all(b is None for _, b in qkv) else fused_projection(
        [b if b is not None else w.new_zeros(w.shape[0]) for w, b in qkv], rotary, None,
        None if built is None else built.qkv_bias)
    return LayerWeights(
        input_norm=layer.input_layernorm.weight,
        qkv=fused_projection([w for w, _ in qkv], rotary, spare, None if built is None else built.qkv),
        qkv_bias=fused_bias,
        q_norm=interleave_heads(attn.q_norm.weight, 1) if hasattr(attn, "q_norm") else None,
        k_norm=interleave_heads(attn.k_norm.weight, 1) if hasattr(attn, "k_norm") else None,
        o=o,
        o_bias=o_bias,
        post_norm=layer.post_attention_layernorm.weight,
        gate_up=None if moe is not None else fused_projection(
            [gate, up], [None, None], spare, None if built is None else built.gate_up),
        down=down,
        act=None if silu else mlp.act_fn,
        moe=moe,
    )


def decoder_layers(
    shape: DecoderShape, w: DecoderWeights, hidden: torch.Tensor, freqs: torch.Tensor, attend,
    routes: list[torch.Tensor] | None = None, compiled: bool = False,
) -> torch.Tensor:
    """Run every decoder layer on hidden [B, S, E] and the final norm; differentiable when `w` is.

    `freqs`: complex rotary factors broadcastable to [B, S, 1, D/2]. `attend(layer, q [B, S, H, D],
    k [B, S, kv, D], v [B, S, kv, D]) -> [B, S, H * D]` is the attention, which owns the keys and
    values (a cache, a shared prompt); q and k are already rotated, in the interleaved layout.
    `routes`: each MoE layer appends the experts [B, S, k] its tokens went to (routing replay's record).
    `compiled`: each SiLU layer's work around the attention through `torch.compile`
    (`models.compiled_layers`, train.compile): the same numbers within the dtype's rounding.
    """
    (b, s, e), heads, kv = hidden.shape, shape.num_heads, shape.num_kv_heads
    steps = layer_steps(heads, kv, shape.head_dim, w.eps) if compiled else None
    rot = torch.view_as_real(freqs.expand(b, s, 1, -1)) if compiled else None   # [B, S, 1, D/2, 2] (cos, sin)
    # Tokens as rows [B S, E]: each residual add rides on its projection's GEMM (addmm), one pass
    # over the activations fewer per projection.
    # RMSNorm and SwiGLU go through `reinforge.kernels`: one fused kernel each way on CPU in fp32.
    x = hidden.reshape(b * s, e)
    for index, lw in enumerate(w.layers):
        if steps is not None and lw.moe is None and lw.act is None:
            q, k, v = steps.attention_inputs(x, lw.input_norm, lw.qkv, lw.qkv_bias, lw.q_norm, lw.k_norm, rot)
            x = steps.layer_rest(x, attend(index, q, k, v).reshape(b * s, -1), lw.o, lw.o_bias, lw.post_norm,
                                 lw.gate_up, lw.down)
            continue
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
        if lw.moe is not None:
            out, experts = moe_mlp(rms_norm(x, lw.post_norm, w.eps), lw.moe)
            x = x + out
            if routes is not None:
                routes.append(experts.view(b, s, -1))
            continue
        gate_up = F.linear(rms_norm(x, lw.post_norm, w.eps), lw.gate_up)
        x = torch.addmm(x, swiglu(gate_up, lw.act), lw.down.t())
    return rms_norm(x, w.final_norm, w.eps).view(b, s, e)


def run_pass(shape: DecoderShape, w: DecoderWeights, ids: torch.Tensor, geometry: PassGeometry, freqs: torch.Tensor,
             prefix: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None, padding_idx: int | None = None,
             fused: bool = True, routes: list[torch.Tensor] | None = None, compiled: bool = False,
             use: str = "learner", replay: list[kernels.LayerRecord] | None = None,
             keep: list[kernels.LayerRecord] | None = None,
             ) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """The decoder on tokens ids [B, S] attending as `geometry` says (a prompt, whole rows, or
    completions after a shared prompt): (hidden states [B, S, E] after the final norm, every layer's
    rotated keys and values [B, S, kv, D]). `prefix`: every layer's keys and values [P, Lp, kv, D]
    of another pass, which `geometry.slot` indexes. `freqs`: the rotary factors of `rotary_factors`.

    On CPU in fp32 each layer is one fused op each way (`kernels.train_layer`, models/fused_pass.py) when
    `fused`, the kernels build and the layer is a plain SwiGLU one; otherwise `decoder_layers` with the
    geometry as an additive mask: the same numbers within float rounding (tests/unit/learner/test_shared_prefix.py).
    Sliding windows are applied on the second path only (the shared-prompt learner refuses them).
    MoE layers run on the second path; `routes` and `compiled` as in `decoder_layers` (`compiled`
    takes the second path). `use`: whose products the fused layers run ("learner", or "engine" for the
    rollout engine's prefill, `DecoderWeights.packed`). `replay`: each layer's activations at these tokens as
    the rollout's decoding kept them (models/replay.py), for the fused path's forward to hand back (the other path
    computes its own); `keep`: gets them, where the fused path runs without a gradient (`fused_pass`)."""
    hidden = F.embedding(ids, w.embed, padding_idx)
    if (
        fused
        and not compiled
        and shape.sliding_window is None
        and all(lw.moe is None for lw in w.layers)
        and all(kernels.fused_layer_ok(lw, shape.head_dim, hidden) for lw in w.layers)
    ):
        return fused_pass(shape, w, hidden, geometry, prefix, use, replay, keep)
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    prefix_len = prefix[0][0].shape[1] if prefix is not None else 0
    # [B, 1, S, Lp + S]
    bias = additive_mask(allowed_keys(geometry, prefix_len, shape.sliding_window)[:, None], w.embed.dtype)

    def attend(layer: int, q, k, v):
        keys.append(k)
        values.append(v)
        if prefix is not None:
            k = torch.cat([prefix[0][layer][geometry.slot], k], dim=1)    # [B, Lp + S, kv, D]
            v = torch.cat([prefix[1][layer][geometry.slot], v], dim=1)
        out = attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), bias)   # [B, heads, S, D]
        return out.transpose(1, 2).flatten(2)

    at = geometry.pos0[:, None] + torch.arange(ids.shape[1], device=ids.device)[None, :]    # [B, S] rotary positions
    return decoder_layers(shape, w, hidden, freqs[at][:, :, None, :], attend, routes, compiled), keys, values
