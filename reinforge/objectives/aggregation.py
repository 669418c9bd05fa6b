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

Every form has the signature fn(mask, *, group_ids=None, max_length=None)
-> [N, T] and sits in `AGGREGATIONS`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from reinforge.objectives.common import Groups, lookup


def _float_mask(mask: Tensor) -> Tensor:
    if mask.dim() != 2:
        raise ValueError(f"mask must be [N, T], got shape {tuple(mask.shape)}")
    return mask.detach() if mask.is_floating_point() else mask.to(torch.get_default_dtype())


def token_mean(mask: Tensor, *, group_ids: Tensor | None = None, max_length: int | None = None) -> Tensor:
    """w_it = m_it / sum_{j,s} m_js: every token of the batch counts equally (DAPO, arXiv 2503.14476)."""
    m = _float_mask(mask)                                                    # [N, T]
    return m / m.sum().clamp(min=1)


def seq_mean_token_mean(mask: Tensor, *, group_ids: Tensor | None = None, max_length: int | None = None) -> Tensor:
    """w_it = m_it / (|y_i| N): mean over tokens, then over sequences (GRPO, arXiv 2402.03300, eq. 3)."""
    m = _float_mask(mask)                                                    # [N, T]
    lengths = m.sum(dim=1, keepdim=True).clamp(min=1)                        # [N, 1]
    return m / (lengths * m.shape[0])


def seq_mean_token_sum(mask: Tensor, *, group_ids: Tensor | None = None, max_length: int | None = None) -> Tensor:
    """w_it = m_it / N: sum over tokens, mean over sequences (REINFORCE / RLOO)."""
    m = _float_mask(mask)                                                    # [N, T]
    return m / max(m.shape[0], 1)


def seq_mean_token_sum_norm(mask: Tensor, *, group_ids: Tensor | None = None, max_length: int | None = None) -> Tensor:
    """w_it = m_it / (N L_norm), a constant normaliser (Dr. GRPO, arXiv 2503.20783).

    L_norm = max_length (the generation budget, max_new_tokens) when given,
    else T, the padded width of this batch. Pass max_length to keep the
    normaliser the same across batches of different padded widths.
    """
    m = _float_mask(mask)                                                    # [N, T]
    length_norm = max_length if max_length is not None else m.shape[1]
    if length_norm <= 0:
        raise ValueError(f"max_length must be positive, got {length_norm}")
    return m / (max(m.shape[0], 1) * length_norm)


def prompt_mean(mask: Tensor, *, group_ids: Tensor | None = None, max_length: int | None = None) -> Tensor:
    """w_it = m_it / (P sum_{j in p(i)} |y_j|): token mean within each prompt group, then
    mean over the P prompts (ScaleRL, arXiv 2510.13786). Requires group_ids [N]."""
    if group_ids is None:
        raise ValueError("aggregation 'prompt_mean' needs group_ids")
    m = _float_mask(mask)                                                    # [N, T]
    if group_ids.shape != m.shape[:1]:
        raise ValueError(f"group_ids must be [N] = [{m.shape[0]}], got {tuple(group_ids.shape)}")
    groups = Groups.of(group_ids)
    group_tokens = groups.sum(m.sum(dim=1)).clamp(min=1)                     # [P]
    return m / (groups.num_groups * group_tokens[groups.index]).unsqueeze(1)


AGGREGATIONS: dict[str, Callable[..., Tensor]] = {
    "token_mean": token_mean,
    "seq_mean_token_mean": seq_mean_token_mean,
    "seq_mean_token_sum": seq_mean_token_sum,
    "seq_mean_token_sum_norm": seq_mean_token_sum_norm,
    "prompt_mean": prompt_mean,
}


def loss_weights(
    name: str, mask: Tensor, *, group_ids: Tensor | None = None, max_length: int | None = None
) -> Tensor:
    """Per-token weights [N, T] of aggregation `name` over the whole optimizer batch."""
    return lookup(AGGREGATIONS, name, "aggregation")(mask, group_ids=group_ids, max_length=max_length)


def aggregate(name: str, terms: Tensor, mask: Tensor, **kwargs) -> Tensor:
    """sum(loss_weights(name, mask, **kwargs) * terms): a scalar, for a batch that is not split."""
    return (loss_weights(name, mask, **kwargs) * terms).sum()


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Mean of `values` over positions where mask is set; 0 for an empty mask, NaN-safe
    (NaN/inf in masked-out positions are ignored). For metrics, not for losses."""
    valid = mask.bool()
    total = torch.where(valid, values, torch.zeros_like(values)).sum()
    return total / valid.sum().clamp(min=1)
