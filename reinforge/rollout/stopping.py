"""Where a completion ends: the first stop token, or the first stop string.

Shared by every engine so that "what counts as the completion" is one rule:
the tokens up to and including the one that ends it; a completion that no
stop token or stop string ended within `max_new_tokens` is truncated.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedTokenizerBase


def completion_mask(completion_ids: torch.Tensor, eos_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask of tokens up to and including the first stop token; truncated = no stop token.

    Returns (mask [N, T] float, truncated [N] bool).
    """
    is_eos = torch.isin(completion_ids, torch.tensor(eos_ids))
    # Tokens strictly after the first eos have a cumulative eos count >= 1 before them.
    eos_before = torch.cumsum(is_eos.long(), dim=1) - is_eos.long()
    mask = (eos_before == 0).float()
    truncated = ~is_eos.any(dim=1)
    return mask, truncated


def stop_string_end(tokenizer: PreTrainedTokenizerBase, ids: list[int], stops: tuple[str, ...]) -> int | None:
    """Number of leading tokens of `ids` whose text first contains one of `stops`, or None.

    The token that completes the stop string is kept (its text may run past the
    stop string: tokens are not split). Quadratic in the length, which is why
    engines call it only when stop strings are set.
    """
    if not stops:
        return None
    if not any(s in tokenizer.decode(ids, skip_special_tokens=True) for s in stops):
        return None
    lo, hi = 1, len(ids)   # the shortest prefix that contains a stop string: text only grows with the prefix
    while lo < hi:
        mid = (lo + hi) // 2
        if any(s in tokenizer.decode(ids[:mid], skip_special_tokens=True) for s in stops):
            hi = mid
        else:
            lo = mid + 1
    return lo


def apply_stop_strings(
    tokenizer: PreTrainedTokenizerBase, completion_ids: torch.Tensor, mask: torch.Tensor, truncated: torch.Tensor,
    stops: tuple[str, ...],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cut each row's mask after its first stop string (a row so cut is not truncated).

    Returns the new (mask [N, T], truncated [N]); the inputs are not modified.
    """
    if not stops:
        return mask, truncated
    mask, truncated = mask.clone(), truncated.clone()
    for row in range(completion_ids.shape[0]):
        kept = int(mask[row].sum())
        end = stop_string_end(tokenizer, completion_ids[row, :kept].tolist(), stops)
        if end is not None:
            mask[row, end:] = 0.0
            truncated[row] = False
    return mask, truncated
