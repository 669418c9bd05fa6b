"""The default job: cold-start SFT on noisy teacher traces, RL, and held-out
evaluation of the model at the start and at the end of RL.

All input is validated before the run directory is created, so bad input
changes nothing on disk.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import numpy as np
import torch
from tqdm import tqdm

from reinforge.config import Config, ConfigError
from reinforge.eval.evaluate import EvalResult, evaluate
from reinforge.loops.rl import StepRecord, train_rl
from reinforge.loops.sft import run_sft
from reinforge.models import load_policy
from reinforge.models.factory import check_model_path
from reinforge.objectives import ObjectiveSpec, resolve_spec
from reinforge.rollout import SamplingParams, build_engine
from reinforge.rollout.native import check_native_model_type
from reinforge.systems import check_runnable
from reinforge.tasks import Task, build_task
from reinforge.telemetry import RunDir, default_output_dir


@dataclass
class RunResult:
    output_dir: str
    summary: dict


def objective_spec(cfg: Config) -> ObjectiveSpec:
    """The recipe's objective with the config's overrides applied."""
    return resolve_spec(cfg.recipe, **cfg.objective.overrides())


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def prepare(cfg: Config) -> tuple[Task, ObjectiveSpec]:
    """Everything that can fail on user input, done before anything is written.

    Raises ConfigError for bad input, NotImplementedError for a recipe whose
    systems are not built yet.
    """
    check_runnable(cfg.recipe)
    try:
        task = build_task(cfg.task.name, **cfg.task.options)
        spec = objective_spec(cfg)
    except (ValueError, TypeError) as err:  # bad option values of the task or objective
        raise ConfigError(str(err)) from None
    check_runnable(cfg.recipe, spec)       # a composition may need more than its recipe (a critic)
    if cfg.sft.enabled and cfg.sft.steps > 0:
        # A task without traces (a dataset with no completions) says so here, before the run directory exists.
        first, rng = task.train_split(1), random.Random(cfg.seed)
        task.teacher_completion(first[0], rng)
        if cfg.sft.corrupt_fraction > 0:
            task.corrupt_completion(first[0], rng)
    if cfg.model.path != "builtin":
        path = check_model_path(cfg.model.path)
        if cfg.rollout.engine == "native":
            check_native_model_type(path)
        if cfg.train.shared_prefix:
            check_native_model_type(path, "train.shared_prefix=true", "train.shared_prefix=false")
    return task, spec


def run(cfg: Config) -> RunResult:
    t_start = time.perf_counter()
    task, spec = prepare(cfg)
    torch.set_num_threads(cfg.threads)
    seed_everything(cfg.seed)
    policy = load_policy(cfg.model, cfg.seed)
    # The resolved config names its real run directory, not the default's null.
    cfg = cfg.model_copy(update={"output_dir": str(cfg.output_dir or default_output_dir(cfg))})
    run_dir = RunDir(cfg.output_dir, cfg)
    show = cfg.log.progress
    sft_summary = None
    try:
        if cfg.sft.enabled and cfg.sft.steps > 0:
            sft_data = task.sft_examples(cfg.sft.num_examples, cfg.sft.corrupt_fraction, seed=cfg.seed)
            bar = tqdm(total=cfg.sft.steps, desc="sft", disable=not show, leave=False)

            def sft_step(step: int, loss: float) -> None:
                bar.update(1)
                if step % 10 == 0:
                    bar.set_postfix(loss=f"{loss:.3f}")

            sft = run_sft(policy, sft_data, cfg.sft, chat_template=cfg.prompt.chat_template, seed=cfg.seed, on_step=sft_step)
            bar.close()
            sft_summary = {"steps": sft.steps, "first_loss": sft.first_loss, "final_loss": sft.final_loss}
            run_dir.log({"stage": "sft", **sft_summary})

        engine = build_engine(cfg.rollout, policy, chat_template=cfg.prompt.chat_template)
        held_out = task.eval_split(cfg.eval.num_prompts)
        start = _evaluate(cfg, engine, task, held_out)

        bar = tqdm(total=cfg.train.steps, desc=f"rl:{cfg.recipe}", disable=not show)

        def rl_step(record: StepRecord) -> None:
            run_dir.log({"stage": "rl", "step": record.step, **record.metrics})
            bar.update(1)
            bar.set_postfix(reward=f"{record.metrics['reward_mean']:.3f}", len=f"{record.metrics['response_length_mean']:.1f}")

        rl = train_rl(cfg, policy, engine, task, spec, rl_step)
        bar.close()
        final = _evaluate(cfg, engine, task, held_out)
        run_dir.save_checkpoint(policy, rl.optimizer, {"rl_steps": rl.steps, "policy_version": rl.policy_version})
        summary = {
            "recipe": cfg.recipe,
            "task": cfg.task.name,
            "seed": cfg.seed,
            "sft": sft_summary,
            "rl_steps": rl.steps,
            "wall_seconds": time.perf_counter() - t_start,
            "eval": {"start": start.to_summary(), "final": final.to_summary()},
        }
        run_dir.write_summary(summary)
    finally:
        run_dir.close()
    return RunResult(output_dir=str(run_dir.path), summary=summary)


def _evaluate(cfg: Config, engine, task: Task, held_out) -> EvalResult:
    sampling = SamplingParams.from_config(cfg.rollout)
    return evaluate(engine, task, held_out, num_samples=cfg.eval.num_samples, sampling=sampling, seed=cfg.eval.seed)


