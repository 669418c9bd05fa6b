"""What the model writes: a few samples of an RL step, as RUN_DIR/samples.jsonl lines.

Every `log.samples_every` RL steps, and at the last step of the run, the
recorder takes `log.samples_per_step` rows of the step's trained batch
(`StepSamples`, what the learner saw) and writes one JSON line per row:

    step              the RL step
    prompt            the example's prompt (before the chat template)
    answer            the example's gold answer
    completion        the decoded completion, special tokens removed (a multi-turn row: its last turn,
                      what the reward functions scored)
    completion_tokens the completion's token ids (eos included, no padding; a multi-turn row's
                      environment tokens too)
    rewards           each reward function's raw value by name (null: it raised or declined)
    reward            the total reward the advantage used (null: the sample was not valid)
    advantage         the sample's advantage (critic recipes: the mean of its per-token advantages
                      over the model's tokens)
    trained           whether the loss saw the row (curation and advantage transforms may drop it)
    truncated         max_new_tokens cut it (a multi-turn row: a turn, or a trajectory limit)

A multi-turn row (tools, an environment: docs/agents.md) adds `trajectory` (its whole conversation as
{role, content} messages, the opening included), `turns`, `stop_reason` and `error` (why its
environment failed, else null).

The rows are spread over the batch (row i * N // k), so with k <= prompts they
come from k different prompts; nothing random is drawn, so logging samples
never changes a training number. The same rows go to TensorBoard (text) and
W&B (a table) when those sinks are on (telemetry/sinks.py).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from reinforge.rollout.base import Rollout
from reinforge.tasks.base import Example

SAMPLES_FILE = "samples.jsonl"


@dataclass(frozen=True)
class StepSamples:
    """One RL step's batch as the learner used it: references, nothing copied until rows are picked."""

    examples: list[Example]          # [P] the prompts of the batch; row r belongs to examples[group_ids[r]]
    rollout: Rollout                 # [N] rows
    rewards: torch.Tensor            # [N] float, the total reward (NaN where not valid)
    parts: dict[str, torch.Tensor]   # function name -> [N] float raw values (NaN where it raised or declined)
    advantages: torch.Tensor         # [N], or [N, T] per-token (critic recipes)
    trained: torch.Tensor            # [N] bool, rows the loss saw


def _number(value: float) -> float | None:
    return value if math.isfinite(value) else None


def pick_samples(step: int, batch: StepSamples, k: int) -> list[dict]:
    """Up to `k` rows of `batch`, spread evenly over it, as samples.jsonl records (see the module docstring)."""
    rollout = batch.rollout
    n = rollout.num_rows
    m = min(k, n)
    rows = [i * n // m for i in range(m)]
    present, trained = rollout.completion_mask, rollout.trained_mask
    out = []
    for r in rows:
        if batch.advantages.dim() == 2:        # per-token advantages: their mean over the tokens trained on
            advantage = float((batch.advantages[r] * trained[r]).sum() / trained[r].sum().clamp(min=1))
        else:
            advantage = float(batch.advantages[r])
        example = batch.examples[int(rollout.group_ids[r])]
        out.append({
            "step": step,
            "prompt": example.prompt,
            "answer": example.answer,
            "completion": rollout.texts[r],
            "completion_tokens": rollout.completion_ids[r][present[r] > 0].tolist(),
            "rewards": {name: _number(float(values[r])) for name, values in batch.parts.items()},
            "reward": _number(float(batch.rewards[r])),
            "advantage": _number(advantage),
            "trained": bool(batch.trained[r]),
            "truncated": bool(rollout.truncated[r]),
        })
        if rollout.episodes is not None:     # a multi-turn row: the whole conversation, with roles
            episode = rollout.episodes[r]
            out[-1].update({"trajectory": episode.transcript(), "turns": episode.result.turns,
                            "stop_reason": episode.result.stop_reason, "error": episode.result.error})
    return out


def truncate_samples(path: str | Path, last_step: int) -> None:
    """Keep the samples of steps <= `last_step` (a resumed run rewrites those after its checkpoint).
    A torn last line (the interrupted run was writing it) goes too. No file: nothing to do."""
    path = Path(path)
    if not path.is_file():
        return
    keep = []
    for line in path.read_text().splitlines(keepends=True):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if record.get("step", math.inf) <= last_step:
            keep.append(line if line.endswith("\n") else line + "\n")
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(keep))
    tmp.replace(path)


class SampleLog:
    """RUN_DIR/samples.jsonl, appended line by line and flushed, so a live run can be watched."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._file = None      # opened by the first write: a run that logs no sample (DPO) has no file

    def write(self, records: list[dict]) -> None:
        if self._file is None:
            self._file = self.path.open("a")
        for record in records:
            self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def sync(self) -> None:
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def samples_markdown(records: list[dict]) -> str:
    """The records as a Markdown table (what TensorBoard's text tab renders)."""
    def cell(value: object) -> str:
        text = json.dumps(value) if not isinstance(value, str) else value
        return text.replace("|", "\\|").replace("\n", "<br>")

    header = "| prompt | completion | rewards | reward | advantage |\n|---|---|---|---|---|\n"
    return header + "".join(
        f"| {cell(r['prompt'])} | {cell(r['completion'])} | {cell(r['rewards'])} | {cell(r['reward'])} | "
        f"{cell(r['advantage'])} |\n" for r in records)
