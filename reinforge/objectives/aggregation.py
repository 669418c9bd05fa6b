"""Loss aggregation: the one place where per-token terms become a scalar.

Every form is written as per-token weights w [N, T] over the WHOLE optimizer
batch, so that loss = sum_{i,t} w_it l_it (ALGORITHMS.md, "Aggregation").
The learner computes the weights once for the full optimizer batch, slices
rows of (weights, terms) into micro-batches (or data-parallel ranks) and sums
the per-slice losses: sum_slices sum(w[rows] * l[rows]) = sum(w * l), so the
gradient is exactly independent of how the batch is split. Normalising each
micro-batch by its own token count instead is the classic bug (verl #906).

Conventions (choices):
- `mask` is 0/1 [N, T]; N counts every row of the batch, including rows
  with no completion tokens (they count in N for the seq_mean forms but
  get weight 0), so that dropping a row never changes other rows' weights.
- Weights are never NaN: an empty row or an all-masked batch gets all-zero
  weights (a zero count is clamped to 1; its numerator is already 0).
- Weights carry no gradient.

Data-parallel ranks: each rank holds some rows of the optimizer batch. The
batch-wide counts (tokens, sequences, per-prompt tokens) are combined through
a `BatchReduce` (all-reduce / all-gather under torch.distributed, see
reinforge.distributed); the default `LOCAL` is the single-process identity.
Then each rank's weights are exactly the rows of the single-process weights,
and the sum of the ranks' losses is the single-process loss. (DDP averages
gradients over ranks: multiply the loss by the world size there.)

Every form has the signature fn(mask, *, group_ids=None, max_length=None,
reduce=LOCAL) -> [N, T] and sits in `AGGREGATIONS`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from torch import Tensor

from reinforge.objectives.common import lookup


class BatchReduce(Protocol):
    """How the batch-wide statistics of aggregation combine across data-parallel ranks."""

    def sum(self, values: Tensor) -> Tensor:
        """Element-wise sum of `values` over all ranks (same shape on every rank)."""
        ...

    def cat(self, values: Tensor) -> Tensor:
        """Concatenation of every rank's `values` along dim 0, in rank order (sizes may differ)."""
        ...


class LocalReduce:
    """One process holds the whole optimizer batch: sums and concatenations are the identity."""

    def sum(self, values: Tensor) -> Tensor:
        return values

    def cat(self, values: Tensor) -> Tensor:
        return values


LOCAL = LocalReduce()


def _num_rows(m: Tensor, reduce: BatchReduce) -> Tensor:
    """N of the whole optimizer batch (all ranks), as a tensor."""
    return reduce.sum(torch.tensor(float(m.shape[0]), dtype=m.dtype, device=m.device))


def _float_mask(mask: Tensor) -> Tensor:
    if mask.dim() != 2:
        raise ValueError(f"mask must be [N, T], got shape {tuple(mask.shape)}")
    return mask.detach() if mask.is_floating_point() else mask.to(torch.get_default_dtype())


def token_mean(mask: Tensor, *, group_ids: Tensor | None = None, max_length: int | None = None,
                reduce: BatchReduce = LOCAL) -> Tensor:
    """w_it = m_it / sum_{j,s} m_js: every token of the batch counts equally (DAPO, arXiv 2503.14476)."""
    m = _float_mask(mask)                                                    # [N, T]
    return m / reduce.sum(m.sum()).clamp(min=1)


def seq_mean_token_mean(mask: Tensor, *, group_ids: Tensor | None = None, max_length: int | None = None,
                reduce: BatchReduce = LOCAL) -> Tensor:
    """w_it = m_it / (|y_i| N): mean over tokens, then over sequences (GRPO, arXiv 2402.03300, eq. 3)."""
    m = _float_mask(mask)                                                    # [N, T]
    lengths = m.sum(dim=1, keepdim=True).clamp(min=1)                        # [N, 1]
    return m / (lengths * _num_rows(m, reduce))


def seq_mean_token_sum(mask: Tensor, *, group_ids: Tensor | None = None, max_length: int | None = None,
                reduce: BatchReduce = LOCAL) -> Tensor:
    """w_it = m_it / N: sum over tokens, mean over sequences (REINFORCE / RLOO)."""
    m = _float_mask(mask)                                                    # [N, T]
    return m / _num_rows(m, reduce).clamp(min=1)


def seq_mean_token_sum_norm(mask: Tensor, *, group_ids: Tensor | None = None, max_length: int | None = None,
                reduce: BatchReduce = LOCAL) -> Tensor:
    """w_it = m_it / (N L_norm), a constant normaliser (Dr. GRPO, arXiv 2503.20783).

    L_norm = max_length (the generation budget, max_new_tokens) when given,
    else T, the padded width of this batch. Pass max_length to keep the
    normaliser the same across batches of different padded widths.
    """
    m = _float_mask(mask)                                                    # [N, T]
    length_norm = max_length if max_length is not None else m.shape[1]
    if length_norm <= 0:
        raise ValueError(f"max_length must be positive, got {length_norm}")
    return m / (_num_rows(m, reduce).clamp(min=1) * length_norm)


def token_sum(mask: Tensor, *, group_ids: Tensor | None = None, max_length: int | None = None,
              reduce: BatchReduce = LOCAL) -> Tensor:
    """w_it = m_it: the sum over every token of the batch, no normaliser (verl's token-sum).

    The loss and its gradient grow with the batch's token count: the learning rate that suits
    token_mean is too large here by that factor. No batch statistic, so micro-batching and ranks
    never change it.
    """
    return _float_mask(mask).clone()


def prompt_mean(mask: Tensor, *, group_ids: Tensor | None = None, max_length: int | None = None,
                reduce: BatchReduce = LOCAL) -> Tensor:
    """w_it = m_it / (P sum_{j in p(i)} |y_j|): token mean within each prompt group, then
    mean over the P prompts (ScaleRL, arXiv 2510.13786). Requires group_ids [N]."""
    if group_ids is None:
        raise ValueError("aggregation 'prompt_mean' needs group_ids")
    m = _float_mask(mask)                                                    # [N, T]
    if group_ids.shape != m.shape[:1]:
        raise ValueError(f"group_ids must be [N] = [{m.shape[0]}], got {tuple(group_ids.shape)}")
    # Prompts may span ranks: gather every row's (group id, length), sum per group.
    all_ids = reduce.cat(group_ids)                                          # [N_all]
    known = torch.unique(all_ids)                                            # [P] sorted
    group_tokens = torch.zeros(known.numel(), dtype=m.dtype, device=m.device).index_add_(
        0, torch.searchsorted(known, all_ids), reduce.cat(m.sum(dim=1))
    ).clamp(min=1)                                                           # [P]
    own = group_tokens[torch.searchsorted(known, group_ids)]                 # [N]
    return m / (known.numel() * own).unsqueeze(1)


AGGREGATIONS: dict[str, Callable[..., Tensor]] = {
    "token_mean": token_mean,
    "seq_mean_token_mean": seq_mean_token_mean,
    "seq_mean_token_sum": seq_mean_token_sum,
    "seq_mean_token_sum_norm": seq_mean_token_sum_norm,
    "prompt_mean": prompt_mean,
    "token_sum": token_sum,
}


def loss_weights(
    name: str, mask: Tensor, *, group_ids: Tensor | None = None, max_length: int | None = None,
    reduce: BatchReduce = LOCAL,
) -> Tensor:
    """Per-token weights [N, T] of aggregation `name` over the whole optimizer batch
    (this rank's rows of it when `reduce` spans data-parallel ranks)."""
    return lookup(AGGREGATIONS, name, "aggregation")(mask, group_ids=group_ids, max_length=max_length, reduce=reduce)


def aggregate(name: str, terms: Tensor, mask: Tensor, **kwargs) -> Tensor:
    """sum(loss_weights(name, mask, **kwargs) * terms): a scalar, for a batch that is not split."""
    return (loss_weights(name, mask, **kwargs) * terms).sum()


def sequence_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Per-sequence mean over valid tokens, [N, T] -> [N]: (1/|y_i|) sum_t m_it v_it.

    The building block of sequence-level objectives (GSPO's length-normalised
    log-ratio, GMPO's geometric mean). It stays within one row, so it is
    unaffected by micro-batching (rows are never split). An empty row gives 0.
    """
    valid = mask.bool()
    total = torch.where(valid, values, torch.zeros_like(values)).sum(dim=1)   # [N]
    return total / valid.sum(dim=1).clamp(min=1)


def sequence_geometric_mean(log_values: Tensor, mask: Tensor) -> Tensor:
    """Per-sequence geometric mean from logs, [N, T] -> [N]: exp((1/|y_i|) sum_t m_it log v_it).

    GMPO's aggregation (arXiv 2507.20673): the geometric mean of token ratios
    is exp of the arithmetic mean of log-ratios, which is computed in log
    space so a single extreme token cannot overflow it. An empty row gives 1.
    """
    return torch.exp(sequence_mean(log_values, mask))


def broadcast_to_tokens(per_sequence: Tensor, mask: Tensor) -> Tensor:
    """[N] -> [N, T]: the sequence's value at each of its valid tokens, 0 elsewhere.

    A sequence-level term J_i written as per-token terms: with weights that sum
    to 1/N over a row (seq_mean_token_mean) the row contributes exactly J_i / N.
    """
    expanded = per_sequence.unsqueeze(1).expand_as(mask)
    return torch.where(mask.bool(), expanded, torch.zeros_like(expanded))


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Mean of `values` over positions where mask is set; 0 for an empty mask, NaN-safe
    (NaN/inf in masked-out positions are ignored). For metrics, not for losses."""
    valid = mask.bool()
    total = torch.where(valid, values, torch.zeros_like(values)).sum()
    return total / valid.sum().clamp(min=1)
