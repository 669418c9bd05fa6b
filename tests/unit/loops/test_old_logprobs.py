"""train.old_logprobs: pi_old recomputed by the learner, taken from the sampler's log-probs, or (auto, the default)
taken from them where the engine says they are the learner's own at the current weights.

A GRPO learner step on rows whose sampler log-probs are known: with `rollout` the update's pi_old is exactly
the sampler's (the sampler-learner mismatch it reports is 0 whatever the sampler said), with `recompute` it is
the learner's own (the mismatch is what the sampler's log-probs were shifted by); and where the sampler's
log-probs are the learner's, both updates move the weights alike. `auto` follows `rollout` only for a batch
marked `logprobs_exact` (the engine's claim, tests/unit/rollout/test_native_engine.py; an asynchronous batch's
stale rows clear it, tests/e2e/test_async.py).
"""

from __future__ import annotations

import pytest
import torch

from reinforge.config import build_config
from reinforge.curation.batches import CuratedBatch, Scores
from reinforge.distributed.data_parallel import DataParallel
from reinforge.learner import ForwardPlan, UpdateSettings, build_sequences, token_logprobs
from reinforge.loops.rl import Learner, RLState, build_credit
from reinforge.models import build_tiny_qwen2
from reinforge.objectives import resolve_spec
from reinforge.rollout import SamplingParams
from reinforge.rollout.trajectory import Segment, Trajectory, collate
from reinforge.tasks import Example

SHIFT = 0.25   # what the sampler's log-probs are moved by, off the learner's own


def learner_step(micro_overrides, mode: str, shift: float, mini_batches: int,
                 exact: bool = False) -> tuple[dict, torch.Tensor]:
    """One GRPO learner step on 2 prompts x 4 completions whose sampler log-probs are the policy's own + shift,
    marked `exact`; the step's metrics and how it moved the weights (all of them, flat)."""
    cfg = build_config([*micro_overrides, f"train.old_logprobs={mode}", f"train.mini_batches={mini_batches}",
                        "train.group_size=4"])
    policy = build_tiny_qwen2(cfg.model, seed=0)
    examples = [Example("2+2=", "4", {}), Example("1+3=", "4", {})]
    prompts = [tuple(policy.tokenizer(e.prompt)["input_ids"]) for e in examples]
    rows = [Trajectory(prompts[p], (Segment.sampled(torch.tensor([5 + k, 6, 7 + p, 8][: 2 + k]), torch.zeros(2 + k),
                                                    0),), truncated=False, group=p) for p in range(2) for k in range(3)]
    rows += [Trajectory(prompts[p], (Segment.sampled(torch.tensor([9, 10, 11]), torch.zeros(3), 0),), truncated=False,
                        group=p) for p in range(2)]
    rows.sort(key=lambda t: t.group)
    rollout = collate(rows, policy.tokenizer.pad_token_id, policy_version=0,
                      decode=lambda ids: policy.tokenizer.batch_decode(ids, skip_special_tokens=True))
    with torch.no_grad():
        seq = build_sequences(rollout.prompt_ids, rollout.completion_ids, rollout.completion_mask,
                              policy.tokenizer.pad_token_id)
        own = token_logprobs(policy.model, seq, 1.0, ForwardPlan())
    rollout.sampler_logprobs = (own + shift) * rollout.completion_mask
    rollout.logprobs_exact = exact
    return grpo_learner_step(cfg, policy, examples, rollout, torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0]))


def grpo_learner_step(cfg, policy, examples, rollout, rewards: torch.Tensor) -> tuple[dict, torch.Tensor]:
    """One GRPO `Learner.step` of `policy` under `cfg` on `rollout` (every row kept and valid, scored `rewards`):
    the step's metrics and how it moved the weights (all of them, flat)."""
    rows = len(rewards)
    scores = Scores(rewards=rewards, valid=torch.ones(rows, dtype=torch.bool), correct=rewards > 0)
    spec = resolve_spec("grpo")
    learner = Learner(policy, spec, UpdateSettings.from_config(cfg.train, cfg.rollout),
                      SamplingParams.from_config(cfg.rollout), DataParallel(None, policy.model),
                      cfg.train.max_nonfinite_steps)
    state = RLState.start(cfg.train, 0, policy.model, examples, spec,
                          build_credit(cfg.train, cfg.critic, policy.model, spec))
    before = torch.cat([p.detach().flatten() for p in policy.model.parameters()])
    metrics = learner.step(state, CuratedBatch(examples, rollout, scores, torch.ones(rows, dtype=torch.bool), {}))
    return metrics, torch.cat([p.detach().flatten() for p in policy.model.parameters()]) - before


@pytest.mark.parametrize("mini_batches", [1, 2])
def test_rollout_takes_the_samplers_log_probs_and_recompute_the_learners(micro_overrides, mini_batches: int) -> None:
    rollout, _ = learner_step(micro_overrides, "rollout", SHIFT, mini_batches)
    recompute, _ = learner_step(micro_overrides, "recompute", SHIFT, mini_batches)
    # mismatch_log_ratio_mean: the mean of pi_old - mu over the trained tokens
    assert rollout["mismatch_log_ratio_mean"] == 0.0 and rollout["mismatch_kl"] == 0.0
    assert recompute["mismatch_log_ratio_mean"] == pytest.approx(-SHIFT, abs=1e-5)


def test_on_policy_both_give_the_same_update(micro_overrides) -> None:
    """The sampler's log-probs here are the plain forward's, the learner's its fused shared-prompt forward's: the
    same to float rounding, which Adam's first step (g / (|g| + eps)) can lift to a few hundredths of the step on
    a weight whose gradient is near eps. Shifted by SHIFT, the sampler's log-probs clip most tokens and move the
    weights otherwise."""
    _, rollout = learner_step(micro_overrides, "rollout", 0.0, 2)
    _, recompute = learner_step(micro_overrides, "recompute", 0.0, 2)
    size = float(recompute.abs().max())
    gap = (rollout - recompute).abs()
    assert size > 1e-5 and float(gap.max()) < 0.1 * size and float(gap.mean()) < 1e-3 * float(recompute.abs().mean())
    _, shifted = learner_step(micro_overrides, "rollout", SHIFT, 2)
    assert float((shifted - rollout).abs().max()) > 0.1 * size


def test_auto_takes_the_samplers_log_probs_only_where_they_are_marked_exact(micro_overrides) -> None:
    """The shift stands for what an engine's log-probs could be off by: `auto` takes them (mismatch 0) only from
    a batch marked exact, and recomputes pi_old otherwise."""
    trusted, _ = learner_step(micro_overrides, "auto", SHIFT, 2, exact=True)
    assert trusted["mismatch_log_ratio_mean"] == 0.0
    recomputed, _ = learner_step(micro_overrides, "auto", SHIFT, 2, exact=False)
    assert recomputed["mismatch_log_ratio_mean"] == pytest.approx(-SHIFT, abs=1e-5)
    # rollout and recompute do not look at the mark
    assert learner_step(micro_overrides, "recompute", SHIFT, 2, exact=True)[0]["mismatch_log_ratio_mean"] == \
        pytest.approx(-SHIFT, abs=1e-5)
    assert learner_step(micro_overrides, "rollout", SHIFT, 2)[0]["mismatch_log_ratio_mean"] == 0.0
