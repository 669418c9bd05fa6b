"""The one bootstrap every job starts through, so that no job can forget a step.

    plan = prepare(cfg)                           # checked, the task and objective built; nothing loaded
    policy = load_policy(cfg, plan.task)          # seeded, cfg.threads threads, its tokenizer checked
    engine = rollout_engine(cfg, policy, plan.task)   # episodes instead when the run has tools or an environment

or, for a job that needs nothing between them, `start(cfg)` (all three).

`prepare` runs every rule across sections (config/checks.py: `check_run`) on the built task and
objective, configures the code sandbox, and says in one line what runs a model folder and why. The
train job (jobs/train.py), the reward-model jobs, the offline filter and the multistage pipeline's
stages all start here; a new job calls the same three.
"""

from __future__ import annotations

import dataclasses
import random
from typing import NamedTuple

import numpy as np
import torch
from rich.console import Console
from rich.markup import escape

from reinforge.agents.setup import build_agent
from reinforge.config import Config
from reinforge.config.checks import check_run
from reinforge.distributed import torchrun_world_size
from reinforge.errors import ConfigError
from reinforge.models import Policy
from reinforge.models import load_policy as load_model_policy
from reinforge.models.model_dir import architecture_plan
from reinforge.objectives import RECIPES, ObjectiveSpec, resolve_spec
from reinforge.objectives.preference import preference_loss
from reinforge.objectives.spec import PreferenceSpec
from reinforge.rollout import RolloutEngine, build_engine
from reinforge.rollout.prompts import check_chat_prompts, check_context
from reinforge.serve.setup import build_agent_functions
from reinforge.tasks import Task, build_task


class JobPlan(NamedTuple):
    """What `prepare` builds: the task (its splits checked) and the objective with the config's overrides."""

    task: Task
    spec: ObjectiveSpec | PreferenceSpec


def objective_spec(cfg: Config) -> ObjectiveSpec | PreferenceSpec:
    """The recipe's objective with the config's overrides applied (objective.* for RL, dpo.* for DPO)."""
    if isinstance(RECIPES[cfg.recipe].objective, PreferenceSpec):
        return preference_spec(cfg)
    return resolve_spec(cfg.recipe, **cfg.objective.overrides())


def preference_spec(cfg: Config) -> PreferenceSpec:
    """The recipe's preference objective with dpo.beta / dpo.loss_type / dpo.label_smoothing applied.

    Raises ValueError for a recipe that is not a preference one, for objective.* overrides (those
    are the parts of RL objectives), and for an unknown loss or a bad parameter.
    """
    objective = RECIPES[cfg.recipe].objective
    if not isinstance(objective, PreferenceSpec):
        raise ValueError(f"recipe {cfg.recipe!r} is not a preference objective")
    if cfg.objective.overrides():
        raise ValueError(f"objective.{next(iter(cfg.objective.overrides()))} sets a part of an RL objective; "
                         f"recipe {cfg.recipe!r} takes dpo.beta, dpo.loss_type and dpo.label_smoothing")
    changes = {k: v for k in ("beta", "loss_type", "label_smoothing") if (v := getattr(cfg.dpo, k)) is not None}
    spec = dataclasses.replace(objective, **changes)
    empty = torch.zeros(0)
    # raises for a bad loss name or parameter
    preference_loss(chosen_logprobs=empty, rejected_logprobs=empty, ref_chosen_logprobs=empty,
                    ref_rejected_logprobs=empty, **dataclasses.asdict(spec))
    return spec


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def prepare(cfg: Config) -> JobPlan:
    """Everything that can fail on user input, done before anything loads or is written: the task and
    objective built, every cross-section rule (config/checks.py), the sandbox configured. ConfigError
    names what to change."""
    try:
        task = build_task(cfg.task.name, **cfg.task.options)
        task.system = cfg.prompt.system
        spec = objective_spec(cfg)
        # Splits too small for the prompts asked for (a small dataset, digits=1) say so now.
        task.train_split(max(cfg.train.num_prompts, cfg.sft.rejection_prompts if cfg.sft.source == "rejection" else 0))
        task.eval_split(cfg.eval.num_prompts)
    except (ValueError, TypeError) as err:  # bad option values of the task or objective
        raise ConfigError(str(err)) from None
    check_run(cfg, task, spec)
    from reinforge.verifiers.code import configure_sandbox

    configure_sandbox(cfg.reward.code.allow_weak_sandbox)     # the code verifier's and python tool's sandbox
    plan = architecture_plan(cfg.model.path) if cfg.model.path != "builtin" else None
    lora_targets = list(cfg.model.lora.target_modules) if cfg.model.lora is not None else None
    note = (plan.note(cfg.rollout.engine, cfg.train.shared_prefix, lora_targets, cfg.train.logprob_chunk_size)
            if plan is not None else None)
    if note is not None and torchrun_world_size() == 1:    # what runs the model, and why: once, last
        Console(stderr=True).print(escape(note), soft_wrap=True, highlight=False)
    return JobPlan(task, spec)


def load_policy(cfg: Config, task: Task) -> Policy:
    """The policy of model.path, loaded after seeding everything with cfg.seed on cfg.threads threads;
    chat-message prompts and every prompt's length checked against its tokenizer (known only now,
    still before anything is written)."""
    torch.set_num_threads(cfg.threads)
    seed_everything(cfg.seed)
    policy = load_model_policy(cfg.model, cfg.seed)
    check_chat_prompts(policy.tokenizer, cfg.prompt.chat_template, [e.prompt for e in task.train_split(1)])
    check_context(policy.model.config, policy.tokenizer, cfg.prompt.chat_template,
                  [e.prompt for e in task.train_split(cfg.train.num_prompts) + task.eval_split(cfg.eval.num_prompts)],
                  cfg.rollout.max_new_tokens, "model.max_positions" if cfg.model.path == "builtin" else None)
    return policy


def rollout_engine(cfg: Config, policy: Policy, task: Task) -> RolloutEngine:
    """The engine of rollout.engine over `policy`; with an agent function, tools or an environment, the agent
    engine over it, so that every consumer (RL, evaluation, pair sampling, filtering) gets episodes."""
    # The engine reads the policy's weights at every call, so it can be built before SFT
    # (rejection-sampling SFT samples from the model it then trains).
    engine = build_engine(cfg.rollout, policy, chat_template=cfg.prompt.chat_template)
    # An agent function (task.agent) plays its episodes through the endpoint (reinforge/serve/).
    return build_agent_functions(cfg.task.agent, cfg.task.agent_timeout_s, cfg.task.agent_concurrency, cfg.rollout,
                                 cfg.prompt.chat_template, engine, task) \
        or build_agent(cfg.rollout, cfg.task.environment, cfg.prompt.chat_template, engine, task,
                       cfg.task.environment_reward) or engine


class Started(NamedTuple):
    """A job's parts after the bootstrap: the task, the objective, the loaded policy and its engine."""

    task: Task
    spec: ObjectiveSpec | PreferenceSpec
    policy: Policy
    engine: RolloutEngine


def start(cfg: Config) -> Started:
    """`prepare`, `load_policy` and `rollout_engine`, in that order (the jobs that write no run directory)."""
    plan = prepare(cfg)
    policy = load_policy(cfg, plan.task)
    return Started(plan.task, plan.spec, policy, rollout_engine(cfg, policy, plan.task))
