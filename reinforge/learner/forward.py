"""How the learner runs its forward passes, as one record, and the passes themselves.

None of these choices but `truncation` changes a number beyond float rounding
(tests check the log-probs and gradients of every combination against the plain
forward): they trade memory and time only.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from transformers import PreTrainedModel

from reinforge.learner.batching import plan_micro_batches
from reinforge.learner.logprobs import completion_token_stats_chunked
from reinforge.learner.routing import routing
from reinforge.learner.sequences import SequenceBatch, TokenStats, completion_token_stats
from reinforge.learner.shared_prefix import completion_token_stats_shared
from reinforge.learner.truncation import Truncation
from reinforge.models.factory import model_device
from reinforge.settings import RolloutConfig, TrainConfig


@dataclass(frozen=True)
class ForwardPlan:
    micro_batch_size: int = 256               # rows per forward/backward at most
    micro_batch_tokens: int | None = 16384    # token budget per micro-batch (rows x longest row)
    chunk_size: int = 0                       # tokens per LM-head chunk (logprobs.py); 0: the full-logits path
    shared_prefix: bool = False               # each prompt once for its group (shared_prefix.py)
    fp32_head: bool = True                    # the LM head in fp32 (chunked and shared paths)
    # Not a memory/time choice: log-probs of the sampler's truncated distribution (top-k / top-p / min-p,
    # renormalised over the kept tokens, learner/truncation.py), so that ratios to the sampler's are 1 on-policy.
    truncation: Truncation | None = None
    routing_replay: bool = False              # MoE: route as the sampler did (learner/routing.py)
    compile: bool = False                     # CUDA, shared prefix: torch.compile the layers (compiled_layers.py)
    # Shared prefix: replay the rollout engine's activations where they are the model's (models/replay.py)
    reuse_activations: bool = False

    @classmethod
    def from_config(cls, train: TrainConfig, rollout: RolloutConfig | None = None) -> ForwardPlan:
        """The plan of train.*; with `rollout`, the policy's log-probs follow its truncation
        (train.truncated_logprobs)."""
        truncation = (Truncation.of(rollout.top_k, rollout.top_p, rollout.min_p)
                      if rollout is not None and train.truncated_logprobs else None)
        return cls(micro_batch_size=train.micro_batch_size, micro_batch_tokens=train.micro_batch_tokens,
                   chunk_size=train.logprob_chunk_size, shared_prefix=train.shared_prefix, truncation=truncation,
                   routing_replay=train.routing_replay, compile=train.compile,
                   reuse_activations=train.reuse_activations)

    def for_reference(self) -> ForwardPlan:
        """This plan for the reference model's log-probs: the full distribution (learner/truncation.py)
        and the reference's own routing (an MoE reference is not forced onto the policy's sampled
        experts, learner/routing.py): the KL penalty is to the reference's own distribution. Nor does it replay
        the policy's activations (a LoRA reference runs the policy's own parameters)."""
        return replace(self, truncation=None, routing_replay=False, reuse_activations=False)

    def micro_batches(self, batch: SequenceBatch, rows: torch.Tensor | None = None,
                      device: torch.device | str | None = None) -> list[torch.Tensor]:
        """Indices into `rows` (default: all rows of `batch`) of each micro-batch. With a shared prefix,
        a group's rows stay together, so that its prompt runs once; when the forward runs on a CUDA
        `device` (the model's), the token budget counts the positions that forward runs (each prompt
        once, `plan_micro_batches`' prompt_lengths), so a pass's fixed cost of launches is paid by
        fewer, larger micro-batches. Elsewhere (the CPU) rows x longest row, as always."""
        rows = torch.arange(batch.input_ids.shape[0]) if rows is None else rows
        groups = batch.group_ids[rows] if self.shared_prefix and batch.group_ids is not None else None
        on_gpu = device is not None and torch.device(device).type == "cuda"
        prompts = batch.starts[rows] if groups is not None and on_gpu else None
        return plan_micro_batches(batch.attention_mask[rows].sum(dim=1), self.micro_batch_size, self.micro_batch_tokens,
                                  groups=groups, prompt_lengths=prompts)


def token_stats(model: PreTrainedModel, batch: SequenceBatch, temperature: float, plan: ForwardPlan) -> TokenStats:
    """Log-probs and entropies [N, T] of the completion tokens at `temperature`, with gradients, on
    the model's device (the batch is moved there). An MoE batch with a routing record (`batch.routes`)
    adds `moe/routing_mismatch` to the stats' metrics and, with `plan.routing_replay`, replays it."""
    batch = batch.to(model_device(model))
    if batch.routes is None or plan.shared_prefix:
        return _token_stats(model, batch, temperature, plan)
    with routing(model, batch.routes, plan.routing_replay) as count:
        stats = _token_stats(model, batch, temperature, plan)
    stats.metrics.update(count.metrics())
    return stats


def _token_stats(model: PreTrainedModel, batch: SequenceBatch, temperature: float, plan: ForwardPlan) -> TokenStats:
    if plan.shared_prefix:
        if batch.group_ids is None:
            raise ValueError(
                "the shared-prefix forward needs the batch's group ids (build_sequences(..., group_ids=...))"
            )
        return completion_token_stats_shared(model, batch, batch.group_ids, temperature,
                                             chunk_size=plan.chunk_size or 1024, fp32_head=plan.fp32_head,
                                             truncation=plan.truncation, compile=plan.compile,
                                             activations=batch.activations if plan.reuse_activations else None)
    if plan.chunk_size > 0:
        return completion_token_stats_chunked(
            model, batch, temperature, chunk_size=plan.chunk_size, fp32_head=plan.fp32_head,
            truncation=plan.truncation,
        )
    return completion_token_stats(model, batch, temperature, plan.truncation)


@torch.no_grad()
def token_logprobs(model: PreTrainedModel, batch: SequenceBatch, temperature: float, plan: ForwardPlan) -> torch.Tensor:
    """Log-probs [N, T] of the completion tokens under `model`, without gradient, in micro-batches;
    on the batch's device (micro-batches run on the model's)."""
    out = torch.zeros_like(batch.completion_mask)
    for rows in plan.micro_batches(batch, device=model_device(model)):
        part = batch.rows(rows)
        out[rows, : part.completion_ids.shape[1]] = token_stats(model, part, temperature, plan).logprobs.to(out.device)
    return out
