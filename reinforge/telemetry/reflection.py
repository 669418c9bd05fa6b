"""Reflection words in RL samples: how often the policy writes "wait", "let me check", "verify", ...,
step by step, split by whether the verifier accepted the sample.

Why: DeepSeek-R1-Zero (arXiv 2501.12948, sec. 2.2.4, the "aha moment") reports that re-checking and
re-evaluation emerge during RL, and analyses of that claim (Liu et al., arXiv 2503.20783, sec. 2)
measure it by keyword search over samples, finding such words already in base models. This module is
that keyword search as a per-step metric, so a run shows whether reflection grows and whether it goes
with correct answers (reflection that helps) or with incorrect ones (hedging, length without progress).

Matching (`reflection_patterns`): case-insensitive; a word or phrase matches only as a whole, i.e. not
preceded or followed by a letter, digit or underscore: "wait" matches "Wait," and "wait." but not
"waiting" or "await" (list inflections as words of their own); the spaces of a phrase match any run of
whitespace ("let me\\ncheck"); hyphens are literal ("double-check" does not match "double check").
Each listed word is counted on its own, so "wait" and "wait a moment" both count in "wait a moment".

Metrics (each step, over every sampled row before curation, as `pass_rate`):
- reasoning/reflection_rate[/correct|/incorrect]: fraction of samples (of all, of those the verifier
  accepted, of those it rejected) containing at least one listed word; NaN when a step has none of the kind.
- reasoning/reflections_per_1k_tokens[/correct|/incorrect]: listed-word occurrences per 1,000 sampled
  tokens (the model's tokens). Per token rather than per sample, so that completions growing longer
  over training (Dr. GRPO, arXiv 2503.20783, sec. 3.1) do not read as more reflection by themselves.
- reasoning/reflection_words/<word>: occurrences of one word per 1,000 sampled tokens (key: the word
  lower-cased, every run of non-alphanumerics as "_": "let me check" -> let_me_check).
Across a step's generation rounds (curation refills) each figure is weighted by the rows or tokens it
is over (`Scores.weighted_metrics`), so the step's figure is the figure of all its rows.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from reinforge.settings.run import word_key

if TYPE_CHECKING:
    from reinforge.records import Scores
    from reinforge.rollout import Rollout
    from reinforge.tasks import Example

def reflection_patterns(words: Sequence[str]) -> list[re.Pattern[str]]:
    """One compiled pattern per word (see the module docstring for what matches)."""
    out = []
    for word in words:
        body = r"\s+".join(re.escape(part) for part in word.split())
        out.append(re.compile(rf"(?<!\w){body}(?!\w)", re.IGNORECASE))
    return out


def count_reflections(texts: Sequence[str], patterns: Sequence[re.Pattern[str]]) -> torch.Tensor:
    """[N, W] long: non-overlapping occurrences of word w in text r. One search of all the words first:
    most samples hold none, and each RL step counts every sample."""
    counts = torch.zeros(len(texts), len(patterns), dtype=torch.long)
    if not patterns:
        return counts
    any_word = re.compile("|".join(f"(?:{p.pattern})" for p in patterns), re.IGNORECASE)
    for r, text in enumerate(texts):
        if any_word.search(text):
            counts[r] = torch.tensor([len(p.findall(text)) for p in patterns])
    return counts


def reflection_metrics(counts: torch.Tensor, lengths: torch.Tensor, correct: torch.Tensor,
                       words: Sequence[str]) -> list[tuple[int, dict[str, float]]]:
    """The figures of one batch (module docstring), each with the number of rows or tokens it is over:
    `counts` [N, W] (count_reflections), `lengths` [N] the sampled tokens of each row, `correct` [N] bool
    (the verifier accepted the row). A figure over nothing is NaN with weight 0."""
    any_word = counts.sum(dim=1) > 0                 # [N]
    per_row = counts.sum(dim=1).float()              # [N] occurrences of any listed word
    lengths = lengths.float()
    out: list[tuple[int, dict[str, float]]] = []
    for suffix, rows in (("", torch.ones_like(correct, dtype=torch.bool)), ("/correct", correct),
                         ("/incorrect", ~correct)):
        n = int(rows.sum())
        rate = float(any_word[rows].float().mean()) if n else float("nan")
        out.append((n, {f"reasoning/reflection_rate{suffix}": rate}))
        tokens = int(lengths[rows].sum())
        per_1k = 1000.0 * float(per_row[rows].sum()) / tokens if tokens else float("nan")
        out.append((tokens, {f"reasoning/reflections_per_1k_tokens{suffix}": per_1k}))
    tokens = int(lengths.sum())
    out.append((tokens, {f"reasoning/reflection_words/{word_key(w)}":
                         1000.0 * float(counts[:, i].sum()) / tokens if tokens else float("nan")
                         for i, w in enumerate(words)}))
    return out


Score = Callable[["list[Example]", "Rollout"], "Scores"]


def with_reflection_metrics(score: Score, words: Sequence[str]) -> Score:
    """`score` whose Scores also carry the reflection figures of the scored rows, split by `Scores.correct`
    (the verifier accepted: what `pass_rate` counts). No words: `score` itself."""
    if not words:
        return score
    patterns, words = reflection_patterns(words), tuple(words)

    def scored(examples: list[Example], rollout: Rollout) -> Scores:
        scores = score(examples, rollout)
        figures = reflection_metrics(count_reflections(rollout.texts, patterns), rollout.lengths, scores.correct,
                                     words)
        return replace(scores, weighted_metrics=[*scores.weighted_metrics, *figures])

    return scored
