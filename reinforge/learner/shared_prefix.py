"""The learner forward with each prompt computed once for all the completions that share it.

GRPO-style groups (arXiv 2402.03300) sample G completions per
prompt, and the plain forward (`sequences.completion_token_stats`,
`logprobs.completion_token_stats_chunked`) runs every [prompt + completion]
row in full, so each prompt goes through the model G times. Here a prompt
pass runs each distinct prompt once and keeps every layer's keys and values;
a completion pass then runs only the completion tokens, each row attending to
its group's prompt keys/values followed by its own (causal), in one pass per
length bucket (`length_buckets`), so that a batch's longest completion does
not pad every other row to its length. Gradients reach
the prompt through all G rows (the gather of the shared keys/values sums them
in the backward), so values and parameter gradients equal the plain path's.
When no two rows share a prompt (SFT, each trace its own group) it is one pass over whole rows.

Layer math is the native rollout engine's (`models.decoder.decoder_layers`,
Llama/Qwen2/Qwen3/Mistral-style decoders); the LM head is the chunked one
(`logprobs.chunked_token_logprobs_and_entropy`). With LoRA (a peft model), each
projection runs its effective weight W + (alpha / r) B A (`models.lora.linear_weight`):
the same function as the adapter's forward, gradients reaching A and B through the
sum, but no dropout on the adapter's input, so LoRA dropout is refused.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from reinforge.learner.logprobs import head_token_stats
from reinforge.learner.sequences import SequenceBatch, TokenStats
from reinforge.learner.truncation import Truncation
from reinforge.models.decoder import DecoderShape, DecoderWeights, decoder_shape, run_pass
from reinforge.models.lora import lora_dropouts
from reinforge.models.positions import pass_geometry, rotary_factors
from reinforge.models.replay import ActivationRecord

OPTION = "train.shared_prefix=false"
# What one more completion pass costs, in padded token positions: merging two length buckets pays
# off when it pads fewer positions than this. On the 2-core CPU, built-in model, a long-tailed batch
# (256 rows, mean 8.7 tokens, longest 46: 11,520 positions in one padded pass), forward and backward
# took 850 ms in one pass, 190-205 ms with 64 or 256 here (4-5 passes, ~2,400 positions) and
# 250 ms with 1024 (2 passes).
PASS_COST_POSITIONS = 256
# On a GPU a pass costs its launches whatever its rows (every layer's kernels forward and backward, with
# host syncs between passes: ~10-20 ms for a 0.5B model), while a padded position costs ~10 us of
# tensor-core time there (6 x 0.5 GFLOP at a few hundred TFLOP/s): merging pays up to ~2,000 positions.
PASS_COST_POSITIONS_GPU = 2048


def length_buckets(need: torch.Tensor, pass_cost: int | None = None) -> list[torch.Tensor]:
    """The rows with need > 0 (need [N]: completion positions a row's pass covers), grouped so that each
    group's pass, padded to its longest row, wastes little: classes of need in (w/2, w] for powers of
    two w, neighbours merged (shortest first) while the merge pads fewer than `pass_cost` positions.
    With long-tailed completion lengths one padded pass spends most of its work on padding; with
    similar lengths this is a single pass over every row. `pass_cost` defaults to PASS_COST_POSITIONS,
    or PASS_COST_POSITIONS_GPU for rows on a GPU."""
    if pass_cost is None:
        pass_cost = PASS_COST_POSITIONS_GPU if need.device.type == "cuda" else PASS_COST_POSITIONS
    rows = (need > 0).nonzero().squeeze(1)
    if not len(rows):
        return []
    need = need[rows]
    classes = torch.ceil(torch.log2(need.double())).long()
    buckets: list[tuple[torch.Tensor, int]] = []
    for c in torch.unique(classes).tolist():
        sub = rows[classes == c]
        width = int(need[classes == c].max())
        if buckets and len(buckets[-1][0]) * (width - buckets[-1][1]) <= pass_cost:
            buckets[-1] = (torch.cat([buckets[-1][0], sub]), width)
        else:
            buckets.append((sub, width))
    return [sub for sub, _ in buckets]


def _native_decoder(model: PreTrainedModel, fused_from: DecoderWeights | None = None,
                    ) -> tuple[DecoderShape, DecoderWeights]:
    """The decoder's shape and its (differentiable, with grad enabled) fused weights, or
    NotImplementedError naming the option to turn off. `fused_from`: the rollout engine's weights of a record
    that matches the model (their fused projections are taken, `DecoderWeights.of`)."""
    try:
        shape = decoder_shape(model)
        weights = DecoderWeights.of(model, logits=False, fused_from=fused_from)   # the head runs apart
    except NotImplementedError as err:
        raise NotImplementedError(f"the shared-prompt learner forward runs the native decoder, which refused "
                                  f"{type(model).__name__}: {err}; set {OPTION}") from err
    if shape.sliding_window is not None:
        raise NotImplementedError(
            f"the shared-prompt learner forward does not model sliding-window attention; set {OPTION}"
        )
    if model.training and getattr(model.config, "attention_dropout", 0.0):
        raise NotImplementedError(f"the shared-prompt learner forward does not apply attention dropout; set {OPTION}")
    if model.training and any(p > 0 for p in lora_dropouts(model)):
        raise NotImplementedError(
            f"the shared-prompt learner forward runs merged LoRA weights, without LoRA dropout; set {OPTION} "
            "or model.lora.dropout=0"
        )
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
        raise ValueError(
            f"row {row} has group id {int(group_ids[row])} but a different prompt from row {int(rep[row])} "
            f"of that group; the shared-prompt forward needs one prompt per group"
        )
    return slot, representative


def completion_token_stats_shared(
    model: PreTrainedModel,
    batch: SequenceBatch,
    group_ids: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    fp32_head: bool = True,
    truncation: Truncation | None = None,
    compile: bool = False,
    activations: ActivationRecord | None = None,
) -> TokenStats:
    """`logprobs.completion_token_stats_chunked` with each group's prompt run once.

    group_ids [N]: rows with equal ids must have equal prompts (ValueError
    otherwise); the batch may hold any subset of a group's rows, in any order.
    Same contract and numbers as the plain path: [N, T] log-probs and
    entropies of the completion tokens at `temperature`, 0 on padding, with
    gradients. The model sees exactly the plain path's inputs: tokens from
    `input_ids`, keys masked by `attention_mask`. `compile`: on a CUDA device, the layers' work around
    the attention through `torch.compile` (`models.compiled_layers`); no effect elsewhere. `activations`: the
    rollout engine's record of these rows (models/replay.py); where it `matches` the model, the completion passes
    take their forward from it, and the prompt pass from its prefill where that was kept for these prompts, with
    the same numbers to float rounding.
    """
    compiled = compile and batch.input_ids.is_cuda
    offered = activations is not None
    if offered and (compiled or not activations.matches(model)):
        activations = None
    shape, w = _native_decoder(model, activations.decoding_weights if activations is not None else None)
    _check_right_padded(batch)
    rows, cols = (batch.completion_mask > 0).nonzero(as_tuple=True)  # [M], [M]
    pad = model.get_input_embeddings().padding_idx   # HF zeroes that row's gradient: so do we
    if len(group_ids.unique()) == len(group_ids):
        predictors = _whole_row_predictors(model, shape, w, batch, rows, cols, pad, compiled)
    else:
        predictors = _shared_prompt_predictors(model, shape, w, batch, group_ids.to(batch.input_ids.device), rows,
                                               cols, pad, compiled, activations)
    # the LM head on the valid tokens only
    stats = head_token_stats(model, batch, predictors, temperature, chunk_size, fp32_head, truncation)
    if offered:
        stats.metrics["learner/replayed_forward"] = float(activations is not None)
    return stats


def _check_right_padded(batch: SequenceBatch) -> None:
    """ValueError unless every row's attention mask is 1 on its tokens, then 0 (right padding)."""
    total = batch.attention_mask.sum(dim=1)    # [N] tokens of each (right-padded) row
    width_all = batch.input_ids.shape[1]
    arange = torch.arange(width_all, device=batch.input_ids.device)
    if not bool((batch.attention_mask > 0).eq(arange[None, :] < total[:, None]).all()):
        raise ValueError("the shared-prompt learner forward needs right-padded rows (attention_mask 1 then 0)")


def _whole_row_predictors(model: PreTrainedModel, shape: DecoderShape, w: DecoderWeights, batch: SequenceBatch,
                          rows: torch.Tensor, cols: torch.Tensor, pad: int | None, compiled: bool) -> torch.Tensor:
    """Nothing to share (SFT: one trace per prompt): whole rows in one pass; the hidden state [M, E]
    predicting each valid token (rows[m], cols[m])."""
    starts, width_all = batch.starts, batch.input_ids.shape[1]
    freqs = rotary_factors(model, shape.head_dim, width_all)
    geometry = pass_geometry(freqs, width_all, torch.zeros_like(starts))
    hidden, _, _ = run_pass(shape, w, batch.input_ids, geometry, freqs, padding_idx=pad, compiled=compiled)
    return hidden[rows, starts[rows] + cols - 1]


def _shared_prompt_predictors(model: PreTrainedModel, shape: DecoderShape, w: DecoderWeights, batch: SequenceBatch,
                              group_ids: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor,
                              pad: int | None, compiled: bool, activations: ActivationRecord | None = None,
                              ) -> torch.Tensor:
    """The hidden state [M, E] predicting each valid token (rows[m], cols[m]): a prompt pass running each
    group's prompt once, then completion passes by length bucket attending to their prompt's keys/values."""
    device = batch.input_ids.device
    starts = batch.starts  # [N]
    width_all = batch.input_ids.shape[1]
    slot, representative = _prompt_slots(batch, group_ids)
    # Token t >= 1 is predicted at completion position t - 1: row i's pass needs positions
    # 0..need[i]-1, need[i] its last trained token's column (0: its tokens are predicted by the prompt
    # pass). Every present token before it, an environment token too, is in that pass as context.
    need = torch.zeros_like(starts).scatter_reduce(0, rows, cols, "amax")  # [N]
    prompt_len = starts[representative]  # [P]
    span = int(prompt_len.max())
    # A pass runs every row of its bucket to the bucket's longest need, from the row's own start: its
    # positions reach the latest start plus the longest need (past a row's need they are masked padding).
    # [positions, D/2] complex
    freqs = rotary_factors(model, shape.head_dim, max(span, int(starts.max()) + int(need.max())))

    # 1. prompt pass: each distinct prompt once, keeping every layer's keys/values [P, Lp, kv, D]; its forward is
    #    the engine's prefill where the record kept it (models/replay.py, `PromptRecord`)
    geometry = pass_geometry(freqs, span, torch.zeros_like(prompt_len))
    prompt_ids = batch.input_ids[representative, :span]
    replay = None if activations is None else activations.prompt_layers(prompt_ids, prompt_len, span)
    prompt_hidden, keys, values = run_pass(shape, w, prompt_ids, geometry, freqs, padding_idx=pad, compiled=compiled,
                                           replay=replay)

    # 2. completion passes, one per length bucket: completion positions only, each row attending to
    #    its group's prompt, then causally to its own tokens
    def completion_pass(sub: torch.Tensor, width: int) -> torch.Tensor:
        """Hidden states [n, width, E] of rows `sub` [n] at their completion positions 0..width-1."""
        # positions past the row are clamped: unseen
        at = (starts[sub, None] + torch.arange(width, device=device)[None, :]).clamp(max=width_all - 1)
        geometry = pass_geometry(freqs, width, starts[sub], slot[sub], starts[sub])
        replay = activations.layers(sub, width) if activations is not None and width <= activations.kept else None
        hidden, _, _ = run_pass(shape, w, batch.input_ids[sub].gather(1, at), geometry, freqs, (keys, values),
                                padding_idx=pad, compiled=compiled, replay=replay)
        return hidden

    # The hidden state predicting each valid token (r, c), in pieces: c = 0 from the prompt pass,
    # c >= 1 from its row's bucket; then put back in (rows, cols) order for the head.
    first = (cols == 0).nonzero().squeeze(1)
    pieces, order = [prompt_hidden[slot[rows[first]], starts[rows[first]] - 1]], [first]
    bucket_of = torch.full_like(starts, -1)
    for b, sub in enumerate(length_buckets(need)):
        bucket_of[sub] = b
        # row -> its place in sub
        local = torch.empty_like(starts).index_copy_(0, sub, torch.arange(len(sub), device=device))
        mine = ((bucket_of[rows] == b) & (cols > 0)).nonzero().squeeze(1)
        hidden = completion_pass(sub, int(need[sub].max()))   # [n, width, E]
        pieces.append(_TakeRows.apply(hidden.flatten(0, 1), local[rows[mine]] * hidden.shape[1] + cols[mine] - 1))
        order.append(mine)
    order = torch.cat(order)
    back = torch.empty_like(order).index_copy_(0, order, torch.arange(len(order), device=device))
    return _TakeRows.apply(torch.cat(pieces), back)


class _TakeRows(torch.autograd.Function):
    """Rows `index` [M] of src [R, E], no row taken twice: src[index] with a backward that writes the gradient's
    rows in place (index_copy_) where autograd's adds them up (an accumulating index_put, one thread on CPU: ~1.3
    ms of the `vs_trl.py`-shaped step's backward for the two gathers above)."""

    @staticmethod
    def forward(ctx, src: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(index)
        ctx.rows = src.shape[0]
        return src.index_select(0, index)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (index,) = ctx.saved_tensors
        return grad.new_zeros(ctx.rows, *grad.shape[1:]).index_copy_(0, index, grad), None
