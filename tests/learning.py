"""A task the micro model learns by RL in a few seconds, for tests where held-out reward must rise.

Every prompt is four random letters and '='; the one right completion is "7" (the `exact`
verifier of a dataset task). The completion is one token (rollout.max_new_tokens=1) and there
is no SFT, so the untrained model answers "7" about once in its vocabulary's size (~1/40): the
first steps' groups of 8 x 8 samples hold a correct one now and then, which is all the signal
GRPO needs. The held-out prompts (the task's eval split) are never trained on, so their pass@1
rising from ~0 measures what RL taught the policy, not a memorised prompt.

Measured (grpo, lr 3e-2, 16 steps), held-out pass@1 from 0.000-0.008 to, on seeds 0 / 1 / 2:
0.92 / 0.98 / 1.00 (sync), 0.98 / 0.99 / 0.98 (async, max_staleness 1); 0.95 on seed 0 (async on two
torchrun learner ranks). The train reward rose by 0.98 / 0.98 / 0.99 (sync) and 0.93 / 0.92 / 0.96 (async).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from conftest import MICRO

# The rise the tests ask for: from ~0 to at least this. Every run above measured >= 0.92, so a CPU whose
# rounding sends a run down another path keeps a margin of 0.3; chance (the untrained model) is ~1/40.
MIN_PASS_RATE = 0.6


def constant_answer_task(directory: Path) -> list[str]:
    """Overrides that train the micro model on the task above (its data written into `directory`)."""
    rng = random.Random(0)
    path = directory / "sevens.jsonl"
    path.write_text(
        "".join(
            json.dumps({"prompt": "".join(rng.choice("abcdefgh") for _ in range(4)) + "=", "answer": "7"}) + "\n"
            for _ in range(300)
        )
    )
    keep = ("model.", "log.", "threads=")
    return [*(o for o in MICRO if o.startswith(keep)), "task.name=dataset", f"task.options.path={path}",
            "task.options.verifier=exact", "sft.enabled=false", "rollout.max_new_tokens=1", "train.prompts_per_step=8",
            "train.group_size=8", "train.micro_batch_size=64", "train.lr=3e-2", "train.steps=16", "eval.num_prompts=32",
            "eval.num_samples=8", "seed=0"]


def held_out_pass_rates(out: Path) -> tuple[float, float]:
    """(start, final) held-out pass@1 of a finished run directory."""
    evals = json.loads((out / "summary.json").read_text())["eval"]
    return evals["start"]["pass@1"], evals["final"]["pass@1"]


def train_rewards(out: Path) -> list[float]:
    """Each RL step's mean train reward."""
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [x["reward_mean"] for x in lines if x.get("stage") == "rl"]
