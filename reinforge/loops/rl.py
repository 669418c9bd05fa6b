"""RL's parts of the one loop (loops/loop.py): its state, its learner step (pi_old, reference,
advantages, update) and its synchronous batch source.

Methods differ only in the objective spec they pass (see `reinforge.objectives`), never by a
branch in this file; asynchronous training (loops/async_rl.py) and data-parallel learner ranks
(distributed/data_parallel.py) change the batch source and the `after_update` hook, never the loop.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from reinforge.curation.batches import BatchCollector, CuratedBatch, PromptStream, domain_metrics
from reinforge.distributed.data_parallel import DataParallel
from reinforge.learner import (
    ForwardPlan,
    LearnerBatch,
    Reference,
    UpdateSettings,
    build_optimizer,
    build_sequences,
    policy_update,
    token_logprobs,
    warmup_constant,
)
from reinforge.learner.critic import Critic
from reinforge.loops.credit import CriticCredit, GroupCredit
from reinforge.loops.loop import LoopState, StepRecord, Timed
from reinforge.models import Policy
from reinforge.objectives import ObjectiveSpec
from reinforge.records import Scores
from reinforge.rewards.compose import RewardComposer
from reinforge.rollout import Rollout, SamplingParams
from reinforge.rollout.base import environment_returns, environment_token_rewards
from reinforge.settings import CriticConfig, TrainConfig
from reinforge.tasks import Example, Task
from reinforge.telemetry.samples import StepSamples


@dataclass(kw_only=True)
class RLState(LoopState):
    """Everything RL carries from one step to the next: what a checkpoint saves and resume restores.

    With it restored (and the weights), step k+1 of a resumed run computes exactly what step k+1 of
    an uninterrupted run computes: the sampler's draws come from torch's global generator, so the
    global RNG states are part of it.
    """

    reference: Reference | None                 # None when the loss has no KL term
    credit: GroupCredit | CriticCredit          # advantages: group estimator state (EMA baselines) or the critic
    pool: PromptStream                          # prompt order, epoch, retired prompts
    generator: torch.Generator                  # mini-batch order, noise transforms
    sampler_rng: torch.Generator                # the rollout's sampling draws

    @classmethod
    def start(cls, train: TrainConfig, seed: int, model: torch.nn.Module, examples: list[Example], spec: ObjectiveSpec,
              credit: GroupCredit | CriticCredit, sharded: torch.nn.Module | None = None) -> RLState:
        """The state as RL starts; the reference (fixed or EMA) begins as the policy (after SFT).
        `model` is the plain policy model; `sharded`, under learner ranks, its sharded copy that trains."""
        optimizer = build_optimizer(model if sharded is None else sharded, train.lr, train.weight_decay)
        return cls(
            optimizer=optimizer, scheduler=warmup_constant(optimizer, train.warmup_steps),
            reference=Reference.build(model, spec), credit=credit,
            pool=PromptStream(examples, seed=seed),
            generator=torch.Generator().manual_seed(seed),
            # Its own stream, so that a sampler in another thread (train.mode=async) draws what the
            # synchronous loop draws.
            sampler_rng=torch.Generator().manual_seed(seed + 1_000_003),
            sharded=sharded,
        )

    def extra_state(self) -> dict:
        return {"reference": self.reference.state_dict() if self.reference is not None else None,
                "credit": self.credit.state_dict(), "pool": self.pool.state_dict(),
                "generator": self.generator.get_state(), "sampler_rng": self.sampler_rng.get_state()}

    def load_extra_state(self, state: dict) -> None:
        if self.reference is not None:
            self.reference.load_state_dict(state["reference"])
        self.credit.load_state_dict(state["credit"])
        self.pool.load_state_dict(state["pool"])
        self.generator.set_state(state["generator"])
        self.sampler_rng.set_state(state["sampler_rng"])


def composed_scores(composer: RewardComposer, group_size: int) -> Callable[[list[Example], Rollout], Scores]:
    """The configured reward functions (cfg.reward) as the reward; row r belongs to examples[r // group_size].
    The episodes of an environment (task.environment) are scored by the environment: their returns.
    A task of several domains (a mix) adds each domain's figures (`domain_metrics`)."""
    task = composer.task

    def score(examples: list[Example], rollout: Rollout) -> Scores:
        scores = _score(examples, rollout)
        if len(task.domains) < 2:
            return scores
        domains = [task.domain_of(e) for e in examples for _ in range(group_size)]
        # each domain's share of the sampled rows (a whole-batch figure); its own figures weigh by its rows
        shares = {f"reward/domain/{d}/frac": domains.count(d) / len(domains) for d in task.domains}
        return replace(scores, metrics={**scores.metrics, **shares}, weighted_metrics=domain_metrics(domains, scores))

    def _score(examples: list[Example], rollout: Rollout) -> Scores:
        returns = environment_returns(rollout)
        if returns is not None:      # episodes of an environment: their return is the reward (NaN: it failed)
            valid = ~returns.isnan()
            mean = float(returns[valid].mean()) if valid.any() else math.nan
            failed = float((~valid).float().mean())
            metrics = {"reward/environment_mean": mean, "reward/total_mean": mean, "reward/valid_frac": 1.0 - failed,
                       "reward/error_frac": failed}
            return Scores(rewards=returns, valid=valid, correct=returns > 0, metrics=metrics,
                          parts={"environment": returns})
        scored = composer.score(examples, rollout, group_size)       # RewardError past reward.max_error_rate
        # Pass rates and the NLL term need "the verifier accepted it" (NaN > 0 is False); on a row of a domain
        # the verifier is not applied to (reward.functions[].domains), a positive reward.
        verifier = scored.parts.get("verifier")
        if verifier is not None:
            correct = torch.where(verifier.isnan() & scored.valid, scored.total > 0, verifier > 0)
        elif composer.terms:
            correct = scored.total > 0
        else:
            # No reward function (a teacher or a reward model alone): the total says nothing of it, the task's
            # verifier does, as in evaluation (the pass rates; it is not part of the reward).
            correct = verified(composer.task, examples, rollout, group_size)
        metrics = scored.metrics()
        return Scores(
            rewards=scored.total, valid=scored.valid, correct=correct, metrics=metrics, parts=scored.parts,
            token_advantages=scored.token_advantages,
        )

    return score


def verified(task: Task, examples: list[Example], rollout: Rollout, group_size: int) -> torch.Tensor:
    """[N] bool: the task's verifier accepts row r's completion (row r answers examples[r // group_size])."""
    return torch.tensor([task.reward(examples[r // group_size], text) >= 1.0 for r, text in enumerate(rollout.texts)])


def with_token_terms(advantages: torch.Tensor, token_terms: torch.Tensor | None,
                     mask: torch.Tensor) -> torch.Tensor:
    """The estimator's advantages ([N], or [N, T] from GAE) plus reward sources' per-token terms [N, T]
    (on-policy distillation's -reverse KL, a PRM's step credit) on the trained tokens `mask` [N, T]:
    [N, T] when there are terms, the advantages unchanged when there are none."""
    if token_terms is None:
        return advantages
    per_token = advantages if advantages.dim() == 2 else advantages[:, None].expand_as(mask)
    return (per_token + token_terms.to(per_token)[:, : mask.shape[1]]) * mask


def build_credit(
    train: TrainConfig, critic: CriticConfig, model: torch.nn.Module, spec: ObjectiveSpec
) -> GroupCredit | CriticCredit:
    """The credit assignment `spec` asks for: a critic and GAE (advantage gae), else the group estimator."""
    if not spec.needs_critic:
        return GroupCredit(spec, train.kl_target)
    return CriticCredit(spec, Critic(model, critic.lr, critic.weight_decay, shared_body=critic.shared_body),
                        ForwardPlan.from_config(train), epochs=train.ppo_epochs, mini_batches=train.mini_batches,
                        grad_clip=train.grad_clip, kl_target=train.kl_target)


def pretrain_critic(
    state: RLState,
    collector: BatchCollector,
    spec: ObjectiveSpec,
    pad_id: int,
    cfg: CriticConfig,
    on_step: Callable[[StepRecord, RLState], None],
    after_collect: Callable[[], None] = lambda: None,
) -> None:
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
                                    group_ids=rollout.group_ids, loss_mask=rollout.loss_mask)
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


class SyncBatches:
    """The synchronous batch source: each step's groups sampled now by the engine with the current
    weights (`SampleNow`) and curated (`BatchCollector`). Under learner ranks `collect` is
    `DataParallel.collect`: the same batch on every rank."""

    def __init__(self, collector: BatchCollector, dp: DataParallel):
        self.collector, self.dp, self.clock = collector, dp, Timed()

    def collect(self, version: int) -> CuratedBatch:
        self.clock.start()
        curated = self.dp.collect(self.collector, version)
        self.clock.collected()
        return curated

    def pending(self) -> list[int]:
        return []

    def step_metrics(self, batch: CuratedBatch) -> dict[str, float]:
        # tokens_per_s counts the tokens the model sampled (an environment's reply is not generated)
        return self.clock.timings(float(batch.rollout.lengths.sum()) if batch.rollout is not None else None)


def sampler_is_pi_old(mode: str, rollout: Rollout) -> bool:
    """Whether pi_old is taken from the sampler's log-probs (train.old_logprobs): always under `rollout`, never
    under `recompute`, and under `auto` where they are the learner's own at its current weights to float rounding
    (`Rollout.logprobs_exact`). A no-grad forward over the batch would then only repeat them."""
    return rollout.logprobs_exact if mode == "auto" else mode == "rollout"


class Learner:
    """Steps 3-5 of an RL step: from a curated batch to an update of the policy (and critic,
    reference, KL coefficient).

    Under data-parallel learner ranks (`dp`), each rank updates on its own rows of the batch and
    `dp.model`, a sharded copy of `policy.model`, trains; `policy.model` takes its weights after
    every update. In one process `dp` changes nothing.
    """

    def __init__(self, policy: Policy, spec: ObjectiveSpec, update: UpdateSettings, sampling: SamplingParams,
                 dp: DataParallel, max_nonfinite_steps: int):
        self.policy, self.model, self.spec, self.update, self.sampling, self.dp = (
            policy, policy.model, spec, update, sampling, dp,
        )
        self.max_nonfinite_steps = max_nonfinite_steps
        # pi_old before the update only where the reward needs it (a KL in the reward); else the update takes
        # it itself at the same weights, partly from its own forward (learner/update.py policy_update)
        self.old_before_update = spec.kl_placement == "in_reward" and spec.needs_reference
        self.samples: StepSamples | None = None   # the latest step's batch with its advantages (samples.jsonl)

    def step(self, state: RLState, curated: CuratedBatch) -> dict[str, float]:
        """Update on `curated`; the step's metrics (without timings). No update when curation left nothing."""
        self.samples = None
        # Nothing to learn from this step: every group was filtered out, or no row has a token to train on
        # (every episode's environment failed before the model's first turn).
        if curated.rollout is None or not bool(curated.rollout.trained_mask.any()):
            return {**curated.metrics, "policy_version": state.version}
        rollout, scores, dp, temperature, forward = (
            curated.rollout,
            curated.scores,
            self.dp,
            self.update.temperature,
            self.update.forward,
        )
        # 3. pi_old (the learner's own view of the rollout, fixed over all epochs) and the reference.
        #    With no KL in the reward, the update takes pi_old itself before its first optimizer step,
        #    the first mini-batch's from that step's own forward (less forward work; TRL does the same
        #    with num_iterations=1). It is also decoupled PPO's proximal policy (AReaL). With
        #    train.old_logprobs=rollout it is the sampler's log-probs, and no forward runs for it; with
        #    auto (the default) too where those are the learner's own to rounding (`sampler_is_pi_old`).
        #    Environment tokens of a multi-turn rollout are in the input, not in the loss (loss_mask).
        sequences = build_sequences(rollout.prompt_ids, rollout.completion_ids, rollout.completion_mask,
                                    self.policy.tokenizer.pad_token_id, group_ids=rollout.group_ids,
                                    loss_mask=rollout.loss_mask, routes=rollout.routes, top_ids=rollout.sampler_top_ids)
        if rollout.activations is not None and rollout.logprobs_exact:   # the engine's, for the first backward
            sequences = replace(sequences, activations=rollout.activations)
        if sampler_is_pi_old(self.update.old_logprobs, rollout):   # 0 off the sampler's tokens
            old_logprobs = rollout.sampler_logprobs
        elif self.old_before_update:
            old_logprobs = dp.rowwise(sequences, lambda rows: token_logprobs(self.model, rows, temperature, forward))
        else:
            old_logprobs = None
        ref_logprobs = (dp.rowwise(sequences, lambda rows: state.reference.logprobs(rows, temperature, forward))
                        if state.reference is not None else None)
        # 4. advantage (whole groups are here; the learner only consumes A): group-relative, or the
        #    critic's GAE (loops/credit.py); transforms may drop samples
        credit = state.credit.assign(sequences, scores.rewards, scores.valid, rollout.group_ids, old_logprobs,
                                     ref_logprobs, state.generator, environment_token_rewards(rollout),
                                     baselines=scores.baselines)
        keep = credit.keep & curated.row_keep    # advantage transforms and curation may drop rows
        advantages = with_token_terms(credit.advantages, scores.token_advantages, sequences.completion_mask)
        self.samples = StepSamples(curated.examples, rollout, scores.rewards, scores.parts, advantages, keep)
        batch = dp.share(LearnerBatch(
            sequences=sequences, advantages=advantages, old_logprobs=old_logprobs,
            sampler_logprobs=rollout.sampler_logprobs, group_ids=rollout.group_ids, ref_logprobs=ref_logprobs,
            correct=scores.correct, sampler_top_logprobs=rollout.sampler_top_logprobs), keep)
        # 5. update (a mini-batch with a NaN/inf loss or gradient takes no step: learner/update.py);
        #    then the engine's weights, the reference and the critic follow
        update = policy_update(
            dp.model, state.optimizer, state.scheduler, batch, self.spec, self.update, state.generator
        )
        dp.sync()
        if state.reference is not None:
            state.reference.after_update(self.model)
        credit_metrics = state.credit.after_update(keep, state.generator)   # critic training, KL coefficient
        state.record_update(update.optimizer_steps, update.skipped_steps)
        return {
            **dp.combine(update.metrics, batch.rows),    # learner ranks: per-rank figures combined over ranks
            **credit_metrics,
            **curated.metrics,   # the sampled rows' reward and length figures (the whole batch), and curation's counts
            "kept_frac": float(credit.keep.float().mean()),
            "guard/skipped_steps": float(update.skipped_steps),
            "guard/skipped_total": float(state.skipped_total),
            "lr": state.scheduler.get_last_lr()[0],
            "policy_version": state.version,
        }

    def check_finite(self, state: RLState) -> None:
        state.check_finite(self.max_nonfinite_steps, "RL", "the rewards or the data")
