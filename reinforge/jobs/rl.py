"""The edge between the config and the loop: RL and DPO runs built from a `Config`.

Everything below here (loops/, learner/, distributed/, rollout/, rewards/) takes small typed
settings or the config sections it needs; this module reads the whole config and wires the
parts: the learner step, the state (resumed from `saved`), the batch source and the
`after_update` hook of train.mode, the rollout workers of `backend`, the data-parallel ranks
(`group`), and the pair source of DPO. What learner ranks do not support is refused before
anything is written (config/checks.py: `check_data_parallel`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from tqdm import tqdm

from reinforge.agents.rollout import AgentEngine
from reinforge.agents.workers import AgentSampler
from reinforge.config import Config
from reinforge.curation.batches import BatchCollector, PromptStream, SampleNow
from reinforge.distributed import LearnerGroup
from reinforge.distributed.data_parallel import DataParallel
from reinforge.errors import ConfigError, RunStopped
from reinforge.learner import ForwardPlan, UpdateSettings
from reinforge.loops.async_rl import StalenessGate, StreamBatches, StreamSource
from reinforge.loops.baselines import greedy_baselines, takes_baselines
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
from reinforge.objectives.spec import PreferenceSpec
from reinforge.records import Scores
from reinforge.rewards.compose import RewardComposer
from reinforge.rewards.judge import build_judge, judge_examples
from reinforge.rewards.source_builders import build_sources
from reinforge.rewards.sources import SourceContext
from reinforge.rollout import Rollout, RolloutEngine, SamplingParams, build_engine, engine_publisher
from reinforge.rollout.stream import RolloutWorkers, WorkerSettings
from reinforge.rollout.vllm_engine import VLLMEngine
from reinforge.rollout.vllm_stream import VLLMSampler
from reinforge.rollout.weight_sync import build_check, sampler_probe, wire
from reinforge.settings.judge import JudgeConfig
from reinforge.tasks import Task
from reinforge.telemetry.recorder import Recorder
from reinforge.telemetry.reflection import with_reflection_metrics

Workers = Callable[[Policy], RolloutWorkers]   # the rollout workers of train.mode=async, given the policy
Score = Callable[[list, Rollout], Scores]
ScoreTransform = Callable[[Score], Score]


@dataclass
class RLStep:
    """One RL step's parts, built in one place (`rl_step`) and run by the one loop (loops/loop.py).

    Steps 1-2 come from `batches` (sampled now, or streamed from rollout workers, then curated), scored by
    the reward functions and sources followed by the named `reward_transforms` in order; steps 3-5 are
    `learner`'s; `after_update` hands the new weights to the sampler (verified by the weight-sync probe
    when `weight_check` is on) and `on_step` logs, evaluates and checkpoints. `describe()` is what the run
    directory records (RUN_DIR/step.json)."""

    mode: str                                     # train.mode
    batches: object                               # a BatchSource: SyncBatches, or StreamBatches via rank 0
    reward_transforms: list[str]                  # applied in order to the composed reward
    learner: Learner
    after_update: Callable[[torch.nn.Module], None]
    on_step: Callable[[StepRecord, RLState], None]
    weight_check: bool
    close: Callable[[], None] = lambda: None      # stops the rollout workers (async)

    def describe(self) -> dict:
        settings = self.learner.update
        return {"mode": self.mode, "batches": type(self.batches).__name__,
                "reward": ["reward functions and sources", *self.reward_transforms],
                "learner": {"objective": _fields(self.learner.spec), "ppo_epochs": settings.ppo_epochs,
                            "mini_batches": settings.mini_batches, "grad_clip": settings.grad_clip,
                            "data_parallel": self.learner.dp.group is not None},
                "after_update": ("publish, then the weight-sync probe" if self.weight_check else "publish"),
                "on_step": "log, evaluate, checkpoint"}


def _fields(spec: object) -> dict:
    """A spec's fields as plain values for step.json (its parameter tables are read-only mappings)."""
    return {f.name: (dict(v) if isinstance(v := getattr(spec, f.name), Mapping) else v)
            for f in dataclasses.fields(spec)}


def reward_step(score: Score, transforms: list[tuple[str, ScoreTransform]]) -> tuple[Score, list[str]]:
    """`score` with each named transform applied in order, and the names (what RLStep records)."""
    for _, transform in transforms:
        score = transform(score)
    return score, [name for name, _ in transforms]


def run_rl(cfg: Config, policy: Policy, engine: RolloutEngine, task: Task, spec: ObjectiveSpec,
           on_step: Callable[[StepRecord, RLState], None], saved: dict | None = None, group: LearnerGroup | None = None,
           workers: Workers | None = None, record_parts: Callable[[dict], None] | None = None) -> RLResult:
    """RL from step 1, or from the step after `saved` (an `RLState.state_dict()`; the weights are the caller's).

    train.mode=sync samples each batch now with `engine`; train.mode=async streams groups from rollout
    workers (`workers`, default by `backend`: a local sampler thread, or Ray actors; `engine` is then
    only the pipeline's, for evaluation) with bounded staleness. `group`: data-parallel learner ranks
    (distributed/data_parallel.py): `policy` stays plain (the sampler reads it) and a sharded copy of
    it trains; every rank runs the same loop on the same batches. `record_parts` gets `RLStep.describe()`.
    """
    tc = cfg.train
    dp = DataParallel(group, policy.model)
    sampling = SamplingParams.from_config(cfg.rollout)
    learner = Learner(policy, spec, UpdateSettings.from_config(tc, cfg.rollout), sampling, dp, tc.max_nonfinite_steps)
    state = RLState.start(tc, cfg.rl_seed, policy.model, task.train_split(tc.num_prompts), spec,
                          build_credit(tc, cfg.critic, policy.model, spec), sharded=dp.sharded)
    if saved is not None:
        state.load_state_dict(saved)
    build = _async_step if tc.mode == "async" else _sync_step
    step = build(cfg, policy, engine, task, spec, on_step, state, learner, workers)
    try:
        if record_parts is not None:
            record_parts(step.describe())
        return train_rl(tc.steps, state, step.batches, step.learner, step.on_step, after_update=step.after_update)
    finally:
        step.close()


def _reward_transforms(cfg: Config, spec: ObjectiveSpec, composer: RewardComposer, engine: RolloutEngine,
                       sampling: SamplingParams) -> list[tuple[str, ScoreTransform]]:
    """The named transforms of the composed reward, in the order they apply."""
    transforms: list[tuple[str, ScoreTransform]] = []
    if cfg.analytics.reflection_words:      # the figures of the samples' reflection words (telemetry/reflection.py)
        words = cfg.analytics.reflection_words
        transforms.append(("reflection word figures", lambda score: with_reflection_metrics(score, words)))
    if takes_baselines(spec):       # ReMax: a greedy completion of each prompt, scored, is its baseline
        greedy = composed_scores(composer, 1)
        transforms.append(("greedy baseline", lambda score: greedy_baselines(score, greedy, engine, sampling,
                                                                             cfg.train.group_size)))
    return transforms


def _sync_step(cfg: Config, policy: Policy, engine: RolloutEngine, task: Task, spec: ObjectiveSpec,
               on_step: Callable, state: RLState, learner: Learner, workers: Workers | None) -> RLStep:
    """train.mode=sync: each batch sampled now with `engine`, curated, then the update."""
    tc, dp, sampling = cfg.train, learner.dp, learner.sampling
    composer = reward_composer(cfg, task, policy)
    score, names = reward_step(composed_scores(composer, tc.group_size),
                               _reward_transforms(cfg, spec, composer, engine, sampling))
    # Learner ranks split generation across themselves (distributed/data_parallel.py); one process: as given.
    engine, score = dp.rollout_parts(engine, score)
    if dp.group is not None:
        names.append("rank 0's rewards on every rank")
    # The engine keeps its activations for the learner's first backward (models/replay.py) where the learner can
    # take them: the shared-prompt forward, on the weights the engine reads (not a data-parallel rank's copy).
    source = SampleNow(state.pool, engine, tc.group_size, sampling, generator=state.sampler_rng,
                       keep_activations=tc.reuse_activations and tc.shared_prefix and dp.group is None)
    collector = BatchCollector(cfg.curation, state.pool, source, score, tc.prompts_per_step, tc.group_size)
    policy.model.train()
    if state.step == 0:
        # VC-PPO / VAPO only
        pretrain_critic(state, collector, spec, policy.tokenizer.pad_token_id, cfg.critic, on_step)
    # The engine reads the trained tensors (learner ranks: the plain copy): the check probes what it reads.
    # An engine with its own copy of the weights (vLLM) is handed them after every update.
    publish = engine_publisher(engine, no_publish)
    check = build_check(tc.weight_sync, dp, lambda version: [sampler_probe(engine, check.ids)],
                        reads_trained=publish is no_publish)
    after_update, on_step = wire(check, publish, on_step, lambda: state.step, lambda: state.version)
    return RLStep("sync", SyncBatches(collector, dp), names, learner, after_update, on_step, check is not None)


def _async_step(cfg: Config, policy: Policy, engine: RolloutEngine, task: Task, spec: ObjectiveSpec,
                on_step: Callable, state: RLState, learner: Learner, workers: Workers | None) -> RLStep:
    """train.mode=async: batches streamed from rollout workers, whose `publish` is the `after_update` hook.
    Under learner ranks rank 0 alone holds the workers and the stream, and sends each batch to every rank."""
    tc, dp = cfg.train, learner.dp
    lead = dp.group is None or dp.group.rank == 0
    pool = (workers or default_workers(cfg, engine))(policy) if lead else None
    try:
        collector = source = None
        names: list[str] = []
        if lead:
            # The version counts learner steps (one weight publication each) and is what staleness counts.
            pool.publish(policy.model, state.step)
            source = StreamSource(state.pool, pool, StalenessGate(tc.prompts_per_step, tc.max_staleness, state.step),
                                  version=state.step, pending=state.pending, generator=state.sampler_rng)
            composer = reward_composer(cfg, task, policy)
            score, names = reward_step(composed_scores(composer, tc.group_size),
                                       _reward_transforms(cfg, spec, composer, engine, learner.sampling))
            collector = BatchCollector(cfg.curation, state.pool, source, score, tc.prompts_per_step, tc.group_size)
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
    except BaseException:
        if pool is not None:
            pool.close()
        raise
    return RLStep("async", dp.from_rank_0(stream), names, learner, after_update, on_step, check is not None,
                  close=pool.close if pool is not None else (lambda: None))


def run_dpo(cfg: Config, policy: Policy, engine: RolloutEngine, task: Task, spec: PreferenceSpec,
            on_step: Callable[[StepRecord, DPOState], None], saved: dict | None = None,
            record_parts: Callable[[dict], None] | None = None) -> RLResult:
    """DPO from step 1, or from the step after `saved` (a `DPOState.state_dict()`; the weights are the caller's):
    the same loop, with the pairs of dpo.pairs and the preference step. `record_parts` gets what the step is
    made of."""
    tc = cfg.train
    forward = ForwardPlan.from_config(tc)
    source = PAIR_SOURCES[cfg.dpo.pairs](cfg, policy, engine, task)
    state = DPOState.start(tc, policy.model, source.pool)
    if saved is not None:
        state.load_state_dict(saved)
    policy.model.train()
    if record_parts is not None:
        record_parts({"mode": "preference", "batches": type(source).__name__, "pairs": cfg.dpo.pairs,
                      "learner": {"objective": _fields(spec), "grad_clip": tc.grad_clip},
                      "after_update": "none (the sampler reads the trained weights)",
                      "on_step": "log, evaluate, checkpoint"})
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
    vllm = _vllm_engine(engine)
    if vllm is not None:
        if vllm is not engine:
            raise ConfigError("train.mode=async with rollout.engine=vllm samples single-turn groups: episodes (tools, "
                              "an environment or an agent) train with train.mode=sync, or rollout.engine=native")
        return lambda policy: VLLMSampler(vllm, settings.sampling, settings.group_size, settings.chat_template)
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


def _vllm_engine(engine: RolloutEngine | None) -> VLLMEngine | None:
    """The vLLM engine `engine` is or drives (agent rollouts wrap the engine they play with), if any."""
    while engine is not None and not isinstance(engine, VLLMEngine) and hasattr(engine, "engine"):
        engine = engine.engine
    return engine if isinstance(engine, VLLMEngine) else None


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


def sft_data(cfg: Config, task: Task) -> list:
    """The SFT data that exists without sampling: the task's (noisy) teacher traces or the traces in
    sft.data_path."""
    if cfg.sft.source == "teacher":
        return task.sft_examples(cfg.sft.num_examples, cfg.sft.corrupt_fraction, seed=cfg.seed)
    if cfg.sft.source == "file":
        from reinforge.curation.rejection import distillation_examples

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
    from reinforge.curation.rejection import rejection_sample

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
                  renderer=getattr(engine, "renderer", None))     # an agent rollout's (multi-turn traces)
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
