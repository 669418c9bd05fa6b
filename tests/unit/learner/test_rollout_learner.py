"""Rollouts and learner log-probs agree; the policy update is micro-batch invariant."""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch

from reinforge.config import build_config
from reinforge.learner import (
    ForwardPlan,
    LearnerBatch,
    UpdateSettings,
    build_optimizer,
    build_sequences,
    completion_token_stats,
    policy_update,
    warmup_constant,
)
from reinforge.models import build_tiny_qwen2
from reinforge.objectives import (
    RECIPE_OBJECTIVES,
    AdvantagePipeline,
    compute_advantages,
    resolve_spec,
)
from reinforge.rollout import HFEngine, SamplingParams
from reinforge.rollout.stopping import completion_mask

PROMPTS = ["12+34=", "7+8=", "99+1=", "3 5 7>22:"]


@pytest.fixture
def policy(micro_overrides):
    cfg = build_config(micro_overrides)
    return build_tiny_qwen2(cfg.model, seed=0)


def test_completion_mask_stops_after_first_eos() -> None:
    ids = torch.tensor([[5, 1, 7, 1], [5, 6, 7, 8], [1, 0, 0, 0]])
    mask, truncated = completion_mask(ids, [1])
    assert mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]
    assert truncated.tolist() == [False, True, False]


@pytest.mark.parametrize(("temperature", "top_k"), [(1.0, 0), (0.7, 0), (1.3, 0)])
def test_sampler_logprobs_equal_learner_logprobs(policy, temperature: float, top_k: int) -> None:
    torch.manual_seed(0)
    rollout = HFEngine(policy).generate(PROMPTS, 3, SamplingParams(temperature=temperature, max_new_tokens=6))
    assert rollout.group_ids.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    seq = build_sequences(
        rollout.prompt_ids, rollout.completion_ids, rollout.completion_mask, policy.tokenizer.pad_token_id
    )
    with torch.no_grad():
        learner = completion_token_stats(policy.model, seq, temperature).logprobs
    assert rollout.completion_mask.sum() > 12
    torch.testing.assert_close(learner, rollout.sampler_logprobs, atol=1e-4, rtol=0)
    # Decoded text is exactly the kept tokens.
    for row, text in enumerate(rollout.texts):
        kept = rollout.completion_ids[row][rollout.completion_mask[row].bool()].tolist()
        assert policy.tokenizer.decode(kept, skip_special_tokens=True) == text


def test_greedy_rollout_is_argmax_of_learner_distribution(policy) -> None:
    rollout = HFEngine(policy).generate(PROMPTS, 1, SamplingParams(max_new_tokens=5, greedy=True))
    for row, prompt_ids in enumerate(rollout.prompt_ids):
        ids = list(prompt_ids)
        for t in range(int(rollout.lengths[row])):
            with torch.no_grad():
                nxt = int(policy.model(torch.tensor([ids])).logits[0, -1].argmax())
            assert nxt == int(rollout.completion_ids[row, t])
            ids.append(nxt)


def _update_grads(policy, batch: LearnerBatch, spec, micro_batch_size: int, micro_batch_tokens=None,
                  logprob_chunk_size=0, shared_prefix=False) -> list[torch.Tensor]:
    """Gradient of one optimizer step (lr 0 keeps the weights, so grads can be read after)."""
    model = copy.deepcopy(policy.model)
    opt = build_optimizer(model, lr=1e-3)
    for group in opt.param_groups:
        group["lr"] = 0.0
    forward = ForwardPlan(micro_batch_size=micro_batch_size, micro_batch_tokens=micro_batch_tokens,
                          chunk_size=logprob_chunk_size, shared_prefix=shared_prefix)
    settings = UpdateSettings(ppo_epochs=1, mini_batches=1, grad_clip=1e9, temperature=1.0, forward=forward,
                              max_length=6)
    policy_update(model, opt, warmup_constant(opt, 0), batch, spec, settings, torch.Generator().manual_seed(0))
    return [p.grad.clone() for p in model.parameters()]


# dppo_topk needs the native engine's recorded top-K: tests/unit/objectives/test_cov_and_topk.py checks it there.
@pytest.mark.parametrize("recipe", sorted(r for r in RECIPE_OBJECTIVES if r != "dppo_topk"))
def test_policy_update_gradient_does_not_depend_on_micro_batches(policy, recipe: str) -> None:
    # Every recipe's objective, through the real model: 1 x 8 == 8 x 1 == 3 + 3 + 2 micro-batches.
    torch.manual_seed(1)
    rollout = HFEngine(policy).generate(PROMPTS[:2], 4, SamplingParams(max_new_tokens=6))
    rewards = torch.tensor([1.0, 0, 0, 1, 0, 1, 1, 1])
    spec = resolve_spec(recipe)
    seq = build_sequences(
        rollout.prompt_ids,
        rollout.completion_ids,
        rollout.completion_mask,
        policy.tokenizer.pad_token_id,
        group_ids=rollout.group_ids,
    )
    with torch.no_grad():
        old = completion_token_stats(policy.model, seq).logprobs
    # Critic recipes get per-sequence advantages here (their GAE needs a critic, not built yet).
    estimator = "dr_grpo" if spec.needs_critic else spec.advantage
    # The inputs some estimators declare: ReMax's greedy-completion rewards, REINFORCE++'s token mask and
    # per-token KL penalty (their [N, T] advantages must split across micro-batches like the rest).
    params = {} if spec.needs_critic else dict(spec.advantage_params)
    if estimator == "passk":
        params["k"] = 2   # the recipe's k=4 on these groups of 4 gives every row 0: pass@4 is 1 whenever one is right
    advantages = AdvantagePipeline(estimator, params)(
        rewards, rollout.group_ids, baselines=torch.tensor([0.5, 0.5, 0.5, 0.5, 1.0, 1.0, 1.0, 1.0]),
        mask=rollout.completion_mask, token_penalty=0.1 * rollout.completion_mask,
    )
    batch = LearnerBatch(
        sequences=seq, advantages=advantages.advantages,
        old_logprobs=old, sampler_logprobs=old + 0.05 * rollout.completion_mask, group_ids=rollout.group_ids,
        ref_logprobs=old - 0.1 * rollout.completion_mask,   # a reference that differs, so KL has a gradient
        correct=rewards > 0,
    )
    whole = _update_grads(policy, batch, spec, micro_batch_size=8)
    # 24 tokens: a few rows per micro-batch; chunk 5: the LM head in chunks of 5 tokens (learner.logprobs);
    # shared: each prompt once per micro-batch (learner.shared_prefix), whole groups or split ones.
    for size, tokens, chunk, shared in (
        (1, None, 0, False), (3, None, 0, False), (8, 24, 0, False), (3, None, 5, False), (8, None, 0, True),
        (3, None, 5, True),
    ):
        split = _update_grads(policy, batch, spec, micro_batch_size=size, micro_batch_tokens=tokens,
                              logprob_chunk_size=chunk, shared_prefix=shared)
        for a, b in zip(whole, split, strict=True):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    assert all(torch.isfinite(g).all() for g in whole)
    assert sum(float(g.abs().sum()) for g in whole) > 1e-3   # the check is not vacuous


def test_several_optimizer_steps_per_rollout_keep_old_logprobs_fixed(policy) -> None:
    torch.manual_seed(2)
    rollout = HFEngine(policy).generate(PROMPTS[:2], 4, SamplingParams(max_new_tokens=6))
    spec = resolve_spec("dr_grpo")
    seq = build_sequences(
        rollout.prompt_ids, rollout.completion_ids, rollout.completion_mask, policy.tokenizer.pad_token_id
    )
    with torch.no_grad():
        old = completion_token_stats(policy.model, seq).logprobs
    frozen = old.clone()
    batch = LearnerBatch(
        sequences=seq,
        advantages=compute_advantages("dr_grpo", torch.tensor([1.0, 0, 0, 1, 0, 1, 1, 1]), rollout.group_ids),
        old_logprobs=old,
        sampler_logprobs=rollout.sampler_logprobs,
        group_ids=rollout.group_ids,
    )
    model = copy.deepcopy(policy.model)
    opt = build_optimizer(model, lr=1e-2)
    settings = UpdateSettings(ppo_epochs=2, mini_batches=2, grad_clip=1.0, temperature=1.0,
                              forward=ForwardPlan(micro_batch_size=3), max_length=6)
    stats = policy_update(model, opt, warmup_constant(opt, 0), batch, spec, settings, torch.Generator().manual_seed(0))
    assert stats.optimizer_steps == 4
    assert torch.equal(batch.old_logprobs, frozen)           # pi_old is the rollout-time policy throughout
    # The first mini-batch sees ratio 1 exactly; later ones see the moved policy against the fixed pi_old.
    assert stats.metrics["ratio_max"] > 1.0 or stats.metrics["ratio_min"] < 1.0
    with torch.no_grad():
        moved = completion_token_stats(model, seq).logprobs
    assert (moved - old).abs().max() > 1e-3


@pytest.mark.parametrize("recipe", ["grpo", "cispo", "gspo"])
def test_pi_old_from_the_update_forward_equals_a_separate_pass(policy, recipe: str) -> None:
    # One optimizer step per batch: pi_old taken inside the update (old_logprobs=None) gives the
    # gradient of a separate no-grad pass, and the update reports the values it used.
    torch.manual_seed(4)
    rollout = HFEngine(policy).generate(PROMPTS[:2], 4, SamplingParams(max_new_tokens=6))
    spec = resolve_spec(recipe)
    seq = build_sequences(
        rollout.prompt_ids, rollout.completion_ids, rollout.completion_mask, policy.tokenizer.pad_token_id
    )
    with torch.no_grad():
        old = completion_token_stats(policy.model, seq).logprobs
    rewards = torch.tensor([1.0, 0, 0, 1, 0, 1, 1, 1])
    advantages = AdvantagePipeline(spec.advantage, spec.advantage_params)(rewards, rollout.group_ids).advantages
    common = dict(sequences=seq, advantages=advantages, sampler_logprobs=old - 0.05 * rollout.completion_mask,
                  group_ids=rollout.group_ids, ref_logprobs=old - 0.1 * rollout.completion_mask)
    separate = _update_grads(policy, LearnerBatch(old_logprobs=old, **common), spec, micro_batch_size=3)
    in_place = _update_grads(policy, LearnerBatch(old_logprobs=None, **common), spec, micro_batch_size=3)
    for a, b in zip(separate, in_place, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    model = copy.deepcopy(policy.model)
    opt = build_optimizer(model, lr=1e-3)
    settings = UpdateSettings(forward=ForwardPlan(micro_batch_size=3), max_length=6)
    in_place_batch = LearnerBatch(old_logprobs=None, **common)
    stats = policy_update(model, opt, warmup_constant(opt, 0), in_place_batch, spec, settings,
                          torch.Generator().manual_seed(0))
    torch.testing.assert_close(stats.old_logprobs, old, atol=1e-6, rtol=0)
    # Several optimizer steps per batch (2 epochs x 2 mini-batches): pi_old taken in place (the first
    # mini-batch from its forward, the rest from one pass before the first step) is the pi_old of a
    # separate pass, so the four steps end at the same weights with the same metrics.
    several = dataclasses.replace(settings, mini_batches=2, ppo_epochs=2)
    ends = []
    for batch in (LearnerBatch(old_logprobs=old, **common), LearnerBatch(old_logprobs=None, **common)):
        model = copy.deepcopy(policy.model)
        opt = build_optimizer(model, lr=1e-2)
        stats = policy_update(model, opt, warmup_constant(opt, 0), batch, spec, several,
                              torch.Generator().manual_seed(0))
        assert stats.optimizer_steps == 4
        torch.testing.assert_close(stats.old_logprobs, old, atol=1e-6, rtol=0)
        ends.append(([p.detach() for p in model.parameters()], stats.metrics))
    (given, given_metrics), (taken, taken_metrics) = ends
    assert max(float((a - b).abs().max()) for a, b in zip(given, taken, strict=True)) < 1e-5
    start = [p.detach() for p in policy.model.parameters()]
    assert max(float((a - b).abs().max()) for a, b in zip(given, start, strict=True)) > 1e-3   # the steps moved
    assert taken_metrics["clip_frac"] == pytest.approx(given_metrics["clip_frac"], abs=1e-6)


def _small_batch(policy, seed: int) -> tuple[LearnerBatch, object]:
    torch.manual_seed(seed)
    rollout = HFEngine(policy).generate(PROMPTS[:2], 4, SamplingParams(max_new_tokens=6))
    seq = build_sequences(
        rollout.prompt_ids, rollout.completion_ids, rollout.completion_mask, policy.tokenizer.pad_token_id
    )
    with torch.no_grad():
        old = completion_token_stats(policy.model, seq).logprobs
    advantages = compute_advantages("dr_grpo", torch.tensor([1.0, 0, 0, 1, 0, 1, 1, 1]), rollout.group_ids)
    return LearnerBatch(sequences=seq, advantages=advantages, old_logprobs=old, sampler_logprobs=old,
                        group_ids=rollout.group_ids), resolve_spec("dr_grpo")


def test_gradient_is_clipped_to_grad_clip_and_the_metric_is_the_norm_before(policy) -> None:
    batch, spec = _small_batch(policy, 5)
    model = copy.deepcopy(policy.model)
    opt = build_optimizer(model, lr=1e-3)
    for group in opt.param_groups:
        group["lr"] = 0.0  # keep the weights: the clipped grads stay readable
    settings = UpdateSettings(ppo_epochs=1, mini_batches=1, grad_clip=1e-3, temperature=1.0,
                              forward=ForwardPlan(micro_batch_size=8))
    stats = policy_update(model, opt, warmup_constant(opt, 0), batch, spec, settings, torch.Generator().manual_seed(0))
    norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in model.parameters()])))
    assert stats.metrics["grad_norm"] > 1e-2                                     # clipping had work to do
    assert norm == pytest.approx(1e-3, rel=1e-4)                                  # ||g|| scaled down to grad_clip


def test_a_nonfinite_mini_batch_takes_no_step_and_the_other_one_does(policy) -> None:
    batch, spec = _small_batch(policy, 6)
    model = copy.deepcopy(policy.model)
    opt = build_optimizer(model, lr=1e-2)
    scheduler = warmup_constant(opt, 0)
    calls = {"n": 0}

    def poison_first(grad: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        return grad * float("nan") if calls["n"] == 1 else grad

    embed = model.get_input_embeddings().weight
    embed.register_hook(poison_first)  # the first backward (first mini-batch) gets a NaN gradient
    stats = policy_update(
        model,
        opt,
        scheduler,
        batch,
        spec,
        UpdateSettings(
            ppo_epochs=1, mini_batches=2, grad_clip=1.0, temperature=1.0, forward=ForwardPlan(micro_batch_size=8)
        ),
        torch.Generator().manual_seed(0),
    )
    assert (stats.optimizer_steps, stats.skipped_steps) == (1, 1)
    assert scheduler.last_epoch == 1 and int(opt.state[embed]["step"]) == 1     # one Adam step, not two
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert all(torch.isfinite(s["exp_avg_sq"]).all() for s in opt.state.values())
    assert math.isfinite(stats.metrics["grad_norm"]) and stats.metrics["grad_norm"] > 0   # the finite step's norm only
