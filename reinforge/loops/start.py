"""The edge between the config and the loop: RL and DPO runs built from a `Config`.

Everything below here (loops/loop.py, loops/rl.py, loops/async_rl.py, loops/dpo.py, learner/,
distributed/) takes small typed settings or the config sections it needs; this module reads the
whole config once and wires the parts: the learner step, the state (resumed from `saved`), the
batch source and the `after_update` hook of train.mode, and the data-parallel ranks (`group`).
"""

from __future__ import annotations

from collections.abc import Callable

from reinforge.config import Config
from reinforge.distributed import LearnerGroup
from reinforge.distributed.data_parallel import DataParallel
from reinforge.learner import ForwardPlan, UpdateSettings
from reinforge.loops.async_rl import StalenessGate, StreamBatches, StreamSource, default_workers
from reinforge.loops.curation import BatchCollector, SampleNow
from reinforge.loops.dpo import PAIR_SOURCES, DPOState, PreferenceLearner
from reinforge.loops.loop import RLResult, StepRecord, no_publish, train_rl
from reinforge.loops.rl import (
    Learner,
    RLState,
    SyncBatches,
    build_credit,
    composed_scores,
    pretrain_critic,
)
from reinforge.models import Policy
from reinforge.objectives import ObjectiveSpec
from reinforge.objectives.spec import PreferenceSpec
from reinforge.rewards.compose import RewardComposer
from reinforge.rollout import RolloutEngine, SamplingParams
from reinforge.rollout.stream import RolloutWorkers
from reinforge.tasks import Task

Workers = Callable[[Config, Policy, RLState, Learner], RolloutWorkers]


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
        return _run_async(cfg, policy, task, spec, on_step, state, learner, workers or default_workers(cfg))
    # Learner ranks split generation across themselves (distributed/data_parallel.py); one process: as given.
    engine, score = dp.rollout_parts(engine, composed_scores(RewardComposer(cfg.reward, task, cfg.rollout.max_new_tokens), tc.group_size))
    source = SampleNow(state.pool, engine, tc.group_size, sampling, generator=state.sampler_rng)
    collector = BatchCollector(cfg.curation, state.pool, source, score, tc.prompts_per_step, tc.group_size)
    policy.model.train()
    if state.step == 0:
        pretrain_critic(state, collector, spec, policy.tokenizer.pad_token_id, cfg.critic, on_step)   # VC-PPO / VAPO only
    return train_rl(tc.steps, state, SyncBatches(collector, dp), learner, on_step)


def _run_async(cfg: Config, policy: Policy, task: Task, spec: ObjectiveSpec, on_step: Callable[[StepRecord, RLState], None],
               state: RLState, learner: Learner, workers: Workers) -> RLResult:
    """train.mode=async: the loop over a `StreamBatches`, whose `publish` is the `after_update` hook. Under
    learner ranks rank 0 alone holds the workers and the stream, and sends each batch to every rank."""
    tc, dp = cfg.train, learner.dp
    lead = dp.group is None or dp.group.rank == 0
    pool = workers(cfg, policy, state, learner) if lead else None
    try:
        collector = source = None
        if lead:
            # The version counts learner steps (one weight publication each) and is what staleness counts.
            pool.publish(policy.model, state.step)
            source = StreamSource(state.pool, pool, StalenessGate(tc.prompts_per_step, tc.max_staleness, state.step),
                                  version=state.step, pending=state.pending, generator=state.sampler_rng)
            collector = BatchCollector(cfg.curation, state.pool, source,
                                       composed_scores(RewardComposer(cfg.reward, task, cfg.rollout.max_new_tokens), tc.group_size),
                                       tc.prompts_per_step, tc.group_size)
        policy.model.train()
        if state.step == 0 and lead:   # a critic: one process only (check_data_parallel)
            pretrain_critic(state, collector, spec, policy.tokenizer.pad_token_id, cfg.critic, on_step,
                            after_collect=source.release_consumed)
        stream = StreamBatches(collector, source, pool) if lead else None
        return train_rl(tc.steps, state, dp.from_rank_0(stream), learner, on_step,
                        after_update=stream.publish if lead else no_publish)
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
    return train_rl(tc.steps, state, source, PreferenceLearner(policy, spec, forward, tc.grad_clip, tc.max_nonfinite_steps),
                    on_step)
