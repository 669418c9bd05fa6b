"""Property tests: no NaN or inf in any loss, gradient or metric, whatever the batch looks like
(empty and all-masked rows, groups of one, all-equal rewards, log-ratios far beyond the clamp)."""

import inspect

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from reinforge.objectives import (
    ADVANTAGE_TRANSFORMS,
    ADVANTAGES,
    AGGREGATIONS,
    CORRECTIONS,
    POLICY_LOSSES,
    RECIPE_OBJECTIVES,
    AdvantagePipeline,
    recipe_loss,
)
from reinforge.objectives.kl import kl_terms

# Log-ratios up to +-50 (beyond the +-20 clamp), rewards binary or real.
log_ratios = st.floats(-50.0, 50.0, allow_nan=False)
rewards = st.one_of(st.sampled_from([0.0, 1.0]), st.floats(-5.0, 5.0, allow_nan=False))


@st.composite
def batches(draw):
    n, t = draw(st.integers(1, 5)), draw(st.integers(1, 5))

    def matrix(elements):
        return torch.tensor(draw(st.lists(st.lists(elements, min_size=t, max_size=t), min_size=n, max_size=n)))

    old_logprobs = matrix(st.floats(-20.0, 0.0, allow_nan=False))
    # Rows may be fully masked; few group ids, so groups of one and all-equal groups are common.
    return dict(
        old_logprobs=old_logprobs,
        logprobs=(old_logprobs + matrix(log_ratios)).clamp(max=0.0),
        ref_logprobs=(old_logprobs + matrix(log_ratios)).clamp(max=0.0),
        sampler_logprobs=(old_logprobs + matrix(log_ratios)).clamp(max=0.0),
        entropy=matrix(st.floats(0.0, 10.0)),
        mask=matrix(st.sampled_from([0.0, 1.0])),
        rewards=torch.tensor(draw(st.lists(rewards, min_size=n, max_size=n))),
        group_ids=torch.tensor(draw(st.lists(st.integers(0, 2), min_size=n, max_size=n))),
    )


def _rewards_for(estimator, batch):
    """The batch's rewards, made 0/1 for an estimator that takes binary rewards only (it has a `threshold`
    parameter and refuses any other reward without one)."""
    if "threshold" in inspect.signature(ADVANTAGES[estimator]).parameters:
        return (batch["rewards"] > 0).to(batch["rewards"].dtype)
    return batch["rewards"]


def _inputs(batch):
    """The inputs some estimators take beyond rewards: ReMax's baselines, REINFORCE++'s mask and per-token KL."""
    return dict(baselines=batch["rewards"].flip(0), mask=batch["mask"],
                token_penalty=0.01 * (batch["old_logprobs"] - batch["ref_logprobs"]).clamp(-20, 20) * batch["mask"])


def _loss_is_finite(batch, advantages, name, **overrides):
    logprobs = batch["logprobs"].clone().requires_grad_()
    out = recipe_loss(name, logprobs=logprobs, old_logprobs=batch["old_logprobs"], advantages=advantages,
                      mask=batch["mask"], ref_logprobs=batch["ref_logprobs"],
                      sampler_logprobs=batch["sampler_logprobs"], group_ids=batch["group_ids"],
                      entropy=batch["entropy"], correct=batch["rewards"] > 0,
                      # K = 2 top-K log-probs (DPPO's top-K divergence); their sums may pass 1 (clamped rest)
                      top_logprobs=torch.stack([batch["logprobs"], batch["ref_logprobs"]], dim=-1),
                      sampler_top_logprobs=torch.stack([batch["sampler_logprobs"], batch["old_logprobs"]], dim=-1),
                      **overrides)
    out.loss.backward()
    assert torch.isfinite(out.loss)
    assert torch.isfinite(logprobs.grad).all()
    assert torch.all(logprobs.grad[batch["mask"] == 0] == 0)    # padding never gets a gradient
    assert all(torch.isfinite(torch.tensor(value)) for value in out.metrics.values()), out.metrics


@settings(max_examples=80, deadline=None)
@given(batches(), st.sampled_from(sorted(RECIPE_OBJECTIVES)), st.sampled_from(sorted(AGGREGATIONS)),
       st.sampled_from([None, 3]))
def test_every_recipe_is_finite(batch, recipe, aggregation, max_length):
    spec = RECIPE_OBJECTIVES[recipe]
    if spec.needs_critic:   # GAE advantages come from a critic: any finite per-token values
        advantages = batch["rewards"].unsqueeze(1) * batch["mask"]
    else:
        advantages = AdvantagePipeline(spec.advantage, spec.advantage_params)(
            _rewards_for(spec.advantage, batch), batch["group_ids"], **_inputs(batch)
        ).advantages
    assert torch.isfinite(advantages).all()
    _loss_is_finite(batch, advantages, recipe, aggregation=aggregation, max_length=max_length)


@settings(max_examples=80, deadline=None)
@given(batches(), st.sampled_from(sorted(POLICY_LOSSES)), st.sampled_from([None, *sorted(CORRECTIONS)]),
       st.sampled_from(["old", "sampler"]))
def test_every_policy_loss_and_correction_is_finite(batch, policy_loss, correction, anchor):
    advantages = AdvantagePipeline("grpo")(batch["rewards"], batch["group_ids"]).advantages
    _loss_is_finite(batch, advantages, "grpo", policy_loss=policy_loss, correction=correction,
                    ratio_anchor=anchor, entropy_coef=0.01, nll_coef=0.1)


@settings(max_examples=80, deadline=None)
@given(batches(), st.sampled_from(sorted(ADVANTAGES)), st.sampled_from(sorted(ADVANTAGE_TRANSFORMS)))
def test_every_advantage_and_transform_is_finite(batch, estimator, transform):
    per_token = "mask" in AdvantagePipeline(estimator).inputs     # [N, T] advantages take no transform
    pipeline = AdvantagePipeline(estimator, transforms=[] if per_token else [(transform, {})])
    for _ in range(2):      # the second batch sees the state the first one left
        result = pipeline(_rewards_for(estimator, batch), batch["group_ids"],
                          generator=torch.Generator().manual_seed(0),
                          **_inputs(batch))
        assert torch.isfinite(result.advantages).all()
        assert result.keep.dtype == torch.bool


@settings(max_examples=200, deadline=None)
@given(st.lists(log_ratios, min_size=1, max_size=16), st.sampled_from([torch.float32, torch.float64]))
def test_k3_is_non_negative(deltas, dtype):
    # k3 = exp(-delta) - 1 + delta >= 0 (convexity of exp), also in floating point.
    delta = torch.tensor(deltas, dtype=dtype)
    ref_logprobs = torch.full_like(delta, -2.0)
    assert torch.all(kl_terms("k3", ref_logprobs + delta, ref_logprobs) >= 0)
