"""The default job: cold-start SFT on noisy teacher traces, RL, and held-out
evaluation of the model at the start and at the end of RL.

All input is validated before the run directory is created, so bad input
changes nothing on disk.

Under torchrun (WORLD_SIZE > 1) every rank runs this same job with the same
seeds, and the RL learner is split over them (distributed/data_parallel.py:
what is duplicated, what is sharded, what is refused); only rank 0 writes.
"""

from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from pydantic import ValidationError
from rich.console import Console
from rich.markup import escape
from tqdm import tqdm

from reinforge.agents.rollout import AgentEngine
from reinforge.agents.setup import build_agent, check_agent
from reinforge.config import Config, config_to_yaml, format_validation_error, load_yaml
from reinforge.distributed import (
    LearnerGroup,
    init_learner_group,
    leave_learner_group,
    torchrun_world_size,
)
from reinforge.distributed.data_parallel import on_rank_0, split_generation
from reinforge.errors import ConfigError, RunStopped
from reinforge.eval.evaluate import EvalResult, evaluate
from reinforge.lifecycle import Interrupts, check_can_train, data_description, resume_line, split_notes
from reinforge.loops.baselines import takes_baselines
from reinforge.loops.dpo import preference_pairs
from reinforge.loops.loop import NonFiniteStop, RLResult, StepRecord
from reinforge.loops.rl import RLState
from reinforge.models import Policy, load_policy, resolve_device
from reinforge.models.decoder import check_native_model_type
from reinforge.models.factory import check_model_dir
from reinforge.models.model_dir import architecture_plan
from reinforge.objectives import RECIPES, ObjectiveSpec, resolve_spec
from reinforge.objectives.spec import PreferenceSpec
from reinforge.rewards.compose import RewardError, check_reward_inputs
from reinforge.rollout import RolloutEngine, SamplingParams, build_engine
from reinforge.rollout.prompts import check_chat_prompts, check_context
from reinforge.serve.setup import build_agent_functions, check_agent_functions
from reinforge.systems import check_runnable
from reinforge.tasks import Task, build_task
from reinforge.telemetry import RunDir, default_output_dir
from reinforge.telemetry.checkpoint import CheckpointStore, CheckpointWriteError, LoadedCheckpoint
from reinforge.telemetry.recorder import Recorder, eval_metrics
from reinforge.telemetry.run_dir import check_output_dir
from reinforge.telemetry.watchdog import Watchdog
from reinforge.telemetry.weight_sync import WeightSyncError
from reinforge.trainers import check_data_parallel, preference_spec, probe_rewards, run_dpo, run_rl, run_sft_stage


@dataclass
class RunResult:
    output_dir: str
    summary: dict


def objective_spec(cfg: Config) -> ObjectiveSpec | PreferenceSpec:
    """The recipe's objective with the config's overrides applied (objective.* for RL, dpo.* for DPO)."""
    if isinstance(RECIPES[cfg.recipe].objective, PreferenceSpec):
        return preference_spec(cfg)
    return resolve_spec(cfg.recipe, **cfg.objective.overrides())


# The training stage after SFT, by the kind of objective: policy-gradient RL (synchronous or
# asynchronous, train.mode) or preference pairs. All take (cfg, policy, engine, task, spec,
# on_step, saved) and checkpoint through on_step.
TRAINERS = {(ObjectiveSpec, "sync"): run_rl, (ObjectiveSpec, "async"): run_rl, (PreferenceSpec, "sync"): run_dpo}


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
        task.system = cfg.prompt.system
        spec = objective_spec(cfg)
        # Splits too small for the prompts asked for (a small dataset, digits=1) say so now.
        task.train_split(max(cfg.train.num_prompts, cfg.sft.rejection_prompts if cfg.sft.source == "rejection" else 0))
        task.eval_split(cfg.eval.num_prompts)
    except (ValueError, TypeError) as err:  # bad option values of the task or objective
        raise ConfigError(str(err)) from None
    check_runnable(cfg.recipe, spec)       # a composition may need more than its recipe (a critic)
    resolve_device(cfg.model.device)       # a CUDA device this machine lacks
    check_mode(cfg, spec)
    if torchrun_world_size() > 1:
        check_data_parallel(cfg, spec, torchrun_world_size())
    if isinstance(spec, PreferenceSpec) and cfg.dpo.pairs == "dataset":
        preference_pairs(cfg.dpo.pairs_path, cfg.dpo.pairs_fields)   # DatasetError (a ConfigError) names a bad row
    if cfg.sft.enabled and cfg.sft.steps > 0 and cfg.sft.source == "file" and not Path(cfg.sft.data_path).exists():
        raise ConfigError(f"sft.data_path '{cfg.sft.data_path}' does not exist")
    # The first train example of each domain (one, unless the task is a mix): what the checks below judge.
    firsts = {task.domain_of(e): e for e in reversed(task.train_split(max(cfg.train.num_prompts, 1)))}
    if cfg.sft.enabled and cfg.sft.steps > 0 and cfg.sft.source == "teacher":
        # A task without traces (a dataset with no completions) says so here, before the run directory exists.
        rng = random.Random(cfg.seed)
        for first in firsts.values():
            task.teacher_completion(first, rng)
            if cfg.sft.corrupt_fraction > 0:
                task.corrupt_completion(first, rng)
    check_agent(cfg.rollout, cfg.task.environment, task)    # tools and environment class, before any load
    check_agent_functions(cfg.task.agent, cfg.task.environment, cfg.rollout, cfg.train.mode, cfg.backend)
    if (task.use_tools or cfg.task.environment) and cfg.sft.enabled and cfg.sft.steps > 0 \
            and cfg.sft.source == "rejection":
        raise ConfigError("sft.source=rejection keeps single completions, and this run's samples are multi-turn "
                          "episodes (tools or task.environment): rejection sampling of episodes is not built; use "
                          "sft.source=teacher or file, or sft.enabled=false")
    if cfg.task.environment_reward == "turn" and not (cfg.task.environment and spec.needs_critic):
        need = "a critic to credit turn by turn (recipe=ppo or vapo, or objective.advantage=gae)" \
            if cfg.task.environment else "task.environment (tools' episodes are scored once, on the answer)"
        raise ConfigError(f"task.environment_reward=turn needs {need}; a group advantage ({cfg.recipe}) reads one "
                          "reward per trajectory: task.environment_reward=trajectory")
    for domain, first in firsts.items():      # a required parameter nothing fills: before any load
        check_reward_inputs(cfg.reward, first, domain)
    check_teachers(cfg)
    from reinforge.verifiers.code import configure_sandbox

    configure_sandbox(cfg.reward.code.allow_weak_sandbox)     # the code verifier's and python tool's sandbox
    if cfg.model.path != "builtin":
        path = check_model_dir(cfg.model.path)      # config.json, weights, a tokenizer that fits
        if cfg.rollout.engine == "native":
            check_native_model_type(path)
        if cfg.train.shared_prefix:
            check_native_model_type(path, "train.shared_prefix=true", "train.shared_prefix=false")
        if torchrun_world_size() > 1:     # shard_model shards the same Llama-family decoders
            check_native_model_type(path, "torchrun (FSDP learner ranks)", "one process")
    if cfg.model.lora is not None and cfg.model.lora.dropout > 0 and cfg.train.shared_prefix:
        raise ConfigError(
            "model.lora.dropout > 0 needs train.shared_prefix=false: the shared-prompt learner forward runs "
            "the merged LoRA weights, with no dropout on the adapters' input (or set model.lora.dropout=0)"
        )
    check_output_dir(cfg.output_dir or default_output_dir(cfg.recipe))
    plan = architecture_plan(cfg.model.path) if cfg.model.path != "builtin" else None
    lora_targets = list(cfg.model.lora.target_modules) if cfg.model.lora is not None else None
    note = (plan.note(cfg.rollout.engine, cfg.train.shared_prefix, lora_targets, cfg.train.logprob_chunk_size)
            if plan is not None else None)
    if note is not None and torchrun_world_size() == 1:    # what runs the model, and why: once, last
        Console(stderr=True).print(escape(note), soft_wrap=True, highlight=False)
    return task, spec


def check_teachers(cfg: Config) -> None:
    """The teachers of distillation exist; on-policy distillation's shares the policy's tokenizer."""
    if cfg.reward.teacher is not None:
        from reinforge.rewards.teacher import check_teacher

        check_teacher(cfg.reward.teacher.path, cfg.model.path)
    if cfg.sft.teacher_path is not None and cfg.sft.enabled and cfg.sft.steps > 0 and cfg.sft.source == "rejection":
        try:
            path = check_model_dir(cfg.sft.teacher_path)
            if cfg.rollout.engine == "native":
                check_native_model_type(path)
        except ConfigError as err:
            raise ConfigError(f"sft.teacher_path: {err}") from None


def check_mode(cfg: Config, spec: ObjectiveSpec | PreferenceSpec) -> None:
    """train.mode against what the recipe and engine can do."""
    if takes_baselines(spec) and (cfg.train.mode == "async" or cfg.backend == "ray"):
        raise ConfigError(
            f"objective.advantage={spec.advantage} needs a greedy completion of each prompt as its baseline, which "
            "only the synchronous loop in one process generates: set train.mode=sync and backend=local"
        )
    if "async" in RECIPES[cfg.recipe].requires and cfg.train.mode != "async":
        raise ConfigError(
            f"recipe {cfg.recipe!r} is asynchronous (train.mode=async in its preset); with train.mode="
            f"{cfg.train.mode} it would not be {cfg.recipe}: compose its objective under another recipe name instead"
        )
    if cfg.backend == "ray" and cfg.train.mode == "sync":
        if cfg.ray.learner_ranks < 2:
            raise ConfigError(
                "backend=ray runs rollout workers for train.mode=async, or data-parallel learner ranks for "
                "train.mode=sync (ray.learner_ranks >= 2): set one of them, or backend=local"
            )
        check_data_parallel(cfg.model_copy(update={"backend": "local"}), spec, cfg.ray.learner_ranks)
    if cfg.train.mode != "async":
        return
    if isinstance(spec, PreferenceSpec):
        raise ConfigError("train.mode=async is for RL recipes; DPO trains synchronously (train.mode=sync)")
    if cfg.rollout.engine != "native":
        raise ConfigError(
            "train.mode=async samples with the native engine (interruptible decoding): set rollout.engine=native"
        )


def resume_config(run_dir: str | Path, *, command: str = "--resume", rewards: bool = True) -> Config:
    """The resolved config a run wrote to RUN_DIR/config.yaml, pointed at RUN_DIR (it may have moved).
    `command` starts the error messages; `rewards=False` leaves the reward functions unresolved (export
    computes no reward, and a notebook function given to reinforge.train lives only in its process)."""
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        raise ConfigError(f"{command}: '{run_dir}' holds no run (no config.yaml)")
    try:     # a damaged file: one line with its line and column
        cfg = Config.model_validate(load_yaml(path), context={"resolve_rewards": rewards})
    except ValidationError as err:
        raise ConfigError(f"{command}: {path} is not a valid config ({format_validation_error(err)})") from None
    return cfg.model_copy(update={"output_dir": str(run_dir)})


class _Muted:
    """The run directory and the recorder of a learner rank other than 0 (only rank 0 writes): every
    call does nothing."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def __getattr__(self, name: str):
        return lambda *args, **kwargs: None


def run(cfg: Config, *, resume: bool = False, overwrite: bool = False) -> RunResult:
    """The default job, or with `resume` its continuation from the newest checkpoint in cfg.output_dir.

    A resumed run ends with the weights and metrics.jsonl of an uninterrupted run (timing
    figures aside, `telemetry.recorder.TIMING_KEYS`). Checkpoints start with RL: a run stopped
    before its first one starts over. Under torchrun, every rank calls it (learner ranks).
    """
    t_start = time.perf_counter()
    task, spec = prepare(cfg)
    if isinstance(spec, ObjectiveSpec) and cfg.train.steps > 0:     # each RL step draws distinct prompts
        check_can_train(len(task.train_split(cfg.train.num_prompts)), cfg.train.num_prompts,
                        cfg.train.prompts_per_step, data_description(task))
    if os.environ.get("RANK", "0") == "0":    # under torchrun, rank 0 says it
        for note in split_notes(task):       # what of the user's file is held out, once, with its key
            Console(stderr=True).print(escape(note), soft_wrap=True, highlight=False)
    if cfg.backend == "ray" and cfg.train.mode == "sync":     # Ray launches the learner ranks, which run this job
        from reinforge.distributed.ray_learners import (
            run_learner_group,  # Ray is imported only when asked for
        )

        return RunResult(**run_learner_group(run, cfg, resume=resume, overwrite=overwrite))
    group = init_learner_group()      # a world of one, nothing initialised, without torchrun
    if group.world_size > 1 and resolve_device(cfg.model.device).type == "cuda":
        # Each learner rank on its own GPU (torchrun's LOCAL_RANK; Ray shows each rank actor one).
        cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"device": str(group.device)})})
    finished = False
    try:
        result = _run(cfg, task, spec, group, t_start, resume=resume, overwrite=overwrite)
        finished = True
        return result
    finally:
        leave_learner_group(finished)


def _run(cfg: Config, task: Task, spec: ObjectiveSpec | PreferenceSpec, group: LearnerGroup, t_start: float, *,
         resume: bool, overwrite: bool) -> RunResult:
    if group.rank != 0:               # rank 0 shows the progress bars
        cfg = cfg.model_copy(update={"log": cfg.log.model_copy(update={"progress": False})})
    torch.set_num_threads(cfg.threads)
    seed_everything(cfg.seed)
    policy = _load_checked_policy(cfg, task)
    # The resolved config names its real run directory, not the default's null.
    cfg = cfg.model_copy(update={"output_dir": str(cfg.output_dir or default_output_dir(cfg.recipe))})
    store = CheckpointStore(Path(cfg.output_dir) / "checkpoints", cfg.checkpoint.keep_last)
    saved = _load_checkpoint(store, group, policy) if resume else None
    if resume and group.rank == 0:
        Console(stderr=True).print(escape(resume_line(saved and saved.step, cfg.train.steps, saved and saved.path,
                                                      Path(cfg.output_dir))), soft_wrap=True, highlight=False)
    # Only rank 0 writes; when it cannot (a run already there), every rank stops.
    run_dir, recorder = on_rank_0(group, lambda: _writers(cfg, saved, overwrite=overwrite or resume)) \
        or (_Muted(cfg.output_dir),) * 2
    # SIGINT / SIGTERM: during RL the step finishes and is saved first (lifecycle.py); one process only.
    interrupts = Interrupts(run_dir.path, saved.step if saved is not None else None,
                            lambda line: recorder.console.print(escape(line)), recorder.log,
                            enabled=group.world_size == 1)
    try:
        with interrupts:
            # The engine reads the policy's weights at every call, so it can be built before SFT
            # (rejection-sampling SFT samples from the model it then trains).
            engine = build_engine(cfg.rollout, policy, chat_template=cfg.prompt.chat_template)
            # Multi-turn (tools or an environment): every consumer of the engine gets episodes instead.
            engine = build_agent_functions(cfg.task.agent, cfg.task.agent_timeout_s, cfg.task.agent_concurrency,
                                           cfg.rollout, cfg.prompt.chat_template, engine, task) \
                or build_agent(cfg.rollout, cfg.task.environment, cfg.prompt.chat_template, engine, task,
                               cfg.task.environment_reward) or engine
            hooks = _start(cfg, policy, engine, task, group, store, saved, recorder)
            hooks.interrupts = interrupts
            rl = _train(cfg, hooks, engine, spec, saved, run_dir)
            interrupts.final()
            summary = _finish(cfg, hooks, rl, saved, run_dir, t_start)
    finally:
        recorder.close()
        run_dir.close()
    return RunResult(output_dir=str(run_dir.path), summary=summary)


def _load_checked_policy(cfg: Config, task: Task) -> Policy:
    policy = load_policy(cfg.model, cfg.seed)
    # Chat-message prompts need the tokenizer's chat template: known only now, still before anything is written.
    check_chat_prompts(policy.tokenizer, cfg.prompt.chat_template, [e.prompt for e in task.train_split(1)])
    check_context(policy.model.config, policy.tokenizer, cfg.prompt.chat_template,
                  [e.prompt for e in task.train_split(cfg.train.num_prompts) + task.eval_split(cfg.eval.num_prompts)],
                  cfg.rollout.max_new_tokens, "model.max_positions" if cfg.model.path == "builtin" else None)
    return policy


def _load_checkpoint(store: CheckpointStore, group: LearnerGroup, policy: Policy) -> LoadedCheckpoint | None:
    """The newest checkpoint that loads, its weights put into `policy`; None when there is none.

    Read whole (and the weights loaded) before anything in the run directory changes: a damaged
    newest checkpoint is skipped for the one before it (one line says so), and when none loads
    the run stops with nothing changed. No checkpoint at all: start over in place (SFT is
    deterministic under the seed)."""
    saved = store.load_for_resume(**({} if group.rank == 0 else {"report": lambda line: None}))
    meta = saved.meta if saved is not None else None
    if meta is not None and (meta.get("learner_ranks", 1) > 1) != (group.world_size > 1):
        # A sharded optimizer's state is saved gathered, by parameter name: not what one process loads.
        raise ConfigError(
            f"--resume: the checkpoint was written by {meta.get('learner_ranks', 1)} learner rank(s) and "
            f"this run has {group.world_size}: resume {'under torchrun' if group.world_size == 1 else 'in one process'}"
        )
    if saved is not None:
        policy.model.load_state_dict(saved.tensors["model"])
    return saved


def _writers(cfg: Config, saved: LoadedCheckpoint | None, *, overwrite: bool) -> tuple[RunDir, Recorder]:
    run_dir = RunDir(cfg.output_dir, config_to_yaml(cfg), cfg.rollout, resume=saved is not None, overwrite=overwrite)
    return run_dir, Recorder(
        run_dir, cfg.log, cfg.alerts, recipe=cfg.recipe, rl_steps=cfg.train.steps, resolved=cfg.model_dump(mode="json"),
        saved=saved.meta["telemetry"] if saved is not None else None,
    )


@dataclass
class _Hooks:
    """What the training stage calls back after each step: the step's record, a held-out
    evaluation every eval.every steps, a checkpoint every checkpoint.every steps and at the end."""

    cfg: Config
    group: LearnerGroup
    policy: Policy
    store: CheckpointStore
    recorder: Recorder
    evaluator: RolloutEngine        # learner ranks: each evaluates a share of the prompts
    task: Task
    held_out: list
    sft_summary: dict | None
    start: EvalResult               # the held-out evaluation of the model RL starts from
    interrupts: Interrupts | None = None    # told of each checkpoint (the line an interrupt ends with)

    def checkpoint(self, state: RLState) -> Path:
        rl_state = state.state_dict()     # on every rank: learner ranks gather the optimizer's state
        if self.group.rank != 0:
            return self.store.root
        self.recorder.sync()
        record = {
            "step": state.step,
            "sft": self.sft_summary,
            "start_eval": self.start.to_summary(),
            "telemetry": {"step": state.step, **self.recorder.state_dict()},
            "learner_ranks": self.group.world_size,
        }
        # policy.model is the plain model; learner ranks copy the trained shards into it after every update
        try:
            path = self.store.save(state.step, {"model": self.policy.model.state_dict(), "rl": rl_state}, record).path
            if self.interrupts is not None:
                self.interrupts.saved(state.step)
            return path
        except CheckpointWriteError as err:     # disk full: one line, exit 2, the previous checkpoint intact
            raise RunStopped(str(err)) from None

    def on_step(self, record: StepRecord, state: RLState) -> None:
        cfg = self.cfg
        if record.stage != "rl":       # before RL (value pre-training): a line of its own, no checkpoint
            self.recorder.log({"stage": record.stage, "step": record.step, **record.metrics})
            return
        every = cfg.eval.every
        if every and record.step % every == 0 and record.step < cfg.train.steps:
            # Under its own seed (evaluate forks the RNG): the training numbers do not change.
            part = self.held_out[: cfg.eval.every_prompts or len(self.held_out)]
            record.metrics.update(
                eval_metrics(_evaluate(cfg, self.evaluator, self.task, part, f"eval (step {record.step})", self.policy))
            )
        self.recorder.step(record.step, record.metrics, record.samples)
        if record.step == cfg.train.steps or (cfg.checkpoint.every and record.step % cfg.checkpoint.every == 0):
            self.checkpoint(state)


def _start(cfg: Config, policy: Policy, engine: RolloutEngine, task: Task, group: LearnerGroup, store: CheckpointStore,
           saved: LoadedCheckpoint | None, recorder: Recorder) -> _Hooks:
    """SFT and the held-out evaluation of the model RL starts from, or for a resumed run what its
    checkpoint says they gave; the hooks of the training stage."""
    evaluator = split_generation(engine, group)
    for warning in probe_rewards(cfg, task, engine):     # a reward that is no reward stops here, not after eval
        if group.rank == 0:
            Console(stderr=True).print(f"warning: {escape(warning)}", soft_wrap=True, highlight=False)
    sft_summary = run_sft_stage(cfg, policy, engine, task, recorder) if saved is None else saved.meta["sft"]
    held_out = task.eval_split(cfg.eval.num_prompts)
    if saved is None:
        start = _evaluate(cfg, evaluator, task, held_out, "eval (start)", policy)
        recorder.log_eval(0, start)
        if cfg.train.seed is not None:
            seed_everything(cfg.train.seed)      # the training stage's own randomness (train.seed)
    else:
        start = EvalResult.from_summary(saved.meta["start_eval"])
    return _Hooks(cfg, group, policy, store, recorder, evaluator, task, held_out, sft_summary, start)


def _train(cfg: Config, hooks: _Hooks, engine: RolloutEngine, spec: ObjectiveSpec | PreferenceSpec,
           saved: LoadedCheckpoint | None, run_dir: RunDir) -> RLResult:
    """The training stage after SFT (TRAINERS); a guard's stop or failed reward code is RunStopped, a
    signal the end of the step, its checkpoint and RunInterrupted."""
    group, recorder = hooks.group, hooks.recorder
    ranks = {"group": group} if group.world_size > 1 else {}    # RL only (check_data_parallel)
    recorder.start_rl(saved.step if saved is not None else 0)   # the bar is up before the first step
    watchdog = (Watchdog(cfg.train.watchdog, run_dir.path, recorder.alert, saved.step if saved is not None else 0)
                if cfg.train.watchdog.enabled and group.rank == 0 else None)

    def on_step(record: StepRecord, state: RLState) -> None:
        hooks.on_step(record, state)
        if watchdog is not None:
            watchdog.beat(record.step)     # progress: a step ended
        if record.stage == "rl" and hooks.interrupts is not None:    # after SIGINT / SIGTERM: save it and stop
            hooks.interrupts.step_done(record.step, lambda: hooks.checkpoint(state))

    if hooks.interrupts is not None:
        hooks.interrupts.rl_started(force=lambda: watchdog is not None and watchdog.stopped is not None)

    try:
        return TRAINERS[type(spec), cfg.train.mode](cfg, hooks.policy, engine, hooks.task, spec, on_step,
                                                    saved=saved.tensors["rl"] if saved is not None else None, **ranks)
    except KeyboardInterrupt:
        if watchdog is None or watchdog.stopped is None:
            raise
        recorder.log({"stage": "failed", "step": watchdog.step + 1, "reason": watchdog.stopped})
        raise RunStopped(watchdog.stopped) from None
    except NonFiniteStop as err:
        path = hooks.checkpoint(err.state)   # skipped updates left the weights at the last good step
        recorder.log({"stage": "stopped", "step": err.state.step, "reason": str(err)})   # the report shows it
        raise RunStopped(f"{err} Checkpoint of the last good weights: {path}; "
                         f"`reinforge train --resume {run_dir.path}` continues from it.") from None
    except WeightSyncError as err:    # the sampler is not sampling the trained weights: alert, then stop
        recorder.alert([err.alert])
        recorder.log({"stage": "failed", "step": err.alert.step, "reason": str(err)})
        raise RunStopped(str(err)) from None
    except RewardError as err:
        # User code failed: one line for the console, the traceback in the run directory, and a
        # "failed" record so the run does not pass for one still going (no summary.json, no model).
        log = Path(run_dir.path) / "error.log"
        if group.rank == 0:
            log.write_text(f"run failed: {err}\n\n{err.details}")
            recorder.log({"stage": "failed", "reason": str(err)})
        raise RunStopped(f"{err}; full traceback in {log}") from None
    finally:
        if watchdog is not None:
            watchdog.close()


def _finish(cfg: Config, hooks: _Hooks, rl: RLResult, saved: LoadedCheckpoint | None, run_dir: RunDir,
            t_start: float) -> dict:
    """The final evaluation, the exported model and summary.json; the summary."""
    recorder = hooks.recorder
    if rl.stopped:     # RL ended early (every prompt retired): say so, then evaluate as usual
        recorder.log({"stage": "stopped", "step": rl.steps, "reason": rl.stopped})
        if rl.steps == 0 and cfg.train.steps > 0:   # nothing trained: not a finished run (no model, no summary)
            raise RunStopped(f"RL trained 0 steps: {rl.stopped}")
        if hooks.group.rank == 0:     # on the console too, not only in metrics.jsonl
            recorder.console.print(escape(f"RL ended at step {rl.steps} of {cfg.train.steps}: {rl.stopped}"))
    final = hooks.start if cfg.train.steps == 0 else \
        _evaluate(cfg, hooks.evaluator, hooks.task, hooks.held_out, "eval (final)", hooks.policy)   # an SFT-only run
    recorder.log_eval(rl.steps, final)
    run_dir.export_model(hooks.policy)
    summary = {
        "recipe": cfg.recipe,
        "task": cfg.task.name,
        "seed": cfg.seed,
        "sft": hooks.sft_summary,
        "rl_steps": rl.steps,
        "rl_stopped": rl.stopped,
        "resumed_from_step": saved.step if saved is not None else None,
        "wall_seconds": time.perf_counter() - t_start,
        "eval": {"start": hooks.start.to_summary(), "final": final.to_summary()},
    }
    if isinstance(hooks.evaluator, AgentEngine) and hooks.evaluator.tools is not None:
        # The same model with no tool to call: one turn each, what the tools add is the difference.
        alone = _evaluate(cfg, hooks.evaluator.engine, hooks.task, hooks.held_out, "eval (final, no tools)")
        summary["eval"]["final_without_tools"] = alone.to_summary()
    run_dir.write_summary(summary)
    return summary


def _evaluate(cfg: Config, engine, task: Task, held_out, label: str = "eval",
              policy: Policy | None = None) -> EvalResult:
    """The held-out evaluation; with eval.token_budgets also pass@1 within each budget, whose cut completions
    `policy`'s tokenizer decodes."""
    budgets = cfg.eval.token_budgets if policy is not None else []
    decode = (lambda ids: policy.tokenizer.batch_decode(ids, skip_special_tokens=True)) if budgets else None
    sampling = SamplingParams.from_config(cfg.rollout)
    # Its own bar, under the RL bar while RL runs; it disappears when done (leave=False).
    with tqdm(total=len(held_out), desc=label, unit="prompt", disable=not cfg.log.progress, leave=False,
              dynamic_ncols=True) as bar:
        return evaluate(engine, task, held_out, num_samples=cfg.eval.num_samples, sampling=sampling, seed=cfg.eval.seed,
                        on_batch=bar.update, token_budgets=budgets, decode=decode)


