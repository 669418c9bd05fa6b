"""Prompt + completion rows as right-padded model inputs, and per-token log-probs
of the completion tokens aligned to the rollout's [N, T] layout.

Two masks go in, one stays: the input sequence holds every present completion token (a multi-turn
row's environment tokens are context for the model's next turn), while the batch's
`completion_mask` is the loss mask, 1 on the tokens trained on only. Everything downstream (log-
probs, losses, KL, entropy, advantages, metrics) reads that one mask, so an environment token is
seen as input and never as a target."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch
from transformers import PreTrainedModel

from reinforge.learner.truncation import Truncation, kept_log_mass
from reinforge.models.replay import ActivationRecord


@dataclass
class SequenceBatch:
    """Right-padded full sequences; completion token t of row i sits at input position starts[i] + t
    (by column: an environment token in the middle keeps its column, it is just not trained on)."""

    input_ids: torch.Tensor       # [N, L] long, prompt then every present completion token, right-padded
    attention_mask: torch.Tensor  # [N, L] long, 1 on the present tokens
    starts: torch.Tensor          # [N] long, prompt length of each row
    completion_ids: torch.Tensor  # [N, T] long
    # [N, T] float, the loss mask: 1 on the completion tokens trained on; 0 on environment tokens
    # (in input_ids as context) and on padding
    completion_mask: torch.Tensor
    group_ids: torch.Tensor | None = None  # [N] long, rows with one id share their prompt (None: unknown)
    # [N, T, K] long: extra token ids per completion position whose log-probs the forward also returns
    # (TokenStats.top_logprobs, no gradient): the sampler's top-K (Rollout.sampler_top_ids); None: none
    top_ids: torch.Tensor | None = None
    # [N, L, layers, k] long, MoE: the experts the sampler chose for each input token in each MoE layer
    # (-1: not recorded, the learner's router chooses); replayed by learner/routing.py. None: no record.
    routes: torch.Tensor | None = None
    # The rollout engine's activations at these rows' completion tokens (models/replay.py), which the learner's
    # first backward may take in place of its forward (train.reuse_activations); None: none kept.
    activations: ActivationRecord | None = None

    def to(self, device: torch.device) -> SequenceBatch:
        """The same rows on `device` (this batch itself when it is there already; the CPU engine's activations
        do not travel)."""
        if self.input_ids.device == device:
            return self
        return SequenceBatch(**{f.name: None if getattr(self, f.name) is None else getattr(self, f.name).to(device)
                                for f in fields(self) if f.name != "activations"})

    def rows(self, index: torch.Tensor) -> SequenceBatch:
        """The sub-batch of the given rows, trimmed to its own longest sequence."""
        present = self.attention_mask[index].sum(dim=1)                     # [n] prompt + completion tokens
        length = int(present.max().item()) if len(index) else 0
        # Completion columns from presence: the loss mask may end before a row's last (environment) token.
        width = int((present - self.starts[index]).max().item()) if len(index) else 0
        width = max(width, 1)
        return SequenceBatch(
            input_ids=self.input_ids[index, :length],
            attention_mask=self.attention_mask[index, :length],
            starts=self.starts[index],
            completion_ids=self.completion_ids[index, :width],
            completion_mask=self.completion_mask[index, :width],
            group_ids=None if self.group_ids is None else self.group_ids[index],
            top_ids=None if self.top_ids is None else self.top_ids[index, :width],
            routes=None if self.routes is None else self.routes[index, :length],
            activations=None if self.activations is None else self.activations.select(index),
        )


def build_sequences(
    prompt_ids: list[list[int]],
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    pad_id: int,
    group_ids: torch.Tensor | None = None,
    loss_mask: torch.Tensor | None = None,
    routes: torch.Tensor | None = None,
    top_ids: torch.Tensor | None = None,
) -> SequenceBatch:
    """The rows as model inputs. completion_mask [N, T]: the tokens present (a prefix of each row,
    right-padded); loss_mask [N, T]: those trained on (None: all present ones), the batch's
    `completion_mask`. routes [N, S, layers, k]: the rollout's routing record (`Rollout.routes`).
    top_ids [N, T, K]: extra ids whose log-probs the forward returns too (or None)."""
    # Whole-batch ops, not a loop over rows: at an RL batch's 64 rows the loop's ~1,000 small ops were
    # ~4 ms of a 0.1 s step (tiny model, benchmarks/vs_trl.py).
    starts = torch.tensor([len(p) for p in prompt_ids], dtype=torch.long)
    lengths = completion_mask.sum(dim=1).long()
    width = max(len(p) for p in prompt_ids)
    prompts = torch.tensor([[*p, *[pad_id] * (width - len(p))] for p in prompt_ids], dtype=torch.long)
    total = starts + lengths
    columns = torch.arange(int(total.max()), dtype=torch.long)[None]                  # [1, L]
    attention_mask = (columns < total[:, None]).long()
    completion_at = columns - starts[:, None]                                            # [N, L]
    in_completion = (completion_at >= 0) & (completion_at < lengths[:, None])
    input_ids = torch.full(attention_mask.shape, pad_id, dtype=torch.long)
    input_ids[:, :width] = prompts[:, : input_ids.shape[1]]
    if completion_ids.shape[1]:
        picked = completion_ids.gather(1, completion_at.clamp(0, completion_ids.shape[1] - 1))
        input_ids = torch.where(in_completion, picked, input_ids)
    return SequenceBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        starts=starts,
        completion_ids=completion_ids,
        completion_mask=(completion_mask if loss_mask is None else loss_mask).float(),
        group_ids=group_ids,
        top_ids=top_ids,
        routes=None if routes is None else _fit_routes(routes, input_ids.shape[1]),
    )


def _fit_routes(routes: torch.Tensor, length: int) -> torch.Tensor:
    """A routing record [N, S, layers, k] cut or -1-padded to the input width `length`."""
    if routes.shape[1] >= length:
        return routes[:, :length]
    pad = torch.full((routes.shape[0], length - routes.shape[1], *routes.shape[2:]), -1, dtype=routes.dtype)
    return torch.cat([routes, pad], dim=1)


@dataclass
class TokenStats:
    logprobs: torch.Tensor  # [N, T] log-prob of each completion token (0 on padding)
    entropy: torch.Tensor   # [N, T] entropy of the full next-token distribution (0 on padding)
    # [N, T, K] detached log-probs of the batch's top_ids at each position (0 off the mask); None without top_ids
    top_logprobs: torch.Tensor | None = None
    metrics: dict[str, float] = field(default_factory=dict)   # what the forward measured (MoE: routing mismatch)


def completion_token_stats(model: PreTrainedModel, batch: SequenceBatch, temperature: float = 1.0,
                           truncation: Truncation | None = None) -> TokenStats:
    """Log-probs and entropies of the completion tokens under `model`.

    The logits are divided by the sampling temperature so that, at equal
    weights, these log-probs are of the same distribution the sampler drew
    from (the ratio exp(logp - mu) is then 1 up to numerics); with `truncation`
    (the sampler's top-k / top-p / min-p), renormalised over the kept tokens as the
    sampler's were (learner/truncation.py). The entropy is the full distribution's.
    """
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits  # [N, L, V]
    n, t = batch.completion_ids.shape
    # Position starts[i] - 1 + j predicts completion token j.
    positions = (batch.starts.unsqueeze(1) - 1 + torch.arange(t, device=batch.starts.device).unsqueeze(0)).clamp(
        max=logits.shape[1] - 1
    )
    picked = logits.gather(1, positions.unsqueeze(-1).expand(n, t, logits.shape[-1])).float() / temperature  # [N, T, V]
    logsumexp = torch.logsumexp(picked, dim=-1)
    token_logits = picked.gather(-1, batch.completion_ids.unsqueeze(-1)).squeeze(-1)
    logprobs = token_logits - logsumexp
    if truncation is not None:
        logprobs = logprobs - kept_log_mass(picked, truncation)
    logprobs = logprobs * batch.completion_mask
    probs = torch.softmax(picked, dim=-1)
    entropy = (logsumexp - (probs * picked).sum(dim=-1)) * batch.completion_mask
    top = None
    if batch.top_ids is not None:   # the sampler's top-K ids, under the same (truncated) distribution
        scores = picked.detach()
        if truncation is not None:
            scores = scores.masked_fill(~truncation.kept(scores.reshape(-1, scores.shape[-1])).view(scores.shape),
                                        float("-inf"))
        top = scores.gather(-1, batch.top_ids) - scores.logsumexp(dim=-1, keepdim=True)         # [N, T, K]
        top = torch.where(batch.completion_mask.unsqueeze(-1) > 0, top, torch.zeros_like(top))
    return TokenStats(logprobs=logprobs, entropy=entropy, top_logprobs=top)

