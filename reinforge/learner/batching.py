"""Micro-batches by length: less padding for the same gradient.

Rows of an optimizer batch are sorted by length (longest first) and packed
into micro-batches of at most `max_rows` rows and, when a token budget is
set, at most `max_tokens` padded tokens (rows x longest row). Similar lengths
share a micro-batch, so little compute goes to padding, and a memory budget
is set in tokens rather than rows. Which rows share a micro-batch never
changes the gradient: the aggregation weights come from the whole optimizer
batch (objectives.aggregation).
"""

from __future__ import annotations

import torch


def plan_micro_batches(lengths: torch.Tensor, max_rows: int, max_tokens: int | None = None) -> list[torch.Tensor]:
    """Row indices [k] of each micro-batch; every row appears exactly once.

    lengths [N]: tokens of each row (prompt + completion). A row longer than
    `max_tokens` gets a micro-batch of its own rather than an error.
    """
    if max_rows <= 0 or (max_tokens is not None and max_tokens <= 0):
        raise ValueError(f"max_rows and max_tokens must be positive, got {max_rows} and {max_tokens}")
    order = torch.argsort(lengths, descending=True, stable=True).tolist()
    plans: list[list[int]] = []
    for row in order:
        current = plans[-1] if plans else None
        # Sorted longest first: the first row of a micro-batch is its longest.
        fits = current is not None and len(current) < max_rows and (
            max_tokens is None or int(lengths[current[0]]) * (len(current) + 1) <= max_tokens
        )
        if fits:
            current.append(row)
        else:
            plans.append([row])
    return [torch.tensor(rows, dtype=torch.long) for rows in plans]
