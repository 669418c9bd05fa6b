"""Reward sources: scorers that read a whole batch at once, usually with a model of their own.

A reward function (reinforge.rewards.compose) is user code called on texts. A reward source is a
part of reinforge that scores a rollout batch in one call: a learned reward model, a generative
judge, a process reward model's step scores, a teacher's per-token log-probs (distillation). The
composer calls each configured source after the functions and combines what it returns with the
source's weight (DESIGN.md, "reward sources"):

- `values` [N]: a sequence reward per row, added to the summed reward like a function's value. NaN
  is "no score for this row" (a judge's output that does not parse): the row is skipped (no
  gradient) and counted.
- `token_values` [N, T]: terms placed on tokens, over the rollout's completion positions; the
  composer sums them (times their weights) into `RewardBatch.token_advantages`, which the learner
  adds to every model token's advantage after the advantage estimator (on-policy distillation's
  per-token reverse KL, a PRM's step-end credit). Zero on padding and environment tokens.

Each source is built from its config section by a builder (the table `SOURCE_BUILDERS` of
rewards/source_builders.py, which sits above the sources' modules), given what every source may need
(`SourceContext`); a section left at None builds nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from torch import Tensor

from reinforge.rollout.base import Rollout
from reinforge.tasks.base import Example, Task


@dataclass(frozen=True)
class SourceScores:
    """What one reward source says about one batch of N rows."""

    values: Tensor | None              # [N] float sequence rewards, NaN: no score for the row; None: none given
    token_values: Tensor | None = None  # [N, T] float per-token terms on the completion positions; None: none
    metrics: dict[str, float] = field(default_factory=dict)   # reported as reward/<key>/<name>
    unscored: int = 0                   # rows it could not score (NaN in values), counted in the metrics


class RewardSource(Protocol):
    """A batched scorer; `key` names it in the reward parts and metrics."""

    key: str
    weight: float

    def score(self, rows: list[Example], rollout: Rollout) -> SourceScores:
        """Scores of every row of `rollout`; rows[r] is row r's example."""
        ...


@dataclass(frozen=True)
class SourceContext:
    """What a source's builder may use besides its config section."""

    task: Task
    device: str                  # the run's model.device: a source's own device defaults to it
    chat_template: str           # prompt.chat_template: prompts are rendered as the rollout rendered them
    policy: Any = None           # the run's Policy (a self-judging source reads the policy itself)
    temperature: float = 1.0     # the rollout's sampling temperature (a teacher scores tokens under it)


def check_values(source: RewardSource, out: SourceScores, n: int, width: int) -> None:
    """ValueError when a source returned tensors of the wrong shape (a bug in the source, not user data)."""
    if out.values is not None and tuple(out.values.shape) != (n,):
        raise ValueError(f"reward source {source.key!r} returned values of shape {tuple(out.values.shape)}, not ({n},)")
    if out.token_values is not None and tuple(out.token_values.shape) != (n, width):
        raise ValueError(f"reward source {source.key!r} returned token values of shape "
                         f"{tuple(out.token_values.shape)}, not ({n}, {width})")


def micro_batches(n: int, size: int) -> list[range]:
    """Row ranges of at most `size` rows covering range(n), in order."""
    return [range(i, min(i + size, n)) for i in range(0, n, size)]


__all__ = ["RewardSource", "SourceContext", "SourceScores", "check_values", "micro_batches"]
