"""Records that several packages share, here below all of them so that none imports another's
producer to read one: the reward step's verdict on each row (`Scores`: made by the RL loops, read
by telemetry), and a preference pair (`PreferencePair`: read from files and sampled by the DPO
loop and the reward-model job, trained on by reinforge.rewards.reward_model), and a health
alert (`Alert`: raised by the monitors of telemetry and by the weight-sync probe of rollout).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Scores:
    """What the reward step says about each row of a rollout, [N] each."""

    rewards: torch.Tensor            # float: the reward the advantage uses
    valid: torch.Tensor              # bool: False where a reward function failed or skipped the sample
    correct: torch.Tensor            # bool: the verifier accepted the completion (pass rate, NLL term)
    metrics: dict[str, float] = field(default_factory=dict)  # the reward step's own figures
    # reward function name -> [N] raw values (samples.jsonl)
    parts: dict[str, torch.Tensor] = field(default_factory=dict)
    # [N, T] per-token terms of reward sources (distillation, process rewards), added to the advantage
    token_advantages: torch.Tensor | None = None
    # [N] float: the reward of the greedy completion of each row's prompt (ReMax's baseline, loops/baselines.py);
    # None: not generated
    baselines: torch.Tensor | None = None
    # figures of a part of the rows (one per domain of a mix, `domain_metrics`), each with its number of
    # rows: averaged over a step's rounds weighted by it (the whole batch's, as `metrics`)
    weighted_metrics: list[tuple[int, dict[str, float]]] = field(default_factory=list)

    def rows(self, rows: torch.Tensor) -> Scores:
        """These rows' scores (the metrics are the whole batch's, and stay with it)."""
        return Scores(self.rewards[rows], self.valid[rows], self.correct[rows],
                      parts={k: v[rows] for k, v in self.parts.items()},
                      token_advantages=self.token_advantages[rows] if self.token_advantages is not None else None,
                      baselines=self.baselines[rows] if self.baselines is not None else None)

    @staticmethod
    def concat(parts: list[Scores]) -> Scores:
        """Rows of several batches' scores in order; token terms right-padded with 0 to the widest."""
        tokens = [s.token_advantages for s in parts]
        if all(t is None for t in tokens):
            token_advantages = None
        else:
            width = max(t.shape[1] for t in tokens if t is not None)
            token_advantages = torch.cat([
                torch.zeros(len(s.rewards), width) if t is None else torch.nn.functional.pad(t, (0, width - t.shape[1]))
                for s, t in zip(parts, tokens, strict=True)])
        return Scores(*(torch.cat([getattr(s, name) for s in parts]) for name in ("rewards", "valid", "correct")),
                      parts={k: torch.cat([s.parts[k] for s in parts]) for k in parts[0].parts},
                      token_advantages=token_advantages,
                      baselines=None if parts[0].baselines is None else torch.cat([s.baselines for s in parts]))


@dataclass(frozen=True)
class PreferencePair:
    """A prompt and two completions of it, `chosen` preferred to `rejected`."""

    prompt: str
    chosen: str
    rejected: str


@dataclass(frozen=True)
class Alert:
    """A health alert of a run (alerts.jsonl): what went wrong at which step, and the numbers behind it."""

    step: int
    name: str
    message: str                 # one line for a person: the step, the numbers, what to try
    values: dict[str, float]     # the numbers behind the message

    def to_json(self) -> dict:
        return {"step": self.step, "alert": self.name, "message": self.message, "values": dict(self.values)}
