"""Weight-only quantisation of the native engine's sampler (`rollout.quantization`).

Production RL stacks sample with a quantised copy of the policy (int8 / fp8 weights) while the learner
trains in full precision, which widens the sampler-learner gap that the TIS / MIS corrections
(`objectives.corrections`) exist for (Yao et al. 2025, https://fengyao.notion.site/off-policy-rl;
Liu, Li et al. 2025, https://richardli.xyz/rl-collapse). This module makes that gap reproducible on a
CPU: the engine's projection weights are rounded to int8 per output channel each time the engine
takes the weights (`DecoderWeights.of`, once per `generate` call or weight reload, so every optimizer
step is quantised afresh), and the learner keeps the fp32 weights.

Per output channel (row i of a [out, in] weight W), symmetric (LLM.int8's vector-wise absmax
quantisation, Dettmers et al. arXiv 2208.07339 sec. 3.1, without its outlier decomposition):

    s_i = max_j |W_ij| / 127,    q_ij = round(W_ij / s_i) in [-127, 127],    W~_ij = q_ij s_i

Round-to-nearest moves each weight by at most half a step: |W_ij - W~_ij| <= s_i / 2. The matmul
runs on the dequantised weight (x @ W~^T in fp32: weight-only int8, W8A16/W8A32 style), so the
engine's fused CPU kernels run unchanged and the sampler's recorded log-probs are exactly those of
the int8 model.

What is quantised: q/k/v/o and the MLP's gate/up/down projections of every layer; the LM head only
with `rollout.quantize_lm_head` (common int8 deployments keep it in high precision, and MiniMax-M1,
arXiv 2506.13585, traced a large mismatch to a low-precision head). Embeddings, norms and biases stay fp32.
In a Mixture-of-Experts layer every expert's (and the shared expert's) projections are quantised per
output channel of each expert; the router stays fp32, as quantised MoE deployments keep the gate in
high precision (a rounded router changes which experts run, a different gap from the one measured here).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from reinforge.models.decoder import DecoderWeights
from reinforge.models.moe import MoEWeights

INT8_MAX = 127


@dataclass(frozen=True)
class Int8Weight:
    """A [out, in] weight as int8 codes and one fp32 scale per output channel."""

    codes: torch.Tensor     # [out, in] int8, in [-127, 127]
    scales: torch.Tensor    # [out] fp32, max_j |W_ij| / 127 (a zero row gets scale 1: codes 0)

    def dequantize(self) -> torch.Tensor:
        """W~ = q s, [out, in] fp32."""
        return self.codes.float() * self.scales[:, None]


def quantize_int8(weight: torch.Tensor) -> Int8Weight:
    """Symmetric per-output-channel int8 of `weight` [out, in] (see the module docstring)."""
    w = weight.detach().float()
    absmax = w.abs().amax(dim=1)                                                # [out]
    scales = torch.where(absmax > 0, absmax / INT8_MAX, torch.ones_like(absmax))
    codes = torch.round(w / scales[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return Int8Weight(codes=codes, scales=scales)


def fake_int8(weight: torch.Tensor) -> torch.Tensor:
    """`weight` rounded to int8 per output channel and dequantised, in its own dtype (no gradient)."""
    return quantize_int8(weight).dequantize().to(weight.dtype)


def _fake_int8_stacked(weight: torch.Tensor | None) -> torch.Tensor | None:
    """`fake_int8` of each [out, in] matrix of a stacked [..., out, in] weight (MoE experts); None stays None."""
    if weight is None:
        return None
    return fake_int8(weight.reshape(-1, weight.shape[-1])).reshape(weight.shape)


def _int8_moe(moe: MoEWeights | None) -> MoEWeights | None:
    if moe is None:
        return None
    return replace(moe, gate_up=_fake_int8_stacked(moe.gate_up), down=_fake_int8_stacked(moe.down),
                   shared_gate_up=_fake_int8_stacked(moe.shared_gate_up),
                   shared_down=_fake_int8_stacked(moe.shared_down))


def _int8(weights: DecoderWeights, head: bool) -> DecoderWeights:
    layers = [replace(lw, qkv=fake_int8(lw.qkv), o=fake_int8(lw.o), gate_up=_fake_int8_stacked(lw.gate_up),
                      down=_fake_int8_stacked(lw.down), moe=_int8_moe(lw.moe))
              for lw in weights.layers]
    # A fresh DecoderWeights: its packed copies for the CPU kernels are made from the int8 weights.
    return DecoderWeights(embed=weights.embed, layers=layers, final_norm=weights.final_norm,
                          head=fake_int8(weights.head) if head else weights.head, eps=weights.eps,
                          head16=None if head else weights.head16)


# rollout.quantization -> (the engine's weights, quantise the LM head too) -> the weights it samples with.
QUANTIZERS: dict[str, Callable[[DecoderWeights, bool], DecoderWeights]] = {
    "none": lambda weights, head: weights,
    "int8": _int8,
}


def quantize_weights(weights: DecoderWeights, method: str, head: bool = False) -> DecoderWeights:
    """The sampler's weights under `rollout.quantization` = `method` (a QUANTIZERS key)."""
    if method not in QUANTIZERS:
        raise ValueError(f"unknown rollout.quantization {method!r}; choose one of {', '.join(QUANTIZERS)}")
    return QUANTIZERS[method](weights, head)
