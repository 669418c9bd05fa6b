"""The trajectory record: what one sample of a rollout is, turn by turn, and the batch view the
learner reads.

A trajectory is its prompt and a sequence of segments, each with its tokens and who produced
them: the model (sampled: the sampler's log-prob and the policy version of every token, trained
on) or the environment (a tool's result, a user's reply: context for the model's next turn, never
trained on). A single-turn sample is one model segment. Engines and rollout workers produce
trajectories; `collate` turns a batch of them into the padded `Rollout` the loop curates and the
learner trains on, and `split` gives a rollout's rows back as trajectories. So a multi-turn
producer is a new source of trajectories, not a new loop.

The record crosses process boundaries (Ray rollout workers), so it carries `schema`, the version
of its layout (STYLE 9); a consumer refuses a schema it does not know instead of misreading it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from reinforge.rollout.base import Rollout

SCHEMA_VERSION = 1

Role = Literal["model", "environment"]


@dataclass(frozen=True)
class Segment:
    """Consecutive tokens of one producer."""

    role: Role
    token_ids: torch.Tensor          # [L] long
    sampler_logprobs: torch.Tensor   # [L] float: log-prob under the distribution it was drawn from; 0 if environment
    versions: torch.Tensor           # [L] long: the policy version that sampled each token; -1 for environment tokens
    # [L, K] long / float: the sampler's K most likely ids at each position and their log-probs
    # (SamplingParams.record_top_k); None: not recorded (always None for environment tokens)
    top_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.role not in ("model", "environment"):
            raise ValueError(f"segment role must be 'model' or 'environment', got {self.role!r}")
        n = self.token_ids.shape[0]
        if self.token_ids.dim() != 1 or self.sampler_logprobs.shape != (n,) or self.versions.shape != (n,):
            raise ValueError(
                f"a segment's token_ids, sampler_logprobs and versions are [L] each; got "
                f"{tuple(self.token_ids.shape)}, {tuple(self.sampler_logprobs.shape)}, {tuple(self.versions.shape)}"
            )

    @classmethod
    def sampled(cls, token_ids: torch.Tensor, sampler_logprobs: torch.Tensor, versions: torch.Tensor | int,
                top_ids: torch.Tensor | None = None, top_logprobs: torch.Tensor | None = None) -> Segment:
        """Tokens the model sampled; `versions` per token, or one version for all of them; the
        sampler's top-K ids and log-probs [L, K] per position when recorded."""
        if isinstance(versions, int):
            versions = torch.full(token_ids.shape, versions, dtype=torch.long)
        return cls("model", _as(token_ids, torch.long), _as(sampler_logprobs, torch.float), _as(versions, torch.long),
                   None if top_ids is None else _as(top_ids, torch.long),
                   None if top_logprobs is None else _as(top_logprobs, torch.float))

    @classmethod
    def observed(cls, token_ids: torch.Tensor) -> Segment:
        """Tokens the environment wrote into the context (tool results, user replies)."""
        return cls(
            "environment",
            token_ids.long(),
            torch.zeros(token_ids.shape),
            torch.full(token_ids.shape, -1, dtype=torch.long),
        )

    @property
    def trained(self) -> bool:
        """Whether the loss sees these tokens: the model's only."""
        return self.role == "model"


@dataclass(frozen=True)
class Trajectory:
    """One sample: its prompt, then its segments in order."""

    prompt_ids: tuple[int, ...]
    segments: tuple[Segment, ...]
    truncated: bool                  # it ended at a length limit, not with a stop
    group: int                       # its prompt's index in the batch: the samples of one prompt share it
    # [P + L, layers, k] long, MoE models: the experts every token went to in each MoE layer when it was
    # sampled (-1: not recorded), for routing replay (learner/routing.py); None: not recorded
    routes: torch.Tensor | None = None
    schema: int = field(default=SCHEMA_VERSION)

    def tokens(self) -> torch.Tensor:
        """[L] long: every token after the prompt, all segments in order."""
        return _cat([s.token_ids for s in self.segments], torch.long)

    def loss_mask(self) -> torch.Tensor:
        """[L] float: 1 on the model's tokens, 0 on the environment's."""
        return _cat([torch.full(s.token_ids.shape, float(s.trained)) for s in self.segments], torch.float)

    def sampler_logprobs(self) -> torch.Tensor:
        """[L] float."""
        return _cat([s.sampler_logprobs for s in self.segments], torch.float)

    def versions(self) -> torch.Tensor:
        """[L] long (-1 on environment tokens)."""
        return _cat([s.versions for s in self.segments], torch.long)

    @property
    def model_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.segments if s.trained)

    @property
    def environment_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.segments if not s.trained)


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`t` in `dtype`: itself when it is already (a conversion op per tensor per row adds up in a rollout)."""
    return t if t.dtype == dtype else t.to(dtype)


def _cat(parts: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    return torch.cat(parts).to(dtype) if parts else torch.zeros(0, dtype=dtype)


def collate(trajectories: Sequence[Trajectory], pad_id: int, policy_version: int,
            decode: Callable[[torch.Tensor], list[str]]) -> Rollout:
    """The batch view of `trajectories`, in order: completions right-padded with `pad_id`.

    A row's completion is all its segments' tokens in order; `completion_mask` is 1 on each of
    them (the learner's input sequence holds them all), `loss_mask` 1 on the model's only, and the
    sampler log-probs are 0 on the environment's. Without any environment token in the batch
    `loss_mask` is None (the same as completion_mask), so a single-turn batch is what it always was.
    `decode` turns the padded [N, T] completion ids, environment tokens included, into texts (the
    tokenizer's batch_decode, skipping special tokens). Group ids are the trajectories' own.
    """
    for t in trajectories:
        if t.schema != SCHEMA_VERSION:
            raise ValueError(f"trajectory schema {t.schema} is not this reader's ({SCHEMA_VERSION}): "
                             "the producer runs another reinforge version")
    # Each segment's size read once, as an int (a tensor's len() is a Python call: at 256 rows, reading
    # them for the width, the columns and the environment's tokens was a third of collating)
    segments = [(i, s) for i, t in enumerate(trajectories) for s in t.segments]
    counts = [s.token_ids.shape[0] for _, s in segments]
    lengths = [0] * len(trajectories)                 # each row's completion tokens
    starts = [0] * len(segments)                      # each segment's first column in its row
    for k, ((i, _), n) in enumerate(zip(segments, counts, strict=True)):
        starts[k] = lengths[i]
        lengths[i] += n
    width = max([*lengths, 1])
    completion_ids = torch.full((len(trajectories), width), pad_id, dtype=torch.long)
    completion_mask = torch.zeros(len(trajectories), width)
    loss_mask = torch.zeros(len(trajectories), width)
    sampler_logprobs = torch.zeros(len(trajectories), width)
    # Every segment's tokens written in one indexed store per field: a store per segment was ~700 small
    # ops at an RL batch's 64 rows (~3 ms of a tiny model's 0.1 s step, benchmarks/vs_trl.py).
    if segments:
        sizes = torch.tensor(counts, dtype=torch.long)
        offsets = sizes.cumsum(0) - sizes             # each segment's first token in the flat order
        rows = torch.tensor([i for i, _ in segments], dtype=torch.long).repeat_interleave(sizes)
        shift = torch.tensor(starts, dtype=torch.long) - offsets      # column minus flat index, per segment
        cols = torch.arange(int(sizes.sum())) + shift.repeat_interleave(sizes)
        trained = torch.tensor([s.trained for _, s in segments]).repeat_interleave(sizes)
        completion_ids[rows, cols] = torch.cat([s.token_ids for _, s in segments])
        completion_mask[rows, cols] = 1.0
        loss_mask[rows[trained], cols[trained]] = 1.0
        sampler_logprobs[rows[trained], cols[trained]] = torch.cat([s.sampler_logprobs for _, s in segments])[trained]
    multi_turn = any(n and not s.trained for (_, s), n in zip(segments, counts, strict=True))
    top_ids, top_logprobs = _collate_top(trajectories, width)
    recorded = [t.routes for t in trajectories if t.routes is not None]
    routes = None
    if recorded:   # right-padded like build_sequences' input rows (prompt then completion), -1 where not recorded
        length = max(len(t.prompt_ids) + n for t, n in zip(trajectories, lengths, strict=True))
        routes = torch.full((len(trajectories), length, *recorded[0].shape[1:]), -1, dtype=torch.long)
        for i, t in enumerate(trajectories):
            if t.routes is not None:
                routes[i, : len(t.routes)] = t.routes
    return Rollout(
        prompt_ids=[list(t.prompt_ids) for t in trajectories],
        completion_ids=completion_ids,
        pad_id=pad_id,
        completion_mask=completion_mask,
        sampler_logprobs=sampler_logprobs,
        truncated=torch.tensor([t.truncated for t in trajectories], dtype=torch.bool),
        group_ids=torch.tensor([t.group for t in trajectories], dtype=torch.long),
        policy_version=policy_version,
        texts=decode(completion_ids),
        loss_mask=loss_mask if multi_turn else None,
        sampler_top_ids=top_ids,
        sampler_top_logprobs=top_logprobs,
        routes=routes,
    )


def _collate_top(trajectories: Sequence[Trajectory], width: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The sampler's top-K ids and log-probs [N, width, K] of the model segments, 0 elsewhere; (None,
    None) unless every model segment recorded them (with one K)."""
    model = [s for t in trajectories for s in t.segments if s.trained]
    if not model or any(s.top_ids is None for s in model):
        return None, None
    k = model[0].top_ids.shape[1]
    ids = torch.zeros(len(trajectories), width, k, dtype=torch.long)
    logprobs = torch.zeros(len(trajectories), width, k)
    for i, t in enumerate(trajectories):
        at = 0
        for s in t.segments:
            end = at + len(s.token_ids)
            if s.trained:
                ids[i, at:end], logprobs[i, at:end] = s.top_ids, s.top_logprobs
            at = end
    return ids, logprobs


def split(rollout: Rollout, versions: torch.Tensor | None = None) -> list[Trajectory]:
    """`rollout`'s rows as trajectories: each maximal run of model tokens (loss mask 1) a model
    segment, each run of environment tokens (present, loss mask 0) an environment segment, so
    `split(collate(ts))` gives `ts` back with adjacent segments of one role merged. A row without
    tokens is one empty model segment. `versions` [N, T]: the policy version of each token (default:
    the rollout's policy_version for all); environment tokens get -1 whatever it holds there."""
    out = []
    for r in range(rollout.num_rows):
        n = int(rollout.completion_mask[r].sum())
        trained = rollout.trained_mask[r, :n] > 0                                    # [n] bool
        # Run boundaries: where the role changes, plus both ends (none for a row without tokens).
        cuts = [0, *((trained[1:] != trained[:-1]).nonzero().squeeze(1) + 1).tolist(), n] if n else [0]
        segments = []
        for a, b in itertools.pairwise(cuts):
            ids = rollout.completion_ids[r, a:b]
            if not bool(trained[a]):
                segments.append(Segment.observed(ids))
                continue
            token_versions = rollout.policy_version if versions is None else versions[r, a:b]
            top = (None, None) if rollout.sampler_top_ids is None else (
                rollout.sampler_top_ids[r, a:b], rollout.sampler_top_logprobs[r, a:b])
            segments.append(Segment.sampled(ids, rollout.sampler_logprobs[r, a:b], token_versions, *top))
        if not segments:
            segments.append(Segment.sampled(rollout.completion_ids[r, :0], rollout.sampler_logprobs[r, :0],
                                            rollout.policy_version))
        routes = None if rollout.routes is None else rollout.routes[r, : len(rollout.prompt_ids[r]) + n]
        out.append(Trajectory(prompt_ids=tuple(rollout.prompt_ids[r]), segments=tuple(segments),
                              truncated=bool(rollout.truncated[r]), group=int(rollout.group_ids[r]), routes=routes))
    return out
