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


def plan_micro_batches(lengths: torch.Tensor, max_rows: int, max_tokens: int | None = None,
                       groups: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Row indices [k] of each micro-batch; every row appears exactly once.

    lengths [N]: tokens of each row (prompt + completion). A row longer than
    `max_tokens` gets a micro-batch of its own rather than an error. With
    `groups` [N], the units packed are groups (by their longest row), not
    rows: a group's rows share a micro-batch, split only when the group alone
    exceeds `max_rows` (for the shared-prefix forward, which runs each
    group's prompt once per micro-batch).
    """
    if max_rows <= 0 or (max_tokens is not None and max_tokens <= 0):
        raise ValueError(f"max_rows and max_tokens must be positive, got {max_rows} and {max_tokens}")
    if groups is None:
        units = [[row] for row in range(len(lengths))]
    else:
        members: dict[int, list[int]] = {}
        for row, group in enumerate(groups.tolist()):
            members.setdefault(group, []).append(row)
        units = [rows[i : i + max_rows] for rows in members.values() for i in range(0, len(rows), max_rows)]
    longest = [max(int(lengths[r]) for r in unit) for unit in units]
    order = sorted(range(len(units)), key=lambda u: -longest[u])     # stable: ties keep their order
    plans: list[list[int]] = []
    width = 0                                                        # longest row of the last micro-batch
    for u in order:
        unit, current = units[u], plans[-1] if plans else None
        # Sorted longest first: the first unit of a micro-batch holds its longest row.
        fits = current is not None and len(current) + len(unit) <= max_rows and (
            max_tokens is None or width * (len(current) + len(unit)) <= max_tokens
        )
        if fits:
            current.extend(unit)
        else:
            plans.append(list(unit))
            width = longest[u]
    return [torch.tensor(rows, dtype=torch.long) for rows in plans]
