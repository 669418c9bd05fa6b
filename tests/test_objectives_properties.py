"""Property tests: no NaN or inf in any loss or gradient, whatever the batch looks like."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from reinforge.objectives import AGGREGATIONS, RECIPE_OBJECTIVES, compute_advantages, recipe_loss
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
        logprobs=old_logprobs + matrix(log_ratios),
        ref_logprobs=old_logprobs + matrix(log_ratios),
        mask=matrix(st.sampled_from([0.0, 1.0])),
        rewards=torch.tensor(draw(st.lists(rewards, min_size=n, max_size=n))),
        group_ids=torch.tensor(draw(st.lists(st.integers(0, 2), min_size=n, max_size=n))),
    )


@settings(max_examples=60, deadline=None)
@given(batches(), st.sampled_from(sorted(RECIPE_OBJECTIVES)), st.sampled_from(sorted(AGGREGATIONS)),
       st.sampled_from([None, 3]))
def test_losses_and_gradients_are_finite(batch, recipe, aggregation, max_length):
    spec = RECIPE_OBJECTIVES[recipe]
    advantages = compute_advantages(spec.advantage, batch["rewards"], batch["group_ids"])
    assert torch.isfinite(advantages).all()
    logprobs = batch["logprobs"].requires_grad_()
    out = recipe_loss(recipe, logprobs=logprobs, old_logprobs=batch["old_logprobs"], advantages=advantages,
                      mask=batch["mask"], ref_logprobs=batch["ref_logprobs"], group_ids=batch["group_ids"],
                      max_length=max_length, aggregation=aggregation)
    out.loss.backward()
    assert torch.isfinite(out.loss)
    assert torch.isfinite(logprobs.grad).all()
    assert torch.all(logprobs.grad[batch["mask"] == 0] == 0)    # padding never gets a gradient
    assert all(torch.isfinite(torch.tensor(value)) for value in out.metrics.values())


@settings(max_examples=200, deadline=None)
@given(st.lists(log_ratios, min_size=1, max_size=16), st.sampled_from([torch.float32, torch.float64]))
def test_k3_is_non_negative(deltas, dtype):
    # k3 = exp(-delta) - 1 + delta >= 0 (convexity of exp), also in floating point.
    delta = torch.tensor(deltas, dtype=dtype)
    ref_logprobs = torch.full_like(delta, -2.0)
    assert torch.all(kl_terms("k3", ref_logprobs + delta, ref_logprobs) >= 0)
