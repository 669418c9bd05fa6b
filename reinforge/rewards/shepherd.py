"""Math-Shepherd's automatic step labels (Wang et al., arXiv 2312.08935, section 3.3): no human marks a
step; the policy itself finds out whether a step still leads to the right answer.

For a sampled solution with steps s_1..s_K and each k < K, the prefix (prompt, s_1..s_k) is continued N
times by the policy, and the verifier judges each continuation's final answer:

    hard_k = 1 if any of the N continuations reaches the right answer, else 0     (section 3.3, "HE")
    soft_k = (continuations that reach it) / N                                   ("SE")

The last step's continuation is the solution itself: its label is the verifier's verdict on it.
Prefixes are continued from the sampled tokens themselves (the prompt's ids, then the solution's ids up
to the token that ends step k: rewards/process.py), never from re-encoded text, so a continuation goes
on from exactly where the policy was.
"""

from __future__ import annotations

from typing import Protocol

import torch
from transformers import PreTrainedTokenizerBase

from reinforge.rewards.process import decode_ids, rollout_steps
from reinforge.rewards.process_model import StepLabels
from reinforge.rollout.base import Rollout, SamplingParams
from reinforge.tasks.base import Example, Task


class ContinuationEngine(Protocol):
    """A rollout engine that samples from token-id contexts (NativeEngine and HFEngine both do)."""

    def generate(self, prompts: list[str], group_size: int, params: SamplingParams, policy_version: int = 0,
                 generator: torch.Generator | None = None) -> Rollout: ...

    def generate_ids(self, prompt_ids: list[list[int]], group_size: int, params: SamplingParams,
                     policy_version: int = 0, generator: torch.Generator | None = None) -> Rollout: ...


def shepherd_labels(engine: ContinuationEngine, task: Task, examples: list[Example], rollout: Rollout,
                    tokenizer: PreTrainedTokenizerBase, *, marker: str = "\n", continuations: int = 8,
                    params: SamplingParams, generator: torch.Generator | None = None,
                    contexts_per_call: int = 256) -> list[StepLabels]:
    """Each row of `rollout` (row r solves examples[rollout.group_ids[r]]) split into steps at `marker`
    and labelled step by step: `continuations` samples (N) from every step prefix but the last, drawn
    with `params` from `generator`, `contexts_per_call` prefixes per call of the engine. A row without
    steps (an empty completion) gives no record. Costs N x (steps - 1) continuations per row."""
    if continuations < 1:
        raise ValueError(f"continuations must be >= 1, got {continuations}")
    steps = rollout_steps(rollout, tokenizer, marker)
    present = rollout.completion_mask > 0
    solutions = [rollout.completion_ids[r][present[r]].tolist() for r in range(rollout.num_rows)]
    rows = [examples[int(g)] for g in rollout.group_ids]
    prefixes = [(r, k, solutions[r][: end + 1]) for r, s in enumerate(steps) for k, end in enumerate(s.token_ends[:-1])]
    reached: dict[tuple[int, int], list[bool]] = {}
    for start in range(0, len(prefixes), contexts_per_call):
        part = prefixes[start: start + contexts_per_call]
        out = engine.generate_ids([rollout.prompt_ids[r] + prefix for r, _, prefix in part], continuations, params,
                                  generator=generator)
        tails = out.completion_mask > 0
        for c, (r, k, prefix) in enumerate(part):
            texts = [decode_ids(tokenizer, prefix + out.completion_ids[j][tails[j]].tolist())
                     for j in range(c * continuations, (c + 1) * continuations)]
            reached[r, k] = [task.reward(rows[r], text) > 0 for text in texts]
    labelled = []
    for r, s in enumerate(steps):
        if not s.texts:
            continue
        final = float(task.reward(rows[r], rollout.texts[r]) > 0)
        hard = [float(any(reached[r, k])) for k in range(len(s.texts) - 1)] + [final]
        soft = [sum(reached[r, k]) / continuations for k in range(len(s.texts) - 1)] + [final]
        labelled.append(StepLabels(prompt=rows[r].prompt, steps=s.texts, hard=tuple(hard), soft=tuple(soft)))
    return labelled


def shepherd_dataset(engine: ContinuationEngine, task: Task, examples: list[Example],
                     tokenizer: PreTrainedTokenizerBase, *, samples: int = 4, marker: str = "\n",
                     continuations: int = 8, params: SamplingParams, generator: torch.Generator | None = None,
                     contexts_per_call: int = 256) -> list[StepLabels]:
    """Math-Shepherd's PRM data from the policy behind `engine`: `samples` solutions of each example
    (Math-Shepherd samples 15 per problem), each labelled by `shepherd_labels`."""
    rollout = engine.generate([e.prompt for e in examples], samples, params, generator=generator)
    return shepherd_labels(engine, task, examples, rollout, tokenizer, marker=marker, continuations=continuations,
                           params=params, generator=generator, contexts_per_call=contexts_per_call)


__all__ = ["ContinuationEngine", "shepherd_dataset", "shepherd_labels"]
