"""The offline difficulty filter (`reinforge filter`): keep the prompts a model finds neither
trivial nor hopeless.

For each train prompt, sample k completions with the model and verify them;
keep the prompt when its pass rate lies in [lo, hi] (ALGORITHMS.md, "Offline
difficulty filter"). Prompts every sample solves, or none does, give a GRPO
group no reward variance, hence no gradient: filtering them before training
spends the rollout budget where the model can learn (as Skywork-OR1,
Polaris and Olmo 3 do with their pass-rate filters).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from reinforge.data.chat import Conversation
from reinforge.rollout import RolloutEngine, SamplingParams
from reinforge.tasks import Example, Task


@dataclass(frozen=True)
class DifficultyReport:
    kept: int
    too_easy: int          # pass rate above hi
    too_hard: int          # pass rate below lo
    pass_rates: list[float]


def pass_rates(engine: RolloutEngine, task: Task, examples: list[Example], k: int, sampling: SamplingParams,
               batch_prompts: int = 64) -> list[float]:
    """Fraction of k sampled completions the task's verifier accepts, per example."""
    rates: list[float] = []
    for start in range(0, len(examples), batch_prompts):
        chunk = examples[start : start + batch_prompts]
        rollout = engine.generate([e.prompt for e in chunk], k, sampling)
        for p, example in enumerate(chunk):
            texts = rollout.texts[p * k : (p + 1) * k]
            rates.append(sum(task.reward(example, t) > 0 for t in texts) / k)
    return rates


def write_filtered(path: Path, examples: list[Example], rates: list[float], lo: float, hi: float) -> DifficultyReport:
    """Write the examples with lo <= pass rate <= hi as JSONL rows {prompt, answer, pass_rate, **meta},
    which `task.name=dataset` reads back."""
    if not 0.0 <= lo <= hi <= 1.0:
        raise ValueError(f"need 0 <= lo <= hi <= 1, got lo={lo}, hi={hi}")
    path.parent.mkdir(parents=True, exist_ok=True)
    kept = 0
    with path.open("w") as out:
        for example, rate in zip(examples, rates, strict=True):
            if lo <= rate <= hi:
                # A chat prompt is written as its messages, so that the file reads back as the same conversation.
                prompt = example.prompt.as_list() if isinstance(example.prompt, Conversation) else example.prompt
                out.write(json.dumps({"prompt": prompt, "answer": example.answer, "pass_rate": rate,
                                      **example.meta}) + "\n")
                kept += 1
    return DifficultyReport(kept=kept, too_easy=sum(r > hi for r in rates), too_hard=sum(r < lo for r in rates),
                            pass_rates=rates)
