"""SFT data that is not the task's teacher: the model's own verified samples, or a teacher's traces from a file.

- `rejection_sample`: rejection-sampling fine-tuning data (RFT, arXiv 2308.01825; the
  rejection-sampling SFT stage of DeepSeek-R1, arXiv 2501.12948 sec. 2.3.3): sample N
  completions per prompt, keep the ones the verifier accepts, drop repeats of the same
  completion (RFT counts distinct reasoning paths), keep at most `max_per_prompt` per prompt
  so that easy prompts do not crowd out hard ones.
- `distillation_examples`: (prompt, completion) traces of a teacher model, read from a file.

Both return `SFTExample`s for `loops.sft.run_sft`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from reinforge.data import load_records
from reinforge.rollout import RolloutEngine, SamplingParams
from reinforge.tasks import Example, SFTExample, Task


@dataclass(frozen=True)
class RejectionResult:
    """What rejection sampling kept, and how much it threw away where."""

    examples: list[SFTExample]      # kept samples, prompt by prompt in input order, samples in draw order
    kept: list[int]                 # [P] kept samples per prompt
    accepted: list[int]             # [P] samples the verifier accepted (that ended), before dedup and cap
    samples: int                    # completions drawn: P x samples_per_prompt
    duplicates_removed: int         # accepted samples identical to an earlier accepted one of the same prompt
    capped: int                     # distinct accepted samples dropped by max_per_prompt
    truncated_rejected: int         # accepted by the verifier but cut at max_new_tokens (never ended): not kept

    @property
    def acceptance_rate(self) -> float:
        """Accepted samples / samples drawn."""
        return sum(self.accepted) / self.samples if self.samples else 0.0

    def metrics(self) -> dict[str, float]:
        prompts = len(self.kept)
        return {
            "rejection/acceptance_rate": self.acceptance_rate,
            "rejection/kept": float(len(self.examples)),
            "rejection/prompts_covered": sum(k > 0 for k in self.kept) / prompts if prompts else 0.0,
            "rejection/duplicates_removed": float(self.duplicates_removed),
            "rejection/capped": float(self.capped),
            "rejection/truncated_rejected": float(self.truncated_rejected),
        }


def rejection_sample(
    engine: RolloutEngine,
    task: Task,
    examples: list[Example],
    samples_per_prompt: int,
    sampling: SamplingParams,
    max_per_prompt: int,
    seed: int,
    batch_prompts: int = 64,
) -> RejectionResult:
    """Sample `samples_per_prompt` completions of each example; keep the verified-correct ones
    (reward >= 1.0, as in evaluation) that ended within max_new_tokens, the first of identical
    completions of a prompt, at most `max_per_prompt` per prompt.

    Sampling runs under its own `seed` and leaves the caller's RNG state untouched (as evaluation).
    A sample cut at max_new_tokens is not kept even when the verifier accepts it: SFT would teach
    the model to stop where the sampler cut it.
    """
    if samples_per_prompt <= 0 or max_per_prompt <= 0:
        raise ValueError(
            f"samples_per_prompt and max_per_prompt must be > 0, got {samples_per_prompt} and {max_per_prompt}"
        )
    kept_examples: list[SFTExample] = []
    kept, accepted = [], []
    duplicates = capped = truncated_rejected = 0
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        for start in range(0, len(examples), batch_prompts):
            chunk = examples[start : start + batch_prompts]
            rollout = engine.generate([e.prompt for e in chunk], samples_per_prompt, sampling)
            for i, example in enumerate(chunk):
                rows = range(i * samples_per_prompt, (i + 1) * samples_per_prompt)
                verified = [r for r in rows if task.reward(example, rollout.texts[r]) >= 1.0]
                ended = [r for r in verified if not bool(rollout.truncated[r])]
                distinct = list(dict.fromkeys(rollout.texts[r] for r in ended))
                truncated_rejected += len(verified) - len(ended)
                duplicates += len(ended) - len(distinct)
                capped += max(len(distinct) - max_per_prompt, 0)
                chosen = distinct[:max_per_prompt]
                kept_examples += [SFTExample(example.prompt, text, True) for text in chosen]
                kept.append(len(chosen))
                accepted.append(len(ended))
    return RejectionResult(
        examples=kept_examples,
        kept=kept,
        accepted=accepted,
        samples=len(examples) * samples_per_prompt,
        duplicates_removed=duplicates,
        capped=capped,
        truncated_rejected=truncated_rejected,
    )


def distillation_examples(
    path: str, fields: Mapping[str, str] | None = None, *, split: str | None = None
) -> list[SFTExample]:
    """A teacher's (prompt, completion) traces from a JSONL / Parquet / datasets file, as SFT examples.

    `fields` maps prompt / completion to the file's columns, e.g. {"completion": "response"}. A bad
    row raises DatasetError naming its row (reinforge.data.loading). The traces are taken as the
    teacher wrote them (correct=True): nothing here verifies them.
    """
    records = load_records(path, fields, split=split, required=("prompt", "completion"))
    return [SFTExample(r["prompt"], r["completion"], True) for r in records]
