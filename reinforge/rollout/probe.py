"""The sampler's side of the weight-sync probe: what a rollout engine or worker computes on the fixed
probe sequence, from the tensors it decodes with. The check that compares it with the learner's
forward, and the reasons for it, are rollout/weight_sync.py's; this record and the scoring sit here,
below both, because the asynchronous samplers (rollout/stream.py, Ray workers) answer probes themselves.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from reinforge.models.decoder import DecoderWeights, decoder_shape, run_pass
from reinforge.models.lora import base_model
from reinforge.models.positions import pass_geometry, rotary_factors


def next_token_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """[S - 1, V] fp32 on the CPU: log p(. | ids[: t + 1]) at every probe position but the last, from [1, S, V]."""
    return F.log_softmax(logits[0, :-1].float(), dim=-1).cpu()


@torch.no_grad()
def engine_logprobs(weights: DecoderWeights, model: torch.nn.Module, ids: torch.Tensor,
                    fused: bool = False) -> torch.Tensor:
    """[S - 1, V] the probe's next-token log-probs from `weights`, the tensors a native-engine session decodes
    with (`model` gives only the architecture: shape and rotary table), on the CPU. `fused`: through the CPU
    kernels' layer (`run_pass`), as an engine that decodes with them prefills: its packed weights, and on the
    built-in model the sampler's side of the probe (which runs every step) in 2.6 instead of 4.1 ms, packing
    the weights included."""
    model = base_model(model)
    shape, s = decoder_shape(model), ids.shape[1]
    freqs = rotary_factors(model, shape.head_dim, s)
    device = weights.head.device
    geometry = pass_geometry(freqs, s, torch.zeros(1, dtype=torch.long, device=device))
    hidden, _, _ = run_pass(shape, weights, ids.to(device), geometry, freqs, fused=fused, use="engine")
    return next_token_logprobs(hidden.float() @ weights.head.t())


# The version a sampler thread holds before the first publication reaches it (the weights it was built with).
# Not 0: a fresh run's first publication is version 0 (its step), and a probe asked for version 0 must wait
# for that publication to be applied, not pass at once on the built weights (a race seen under load).
UNPUBLISHED = -1


@dataclass(frozen=True)
class SamplerProbe:
    """What one sampler computed on the probe: who it is, the weight version it holds, its log-probs."""

    name: str                    # "native engine", "sampler thread", "ray worker 1", "rank 2 engine copy"
    logprobs: torch.Tensor       # [S - 1, V] fp32 next-token log-probs at the probe's positions, CPU
    version: int | None = None   # the version it holds (None: it reads the learner's tensors, no versions)
