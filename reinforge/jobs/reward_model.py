"""The reward-model job (`reinforge reward-model`): preference pairs -> a Bradley-Terry reward model
folder, with its held-out pair accuracy.

1. the policy the pairs are sampled from (model.path, after the cold-start SFT when sft is on,
   exactly as `reinforge train` starts);
2. pairs: on-policy, rm.samples_per_prompt samples of each of rm.num_prompts train prompts, a
   verified-correct one chosen over an incorrect one of the same prompt (InstructGPT's comparisons,
   labelled by the verifier instead of people), or read from rm.pairs_path (TRL's prompt / chosen /
   rejected layout);
3. a held-out part: rm.heldout_fraction of the pairs (split by pair, seeded) is never trained on;
   on-policy runs also report the pairs of held-out prompts (eval split), which the model never saw;
4. `train_reward_model` from the policy's backbone (InstructGPT starts its reward model from the SFT
   model, arXiv 2203.02155 sec. 3.5), and the mean and std of its scores on its training pairs
   saved in config.json (reward_mean / reward_std) for `reward.model.normalize`;
5. OUT/ holds the model folder and rm_summary.json.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from reinforge.config import Config
from reinforge.errors import ConfigError
from reinforge.jobs import start as bootstrap
from reinforge.loops.dpo import preference_pairs, verifier_pairs
from reinforge.loops.rl import verified
from reinforge.models import Policy
from reinforge.records import PreferencePair
from reinforge.rewards.reward_model import (
    build_reward_model,
    pair_accuracy,
    reward_statistics,
    save_reward_model,
    train_reward_model,
)
from reinforge.rollout import RolloutEngine, SamplingParams
from reinforge.tasks import Example, Task


@dataclass
class RewardModelJobResult:
    """What the job wrote and measured."""

    path: str                              # the reward model's folder
    train_pairs: int
    heldout_pairs: int
    heldout_accuracy: float                # pair accuracy on held-out pairs of the train prompts (or file)
    unseen_prompt_pairs: int               # on-policy: pairs of held-out (eval split) prompts; 0 otherwise
    unseen_prompt_accuracy: float | None
    train_accuracy: float
    first_loss: float
    final_loss: float
    reward_mean: float
    reward_std: float
    seconds: float


def sampled_pairs(engine: RolloutEngine, task: Task, examples: list[Example], samples: int, per_prompt: int,
                  sampling: SamplingParams, batch_prompts: int = 64) -> list[PreferencePair]:
    """Verifier-labelled pairs of `samples` completions of each example: a correct one chosen over an
    incorrect one of the same prompt (`verifier_pairs`), text only."""
    pairs: list[PreferencePair] = []
    for start in range(0, len(examples), batch_prompts):
        part = examples[start: start + batch_prompts]
        rollout = engine.generate([e.prompt for e in part], samples, sampling)
        correct = verified(task, part, rollout, samples)
        for chosen, rejected in verifier_pairs(correct.view(len(part), samples), per_prompt):
            pairs.append(PreferencePair(prompt=part[chosen // samples].prompt, chosen=rollout.texts[chosen],
                                        rejected=rollout.texts[rejected]))
    return pairs


def split_pairs(pairs: list[PreferencePair], heldout_fraction: float, seed: int) -> tuple[list, list]:
    """(train, held-out): a seeded shuffle, the last `heldout_fraction` held out (at least one of each)."""
    order = list(range(len(pairs)))
    random.Random(seed).shuffle(order)
    held = max(1, round(len(pairs) * heldout_fraction)) if heldout_fraction > 0 else 0
    if len(pairs) - held < 1:
        raise ConfigError(f"{len(pairs)} preference pairs leave none to train on after holding out "
                          f"rm.heldout_fraction={heldout_fraction}: sample more (rm.num_prompts) or hold out less")
    return [pairs[i] for i in order[: len(pairs) - held]], [pairs[i] for i in order[len(pairs) - held:]]


def cold_start(cfg: Config, policy: Policy, task: Task, engine: RolloutEngine) -> None:
    """The cold-start SFT `reinforge train` runs first (sft section), when it is on."""
    from reinforge.jobs.rl import sft_examples
    from reinforge.learner import ForwardPlan
    from reinforge.loops.sft import run_sft

    if cfg.sft.enabled and cfg.sft.steps > 0:
        data, _ = sft_examples(cfg, engine, task)
        run_sft(policy, data, cfg.sft, chat_template=cfg.prompt.chat_template, seed=cfg.seed,
                forward=ForwardPlan.from_config(cfg.train))


def job_start(cfg: Config, out: str | Path, prompts: int, heldout: int) -> bootstrap.Started:
    """The bootstrap of a job that writes a model to `out` from a run's config (this one and
    `reinforge process-reward-model`'s): every check, seeded, `cfg.threads` threads, the policy of
    model.path before any cold start, its engine (episodes with tools or an environment); jobs/start.py.
    `prompts` and `heldout`: the train and held-out prompts the job draws (rm.num_prompts and rm.unseen_prompts,
    prm.num_prompts and prm.heldout_prompts), which the checks judge the task's splits by in place of RL's
    train.num_prompts and eval.num_prompts. FileExistsError for an `out` that holds something."""
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} already exists and is not empty: choose another output folder")
    return bootstrap.start(cfg.model_copy(update={"train": cfg.train.model_copy(update={"num_prompts": prompts}),
                                                  "eval": cfg.eval.model_copy(update={"num_prompts": heldout})}))


def run_reward_model_job(cfg: Config, out: str | Path) -> RewardModelJobResult:
    """Pairs -> reward model -> OUT (see the module docstring)."""
    t0 = time.perf_counter()
    rm_cfg = cfg.rm
    task, _, policy, engine = job_start(cfg, out, rm_cfg.num_prompts, rm_cfg.unseen_prompts)
    out = Path(out)
    sampling = SamplingParams.from_config(cfg.rollout)
    unseen: list[PreferencePair] = []
    if rm_cfg.pairs == "dataset":
        pairs = preference_pairs(rm_cfg.pairs_path, rm_cfg.pairs_fields)
    else:
        cold_start(cfg, policy, task, engine)
        with torch.random.fork_rng():
            torch.manual_seed(cfg.seed + 1)
            pairs = sampled_pairs(engine, task, task.train_split(rm_cfg.num_prompts), rm_cfg.samples_per_prompt,
                                  rm_cfg.pairs_per_prompt, sampling)
            if rm_cfg.unseen_prompts:
                unseen = sampled_pairs(engine, task, task.eval_split(rm_cfg.unseen_prompts),
                                       rm_cfg.samples_per_prompt, rm_cfg.pairs_per_prompt, sampling)
        if not pairs:
            raise ConfigError(f"no prompt of {rm_cfg.num_prompts} gave both a correct and an incorrect sample in "
                              f"{rm_cfg.samples_per_prompt} tries: nothing to compare; start from a model that "
                              "solves some prompts (sft) or raise rm.samples_per_prompt")
    train, held = split_pairs(pairs, rm_cfg.heldout_fraction, cfg.seed)
    rm = build_reward_model(policy, seed=cfg.seed)
    with tqdm(total=rm_cfg.steps, desc="reward model", disable=not cfg.log.progress, leave=False,
              dynamic_ncols=True) as bar:
        fit = train_reward_model(rm.model, rm.tokenizer, train, steps=rm_cfg.steps, batch_size=rm_cfg.batch_size,
                                 lr=rm_cfg.lr, seed=cfg.seed, chat_template=cfg.prompt.chat_template,
                                 on_step=lambda step, loss: (bar.update(1), bar.set_postfix(loss=f"{loss:.3f}")))
    mean, std = reward_statistics(rm.model, rm.tokenizer, train, chat_template=cfg.prompt.chat_template)
    rm.model.config.reward_mean, rm.model.config.reward_std = mean, std
    path = save_reward_model(rm.model, rm.tokenizer, out)
    result = RewardModelJobResult(
        path=str(path), train_pairs=len(train), heldout_pairs=len(held),
        heldout_accuracy=(pair_accuracy(rm.model, rm.tokenizer, held, chat_template=cfg.prompt.chat_template)
                          if held else float("nan")),
        unseen_prompt_pairs=len(unseen),
        unseen_prompt_accuracy=(pair_accuracy(rm.model, rm.tokenizer, unseen, chat_template=cfg.prompt.chat_template)
                                if unseen else None),
        train_accuracy=fit.train_accuracy, first_loss=fit.first_loss, final_loss=fit.final_loss,
        reward_mean=mean, reward_std=std, seconds=time.perf_counter() - t0,
    )
    (path / "rm_summary.json").write_text(json.dumps(asdict(result), indent=2) + "\n")
    return result
