"""What a decoding session asks of the engine it decodes for (`DecodePasses`): the model's prefill and
decode passes and the state they read. `rollout.native.NativeEngine` is the one implementation; the
session (rollout/session.py), its continuation passes (rollout/continuation.py) and the decode graphs
(rollout/graphs.py) are written against this interface, so none imports the engine module that builds them.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from reinforge.models import Policy
from reinforge.models.decoder import DecoderShape, DecoderWeights
from reinforge.rollout.kv_cache import KVCache
from reinforge.rollout.rows import LoopRows


class DecodePasses(Protocol):
    """The engine as a session reads it (the members are `NativeEngine`'s, documented there)."""

    policy: Policy                 # its model, tokenizer and end-of-sequence ids
    shape: DecoderShape            # heads, head size, sliding window of the decoder
    kernels: Any                   # the fused CPU decode kernels, None when the step runs `_decode_rows`
    graph_mode: str | None         # "capture" / "eager": the decode step through rollout/graphs.py; None: plain
    moe_layers: int                # MoE layers of the decoder (0: dense)
    top_k: int                     # experts per token of its MoE layers
    _spare: KVCache | None         # a finished session's cache, whose memory the next one reuses
    prefill_tokens: int            # positions one prefill (or continuation) pass covers at most

    def decoder_weights(self) -> DecoderWeights:
        """The weights to decode with, taken afresh (the latest optimizer step)."""
        ...

    def head_logits(self, w: DecoderWeights, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 next-token logits [B, V] of final hidden states [B, E]."""
        ...

    def disable_graphs(self, reason: str) -> None:
        """Decode eagerly from now on (`reason` logged)."""
        ...

    def _prefill(self, w: DecoderWeights, prompt_ids: list[list[int]], freqs: torch.Tensor,
                 routes: list[torch.Tensor] | None = None) -> Any:
        """Per-layer keys, values of each prompt and the logits of its next token."""
        ...

    def _decode(self, w: DecoderWeights, cache: KVCache, tokens: torch.Tensor, positions: torch.Tensor,
                freqs: torch.Tensor, routes: list[torch.Tensor] | None = None) -> torch.Tensor:
        """One token of each front slot; next-token logits [live, V]."""
        ...

    def _decode_sample(self, w: DecoderWeights, cache: KVCache, tokens: torch.Tensor, positions: torch.Tensor,
                       freqs: torch.Tensor, keys: torch.Tensor, counters: torch.Tensor,
                       params: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """`_decode` and sampling in one call of the CPU kernels: the next tokens and their log-probs [live]."""
        ...

    def _decode_loop(self, w: DecoderWeights, cache: KVCache, freqs: torch.Tensor, rows: LoopRows,
                     params: Any, record: torch.Tensor | None = None) -> int:
        """The live rows decoded to their ends in one call of the CPU kernels, `rows` advanced in place (and with
        `record`, every token's activations kept there); the steps."""
        ...

    def _decode_rows(self, w: DecoderWeights, cache: KVCache, tokens: torch.Tensor, positions: torch.Tensor,
                     rot: torch.Tensor, routes: list[torch.Tensor] | None = None) -> torch.Tensor:
        """`_decode` without host synchronisation (a CUDA graph's body)."""
        ...

    def _stop_strings(self, tokens: torch.Tensor, generated: torch.Tensor, stop: tuple[str, ...]) -> torch.Tensor:
        """[live] bool: which rows' text so far contains a stop string."""
        ...
