"""The record a rollout engine returns, and the interface engines implement.

`Rollout` crosses the boundary between generation and learning (and, later,
between processes), so every field is documented and shape-annotated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from reinforge.models.replay import ActivationRecord, concat_records
from reinforge.settings import RolloutConfig


@dataclass(frozen=True)
class SamplingParams:
    """How completions are drawn; the sampler log-probs are of exactly this distribution."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0            # 0 = off
    min_p: float = 0.0        # keep tokens with p >= min_p * max p (after temperature); 0 = off
    max_new_tokens: int = 8
    greedy: bool = False      # argmax decoding; log-probs are then of the untempered distribution
    stop: tuple[str, ...] = ()  # stop strings: a completion ends with the token that completes one
    record_top_k: int = 0     # K: record each position's K most likely ids and log-probs (native engine); 0 = off

    @property
    def truncates(self) -> bool:
        """Whether the sampling distribution drops tokens (top-k, top-p or min-p), so that its
        log-probs are of a renormalised subset of the vocabulary (learner/truncation.py)."""
        return not self.greedy and (self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0)

    @classmethod
    def from_config(cls, rollout: RolloutConfig) -> SamplingParams:
        return cls(temperature=rollout.temperature, top_p=rollout.top_p, top_k=rollout.top_k,
                   min_p=rollout.min_p, max_new_tokens=rollout.max_new_tokens, stop=tuple(rollout.stop),
                   record_top_k=rollout.record_top_k)


@dataclass
class Rollout:
    """Completions of a batch of prompts, `group_size` per prompt, rows grouped by prompt.

    Row r holds sample r % G of prompt r // G. A multi-turn row's completion is the model's turns
    and the environment's replies (tool results, user turns) in order: every one of its tokens is
    present (`completion_mask`, the learner's input sequence), only the model's are trained on
    (`trained_mask`: the loss, KL, entropy, advantages, length figures).
    """

    prompt_ids: list[list[int]]          # [N][P_i] prompt tokens of each row (no padding)
    completion_ids: torch.Tensor  # [N, T] long, right-padded with pad_id
    pad_id: int  # the id past each row's completion: the tokenizer's pad token (0 if it has none)
    completion_mask: torch.Tensor  # [N, T] float, 1 for every token present (eos included), 0 on padding
    sampler_logprobs: torch.Tensor  # [N, T] float, log-prob of each token under the sampling distribution; 0 on padding
    truncated: torch.Tensor              # [N] bool, True if no stop token came within max_new_tokens
    group_ids: torch.Tensor              # [N] long, index of the prompt in the batch
    policy_version: int                  # optimizer steps the generating weights had taken
    texts: list[str]                     # [N] decoded completions, special tokens removed
    # [N, T] float, 1 on the model's tokens (trained on), 0 on environment tokens and padding; None:
    # every present token is the model's (single-turn), i.e. completion_mask. Read it as `trained_mask`.
    loss_mask: torch.Tensor | None = None
    # [N] multi-turn rows: how each episode went (reinforge.agents.rollout.AgentRow: its conversation,
    # turns, tool calls, the environment's return); None for single-turn rollouts.
    episodes: list[Any] | None = None
    # [N, T, K] long / float: at each sampled position the sampler's K most likely token ids and their
    # log-probs under the sampling distribution (SamplingParams.record_top_k; None: not recorded).
    # Padding and environment tokens hold ids 0 and log-prob 0.
    sampler_top_ids: torch.Tensor | None = None
    sampler_top_logprobs: torch.Tensor | None = None
    # [N, S, layers, k] long, MoE models sampled by the native engine: the experts each token (prompt, then
    # completion, as build_sequences lays rows out) went to in each MoE layer; -1 where not recorded. None: none.
    routes: torch.Tensor | None = None
    # True where `sampler_logprobs` are the learner's own log-probs up to float rounding at the weights it holds
    # when it trains on the rows: the engine sampled in this process from the learner's fp32 weights, unquantised,
    # drawing from the whole tempered softmax (no top-k / top-p / min-p, not greedy), and no update came between.
    # A source that hands over rows sampled before the learner's latest update clears it (loops/async_rl.py).
    # train.old_logprobs=auto takes pi_old from them.
    logprobs_exact: bool = False
    # Where the engine kept them, every layer's activations at the completion tokens its decoding read
    # (models/replay.py), for the learner's first backward to use in place of its forward; only with
    # `logprobs_exact` (the same weights). None: not kept.
    activations: ActivationRecord | None = None

    @property
    def num_rows(self) -> int:
        return self.completion_ids.shape[0]

    @property
    def trained_mask(self) -> torch.Tensor:   # [N, T] float, 1 on the tokens the loss sees
        return self.completion_mask if self.loss_mask is None else self.loss_mask

    @property
    def lengths(self) -> torch.Tensor:   # [N] the model's (trained) tokens per row: response length figures
        return self.trained_mask.sum(dim=1)

    @property
    def present_lengths(self) -> torch.Tensor:   # [N] every token of the completion, the environment's included
        return self.completion_mask.sum(dim=1)


def environment_returns(rollout: Rollout) -> torch.Tensor | None:
    """[N] float: the return of each row's episode when an environment scores them (NaN where the episode
    failed); None when the reward functions score the rows (single-turn, or tools)."""
    if rollout.episodes is None or any(e.reward is None for e in rollout.episodes):
        return None
    return torch.tensor([e.reward for e in rollout.episodes], dtype=torch.float)


def environment_token_rewards(rollout: Rollout) -> torch.Tensor | None:
    """[N, T] float: each turn's reward on that turn's last model token, for episodes whose environment
    credits turn by turn (task.environment_reward=turn); None otherwise (one reward per row)."""
    if rollout.episodes is None or any(e.reward is None or e.result.reward_mode != "turn" for e in rollout.episodes):
        return None
    out = torch.zeros(rollout.completion_ids.shape)
    for r, episode in enumerate(rollout.episodes):
        placed = episode.result.token_rewards()
        out[r, : len(placed)] = placed
    return out


class RolloutEngine(Protocol):
    def generate(self, prompts: list[str], group_size: int, params: SamplingParams, policy_version: int = 0,
                 generator: torch.Generator | None = None) -> Rollout:
        """Sample `group_size` completions for each prompt, drawing from `generator` (None: torch's global one)."""
        ...


def select_rows(rollout: Rollout, rows: torch.Tensor) -> Rollout:
    """The rollout's rows `rows` (whole groups, in order), group ids renumbered 0..P'-1."""
    index = rows.tolist()
    _, groups = torch.unique(rollout.group_ids[rows], return_inverse=True)
    return Rollout(
        prompt_ids=[rollout.prompt_ids[i] for i in index],
        completion_ids=rollout.completion_ids[rows],
        pad_id=rollout.pad_id,
        completion_mask=rollout.completion_mask[rows],
        sampler_logprobs=rollout.sampler_logprobs[rows],
        truncated=rollout.truncated[rows],
        group_ids=groups,
        policy_version=rollout.policy_version,
        texts=[rollout.texts[i] for i in index],
        loss_mask=None if rollout.loss_mask is None else rollout.loss_mask[rows],
        episodes=None if rollout.episodes is None else [rollout.episodes[i] for i in index],
        sampler_top_ids=None if rollout.sampler_top_ids is None else rollout.sampler_top_ids[rows],
        sampler_top_logprobs=None if rollout.sampler_top_logprobs is None else rollout.sampler_top_logprobs[rows],
        routes=None if rollout.routes is None else rollout.routes[rows],
        logprobs_exact=rollout.logprobs_exact,
        activations=None if rollout.activations is None else rollout.activations.select(rows),
    )


def concat_rollouts(parts: list[Rollout]) -> Rollout:
    """Rows of several rollouts in order, completions right-padded to the widest with their common
    `pad_id`; group ids renumbered."""
    width = max(p.completion_ids.shape[1] for p in parts)
    pad_ids = {p.pad_id for p in parts}
    if len(pad_ids) != 1:
        raise ValueError(f"rollouts padded with different ids {sorted(pad_ids)} cannot be concatenated")
    (pad_id,) = pad_ids

    def pad(t: torch.Tensor, value: float) -> torch.Tensor:
        return F.pad(t, (0, width - t.shape[1]), value=value)

    offsets, groups = 0, []
    for p in parts:
        groups.append(p.group_ids + offsets)
        offsets += int(p.group_ids.max()) + 1 if p.num_rows else 0
    return Rollout(
        prompt_ids=[ids for p in parts for ids in p.prompt_ids],
        completion_ids=torch.cat([pad(p.completion_ids, pad_id) for p in parts]),
        pad_id=pad_id,
        completion_mask=torch.cat([pad(p.completion_mask, 0.0) for p in parts]),
        sampler_logprobs=torch.cat([pad(p.sampler_logprobs, 0.0) for p in parts]),
        truncated=torch.cat([p.truncated for p in parts]),
        group_ids=torch.cat(groups),
        policy_version=min(p.policy_version for p in parts),
        texts=[t for p in parts for t in p.texts],
        loss_mask=(None if all(p.loss_mask is None for p in parts)
                   else torch.cat([pad(p.trained_mask, 0.0) for p in parts])),
        episodes=None if any(p.episodes is None for p in parts) else [e for p in parts for e in p.episodes],
        sampler_top_ids=_cat_top([p.sampler_top_ids for p in parts], width),
        sampler_top_logprobs=_cat_top([p.sampler_top_logprobs for p in parts], width),
        routes=_concat_routes([p.routes for p in parts], [p.num_rows for p in parts]),
        logprobs_exact=all(p.logprobs_exact for p in parts),
        activations=concat_records([p.activations for p in parts]),
    )


def _cat_top(parts: list[torch.Tensor | None], width: int) -> torch.Tensor | None:
    """[N_i, T_i, K] parts, zero-padded to `width` and concatenated; None unless every part has them."""
    if any(p is None for p in parts):
        return None
    return torch.cat([F.pad(p, (0, 0, 0, width - p.shape[1])) for p in parts])


def _concat_routes(parts: list[torch.Tensor | None], rows: list[int]) -> torch.Tensor | None:
    """Routing records [N_i, S_i, layers, k] stacked, right-padded with -1 (a part without one: all -1)."""
    known = [p for p in parts if p is not None]
    if not known:
        return None
    length = max(p.shape[1] for p in known)
    out = torch.full((sum(rows), length, *known[0].shape[2:]), -1, dtype=torch.long)
    at = 0
    for p, n in zip(parts, rows, strict=True):
        if p is not None:
            out[at : at + n, : p.shape[1]] = p
        at += n
    return out
