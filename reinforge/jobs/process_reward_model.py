"""The process-reward-model job (`reinforge process-reward-model`): the policy's solutions, labelled step
by step with Math-Shepherd's continuations -> a PRM folder, with its held-out step accuracy.

1. the policy whose solutions are labelled (model.path, after the cold-start SFT when sft is on, exactly
   as `reinforge train` starts: `reward_model.cold_start`), which also continues the step prefixes;
2. labels: prm.samples_per_prompt solutions of each of prm.num_prompts train prompts, split at
   prm.marker, each step labelled by prm.continuations continuations of its prefix (rewards/shepherd.py);
   the same for prm.heldout_prompts held-out (eval split) prompts, never trained on;
3. `train_process_reward_model` from the policy's backbone on the prm.target labels, and its step
   accuracy on the held-out solutions; for a task that knows each step's correctness (chain_sum's
   `step_correct`) also how often the automatic labels and the PRM agree with it;
4. OUT/ holds the model folder (config.json records the marker), prm_summary.json and
   step_labels.jsonl (every labelled solution, with its split).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from reinforge.config import Config
from reinforge.errors import ConfigError
from reinforge.jobs.reward_model import cold_start, job_start
from reinforge.rewards.process_model import (
    StepLabels,
    build_process_reward_model,
    save_process_reward_model,
    step_accuracy,
    step_probabilities,
    train_process_reward_model,
)
from reinforge.rewards.shepherd import shepherd_dataset
from reinforge.rollout import SamplingParams
from reinforge.tasks import Task


@dataclass
class PRMJobResult:
    """What the job wrote and measured."""

    path: str                          # the PRM's folder
    train_solutions: int
    train_steps: int                   # labelled steps trained on
    train_positive_rate: float         # fraction of them labelled 1 (hard)
    heldout_solutions: int
    heldout_steps: int
    heldout_accuracy: float            # PRM vs the held-out hard labels (NaN without held-out prompts)
    heldout_positive_rate: float       # a constant guess scores max(p, 1 - p)
    heldout_final_accuracy: float      # on each held-out solution's last step
    label_exact_agreement: float | None   # hard labels vs the task's step_correct, all labelled steps; None: no truth
    heldout_exact_accuracy: float | None  # PRM vs step_correct on the held-out steps
    first_loss: float
    final_loss: float
    seconds: float


def exact_steps(task: Task, labelled: list[StepLabels]) -> list[list[bool]] | None:
    """Each solution's steps judged by the task's own `step_correct` (the chain_sum task has one), or None."""
    judge = getattr(task, "step_correct", None)
    if judge is None:
        return None
    by_prompt = {e.prompt: e for e in task.drawn()}
    return [judge(by_prompt[s.prompt], list(s.steps)) for s in labelled]


def run_process_reward_model_job(cfg: Config, out: str | Path) -> PRMJobResult:
    """Policy -> Math-Shepherd labels -> PRM -> OUT (see the module docstring)."""
    t0 = time.perf_counter()
    settings = cfg.prm
    task, _, policy, engine = job_start(cfg, out, settings.num_prompts, settings.heldout_prompts)
    cold_start(cfg, policy, task, engine)
    generator = torch.Generator().manual_seed(cfg.seed + 1)

    def labels(examples):
        return shepherd_dataset(engine, task, examples, policy.tokenizer, samples=settings.samples_per_prompt,
                                marker=settings.marker, continuations=settings.continuations,
                                params=SamplingParams.from_config(cfg.rollout), generator=generator)

    train = labels(task.train_split(settings.num_prompts))
    held = labels(task.eval_split(settings.heldout_prompts)) if settings.heldout_prompts else []
    if not train:
        raise ConfigError("the policy wrote no text for any of the prm.num_prompts prompts: no steps to label; start "
                          "from a model that answers (sft) or raise rollout.max_new_tokens")
    prm = build_process_reward_model(policy, seed=cfg.seed)
    fit = train_process_reward_model(prm.model, prm.tokenizer, train, steps=settings.steps,
                                     batch_size=settings.batch_size, lr=settings.lr, target=settings.target,
                                     seed=cfg.seed, chat_template=cfg.prompt.chat_template)
    path = save_process_reward_model(prm.model, prm.tokenizer, out, marker=settings.marker)
    measured = step_accuracy(prm.model, prm.tokenizer, held, chat_template=cfg.prompt.chat_template) if held else None
    truth = exact_steps(task, train + held)
    held_truth = None
    if truth is not None and held:
        probs, mask = step_probabilities(prm.model, prm.tokenizer, [s.prompt for s in held], [s.steps for s in held],
                                         cfg.prompt.chat_template)
        verdicts = [(p > 0.5) == ok for row, oks in zip(probs, truth[len(train):], strict=True)
                    for p, ok in zip(row.tolist(), oks, strict=False)]
        held_truth = sum(verdicts) / int(mask.sum())
    all_hard = [h for s in train for h in s.hard]
    result = PRMJobResult(
        path=str(path), train_solutions=len(train), train_steps=len(all_hard),
        train_positive_rate=sum(all_hard) / len(all_hard),
        heldout_solutions=len(held), heldout_steps=measured.steps if measured else 0,
        heldout_accuracy=measured.accuracy if measured else float("nan"),
        heldout_positive_rate=measured.positive_rate if measured else float("nan"),
        heldout_final_accuracy=measured.final_accuracy if measured else float("nan"),
        label_exact_agreement=(None if truth is None else _agreement(train + held, truth)),
        heldout_exact_accuracy=held_truth, first_loss=fit.first_loss, final_loss=fit.final_loss,
        seconds=time.perf_counter() - t0,
    )
    (path / "prm_summary.json").write_text(json.dumps(asdict(result), indent=2) + "\n")
    with open(path / "step_labels.jsonl", "w") as f:
        for split, data in (("train", train), ("heldout", held)):
            for s in data:
                f.write(json.dumps({"split": split, **asdict(s)}) + "\n")
    return result


def _agreement(labelled: list[StepLabels], truth: list[list[bool]]) -> float:
    pairs = [(h == 1.0) == ok for s, oks in zip(labelled, truth, strict=True)
             for h, ok in zip(s.hard, oks, strict=True)]
    return sum(pairs) / len(pairs)
