"""A decoder pass through the fused CPU layers (`kernels.train_layer`), forward and backward one op per layer.

`models.decoder.run_pass` takes this path on CPU in fp32 for plain SwiGLU layers; with a `replay` (the rollout's
own activations at these tokens, models/replay.py) each layer's forward is the record (`kernels.replay_layer`)
and only the backward runs.
"""

from __future__ import annotations

import torch

from reinforge import kernels
from reinforge.kernels import PassGeometry, load_cpu_kernels, rms_norm


def fused_pass(shape, w, hidden: torch.Tensor, geometry: PassGeometry,
               prefix: tuple[list[torch.Tensor], list[torch.Tensor]] | None, use: str,
               replay: list[kernels.LayerRecord] | None = None, keep: list[kernels.LayerRecord] | None = None,
               ) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """`run_pass` of embedded tokens hidden [B, S, E] through the fused layers of `w` (a `DecoderWeights` of the
    `DecoderShape` `shape`, every layer `kernels.fused_layer_ok`): (hidden states after the final norm [B, S, E],
    every layer's keys and values [B, S, kv, D]). `keep` (a list, outside autograd): gets each layer's activations
    (`kernels.record_layer`), which a learner pass over the same tokens can replay."""
    b, s = hidden.shape[:2]
    x = hidden.reshape(b * s, -1)
    ops = load_cpu_kernels()
    layers = len(w.layers)
    if replay is not None and len(replay) != layers:
        raise ValueError(f"a replay of {len(replay)} layers for a decoder of {layers}")
    # the forward's packed products are not needed where the record stands in for the forward
    forward = w.packed(ops, use=use) if replay is None else [None] * layers
    backward = w.packed(ops, transposed=True, use=use) if torch.is_grad_enabled() else [None] * layers
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    for index, (lw, packs) in enumerate(zip(w.layers, zip(forward, backward, strict=True), strict=True)):
        layer_prefix = (prefix[0][index], prefix[1][index]) if prefix is not None else None
        if keep is not None and replay is None and not torch.is_grad_enabled():
            keep.append(kernels.record_layer(x, lw, packs, geometry, layer_prefix, shape.num_heads,
                                             shape.num_kv_heads, w.eps))
            x, k, v = keep[-1].x_out, keep[-1].k, keep[-1].v
        elif replay is None:
            x, k, v = kernels.train_layer(x, lw, packs, geometry, layer_prefix, shape.num_heads, shape.num_kv_heads,
                                          w.eps)
        else:
            x, k, v = kernels.replay_layer(x, lw, packs, geometry, layer_prefix, shape.num_heads,
                                           shape.num_kv_heads, w.eps, replay[index])
        keys.append(k)
        values.append(v)
    return rms_norm(x, w.final_norm, w.eps).view(b, s, -1), keys, values
