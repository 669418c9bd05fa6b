"""The synchronous RL loop: sample, reward, advantage, update, log.

It reads top to bottom; methods differ only in the objective spec they pass
(see `reinforge.objectives`), never by a branch in this file.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from reinforge.config import Config, CriticConfig
from reinforge.distributed import LearnerGroup, full_optimizer_state, load_full_optimizer_state
from reinforge.distributed.data_parallel import DataParallel
from reinforge.learner import (
    ForwardPlan,
    LearnerBatch,
    Reference,
    build_optimizer,
    build_sequences,
    policy_update,
    token_logprobs,
    warmup_constant,
)
from reinforge.learner.critic import Critic
from reinforge.loops.credit import CriticCredit, GroupCredit
from reinforge.loops.curation import (
    BatchCollector,
    CuratedBatch,
    PoolExhausted,
    PromptStream,
    SampleNow,
    Scores,
)
from reinforge.models import Policy
from reinforge.objectives import ObjectiveSpec
from reinforge.objectives.corrections import mismatch_metrics
from reinforge.rewards.compose import RewardComposer
from reinforge.rollout import Rollout, RolloutEngine, SamplingParams
from reinforge.tasks import Example, Task
from reinforge.telemetry.checkpoint import global_rng_state, set_global_rng_state
from reinforge.telemetry.samples import StepSamples


@dataclass
class RLResult:
    steps: int                                  # RL steps completed
    policy_version: int
    optimizer: torch.optim.Optimizer
    stopped: str | None = None                  # why RL ended before train.steps (every prompt retired)


@dataclass
class StepRecord:
    """One line of metrics.jsonl."""

    step: int
    metrics: dict[str, float]
    stage: str = "rl"          # "value_pretrain": a critic pre-training step before RL (not an RL step)
    samples: StepSamples | None = None   # the step's trained batch, for samples.jsonl (None: no update this step)


class NonFiniteStop(RuntimeError):
    """Too many RL steps in a row had a NaN/inf loss or gradient (train.max_nonfinite_steps).

    `state` is the loop's state at the stop (the weights and optimizer of the last good step,
    since skipped updates changed nothing): what the caller checkpoints.
    """

    def __init__(self, message: str, state: RLState):
        super().__init__(message)
        self.state = state


@dataclass
class RLState:
    """Everything RL carries from one step to the next: what a checkpoint saves and resume restores.

    With it restored (and the weights), step k+1 of a resumed run computes exactly what step k+1 of
    an uninterrupted run computes: the sampler's draws come from torch's global generator, so the
    global RNG states are part of it.
    """

    step: int                                   # last completed RL step
    version: int                                # policy version: optimizer steps taken
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    reference: Reference | None                 # None when the loss has no KL term
    credit: GroupCredit | CriticCredit          # advantages: group estimator state (EMA baselines) or the critic
    pool: PromptStream                          # prompt order, epoch, retired prompts
    generator: torch.Generator                  # mini-batch order, noise transforms
    sampler_rng: torch.Generator                # the rollout's sampling draws
    nonfinite_streak: int = 0                   # RL steps in a row with a skipped optimizer step
    pending: list[int] = field(default_factory=list)   # train.mode=async: pool indices requested, not yet trained on
    skipped_total: int = 0                      # optimizer steps skipped over the run
    # Data-parallel learner ranks: the FSDP-sharded model the optimizer steps (its state is gathered
    # into a full one in a checkpoint, so every rank must call state_dict); None in one process.
    sharded: torch.nn.Module | None = None

    @classmethod
    def start(cls, cfg: Config, model: torch.nn.Module, task: Task, spec: ObjectiveSpec,
              sharded: torch.nn.Module | None = None) -> RLState:
        """The state as RL starts; the reference (fixed or EMA) begins as the policy (after SFT).
        `model` is the plain policy model; `sharded`, under learner ranks, its sharded copy that trains."""
        optimizer = build_optimizer(model if sharded is None else sharded, cfg.train.lr, cfg.train.weight_decay)
        return cls(
            step=0, version=0, optimizer=optimizer, scheduler=warmup_constant(optimizer, cfg.train.warmup_steps),
            reference=Reference.build(model, spec),
            credit=build_credit(cfg, model, spec),
            pool=PromptStream(task.train_split(cfg.train.num_prompts), seed=cfg.rl_seed),
            generator=torch.Generator().manual_seed(cfg.rl_seed),
            # Its own stream, so that a sampler in another thread (train.mode=async) draws what the
            # synchronous loop draws.
            sampler_rng=torch.Generator().manual_seed(cfg.rl_seed + 1_000_003),
            sharded=sharded,
        )

    def state_dict(self) -> dict:
        return {
            "step": self.step, "version": self.version,
            "optimizer": self.optimizer.state_dict() if self.sharded is None else full_optimizer_state(self.sharded, self.optimizer),
            "scheduler": self.scheduler.state_dict(),
            "reference": self.reference.state_dict() if self.reference is not None else None,
            "credit": self.credit.state_dict(), "pool": self.pool.state_dict(),
            "generator": self.generator.get_state(), "sampler_rng": self.sampler_rng.get_state(),
            "global_rng": global_rng_state(),
            "nonfinite_streak": self.nonfinite_streak, "skipped_total": self.skipped_total,
            "pending": list(self.pending),
        }

    def load_state_dict(self, state: dict) -> None:
        self.step, self.version = state["step"], state["version"]
        if self.sharded is None:
            self.optimizer.load_state_dict(state["optimizer"])
        else:
            load_full_optimizer_state(self.sharded, self.optimizer, state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if self.reference is not None:
            self.reference.load_state_dict(state["reference"])
        self.credit.load_state_dict(state["credit"])
        self.pool.load_state_dict(state["pool"])
        self.generator.set_state(state["generator"])
        self.sampler_rng.set_state(state["sampler_rng"])
        self.nonfinite_streak, self.skipped_total = state["nonfinite_streak"], state["skipped_total"]
        self.pending = list(state.get("pending", []))
        set_global_rng_state(state["global_rng"])


def composed_scores(composer: RewardComposer, group_size: int) -> Callable[[list[Example], Rollout], Scores]:
    """The configured reward functions (cfg.reward) as the reward; row r belongs to examples[r // group_size]."""

    def score(examples: list[Example], rollout: Rollout) -> Scores:
        scored = composer.score(examples, rollout, group_size)       # RewardError past reward.max_error_rate
        # Pass rates and the NLL term need "the verifier accepted it" (NaN > 0 is False).
        correct = scored.parts["verifier"] > 0 if "verifier" in scored.parts else scored.total > 0
        return Scores(rewards=scored.total, valid=scored.valid, correct=correct, metrics=scored.metrics(), parts=scored.parts)

    return score


def build_credit(cfg: Config, model: torch.nn.Module, spec: ObjectiveSpec) -> GroupCredit | CriticCredit:
    """The credit assignment `spec` asks for: a critic and GAE (advantage gae), else the group estimator."""
    if not spec.needs_critic:
        return GroupCredit(spec, cfg.train.kl_target)
    critic = Critic(model, cfg.critic.lr, cfg.critic.weight_decay, shared_body=cfg.critic.shared_body)
    return CriticCredit(spec, critic, ForwardPlan.from_config(cfg.train),
                        epochs=cfg.train.ppo_epochs, mini_batches=cfg.train.mini_batches, grad_clip=cfg.train.grad_clip,
                        kl_target=cfg.train.kl_target)


def pretrain_critic(state: RLState, collector: BatchCollector, spec: ObjectiveSpec, pad_id: int, cfg: CriticConfig,
                    on_step: Callable[[StepRecord, RLState], None], after_collect: Callable[[], None] = lambda: None) -> None:
    """Value pre-training before the first policy update (VC-PPO, VAPO): the critic fits the initial
    policy's Monte-Carlo returns for up to objective.value.pretrain_steps steps, and stops once its
    explained variance has converged (critic.pretrain_patience / pretrain_tolerance). Nothing
    without a critic."""
    if not isinstance(state.credit, CriticCredit):
        return
    history: list[float] = []
    for k in range(1, spec.value.pretrain_steps + 1):
        curated = collector.collect(state.version)
        after_collect()
        if curated.rollout is None:
            continue
        rollout = curated.rollout
        sequences = build_sequences(rollout.prompt_ids, rollout.completion_ids, rollout.completion_mask, pad_id,
                                    group_ids=rollout.group_ids)
        fitted = state.credit.pretrain(sequences, curated.scores.rewards, curated.scores.valid, state.generator)
        on_step(StepRecord(step=k, metrics=fitted, stage="value_pretrain"), state)
        history.append(fitted.get("critic/explained_variance_after", float("nan")))
        if explained_variance_converged(history, cfg.pretrain_patience, cfg.pretrain_tolerance):
            break


def explained_variance_converged(history: list[float], patience: int, tolerance: float) -> bool:
    """The last `patience` steps raised the best explained variance by less than `tolerance`
    (NaN, a batch whose returns do not vary, counts as no rise)."""
    if len(history) <= patience:
        return False
    before = max((v for v in history[:-patience] if v == v), default=float("-inf"))
    recent = max((v for v in history[-patience:] if v == v), default=float("-inf"))
    return recent < before + tolerance


def train_rl(
    cfg: Config,
    policy: Policy,
    engine: RolloutEngine,
    task: Task,
    spec: ObjectiveSpec,
    on_step: Callable[[StepRecord, RLState], None],
    saved: dict | None = None,
    group: LearnerGroup | None = None,
) -> RLResult:
    """RL from step 1, or from the step after `saved` (an `RLState.state_dict()`; the weights are the caller's).

    `on_step` gets every step's record and the state after it (to log, evaluate and checkpoint).
    Raises NonFiniteStop after train.max_nonfinite_steps steps in a row with a skipped update,
    once `on_step` has seen the last of them.

    `group`: data-parallel learner ranks (distributed/data_parallel.py): `policy` stays plain (the
    engine samples from it) and a sharded copy of it trains; every rank runs this same loop.
    """
    tc = cfg.train
    learner = Learner(cfg, policy, spec, group)
    state = RLState.start(cfg, policy.model, task, spec, sharded=learner.dp.sharded)
    if saved is not None:
        state.load_state_dict(saved)
    # Learner ranks split generation across themselves (distributed/data_parallel.py); one process: as given.
    engine, score = learner.dp.rollout_parts(engine, composed_scores(RewardComposer(cfg.reward, task, cfg.rollout.max_new_tokens), tc.group_size))
    source = SampleNow(state.pool, engine, tc.group_size, learner.sampling, generator=state.sampler_rng)
    collector = BatchCollector(cfg.curation, state.pool, source, score, tc.prompts_per_step, tc.group_size)
    policy.model.train()
    if state.step == 0:
        pretrain_critic(state, collector, spec, policy.tokenizer.pad_token_id, cfg.critic, on_step)   # VC-PPO / VAPO only
    for step in range(state.step + 1, tc.steps + 1):
        t0 = time.perf_counter()
        state.step = step
        # 1-2. sample and reward, in as many rounds as curation needs to fill the batch (curation.py)
        try:   # learner ranks: the same batch on every rank
            curated = learner.dp.collect(collector, state.version)
        except PoolExhausted as err:    # no-positive-resampling left fewer prompts than a batch: RL ends here
            state.step = step - 1
            return RLResult(steps=state.step, policy_version=state.version, optimizer=state.optimizer, stopped=str(err))
        t_gen = time.perf_counter() - t0
        # 3-5. pi_old, reference, advantages, update
        metrics = learner.step(state, curated)
        # 6. log
        seconds = time.perf_counter() - t0
        if curated.rollout is not None:
            metrics["tokens_per_s"] = float(curated.rollout.completion_mask.sum()) / seconds
        on_step(StepRecord(step=step, metrics={**metrics, "generation_seconds": t_gen, "step_seconds": seconds},
                           samples=learner.samples), state)
        learner.check_finite(state)
    return RLResult(steps=tc.steps, policy_version=state.version, optimizer=state.optimizer)


class Learner:
    """Steps 3-5 of an RL step, shared by the synchronous and asynchronous loops: from a curated
    batch to an update of the policy (and critic, reference, KL coefficient).

    Under data-parallel learner ranks (`group`), each rank updates on its own rows of the batch and
    `self.dp.model`, a sharded copy of `policy.model`, trains; `policy.model` takes its weights after
    every update. In one process `self.dp` changes nothing.
    """

    def __init__(self, cfg: Config, policy: Policy, spec: ObjectiveSpec, group: LearnerGroup | None = None):
        self.cfg, self.policy, self.spec = cfg, policy, spec
        self.dp = DataParallel(group, policy.model)
        self.sampling = SamplingParams.from_config(cfg.rollout)
        self.forward = ForwardPlan.from_config(cfg.train)
        tc = cfg.train
        self.old_before_update = tc.ppo_epochs * tc.mini_batches > 1 or (spec.kl_placement == "in_reward" and spec.needs_reference)
        self.samples: StepSamples | None = None   # the latest step's batch with its advantages (samples.jsonl)

    def step(self, state: RLState, curated: CuratedBatch) -> dict[str, float]:
        """Update on `curated`; the step's metrics (without timings). No update when curation left nothing."""
        self.samples = None
        if curated.rollout is None:    # every group was filtered out: nothing to learn from this step
            return {**curated.metrics, "policy_version": state.version}
        tc, sampling, forward, dp = self.cfg.train, self.sampling, self.forward, self.dp
        rollout, rewards = curated.rollout, curated.scores.rewards
        # 3. pi_old (the learner's own view of the rollout, fixed over all epochs) and the reference.
        #    With one optimizer step per batch and no KL in the reward, pi_old is the policy of that
        #    step's own forward: the update takes it there (one forward less; TRL does the same
        #    with num_iterations=1). It is also decoupled PPO's proximal policy (AReaL).
        #    Learner ranks compute both for their own rows on plain models (no collective), then
        #    every rank has the whole batch's (dp.whole), for credit assignment.
        sequences = build_sequences(rollout.prompt_ids, rollout.completion_ids, rollout.completion_mask,
                                    self.policy.tokenizer.pad_token_id, group_ids=rollout.group_ids)
        mine = dp.rows(rollout.group_ids)      # [N] bool: this rank's rows (whole groups); all of them in one process
        own, like = dp.own(sequences, mine), sequences.completion_mask
        old_logprobs = (dp.whole(token_logprobs(self.policy.model, own, sampling.temperature, forward), mine, like)
                        if self.old_before_update else None)
        ref_logprobs = (dp.whole(state.reference.logprobs(own, sampling.temperature, forward), mine, like)
                        if state.reference is not None else None)
        # 4. advantage (whole groups are here; the learner only consumes A): group-relative, or the
        #    critic's GAE (loops/credit.py); transforms may drop samples
        credit = state.credit.assign(sequences, rewards, curated.scores.valid, rollout.group_ids, old_logprobs,
                                     ref_logprobs, state.generator)
        keep = credit.keep & curated.row_keep    # advantage transforms and curation may drop rows
        self.samples = StepSamples(curated.examples, rollout, rewards, curated.scores.parts, credit.advantages, keep)
        batch = LearnerBatch(
            sequences=sequences, advantages=credit.advantages, old_logprobs=old_logprobs,
            sampler_logprobs=rollout.sampler_logprobs, group_ids=rollout.group_ids, ref_logprobs=ref_logprobs,
            correct=curated.scores.correct,
        ).select(keep & mine)
        kept = keep.nonzero().squeeze(1)                  # the rows trained on, by all ranks together
        # 5. update (a mini-batch with a NaN/inf loss or gradient takes no step: learner/update.py);
        #    learner ranks: each its share of the global-batch loss, then the engine's weights follow
        update = policy_update(
            dp.model, state.optimizer, state.scheduler, batch, self.spec,
            ppo_epochs=tc.ppo_epochs, mini_batches=tc.mini_batches, grad_clip=tc.grad_clip,
            temperature=sampling.temperature, generator=state.generator, forward=forward,
            max_length=self.cfg.rollout.max_new_tokens, reduce=dp.reduce,
            batch_rows=mine[kept].nonzero().squeeze(1), total_rows=len(kept),
        )
        dp.sync()
        if state.reference is not None:
            state.reference.after_update(self.policy.model)
        credit_metrics = state.credit.after_update(keep, state.generator)   # critic training, KL coefficient
        state.version += update.optimizer_steps
        state.skipped_total += update.skipped_steps
        state.nonfinite_streak = state.nonfinite_streak + 1 if update.skipped_steps else 0
        rows = batch.sequences.input_ids.shape[0]     # learner ranks: per-rank figures combined over ranks
        return {
            **dp.combine(update.metrics, rows),
            **credit_metrics,
            **curated.metrics,   # the sampled rows' reward and length figures (the whole batch), and curation's counts
            # |p_sampler - p_learner| per token at the same weights, over the rows trained on
            # (ALGORITHMS.md, sampler-learner mismatch), and the IS weights pi_old / mu.
            **dp.combine(mismatch_metrics(update.old_logprobs, batch.sampler_logprobs, batch.sequences.completion_mask), rows),
            "kept_frac": float(credit.keep.float().mean()),
            "guard/skipped_steps": float(update.skipped_steps),
            "guard/skipped_total": float(state.skipped_total),
            "lr": state.scheduler.get_last_lr()[0],
            "policy_version": state.version,
        }

    def check_finite(self, state: RLState) -> None:
        """NonFiniteStop once train.max_nonfinite_steps steps in a row had a skipped update (after the
        caller logged the last of them)."""
        tc = self.cfg.train
        if state.nonfinite_streak >= tc.max_nonfinite_steps:
            raise NonFiniteStop(
                f"RL step {state.step}: {state.nonfinite_streak} steps in a row had a NaN/inf loss or gradient, so their "
                f"updates were skipped (train.max_nonfinite_steps={tc.max_nonfinite_steps}); the weights are still "
                "those of the last good step. Lower train.lr, or look for NaN in the rewards or the data.", state)
