"""Multi-turn rows: environment tokens are in the learner's input and out of everything per trained token.

A trajectory [model 3, env 4, model 2] collates to a row whose completion holds all 9 tokens
(`completion_mask`) and whose loss mask holds the model's 5 (`loss_mask`). The checks: the batch
view by hand and back; the loss, its gradient and every metric blind to what sits at an
environment position (its label, log-probs, advantage) but not to its token as context; the loss
equal to the single-turn loss written out by hand over the model's tokens; length figures and
GAE over the model's tokens only; a real RL learner step (GRPO, PPO with a critic) on such rows.
"""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch

from reinforge.config import build_config
from reinforge.curation.batches import CuratedBatch, Groups, Scores, rollout_metrics, select_rows
from reinforge.distributed.data_parallel import DataParallel
from reinforge.learner import (
    ForwardPlan,
    LearnerBatch,
    UpdateSettings,
    build_optimizer,
    build_sequences,
    policy_update,
    token_logprobs,
    warmup_constant,
)
from reinforge.loops.rl import Learner, RLState, build_credit
from reinforge.models import build_tiny_qwen2
from reinforge.objectives import resolve_spec
from reinforge.objectives.value import decoupled_gae, gae, outcome_token_rewards
from reinforge.rewards.compose import RewardComposer
from reinforge.rollout import SamplingParams
from reinforge.rollout.base import concat_rollouts
from reinforge.rollout.stream import FinishedGroup
from reinforge.rollout.trajectory import Segment, Trajectory, collate, split
from reinforge.settings import RewardConfig
from reinforge.tasks import Example
from reinforge.tasks.arithmetic import ArithmeticTask

PAD = 0


def decode_ids(ids: torch.Tensor) -> list[str]:
    """A stand-in tokenizer: token k is the letter chr(97 + k), the pad is skipped."""
    return ["".join(chr(97 + int(t)) for t in row if int(t) != PAD) for row in ids]


def model(tokens: list[int], logprobs: list[float] | None = None, version: int = 3) -> Segment:
    logprobs = [-0.5 - 0.1 * k for k in range(len(tokens))] if logprobs is None else logprobs
    return Segment.sampled(torch.tensor(tokens), torch.tensor(logprobs), version)


def env(tokens: list[int]) -> Segment:
    return Segment.observed(torch.tensor(tokens))


def trajectories() -> list[Trajectory]:
    """Row 0: [m m m e e e e m m]; row 1 ends on environment tokens; row 2 is single-turn (another prompt)."""
    return [
        Trajectory((5, 6, 7), (model([8, 9, 10]), env([11, 12, 13, 14]), model([15, 16])), truncated=False, group=0),
        Trajectory((5, 6, 7), (model([17, 18]), env([19]), model([20]), env([21, 22])), truncated=True, group=0),
        Trajectory((8, 9), (model([10, 11, 12]),), truncated=False, group=1),
    ]


# ------------------------------------------------------------------ the batch view


def test_collate_puts_environment_tokens_in_the_completion_and_out_of_the_loss_mask() -> None:
    turns = (model([3, 4, 5], [-0.5, -1.0, -0.25], 2), env([6, 7, 8, 9]), model([10, 11], [-2.0, -0.75], 3))
    a = Trajectory((1, 2), turns, truncated=False, group=0)
    b = Trajectory((1, 2), (model([12], [-1.5], 3),), truncated=True, group=0)
    rollout = collate([a, b], pad_id=PAD, policy_version=2, decode=decode_ids)
    assert rollout.completion_ids.tolist() == [[3, 4, 5, 6, 7, 8, 9, 10, 11], [12, 0, 0, 0, 0, 0, 0, 0, 0]]
    assert rollout.completion_mask.tolist() == [[1, 1, 1, 1, 1, 1, 1, 1, 1], [1, 0, 0, 0, 0, 0, 0, 0, 0]]
    assert rollout.loss_mask.tolist() == [[1, 1, 1, 0, 0, 0, 0, 1, 1], [1, 0, 0, 0, 0, 0, 0, 0, 0]]
    assert torch.equal(rollout.trained_mask, rollout.loss_mask)
    assert rollout.sampler_logprobs.tolist() == [[-0.5, -1.0, -0.25, 0, 0, 0, 0, -2.0, -0.75], [-1.5] + [0.0] * 8]
    assert rollout.lengths.tolist() == [5, 1] and rollout.present_lengths.tolist() == [9, 1]
    assert rollout.texts == ["defghijkl", "m"]          # the text is the whole completion, the environment's too

    # Back: the same segments (roles, tokens, log-probs; versions as given, -1 on the environment's).
    versions = torch.tensor([[2, 2, 2, 7, 7, 7, 7, 3, 3], [3] + [0] * 8])
    back = split(rollout, versions)
    for original, restored in zip([a, b], back, strict=True):
        assert (restored.prompt_ids, restored.truncated, restored.group) == (
            original.prompt_ids, original.truncated, original.group)
        assert [s.role for s in restored.segments] == [s.role for s in original.segments]
        for s, t in zip(original.segments, restored.segments, strict=True):
            assert torch.equal(s.token_ids, t.token_ids) and torch.equal(s.sampler_logprobs, t.sampler_logprobs)
            assert torch.equal(s.versions, t.versions)
    assert back[0].segments[1].versions.tolist() == [-1, -1, -1, -1]


def test_a_single_turn_batch_collates_as_before_without_a_loss_mask() -> None:
    a = Trajectory((1,), (model([3, 4], [-0.5, -1.0]),), truncated=False, group=0)
    b = Trajectory((1,), (model([5], [-2.0]),), truncated=False, group=0)
    empty = Trajectory((1,), (model([], []),), truncated=True, group=0)
    rollout = collate([a, b, empty], pad_id=PAD, policy_version=3, decode=decode_ids)
    assert rollout.loss_mask is None
    assert rollout.completion_mask.tolist() == [[1, 1], [1, 0], [0, 0]]
    assert torch.equal(rollout.trained_mask, rollout.completion_mask)
    assert rollout.sampler_logprobs.tolist() == [[-0.5, -1.0], [-2.0, 0.0], [0.0, 0.0]]
    back = split(rollout)
    assert [len(t.segments) for t in back] == [1, 1, 1] and back[2].segments[0].token_ids.tolist() == []
    assert [t.model_tokens for t in back] == [2, 1, 0]


def test_slicing_and_concatenating_rollouts_carries_the_loss_mask() -> None:
    multi = collate(trajectories(), pad_id=PAD, policy_version=3, decode=decode_ids)
    single = collate([Trajectory((1,), (model([3, 4]),), truncated=False, group=0)], PAD, 3, decode_ids)
    both = concat_rollouts([single, multi])
    # The single-turn part's loss mask is its completion mask, padded to the common width.
    assert both.loss_mask.tolist() == [[1, 1, 0, 0, 0, 0, 0, 0, 0], *multi.loss_mask.tolist()]
    assert both.lengths.tolist() == [2, 5, 3, 3]
    assert concat_rollouts([single, single]).loss_mask is None
    picked = select_rows(multi, torch.tensor([1, 2]))
    assert torch.equal(picked.loss_mask, multi.loss_mask[[1, 2]]) and picked.lengths.tolist() == [3, 3]


def test_staleness_counts_from_the_models_tokens_only() -> None:
    rollout = collate(trajectories()[:2], pad_id=PAD, policy_version=4, decode=decode_ids)
    versions = torch.tensor([[4, 4, 4, -1, -1, -1, -1, 5, 5], [6, 6, -1, 6, -1, -1, 0, 0, 0]])
    assert FinishedGroup(0, rollout, versions).oldest_versions().tolist() == [4, 6]


# ------------------------------------------------------------------ the learner


@pytest.fixture
def policy(micro_overrides):
    return build_tiny_qwen2(build_config(micro_overrides).model, seed=0)


def _multi_turn_rollout():
    return collate(trajectories(), pad_id=PAD, policy_version=3, decode=decode_ids)


def test_sequences_hold_environment_tokens_as_input_and_the_loss_mask_as_their_mask() -> None:
    rollout = _multi_turn_rollout()
    seq = build_sequences(rollout.prompt_ids, rollout.completion_ids, rollout.completion_mask, PAD,
                          group_ids=rollout.group_ids, loss_mask=rollout.loss_mask)
    assert seq.input_ids.tolist() == [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16],
                                      [5, 6, 7, 17, 18, 19, 20, 21, 22, 0, 0, 0],
                                      [8, 9, 10, 11, 12, 0, 0, 0, 0, 0, 0, 0]]
    assert seq.attention_mask.sum(dim=1).tolist() == [12, 9, 5]
    assert torch.equal(seq.completion_mask, rollout.loss_mask)
    # Row 1's loss mask ends at column 3, its tokens at column 5: a sub-batch keeps all 6 columns.
    sub = seq.rows(torch.tensor([1]))
    assert sub.completion_ids.tolist() == [[17, 18, 19, 20, 21, 22]]
    assert sub.completion_mask.tolist() == [[1, 1, 0, 1, 0, 0]]
    assert sub.input_ids.tolist() == [[5, 6, 7, 17, 18, 19, 20, 21, 22]]


PLANS = {
    "full_logits": ForwardPlan(micro_batch_size=8),
    "chunked": ForwardPlan(micro_batch_size=8, chunk_size=3),
    "shared_prefix": ForwardPlan(micro_batch_size=8, chunk_size=3, shared_prefix=True),
    "row_by_row": ForwardPlan(micro_batch_size=1),
}


def _learner_batch(policy, seed: int = 0) -> LearnerBatch:
    """The multi-turn rollout as a learner batch: pi_old off the current policy (some ratios clip), a
    sampler and a reference that differ from it, per-token advantages."""
    rollout = _multi_turn_rollout()
    seq = build_sequences(rollout.prompt_ids, rollout.completion_ids, rollout.completion_mask, PAD,
                          group_ids=rollout.group_ids, loss_mask=rollout.loss_mask)
    g = torch.Generator().manual_seed(seed)
    mask = seq.completion_mask
    current = token_logprobs(policy.model, seq, 1.0, ForwardPlan())
    old = current + 0.3 * torch.randn(mask.shape, generator=g) * mask
    return LearnerBatch(sequences=seq, advantages=torch.randn(mask.shape, generator=g) * mask, old_logprobs=old,
                        sampler_logprobs=old + 0.05 * mask, group_ids=rollout.group_ids,
                        ref_logprobs=current - 0.1 * mask)


def _update(policy, batch: LearnerBatch, spec, plan: ForwardPlan, hook=None):
    """One optimizer step at lr 0 (the weights stay): its stats and every parameter's gradient."""
    net = copy.deepcopy(policy.model)
    handle = None if hook is None else net.register_forward_hook(hook, with_kwargs=True)
    opt = build_optimizer(net, lr=1e-3)
    for group in opt.param_groups:
        group["lr"] = 0.0
    settings = UpdateSettings(grad_clip=1e9, forward=plan, max_length=9)
    stats = policy_update(net, opt, warmup_constant(opt, 0), batch, spec, settings, torch.Generator().manual_seed(0))
    if handle is not None:
        handle.remove()
    return stats, [p.grad.clone() for p in net.parameters()]


def _same_metrics(a: dict[str, float], b: dict[str, float]) -> bool:
    return a.keys() == b.keys() and all(a[k] == b[k] or (math.isnan(a[k]) and math.isnan(b[k])) for k in a)


def _with(batch: LearnerBatch, row: int, cols: list[int], label: int, shift: float) -> LearnerBatch:
    """`batch` with the label (not the input token), pi_old, sampler and reference log-probs and the
    advantage at (row, cols) changed."""
    def moved(x: torch.Tensor) -> torch.Tensor:
        x = x.clone()
        x[row, cols] += shift
        return x
    ids = batch.sequences.completion_ids.clone()
    ids[row, cols] = label
    return dataclasses.replace(
        batch, sequences=dataclasses.replace(batch.sequences, completion_ids=ids), advantages=moved(batch.advantages),
        old_logprobs=moved(batch.old_logprobs), sampler_logprobs=moved(batch.sampler_logprobs),
        ref_logprobs=moved(batch.ref_logprobs))


@pytest.mark.parametrize("plan", sorted(PLANS))
def test_what_sits_at_an_environment_position_moves_no_loss_metric_or_gradient(policy, plan: str) -> None:
    spec = resolve_spec("grpo")                  # PPO clip, k3 KL in the loss, seq_mean_token_mean
    batch = _learner_batch(policy)
    base, grads = _update(policy, batch, spec, PLANS[plan])
    # Row 0's environment run (columns 3-6) and row 1's trailing one (4-5): other labels, log-probs, advantages.
    changed = _with(_with(batch, 0, [3, 4, 5, 6], label=30, shift=-2.5), 1, [4, 5], label=31, shift=1.75)
    stats, changed_grads = _update(policy, changed, spec, PLANS[plan])
    assert _same_metrics(stats.metrics, base.metrics)
    assert all(torch.equal(a, b) for a, b in zip(grads, changed_grads, strict=True))
    # The same change at a model token (row 0, column 7) does move them.
    stats, moved_grads = _update(policy, _with(batch, 0, [7], label=30, shift=-2.5), spec, PLANS[plan])
    assert stats.metrics["policy_loss"] != base.metrics["policy_loss"]
    assert not all(torch.equal(a, b) for a, b in zip(grads, moved_grads, strict=True))


def test_logits_predicting_environment_tokens_get_exactly_zero_gradient(policy) -> None:
    batch = _learner_batch(policy)
    seq = batch.sequences
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def keep_logits(module, args, kwargs, output) -> None:
        output.logits.retain_grad()
        seen.append((kwargs["input_ids"], output.logits))

    _update(policy, batch, resolve_spec("grpo"), PLANS["row_by_row"], hook=keep_logits)
    assert len(seen) == 3
    for input_ids, logits in seen:
        length = input_ids.shape[1]
        (r,) = [i for i in range(3) if torch.equal(seq.input_ids[i, :length], input_ids[0])]
        start = int(seq.starts[r])
        for j in range(length - start):
            grad = logits.grad[0, start - 1 + j]          # the position predicting completion token j
            if seq.completion_mask[r, j] == 0:
                assert torch.equal(grad, torch.zeros_like(grad)), (r, j)
            else:
                assert grad.abs().max() > 0, (r, j)        # the KL term alone never vanishes here
        assert torch.equal(logits.grad[0, : start - 1], torch.zeros_like(logits.grad[0, : start - 1]))


@pytest.mark.parametrize("plan", sorted(PLANS))
def test_environment_tokens_are_context_by_column(policy, plan: str) -> None:
    # Every forward gives the full-logits log-probs of the model's tokens, read at their own columns;
    # changing an environment token's input changes those after it and none before.
    batch = _learner_batch(policy)
    seq = batch.sequences
    with torch.no_grad():
        logits = policy.model(input_ids=seq.input_ids, attention_mask=seq.attention_mask).logits.log_softmax(-1)
    expected = torch.zeros_like(seq.completion_mask)
    for r, c in seq.completion_mask.nonzero().tolist():
        expected[r, c] = logits[r, int(seq.starts[r]) - 1 + c, int(seq.completion_ids[r, c])]
    got = token_logprobs(policy.model, seq, 1.0, PLANS[plan])
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    other = seq.input_ids.clone()
    other[0, 3 + 4] = 40                                            # row 0's environment token at column 4
    moved = token_logprobs(policy.model, dataclasses.replace(seq, input_ids=other), 1.0, PLANS[plan])
    assert torch.equal(moved[1:], got[1:]) and torch.equal(moved[0, :3], got[0, :3])
    assert (moved[0, 7:] - got[0, 7:]).abs().min() > 1e-6


def test_the_loss_is_the_single_turn_loss_of_the_models_tokens_by_hand(policy) -> None:
    spec = resolve_spec("grpo", aggregation="token_mean")
    batch = _learner_batch(policy)
    seq = batch.sequences
    stats, grads = _update(policy, batch, spec, PLANS["full_logits"])
    # By hand, over the 11 model tokens (5 + 3 + 3): PPO clip (eps 0.2) and beta k3 (beta 0.04), token mean.
    net = copy.deepcopy(policy.model)
    logits = net(input_ids=seq.input_ids, attention_mask=seq.attention_mask).logits.float().log_softmax(-1)
    policy_terms, kl_terms = [], []
    for r, c in seq.completion_mask.nonzero().tolist():
        logp = logits[r, int(seq.starts[r]) - 1 + c, int(seq.completion_ids[r, c])]
        ratio = torch.exp(logp - batch.old_logprobs[r, c])
        advantage = batch.advantages[r, c]
        policy_terms.append(-torch.minimum(ratio * advantage, ratio.clamp(0.8, 1.2) * advantage))
        delta = batch.ref_logprobs[r, c] - logp
        kl_terms.append(torch.exp(delta) - delta - 1)
    assert len(policy_terms) == 11
    policy_loss, kl = torch.stack(policy_terms).mean(), torch.stack(kl_terms).mean()
    assert stats.metrics["policy_loss"] == pytest.approx(policy_loss.item(), abs=1e-6)
    assert stats.metrics["kl"] == pytest.approx(kl.item(), abs=1e-7)
    (policy_loss + 0.04 * kl).backward()
    for mine, hand in zip(grads, [p.grad for p in net.parameters()], strict=True):
        torch.testing.assert_close(mine, hand, atol=1e-6, rtol=1e-4)


# ------------------------------------------------------------------ lengths and credit


def test_length_figures_and_overlong_shaping_count_the_models_tokens() -> None:
    # Two prompts x 2 samples; model tokens [5, 3, 3, 1], tokens present [9, 6, 3, 1].
    rows = [*trajectories(), Trajectory((8, 9), (model([13]),), truncated=False, group=1)]
    rollout = collate(rows, pad_id=PAD, policy_version=3, decode=lambda ids: ["4"] * len(ids))
    groups = Groups(rewards=torch.tensor([[1.0, 0.0], [1.0, 1.0]]), valid=torch.ones(2, 2, dtype=torch.bool),
                    correct=torch.tensor([[True, False], [True, True]]), truncated=rollout.truncated.view(2, 2))
    metrics = rollout_metrics(rollout, groups)
    assert metrics["response_length_mean"] == 3.0                  # (5 + 3 + 3 + 1) / 4, not 19 / 4
    assert metrics["response_length_max"] == 5.0
    assert metrics["response_length_incorrect_mean"] == 3.0        # row 1: 3 model tokens of 6
    # L_max 8, cache 4: 5 tokens -> (4 - 5) / 4 = -0.25; counted with the environment's, row 0 (9) would get -1.
    composer = RewardComposer(RewardConfig(overlong={"cache": 4, "coef": 1.0}), ArithmeticTask(), 8)
    scored = composer.score([Example("2+2=", "4", {}), Example("1+3=", "4", {})], rollout, group_size=2)
    assert scored.parts["overlong"].tolist() == [-0.25, 0.0, 0.0, 0.0]


def _compact(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each row's values at mask 1, in order, left-aligned (the row as if the other positions were not there)."""
    out = torch.zeros_like(x)
    for r in range(x.shape[0]):
        kept = x[r][mask[r] > 0]
        out[r, : len(kept)] = kept
    return out


def test_gae_over_an_environment_run_equals_gae_over_the_model_tokens_alone() -> None:
    loss_mask = _multi_turn_rollout().loss_mask                      # [3, 9]
    g = torch.Generator().manual_seed(0)
    values = torch.randn(loss_mask.shape, generator=g)               # the environment positions hold garbage
    kl = torch.rand(loss_mask.shape, generator=g)
    rewards = torch.tensor([1.0, -1.0, 0.5])
    token_rewards = outcome_token_rewards(rewards, loss_mask, kl, kl_coef=0.1)
    # The outcome sits on the last model token: row 0 column 8, row 1 column 3 (not its last token, 5).
    assert token_rewards[0, 8] == pytest.approx(1.0 - 0.1 * float(kl[0, 8]))
    assert token_rewards[1, 3] == pytest.approx(-1.0 - 0.1 * float(kl[1, 3])) and token_rewards[1, 4:].eq(0).all()
    lengths = loss_mask.sum(dim=1).long()
    dense = (torch.arange(9)[None, :] < lengths[:, None]).float()   # the compacted rows' mask
    for run in (lambda r, v, m: gae(r, v, m, gamma=0.9, lam=0.8),
                lambda r, v, m: decoupled_gae(r, v, m, gamma=0.9, lam_critic=0.95, length_adaptive_alpha=0.5)):
        full = run(token_rewards, values, loss_mask)
        alone = run(_compact(token_rewards, loss_mask), _compact(values, loss_mask), dense)
        torch.testing.assert_close(_compact(full.advantages, loss_mask), alone.advantages, atol=1e-6, rtol=0)
        torch.testing.assert_close(_compact(full.returns, loss_mask), alone.returns, atol=1e-6, rtol=0)
        assert full.advantages[loss_mask == 0].eq(0).all() and full.returns[loss_mask == 0].eq(0).all()
    # By hand for row 1 (model tokens at columns 0, 1, 3; gamma 0.9, lambda 0.8):
    #   delta_3 = r_3 - V_3, delta_1 = r_1 + 0.9 V_3 - V_1, A_1 = delta_1 + 0.72 A_3 (column 2 skipped).
    r, v = token_rewards[1], values[1]
    a3 = r[3] - v[3]
    a1 = r[1] + 0.9 * v[3] - v[1] + 0.72 * a3
    out = gae(token_rewards, values, loss_mask, gamma=0.9, lam=0.8)
    assert float(out.advantages[1, 3]) == pytest.approx(float(a3), abs=1e-6)
    assert float(out.advantages[1, 1]) == pytest.approx(float(a1), abs=1e-6)


# ------------------------------------------------------------------ end to end


def _game(prompt_ids: tuple[int, ...], group: int, k: int) -> Trajectory:
    """Two model turns around a tool reply (and a trailing reply on odd samples)."""
    segments = [model([20 + k, 21, 22]), env([30, 31, 32 + k]), model([23, 24 + k])]
    if k % 2:
        segments.append(env([33]))
    return Trajectory(prompt_ids, tuple(segments), truncated=False, group=group)


@pytest.mark.parametrize("recipe", ["grpo", "ppo"])
def test_an_rl_learner_step_trains_on_multi_turn_rows(micro_overrides, recipe: str) -> None:
    cfg = build_config(micro_overrides)
    policy = build_tiny_qwen2(cfg.model, seed=0)
    spec = resolve_spec(recipe)
    examples = [Example("2+2=", "4", {}), Example("1+3=", "4", {})]
    prompts = [tuple(policy.tokenizer(e.prompt)["input_ids"]) for e in examples]
    rollout = collate([_game(prompts[p], p, k) for p in range(2) for k in range(2)],
                      policy.tokenizer.pad_token_id, policy_version=0,
                      decode=lambda ids: policy.tokenizer.batch_decode(ids, skip_special_tokens=True))
    with torch.no_grad():       # the sampler's log-probs: the policy's own, at the model's tokens
        seq = build_sequences(rollout.prompt_ids, rollout.completion_ids, rollout.completion_mask,
                              policy.tokenizer.pad_token_id, loss_mask=rollout.loss_mask)
        rollout.sampler_logprobs = token_logprobs(policy.model, seq, 1.0, ForwardPlan())
    assert rollout.loss_mask is not None and rollout.lengths.tolist() == [5, 5, 5, 5]
    scores = Scores(rewards=torch.tensor([1.0, 0.0, 0.0, 1.0]), valid=torch.ones(4, dtype=torch.bool),
                    correct=torch.tensor([True, False, False, True]))
    dp = DataParallel(None, policy.model)
    learner = Learner(policy, spec, UpdateSettings.from_config(cfg.train, cfg.rollout),
                      SamplingParams.from_config(cfg.rollout), dp, cfg.train.max_nonfinite_steps)
    state = RLState.start(cfg.train, 0, policy.model, examples, spec, build_credit(cfg.train, cfg.critic,
                                                                                      policy.model, spec))
    before = [p.detach().clone() for p in policy.model.parameters()]
    metrics = learner.step(state, CuratedBatch(examples, rollout, scores, torch.ones(4, dtype=torch.bool), {}))
    assert math.isfinite(metrics["policy_loss"]) and metrics["policy_loss"] != 0.0
    assert metrics["guard/skipped_steps"] == 0.0
    assert any(not torch.equal(a, b) for a, b in zip(before, policy.model.parameters(), strict=True))
    if recipe == "ppo":
        assert math.isfinite(metrics["critic/value_loss"]) and math.isfinite(metrics["critic/grad_norm"])
        # GAE with V = 0 (the critic's head starts at zero) and no KL (pi_old = reference): A_t = R (gamma
        # lam)^k, k the model tokens after t (gamma 1, lam 0.95), the environment's not counted; 0 on them.
        advantages = learner.samples.advantages                      # [N, T]
        steps = torch.tensor([0.95**4, 0.95**3, 0.95**2, 0.95, 1.0])
        for r in range(4):
            torch.testing.assert_close(advantages[r][rollout.loss_mask[r] > 0], float(scores.rewards[r]) * steps)
        assert advantages[rollout.loss_mask == 0].eq(0).all()
