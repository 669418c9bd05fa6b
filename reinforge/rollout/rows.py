"""The rows of a decoding session (rollout/session.py): what a row carries while it waits, what a finished
row hands back (`FinishedRow`, with the `RowContext` a multi-turn episode continues from), and their
collation into a `Rollout` (`rows_to_rollout`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from reinforge.models.replay import ActivationRecord
from reinforge.rollout.base import Rollout
from reinforge.rollout.trajectory import Segment, Trajectory, collate


@dataclass
class RowContext:
    """What a finished turn leaves for the row's next turn (`DecodeSession.extend`): a multi-turn
    trajectory (prompt, model turn, observation, model turn, ...) goes on without re-prefilling."""

    ids: list[int]                        # every token so far: prompt, all turns and observations, this turn's last
    keys: list[torch.Tensor] | None       # per layer [kv_heads, cached, head_dim] of ids[:cached] (None: not kept)
    values: list[torch.Tensor] | None     # per layer [kv_heads, cached, head_dim]
    cached: int                           # positions stored: len(ids) - 1 (the last sampled token is not cached yet)
    key: int                              # the row's sampling stream (`keyed_uniforms`)
    drawn: int                            # draws taken from it so far (all turns): the next turn's first counter
    version: int                          # the weight version that computed keys/values


def slot_context(cache, slot: int, ids: list[int], cached: int, key: int, drawn: int, version: int) -> RowContext:
    """The `RowContext` of the row in `slot` of `cache` (a `KVCache`) that just ended its turn, `ids` its every
    token: its keys/values copied out of the cache before the slot is refilled or packed."""
    layers = range(len(cache.v))
    # Copies (`contiguous()` of a slot that fills the cache would be a view of it).
    dense = torch.contiguous_format
    return RowContext(ids=ids,
                      keys=[cache.keys(layer)[slot, :, :cached].clone(memory_format=dense) for layer in layers],
                      values=[cache.v[layer][slot, :, :cached].clone(memory_format=dense) for layer in layers],
                      cached=cached, key=key, drawn=drawn, version=version)


@dataclass
class FinishedRow:
    """One completed sample of a `DecodeSession` (of an extended row: its latest turn only)."""

    tag: Any                    # the caller's label, given to `add` or `extend`
    tokens: torch.Tensor        # [L] long, eos (or the token completing a stop string) included
    logprobs: torch.Tensor      # [L] float, sampler log-prob of each token
    versions: torch.Tensor      # [L] long, the weight version that sampled each token
    truncated: bool             # no stop within max_new_tokens
    context: RowContext | None = None   # with `keep_context`: what `extend` continues from
    top_ids: torch.Tensor | None = None       # [L, K] long, the sampler's K most likely ids (record_top_k)
    top_logprobs: torch.Tensor | None = None  # [L, K] float, their log-probs under the sampling distribution
    # [P + L, layers, k] long, MoE models: the experts each prompt token and each generated token went to in
    # every MoE layer (-1 on the last token, which no pass reads); None: dense model, or an extended row
    routes: torch.Tensor | None = None
    # The activations its decoding kept (models/replay.py): all rows of one call share `record`, this row's is
    # its row `record_row`. None: not kept.
    record: ActivationRecord | None = None
    record_row: int = -1


@dataclass(frozen=True)
class LoopRows:
    """A session's live rows as the engine's one-call generation (`_decode_loop`) reads and advances them in
    place: the session's tensors of the same names (rollout/session.py) and its end-of-sequence ids."""

    tokens: torch.Tensor        # [slots, max_new + 1] long, each row's tokens so far
    logprobs: torch.Tensor      # [slots, max_new + 1] float, their sampler log-probs
    last: torch.Tensor          # [slots] long, each row's newest token (not yet cached)
    length: torch.Tensor        # [slots] long, positions in its cache
    generated: torch.Tensor     # [slots] long, its tokens so far
    drawn: torch.Tensor         # [slots] long, its stream's draws before this turn
    keys: torch.Tensor          # [slots] long, its sampling stream
    eos: torch.Tensor           # [n] long, the ids that end a row
    live: int                   # the rows in slots 0..live-1


@dataclass
class PromptBlock:
    """Prompts prefilled together: their keys/values per layer [P, kv_heads, width, D]."""

    prompt_ids: list[list[int]]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    routes: torch.Tensor | None = None    # [P, width, layers, k] MoE experts of each prompt token; None: not recorded


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
    drawn: int = 0              # draws of that stream before this turn (earlier turns of an extended row)
    top: tuple[torch.Tensor, torch.Tensor] | None = None   # its first position's top-K ([K] ids, [K] log-probs)


def rows_to_rollout(rows: list[FinishedRow], prompt_ids: list[list[int]], group_size: int, tokenizer,
                    policy_version: int, exact: bool = False) -> Rollout:
    """Finished rows, in order (row r is sample r % G of prompt r // G): single-turn trajectories,
    collated into the right-padded batch view; `exact`: its `Rollout.logprobs_exact`. Rows without top-K or
    routing records (an RL batch's usual rows) are padded in one masked store per field, to what `collate`
    makes of them: a `Trajectory` per row took half of this at 256 rows."""
    if rows and all(row.top_ids is None and row.routes is None for row in rows):
        rollout = _padded_rows(rows, prompt_ids, group_size, tokenizer, policy_version)
    else:
        trajectories = [
            Trajectory(prompt_ids=tuple(ids), segments=(Segment.sampled(row.tokens, row.logprobs, row.versions,
                                                                         row.top_ids, row.top_logprobs),),
                       truncated=row.truncated, group=r // group_size, routes=row.routes)
            for r, (row, ids) in enumerate(zip(rows, prompt_ids, strict=True))
        ]
        rollout = collate(trajectories, tokenizer.pad_token_id or 0, policy_version,
                          lambda ids: tokenizer.batch_decode(ids, skip_special_tokens=True))
    rollout.logprobs_exact = exact
    record = rows[0].record if rows else None
    if record is not None and exact and all(row.record is record for row in rows):
        rollout.activations = record.select(torch.tensor([row.record_row for row in rows], dtype=torch.long))
    return rollout


def _padded_rows(rows: list[FinishedRow], prompt_ids: list[list[int]], group_size: int, tokenizer,
                 policy_version: int) -> Rollout:
    """`collate` of plain single-turn rows (no top-K or routing records), without a record per row."""
    pad_id = tokenizer.pad_token_id or 0
    prompts = [list(ids) for _, ids in zip(rows, prompt_ids, strict=True)]
    lengths = torch.tensor([row.tokens.shape[0] for row in rows], dtype=torch.long)
    width = max(int(lengths.max()), 1)
    kept = torch.arange(width) < lengths[:, None]                         # [N, width]
    completion_ids = torch.full(kept.shape, pad_id, dtype=torch.long)
    completion_ids[kept] = torch.cat([row.tokens for row in rows]).long()
    sampler_logprobs = torch.zeros(kept.shape)
    sampler_logprobs[kept] = torch.cat([row.logprobs for row in rows]).float()
    return Rollout(prompt_ids=prompts, completion_ids=completion_ids, pad_id=pad_id,
                   completion_mask=kept.float(), sampler_logprobs=sampler_logprobs,
                   truncated=torch.tensor([row.truncated for row in rows], dtype=torch.bool),
                   group_ids=torch.arange(len(rows)) // group_size, policy_version=policy_version,
                   texts=tokenizer.batch_decode(completion_ids, skip_special_tokens=True))
