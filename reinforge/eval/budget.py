"""Accuracy against a token budget (test-time scaling): held-out pass@1 when generation is cut at B
new tokens, for each B of eval.token_budgets.

Why: reasoning models trade tokens for accuracy (DeepSeek-R1, arXiv 2501.12948, sec. 2.2.4: accuracy
grows with the thinking time RL teaches; s1, arXiv 2501.19393: accuracy against a thinking-token
budget as the measure of test-time scaling). The curve says whether RL made the model need more tokens to be
right, and how much accuracy a shorter generation limit would cost.

How, without generating once per budget: each sample is generated once up to rollout.max_new_tokens M,
and its first B tokens are decoded and verified. That is what a generation limited to B tokens returns,
because a sample's first B tokens do not depend on the limit: token t is drawn from the model given the
tokens before it, with the t-th draw of the sample's own random stream (the native engine keys each
prompt's stream, rollout/sampling.py; the transformers engine draws every row's step-t uniforms together
from one generator, and up to step B the same rows are being decoded whatever M is), and the limit only
decides when decoding stops. A sample that ended (eos, a stop string) within B tokens is unchanged; one
still going at B is judged on its cut text, as the limited generation would be (the answer must be
complete within B tokens). tests/unit/telemetry/test_reasoning_analytics.py checks it against generating with
max_new_tokens=B.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from reinforge.rollout import Rollout


def cut_texts(rollout: Rollout, budget: int, decode: Callable[[list[list[int]]], list[str]]) -> list[str]:
    """[N] each row's completion cut at `budget` tokens, decoded as the engine decodes a completion
    (special tokens removed); rows of at most `budget` tokens keep their text."""
    if rollout.loss_mask is not None or rollout.episodes is not None:
        raise ValueError("token budgets cut single-turn completions; an episode has turns of its own "
                         "(set eval.token_budgets=[])")
    lengths = rollout.completion_mask.sum(dim=1).long()     # [N] tokens present (eos included)
    out = list(rollout.texts)
    cut = (lengths > budget).nonzero().flatten().tolist()
    if cut:
        decoded = decode([rollout.completion_ids[r, :budget].tolist() for r in cut])
        for r, text in zip(cut, decoded, strict=True):
            out[r] = text
    return out


def budget_correct(rollout: Rollout, budgets: Sequence[int], decode: Callable[[list[list[int]]], list[str]],
                   verify: Callable[[list[str]], list[bool]]) -> dict[int, torch.Tensor]:
    """Budget B -> [N] bool: row r's completion cut at B tokens is accepted by `verify` (the evaluation's
    verifier over the rows' texts, in row order)."""
    return {b: torch.tensor(verify(cut_texts(rollout, b, decode)), dtype=torch.bool) for b in budgets}
