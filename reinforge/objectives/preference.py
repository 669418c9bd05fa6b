"""Preference losses (the DPO family): per-pair terms over summed sequence log-probs.

Inputs are, per preference pair p, the response log-probs SUMMED over the
response tokens, under the policy and under the frozen reference, for the
chosen (w) and the rejected (l) response. With the implicit rewards

    h_w = logp(y_w) - ref(y_w),   h_l = logp(y_l) - ref(y_l),   z = h_w - h_l

(ALGORITHMS.md, the dpo recipe row) every loss is a function of the margin z
only, fn(*, margin, beta, label_smoothing) -> [P], and sits in
`PREFERENCE_LOSSES`. `preference_loss` returns the unreduced per-pair losses;
the caller takes the mean over pairs (the dpo recipe's aggregation).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from reinforge.objectives.common import resolve


@dataclass
class PreferenceOutput:
    """What `preference_loss` returns: unreduced per-pair losses and batch metrics."""

    losses: Tensor                                                 # [P] per-pair loss, not reduced
    metrics: dict[str, float] = field(default_factory=dict)        # batch means over pairs, see preference_loss


def sigmoid(*, margin: Tensor, beta: float, label_smoothing: float = 0.0) -> Tensor:
    """DPO (arXiv 2305.18290, eq. 7), with conservative label smoothing s (cDPO):

        l = -(1 - s) log sigmoid(beta z) - s log sigmoid(-beta z)

    s = 0 is DPO. s > 0 treats each label as flipped with probability s
    (Mitchell 2023, "A note on DPO with noisy preferences & relationship to
    IPO"); since log sigmoid(x) - log sigmoid(-x) = x, l = l_DPO + s beta z,
    so the loss no longer vanishes as z -> inf and stops pushing the margin
    once sigmoid(beta z) = 1 - s. s = 0.5 makes l even in z (no preference).
    Written with logsigmoid, finite for any finite z.
    dl/dz = -beta [(1 - s) sigmoid(-beta z) - s sigmoid(beta z)].
    """
    if not 0.0 <= label_smoothing <= 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5], got {label_smoothing}")
    logits = beta * margin                                                     # [P]
    return -(1.0 - label_smoothing) * F.logsigmoid(logits) - label_smoothing * F.logsigmoid(-logits)


def ipo(*, margin: Tensor, beta: float, label_smoothing: float = 0.0) -> Tensor:
    """IPO (arXiv 2310.12036, eq. 17, with beta as its tau):

        l = (z - 1 / (2 beta))^2,   minimal (0) at z = 1 / (2 beta);  dl/dz = 2 (z - 1 / (2 beta))

    A squared loss regresses the margin to a finite target instead of pushing
    it to infinity, so it does not overfit deterministic preferences. z is
    the difference of SUMMED log-ratios (ALGORITHMS.md; TRL averages over
    tokens instead). Label smoothing is not defined for IPO.
    """
    if label_smoothing != 0.0:
        raise ValueError(f"loss_type 'ipo' takes no label_smoothing, got {label_smoothing}")
    return (margin - 1.0 / (2.0 * beta)) ** 2


PREFERENCE_LOSSES: dict[str, Callable[..., Tensor]] = {
    "sigmoid": sigmoid,
    "ipo": ipo,
}


def preference_loss(
    *,
    chosen_logprobs: Tensor,                # [P] policy log-prob of y_w, summed over its tokens
    rejected_logprobs: Tensor,              # [P] policy log-prob of y_l, summed
    ref_chosen_logprobs: Tensor,            # [P] reference log-prob of y_w, summed
    ref_rejected_logprobs: Tensor,          # [P] reference log-prob of y_l, summed
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
) -> PreferenceOutput:
    """Per-pair preference losses of `loss_type` (a PREFERENCE_LOSSES key or "module:function").

    The reference log-probs are detached: the reference is frozen. metrics
    (floats; 0.0 for P = 0):
    - reward_chosen / reward_rejected: mean of beta h_w / beta h_l;
    - reward_margin: mean of beta (h_w - h_l);
    - reward_accuracy: fraction of pairs with h_w > h_l (a tie counts as wrong).
    """
    shapes = {t.shape for t in (chosen_logprobs, rejected_logprobs, ref_chosen_logprobs, ref_rejected_logprobs)}
    if len(shapes) != 1 or chosen_logprobs.dim() != 1:
        raise ValueError(f"preference inputs must all be [P], got shapes {sorted(tuple(s) for s in shapes)}")
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    loss_fn = resolve(PREFERENCE_LOSSES, loss_type, "preference loss")
    chosen = chosen_logprobs - ref_chosen_logprobs.detach()                    # [P] h_w
    rejected = rejected_logprobs - ref_rejected_logprobs.detach()              # [P] h_l
    margin = chosen - rejected                                                 # [P] z
    losses = loss_fn(margin=margin, beta=beta, label_smoothing=label_smoothing)
    with torch.no_grad():
        count = max(margin.numel(), 1)
        metrics = {
            "reward_chosen": (beta * chosen.sum() / count).item(),
            "reward_rejected": (beta * rejected.sum() / count).item(),
            "reward_margin": (beta * margin.sum() / count).item(),
            "reward_accuracy": ((chosen > rejected).sum() / count).item(),
        }
    return PreferenceOutput(losses=losses, metrics=metrics)
