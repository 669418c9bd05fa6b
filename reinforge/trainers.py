"""The edge between the config and the loop: RL and DPO runs built from a `Config`.

Everything below here (loops/, learner/, distributed/, rollout/, rewards/) takes small typed
settings or the config sections it needs; this module reads the whole config and wires the
parts: the learner step, the state (resumed from `saved`), the batch source and the
`after_update` hook of train.mode, the rollout workers of `backend`, the data-parallel ranks
(`group`), and the preference objective and pair source of DPO. It also refuses, before anything
is written, what learner ranks do not support (`check_data_parallel`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import torch
from tqdm import tqdm

from reinforge.agents.rollout import AgentEngine
from reinforge.agents.workers import AgentSampler
from reinforge.config import Config
from reinforge.distributed import LearnerGroup
from reinforge.distributed.data_parallel import DataParallel
from reinforge.errors import ConfigError, RunStopped
from reinforge.learner import ForwardPlan, UpdateSettings
from reinforge.loops.async_rl import StalenessGate, StreamBatches, StreamSource
from reinforge.loops.baselines import greedy_baselines, takes_baselines
from reinforge.loops.curation import BatchCollector, PromptStream, SampleNow, Scores
from reinforge.loops.dpo import (
    DatasetPairs,
    DPOState,
    OnPolicyPairs,
    PairSource,
    PreferenceLearner,
    preference_pairs,
)
from reinforge.loops.loop import RLResult, StepRecord, no_publish, train_rl
from reinforge.loops.rl import (
    Learner,
    RLState,
    SyncBatches,
    build_credit,
    composed_scores,
    pretrain_critic,
)
from reinforge.loops.self_play import SelfJudgedPairs, SpinPairs
from reinforge.loops.sft import run_sft
from reinforge.models import Policy, load_policy
from reinforge.objectives import ObjectiveSpec
from reinforge.objectives.preference import preference_loss
from reinforge.objectives.recipes import RECIPES
from reinforge.objectives.spec import PreferenceSpec
from reinforge.rewards.compose import RewardComposer
from reinforge.rewards.judge import build_judge, judge_examples
from reinforge.rewards.sources import SourceContext, build_sources
from reinforge.rollout import Rollout, RolloutEngine, SamplingParams, build_engine, engine_publisher
from reinforge.rollout.stream import RolloutWorkers, WorkerSettings
from reinforge.settings.judge import JudgeConfig
from reinforge.tasks import Task
from reinforge.telemetry.recorder import Recorder
from reinforge.telemetry.reflection import with_reflection_metrics
from reinforge.telemetry.weight_sync import build_check, sampler_probe, wire

Workers = Callable[[Policy], RolloutWorkers]   # the rollout workers of train.mode=async, given the policy


def run_rl(cfg: Config, policy: Policy, engine: RolloutEngine, task: Task, spec: ObjectiveSpec,
           on_step: Callable[[StepRecord, RLState], None], saved: dict | None = None, group: LearnerGroup | None = None,
           workers: Workers | None = None) -> RLResult:
    """RL from step 1, or from the step after `saved` (an `RLState.state_dict()`; the weights are the caller's).

    train.mode=sync samples each batch now with `engine`; train.mode=async streams groups from rollout
    workers (`workers`, default by `backend`: a local sampler thread, or Ray actors; `engine` is then
    only the pipeline's, for evaluation) with bounded staleness. `group`: data-parallel learner ranks
    (distributed/data_parallel.py): `policy` stays plain (the sampler reads it) and a sharded copy of
    it trains; every rank runs the same loop on the same batches.
    """
    tc = cfg.train
    dp = DataParallel(group, policy.model)
    sampling = SamplingParams.from_config(cfg.rollout)
    learner = Learner(policy, spec, UpdateSettings.from_config(tc, cfg.rollout), sampling, dp, tc.max_nonfinite_steps)
    state = RLState.start(tc, cfg.rl_seed, policy.model, task.train_split(tc.num_prompts), spec,
                          build_credit(tc, cfg.critic, policy.model, spec), sharded=dp.sharded)
    if saved is not None:
        state.load_state_dict(saved)
    if tc.mode == "async":
        return _run_async(cfg, policy, task, spec, on_step, state, learner, workers or default_workers(cfg, engine))
    # Learner ranks split generation across themselves (distributed/data_parallel.py); one process: as given.
    composer = reward_composer(cfg, task, policy)
    score = run_scores(cfg, composer)
    if takes_baselines(spec):       # ReMax: a greedy completion of each prompt, scored, is its baseline
        score = greedy_baselines(score, composed_scores(composer, 1), engine, sampling, tc.group_size)
    engine, score = dp.rollout_parts(engine, score)
    source = SampleNow(state.pool, engine, tc.group_size, sampling, generator=state.sampler_rng)
    collector = BatchCollector(cfg.curation, state.pool, source, score, tc.prompts_per_step, tc.group_size)
    policy.model.train()
    if state.step == 0:
        # VC-PPO / VAPO only
        pretrain_critic(state, collector, spec, policy.tokenizer.pad_token_id, cfg.critic, on_step)
    # The engine reads the trained tensors (learner ranks: the plain copy): the check probes what it reads.
    check = build_check(tc.weight_sync, dp, lambda version: [sampler_probe(engine, check.ids)])
    # An engine with its own copy of the weights (vLLM) is handed them after every update.
    after_update, on_step = wire(check, engine_publisher(engine, no_publish), on_step, lambda: state.step,
                                 lambda: state.version)
    return train_rl(tc.steps, state, SyncBatches(collector, dp), learner, on_step, after_update=after_update)


def _run_async(
    cfg: Config,
    policy: Policy,
    task: Task,
    spec: ObjectiveSpec,
    on_step: Callable[[StepRecord, RLState], None],
    state: RLState,
    learner: Learner,
    workers: Workers,
) -> RLResult:
    """train.mode=async: the loop over a `StreamBatches`, whose `publish` is the `after_update` hook. Under
    learner ranks rank 0 alone holds the workers and the stream, and sends each batch to every rank."""
    tc, dp = cfg.train, learner.dp
    lead = dp.group is None or dp.group.rank == 0
    pool = workers(policy) if lead else None
    try:
        collector = source = None
        if lead:
            # The version counts learner steps (one weight publication each) and is what staleness counts.
            pool.publish(policy.model, state.step)
            source = StreamSource(state.pool, pool, StalenessGate(tc.prompts_per_step, tc.max_staleness, state.step),
                                  version=state.step, pending=state.pending, generator=state.sampler_rng)
            collector = BatchCollector(
                cfg.curation,
                state.pool,
                source,
                run_scores(cfg, reward_composer(cfg, task, policy)),
                tc.prompts_per_step,
                tc.group_size,
            )
        policy.model.train()
        if state.step == 0 and lead:   # a critic: one process only (check_data_parallel)
            pretrain_critic(state, collector, spec, policy.tokenizer.pad_token_id, cfg.critic, on_step,
                            after_collect=source.release_consumed)
        stream = StreamBatches(collector, source, pool) if lead else None
        # Every worker must hold the version just published and score the probe as the learner does.
        check = build_check(tc.weight_sync, dp, lambda version: pool.probe(version, check.ids, tc.weight_sync.timeout_s)
                            if lead else [])
        if check is not None:
            check.verify(state.step, state.step)     # the first publication, before any sample is taken
        after_update, on_step = wire(check, stream.publish if lead else no_publish, on_step, lambda: state.step,
                                     lambda: source.version if lead else state.step)
        return train_rl(tc.steps, state, dp.from_rank_0(stream), learner, on_step, after_update=after_update)
    finally:
        if pool is not None:
            pool.close()


def run_dpo(cfg: Config, policy: Policy, engine: RolloutEngine, task: Task, spec: PreferenceSpec,
            on_step: Callable[[StepRecord, DPOState], None], saved: dict | None = None) -> RLResult:
    """DPO from step 1, or from the step after `saved` (a `DPOState.state_dict()`; the weights are the caller's):
    the same loop, with the pairs of dpo.pairs and the preference step."""
    tc = cfg.train
    forward = ForwardPlan.from_config(tc)
    source = PAIR_SOURCES[cfg.dpo.pairs](cfg, policy, engine, task)
    state = DPOState.start(tc, policy.model, source.pool)
    if saved is not None:
        state.load_state_dict(saved)
    policy.model.train()
    return train_rl(
        tc.steps, state, source, PreferenceLearner(policy, spec, forward, tc.grad_clip, tc.max_nonfinite_steps), on_step
    )


def reward_composer(cfg: Config, task: Task, policy: Policy) -> RewardComposer:
    """The run's reward: its functions and its reward sources (reward models, judges, teachers), built now."""
    context = SourceContext(task=task, device=cfg.model.device, chat_template=cfg.prompt.chat_template,
                            policy=policy, temperature=cfg.rollout.temperature)
    return RewardComposer(cfg.reward, task, cfg.rollout.max_new_tokens, build_sources(cfg.reward, context))


def probe_rewards(cfg: Config, task: Task, engine: RolloutEngine, rows: int = 3) -> list[str]:
    """The reward functions called on one sampled completion of each of the first `rows` training
    prompts, before SFT and the start-of-RL evaluation: ConfigError at once for a function that returns
    something other than a reward (RewardComposer.probe); the warnings of functions that scored none.
    Reward sources (models, judges) are not loaded for it."""
    if not cfg.reward.functions:
        return []
    examples = task.train_split(min(rows, cfg.train.num_prompts))[:rows]
    if not examples:
        return []
    composer = RewardComposer(cfg.reward, task, cfg.rollout.max_new_tokens, check_domains=False)
    params = dataclasses.replace(SamplingParams.from_config(cfg.rollout),
                                 max_new_tokens=min(cfg.rollout.max_new_tokens, 32))   # a few tokens tell the type
    # Its own random stream, the run's left as it was: a run samples the same with the probe as without it.
    with torch.random.fork_rng():     # the CPU stream and every CUDA device's, restored after
        rollout = engine.generate([e.prompt for e in examples], 1, params,
                                  generator=torch.Generator().manual_seed(cfg.seed))
    return composer.probe(examples, rollout)


def run_scores(cfg: Config, composer: RewardComposer) -> Callable[[list, Rollout], Scores]:
    """The RL step's reward (`composed_scores`), its figures with the reflection words of the samples
    (analytics.reflection_words: telemetry/reflection.py)."""
    return with_reflection_metrics(composed_scores(composer, cfg.train.group_size), cfg.analytics.reflection_words)


def default_workers(cfg: Config, engine: RolloutEngine | None = None) -> Workers:
    """The rollout workers of `backend`: a sampler thread of this process, or Ray actors; for episodes
    (`engine` an agent rollout) a sampler thread that plays them."""
    tc = cfg.train
    if cfg.rollout.quantization != "none":
        raise ConfigError(f"rollout.quantization={cfg.rollout.quantization} is built for the synchronous loop's "
                          "engine only, not for rollout workers: set train.mode=sync, or rollout.quantization=none")
    settings = WorkerSettings(SamplingParams.from_config(cfg.rollout), tc.group_size,
                              slots=cfg.rollout.max_batch_rows or tc.prompts_per_step * tc.group_size,
                              in_flight=tc.in_flight, chat_template=cfg.prompt.chat_template,
                              cpu_kernels=cfg.rollout.cpu_kernels)
    if isinstance(engine, AgentEngine):
        if cfg.backend == "ray":
            raise ConfigError("backend=ray with tools or an environment: Ray rollout workers do not play episodes "
                              "yet; use backend=local (the default), whose sampler thread does")
        return lambda policy: AgentSampler(policy, engine, settings)
    if cfg.backend != "ray":
        return settings.sampler
    from reinforge.distributed.ray_workers import (  # Ray is imported only when asked for
        RayWorkerSettings,
        ray_workers,
    )
    ray_settings = RayWorkerSettings(settings, cfg.model, cfg.seed, cfg.ray)
    return lambda policy: ray_workers(ray_settings, policy)


def _on_policy_pairs(cfg: Config, policy: Policy, engine: RolloutEngine, task: Task) -> OnPolicyPairs:
    tc = cfg.train
    return OnPolicyPairs(PromptStream(task.train_split(tc.num_prompts), seed=cfg.rl_seed), engine, task,
                         SamplingParams.from_config(cfg.rollout), tc.prompts_per_step, tc.group_size,
                         cfg.dpo.pairs_per_prompt, policy.tokenizer.pad_token_id)


def _dataset_pairs(cfg: Config, policy: Policy, engine: RolloutEngine, task: Task) -> DatasetPairs:
    pool = PromptStream(
        preference_pairs(cfg.dpo.pairs_path, cfg.dpo.pairs_fields), seed=cfg.rl_seed  # type: ignore[arg-type]
    )
    return DatasetPairs(pool, policy, cfg.train.prompts_per_step, cfg.prompt.chat_template)


def _self_judged_pairs(cfg: Config, policy: Policy, engine: RolloutEngine, task: Task) -> SelfJudgedPairs:
    tc = cfg.train
    # The policy judges its own samples unless reward.judge names another judge.
    judge = build_judge(cfg.reward.judge or JudgeConfig(), policy, cfg.model.device, cfg.prompt.chat_template)
    return SelfJudgedPairs(PromptStream(task.train_split(tc.num_prompts), seed=cfg.rl_seed), engine, judge, task,
                           SamplingParams.from_config(cfg.rollout), tc.prompts_per_step, tc.group_size,
                           policy.tokenizer.pad_token_id)


def _spin_pairs(cfg: Config, policy: Policy, engine: RolloutEngine, task: Task) -> SpinPairs:
    pool = PromptStream(sft_data(cfg, task), seed=cfg.rl_seed)     # type: ignore[arg-type]
    return SpinPairs(pool, policy, engine, SamplingParams.from_config(cfg.rollout), cfg.train.prompts_per_step,
                     cfg.prompt.chat_template)


# DPO's pairs (dpo.pairs): sampled from the policy and paired by the verifier or by the policy's own
# judgements, read from a file, or the SFT data against the policy's samples.
PAIR_SOURCES: dict[str, Callable[[Config, Policy, RolloutEngine, Task], PairSource]] = {
    "on_policy": _on_policy_pairs,
    "dataset": _dataset_pairs,
    "self_judged": _self_judged_pairs,
    "spin": _spin_pairs,
}


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


def check_data_parallel(cfg: Config, spec: ObjectiveSpec | PreferenceSpec, world_size: int) -> None:
    """Refuse, before anything is written, what data-parallel learner ranks do not support yet."""
    where = f"under torchrun (WORLD_SIZE={world_size}: data-parallel FSDP learner ranks)"
    if cfg.train.shared_prefix:
        raise ConfigError(
            f"train.shared_prefix=true is not supported {where}: the shared-prompt learner forward reads "
            "every layer's weights directly, past FSDP's per-layer all-gathers; set train.shared_prefix=false"
        )
    if cfg.model.lora is not None:
        raise ConfigError(
            f"model.lora is not supported {where} yet: train the full model (model.lora=null), or run one process"
        )
    if isinstance(spec, PreferenceSpec):
        raise ConfigError(f"recipe {cfg.recipe!r} (preference pairs) is not supported {where} yet: run one process")
    if spec.needs_critic:
        raise ConfigError(
            f"recipe {cfg.recipe!r} trains a critic, which is not supported {where} yet: run one process, "
            "or use a critic-free recipe (grpo, dr_grpo, ...)"
        )
    if takes_baselines(spec):
        raise ConfigError(f"objective.advantage={spec.advantage} (a greedy baseline rollout) is not supported {where} "
                          "yet: run one process")
    if cfg.backend != "local":
        raise ConfigError(f"backend={cfg.backend} is not supported {where}: set backend=local")


def sft_data(cfg: Config, task: Task) -> list:
    """The SFT data that exists without sampling: the task's (noisy) teacher traces or the traces in
    sft.data_path."""
    if cfg.sft.source == "teacher":
        return task.sft_examples(cfg.sft.num_examples, cfg.sft.corrupt_fraction, seed=cfg.seed)
    if cfg.sft.source == "file":
        from reinforge.loops.rejection import distillation_examples

        return distillation_examples(cfg.sft.data_path)
    raise ConfigError(f"sft.source={cfg.sft.source} has no SFT data before sampling (dpo.pairs=spin pairs the SFT "
                      "data with the policy's samples): set sft.source=teacher or file")


def sft_examples(cfg: Config, engine, task: Task) -> tuple[list, dict]:
    """What SFT trains on (sft.source), with sft.judge_fraction of judge training data, and figures about
    it for the summary."""
    examples, figures = _sft_source(cfg, engine, task)
    fraction = cfg.sft.judge_fraction
    if fraction == 0:
        return examples, figures
    # Of sft.num_examples teacher traces, the fraction is judge data (in place of the last traces drawn);
    # other sources get it on top.
    count = round(fraction * cfg.sft.num_examples) if cfg.sft.source == "teacher" else \
        round(fraction / (1 - fraction) * len(examples))
    judging = judge_examples(task, count, cfg.reward.judge or JudgeConfig(), seed=cfg.seed + 1)
    if cfg.sft.source == "teacher":
        examples = examples[: cfg.sft.num_examples - count]
    return examples + judging, {**figures, "judge_examples": len(judging)}


def _sft_source(cfg: Config, engine, task: Task) -> tuple[list, dict]:
    if cfg.sft.source == "teacher":
        return sft_data(cfg, task), {}
    if cfg.sft.source == "file":
        examples = sft_data(cfg, task)
        return examples, {"examples": len(examples)}
    from reinforge.loops.rejection import rejection_sample

    if cfg.sft.teacher_path is not None:      # offline distillation: the teacher's samples, not the model's own
        teacher = load_policy(cfg.model.model_copy(update={"path": cfg.sft.teacher_path, "lora": None}), cfg.seed)
        engine = build_engine(cfg.rollout, teacher, chat_template=cfg.prompt.chat_template)
    kept = rejection_sample(engine, task, task.train_split(cfg.sft.rejection_prompts), cfg.sft.rejection_samples,
                            SamplingParams.from_config(cfg.rollout), cfg.sft.rejection_max_per_prompt, seed=cfg.seed)
    if not kept.examples:
        who = "the teacher (sft.teacher_path)" if cfg.sft.teacher_path is not None else "the model"
        raise RunStopped(f"rejection sampling kept no sample: none of {cfg.sft.rejection_prompts} prompts x "
                         f"{cfg.sft.rejection_samples} samples of {who} was verified correct; start from a stronger "
                         "model or raise sft.rejection_samples")
    return kept.examples, kept.metrics()


def run_sft_stage(cfg: Config, policy, engine, task: Task, recorder: Recorder) -> dict | None:
    """SFT on the sft.source examples; its summary, or None when it is off."""
    if not (cfg.sft.enabled and cfg.sft.steps > 0):
        return None
    data, figures = sft_examples(cfg, engine, task)
    t0 = time.perf_counter()
    bar = tqdm(total=cfg.sft.steps, desc="sft", disable=not cfg.log.progress, leave=False, dynamic_ncols=True)

    def sft_step(step: int, loss: float) -> None:
        recorder.log_sft_step(step, loss)
        bar.update(1)
        if step % 10 == 0:
            bar.set_postfix(loss=f"{loss:.3f}")

    sft = run_sft(policy, data, cfg.sft, chat_template=cfg.prompt.chat_template, seed=cfg.seed, on_step=sft_step,
                  forward=ForwardPlan.from_config(cfg.train),
                  renderer=engine.renderer if isinstance(engine, AgentEngine) else None)
    bar.close()
    summary = {
        "source": cfg.sft.source,
        **figures,
        "steps": sft.steps,
        "first_loss": sft.first_loss,
        "final_loss": sft.final_loss,
    }
    recorder.sft_done(summary, time.perf_counter() - t0)
    return summary
