"""The learner forward with each prompt computed once for all the completions that share it.

GRPO-style groups (arXiv 2402.03300) sample G completions per
prompt, and the plain forward (`sequences.completion_token_stats`,
`logprobs.completion_token_stats_chunked`) runs every [prompt + completion]
row in full, so each prompt goes through the model G times. Here a prompt
pass runs each distinct prompt once and keeps every layer's keys and values;
a completion pass then runs only the completion tokens, each row attending to
its group's prompt keys/values followed by its own (causal). Gradients reach
the prompt through all G rows (the gather of the shared keys/values sums them
in the backward), so values and parameter gradients equal the plain path's.

Layer math is the native rollout engine's (`rollout.native.decoder_layers`,
Llama/Qwen2/Qwen3/Mistral-style decoders); the LM head is the chunked one
(`logprobs.chunked_token_logprobs_and_entropy`). With LoRA (a peft model), each
projection runs its effective weight W + (alpha / r) B A (`models.lora.linear_weight`):
the same function as the adapter's forward, gradients reaching A and B through the
sum, but no dropout on the adapter's input, so LoRA dropout is refused.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from reinforge.learner.logprobs import head_token_stats
from reinforge.learner.sequences import SequenceBatch, TokenStats
from reinforge.models.lora import lora_dropouts
from reinforge.rollout.native import (
    DecoderShape,
    DecoderWeights,
    additive_mask,
    attention,
    decoder_layers,
    decoder_shape,
    rotary_factors,
)

OPTION = "train.shared_prefix=false"


def _native_decoder(model: PreTrainedModel) -> tuple[DecoderShape, DecoderWeights]:
    """The decoder's shape and its (differentiable, with grad enabled) fused weights, or
    NotImplementedError naming the option to turn off."""
    try:
        shape = decoder_shape(model)
        weights = DecoderWeights.of(model)
    except NotImplementedError as err:
        raise NotImplementedError(f"the shared-prompt learner forward runs the native decoder, which refused "
                                  f"{type(model).__name__}: {err}; set {OPTION}") from err
    if shape.sliding_window is not None:
        raise NotImplementedError(f"the shared-prompt learner forward does not model sliding-window attention; set {OPTION}")
    if model.training and getattr(model.config, "attention_dropout", 0.0):
        raise NotImplementedError(f"the shared-prompt learner forward does not apply attention dropout; set {OPTION}")
    if model.training and any(p > 0 for p in lora_dropouts(model)):
        raise NotImplementedError(f"the shared-prompt learner forward runs merged LoRA weights, without LoRA dropout; set {OPTION} "
                                  "or model.lora.dropout=0")
    return shape, weights


def _prompt_slots(batch: SequenceBatch, group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(slot [N]: the row's distinct prompt, representative [P]: one row holding each prompt).

    Raises ValueError when two rows of one group have different prompt tokens.
    """
    n, device = batch.input_ids.shape[0], batch.input_ids.device
    _, slot = torch.unique(group_ids, return_inverse=True)  # [N] in 0..P-1
    order = torch.arange(n, device=device)
    representative = torch.full((int(slot.max()) + 1,), n, device=device).scatter_reduce(0, slot, order, "amin")  # [P]
    rep = representative[slot]  # [N]
    width = int(batch.starts.max())
    in_prompt = torch.arange(width, device=device)[None, :] < batch.starts[:, None]  # [N, Lp]
    same = (batch.starts == batch.starts[rep]) & (
        (batch.input_ids[:, :width] == batch.input_ids[rep, :width]) | ~in_prompt
    ).all(dim=1)
    if not bool(same.all()):
        row = int((~same).nonzero()[0])
        raise ValueError(f"row {row} has group id {int(group_ids[row])} but a different prompt from row {int(rep[row])} "
                         f"of that group; the shared-prompt forward needs one prompt per group")
    return slot, representative


def completion_token_stats_shared(
    model: PreTrainedModel,
    batch: SequenceBatch,
    group_ids: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    fp32_head: bool = True,
) -> TokenStats:
    """`logprobs.completion_token_stats_chunked` with each group's prompt run once.

    group_ids [N]: rows with equal ids must have equal prompts (ValueError
    otherwise); the batch may hold any subset of a group's rows, in any order.
    Same contract and numbers as the plain path: [N, T] log-probs and
    entropies of the completion tokens at `temperature`, 0 on padding, with
    gradients. The model sees exactly the plain path's inputs: tokens from
    `input_ids`, keys masked by `attention_mask`.
    """
    shape, w = _native_decoder(model)
    device = batch.input_ids.device
    group_ids = group_ids.to(device)
    slot, representative = _prompt_slots(batch, group_ids)
    starts = batch.starts  # [N]
    rows, cols = (batch.completion_mask > 0).nonzero(as_tuple=True)  # [M], [M]
    # Token t >= 1 is predicted at completion position t - 1: the pass needs positions 0..Tc-1, where
    # Tc is the last valid token's index (0: every token is predicted by the prompt pass).
    tc = int(cols.max()) if len(cols) else 0
    prompt_len = starts[representative]  # [P]
    span = int(prompt_len.max())
    freqs = rotary_factors(model, shape, max(span, int((starts + tc).max())))  # [positions, D/2] complex
    embed_pad = model.get_input_embeddings().padding_idx  # HF zeroes that row's gradient: so do we

    # 1. prompt pass: each distinct prompt once, keeping every layer's keys/values [P, kv, Lp, D]
    pos = torch.arange(span, device=device)
    prompt_ids = batch.input_ids[representative, :span]  # [P, Lp], right-padded (past the prompt: unseen)
    allowed = (pos[None, :] <= pos[:, None])[None] & (pos[None, None, :] < prompt_len[:, None, None])  # [P, Lp, Lp]
    prompt_bias = additive_mask(allowed[:, None], w.embed.dtype)
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []

    def attend_prompt(layer: int, q, k, v):
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [P, heads, Lp, D]
        keys.append(k)
        values.append(v)
        out = attention(q, k, v, prompt_bias)
        return out.transpose(1, 2).flatten(2)

    prompt_hidden = decoder_layers(shape, w, F.embedding(prompt_ids, w.embed, embed_pad), freqs[:span, None, :], attend_prompt)
    # predictors[:, t] is the hidden state that predicts completion token t, [N, 1 + Tc, E].
    predictors = prompt_hidden[slot, starts - 1][:, None]  # token 0: the prompt's last position

    # 2. completion pass: completion positions only, attending to the group's prompt, then causally
    if tc:
        t = torch.arange(tc, device=device)
        at = starts[:, None] + t[None, :]  # [N, Tc] input positions
        inside = at < batch.input_ids.shape[1]
        at_clamped = at.clamp(max=batch.input_ids.shape[1] - 1)
        ids = batch.input_ids.gather(1, at_clamped)  # [N, Tc]
        key_valid = inside & (batch.attention_mask.gather(1, at_clamped) > 0)  # [N, Tc]
        mask = torch.cat([
            (pos[None, :] < starts[:, None])[:, None, :].expand(-1, tc, -1),  # prompt keys j < starts
            (t[None, :] <= t[:, None])[None] & key_valid[:, None, :],             # own keys j <= t
        ], dim=-1)[:, None]  # [N, 1, Tc, Lp + Tc]
        completion_bias = additive_mask(mask, w.embed.dtype)

        def attend_completion(layer: int, q, k, v):
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [N, heads, Tc, D]
            k = torch.cat([keys[layer][slot], k], dim=2)  # [N, kv, Lp + Tc, D]
            v = torch.cat([values[layer][slot], v], dim=2)
            out = attention(q, k, v, completion_bias)
            return out.transpose(1, 2).flatten(2)

        completion_hidden = decoder_layers(shape, w, F.embedding(ids, w.embed, embed_pad), freqs[at][:, :, None, :],
                                           attend_completion)  # [N, Tc, E]
        predictors = torch.cat([predictors, completion_hidden], dim=1)

    # 3. the LM head on the valid tokens only
    return head_token_stats(model, batch, predictors[rows, cols], temperature, chunk_size, fp32_head)
