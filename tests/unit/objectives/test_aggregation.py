"""Loss aggregation: hand values of every form, micro-batch invariance, no NaN."""

import pytest
import torch

from reinforge.objectives import AGGREGATIONS, loss_weights, objective_loss, resolve_spec
from reinforge.objectives.aggregation import aggregate, masked_mean

# Three sequences of lengths 3, 1, 2 (T = 4); 100 marks padding that must not count.
MASK = torch.tensor([[1.0, 1, 1, 0], [1, 0, 0, 0], [1, 1, 0, 0]])
TERMS = torch.tensor([[1.0, 2, 3, 100], [4, 100, 100, 100], [5, 6, 100, 100]])
GROUP_IDS = torch.tensor([7, 7, 3])      # prompt 7 = rows {0, 1}, prompt 3 = row {2}

# Hand values. Valid tokens: row sums 6, 4, 11 (total 21), lengths 3, 1, 2 (total 6), N = 3.
HAND = {
    "token_mean": 21 / 6,                               # 3.5
    "seq_mean_token_mean": (6 / 3 + 4 / 1 + 11 / 2) / 3,  # (2 + 4 + 5.5) / 3 = 3.8333
    "seq_mean_token_sum": 21 / 3,                       # 7
    "seq_mean_token_sum_norm": 21 / (3 * 4),            # L_norm = T = 4 -> 1.75
    "prompt_mean": ((6 + 4) / 4 + 11 / 2) / 2,          # (2.5 + 5.5) / 2 = 4
    "token_sum": 21,                                    # no normaliser
}


@pytest.mark.parametrize("name", sorted(HAND))
def test_hand_values(name):
    value = aggregate(name, TERMS, MASK, group_ids=GROUP_IDS)
    assert value.item() == pytest.approx(HAND[name], abs=1e-6)


def test_every_registered_form_has_a_hand_value():
    assert set(HAND) == set(AGGREGATIONS)


def test_seq_mean_token_sum_norm_uses_max_length():
    # L_norm = 7: 21 / (3 * 7) = 1.0.
    assert aggregate("seq_mean_token_sum_norm", TERMS, MASK, max_length=7).item() == pytest.approx(1.0)


def test_seq_mean_token_mean_weights():
    # Row 0: 1 / (3 * 3) = 1/9 per token; row 1: 1 / (1 * 3) = 1/3; row 2: 1 / (2 * 3) = 1/6.
    expected = torch.tensor([[1 / 9, 1 / 9, 1 / 9, 0], [1 / 3, 0, 0, 0], [1 / 6, 1 / 6, 0, 0]])
    torch.testing.assert_close(loss_weights("seq_mean_token_mean", MASK), expected)


def test_bool_mask_gives_same_weights():
    for name in AGGREGATIONS:
        torch.testing.assert_close(loss_weights(name, MASK.bool(), group_ids=GROUP_IDS),
                                   loss_weights(name, MASK, group_ids=GROUP_IDS))


def _invariance_batch(dtype=torch.float32):
    generator = torch.Generator().manual_seed(0)
    n, t = 8, 6
    lengths = torch.tensor([6, 0, 3, 1, 6, 2, 5, 4])                  # an empty row included
    mask = (torch.arange(t) < lengths[:, None]).to(dtype)
    logprobs = (torch.randn(n, t, generator=generator, dtype=dtype) * 0.5 - 1).requires_grad_()
    return dict(
        logprobs=logprobs,
        old_logprobs=logprobs.detach() + 0.3 * torch.randn(n, t, generator=generator, dtype=dtype),
        ref_logprobs=logprobs.detach() + 0.5 * torch.randn(n, t, generator=generator, dtype=dtype),
        entropy=torch.rand(n, t, generator=generator, dtype=dtype),
        advantages=torch.randn(n, generator=generator, dtype=dtype),
        mask=mask,
    )


def _sliced(batch, rows):
    return {key: value[rows] for key, value in batch.items()}


def _grad_of_split(spec, batch, weights, splits):
    """Sum of micro-batch losses, each on its row slice of the full-batch weights."""
    batch["logprobs"].grad = None
    total = sum(objective_loss(spec, weights=weights[rows], **_sliced(batch, rows)).loss for rows in splits)
    total.backward()
    return total.detach(), batch["logprobs"].grad.clone()


SPLITS = {
    "8x1": [slice(i, i + 1) for i in range(8)],
    "2x4": [slice(0, 4), slice(4, 8)],
    "3+5": [slice(0, 3), slice(3, 8)],
}


@pytest.mark.parametrize("name", sorted(AGGREGATIONS))
def test_gradient_is_independent_of_the_micro_batch_split(name):
    # Weights over the whole optimizer batch, sliced by rows; summed micro-batch losses
    # equal the full-batch loss, hence so do the gradients, for every form.
    spec = resolve_spec("grpo", aggregation=name, entropy_coef=0.01)
    batch = _invariance_batch()
    group_ids = torch.tensor([5, 5, 2, 2, 9, 9, 9, 1])
    weights = loss_weights(name, batch["mask"], group_ids=group_ids, max_length=8)
    full_loss, full_grad = _grad_of_split(spec, batch, weights, [slice(0, 8)])
    assert full_grad.abs().sum() > 0
    for split in SPLITS.values():
        loss, grad = _grad_of_split(spec, batch, weights, split)
        torch.testing.assert_close(loss, full_loss, atol=1e-6, rtol=0)
        torch.testing.assert_close(grad, full_grad, atol=1e-6, rtol=0)


def test_per_micro_batch_normalisation_would_break_invariance():
    # The bug the design prevents: token_mean normalised per micro-batch (verl #906).
    spec = resolve_spec("grpo", aggregation="token_mean")
    batch = _invariance_batch()
    weights = loss_weights("token_mean", batch["mask"])
    _, full_grad = _grad_of_split(spec, batch, weights, [slice(0, 8)])
    batch["logprobs"].grad = None
    sum(objective_loss(spec, weights=loss_weights("token_mean", batch["mask"][rows]), **_sliced(batch, rows)).loss
        for rows in SPLITS["3+5"]).backward()
    assert not torch.allclose(batch["logprobs"].grad, full_grad, atol=1e-4)


@pytest.mark.parametrize("name", sorted(AGGREGATIONS))
def test_all_masked_batch_and_empty_rows_give_zero_weights_not_nan(name):
    group_ids = torch.tensor([0, 0, 1])
    all_masked = loss_weights(name, torch.zeros(3, 4), group_ids=group_ids)
    assert torch.equal(all_masked, torch.zeros(3, 4))
    with_empty = loss_weights(name, MASK * torch.tensor([[1.0], [0.0], [1.0]]), group_ids=group_ids)
    assert torch.isfinite(with_empty).all() and torch.equal(with_empty[1], torch.zeros(4))


def test_empty_rows_count_in_n():
    # seq_mean_token_sum: rows {3 tokens, empty} -> N = 2 -> w = 1/2 on row 0's tokens.
    mask = torch.tensor([[1.0, 1, 1], [0, 0, 0]])
    torch.testing.assert_close(loss_weights("seq_mean_token_sum", mask)[0], torch.full((3,), 0.5))


def test_prompt_mean_needs_group_ids():
    with pytest.raises(ValueError, match="needs group_ids"):
        loss_weights("prompt_mean", MASK)


def test_unknown_aggregation_suggests_the_closest():
    with pytest.raises(ValueError, match="did you mean 'token_mean'"):
        loss_weights("token_means", MASK)


def test_masked_mean_ignores_masked_nan_and_is_zero_when_empty():
    values = torch.tensor([[1.0, float("nan")], [3.0, float("inf")]])
    mask = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    assert masked_mean(values, mask).item() == 2.0
    assert masked_mean(values, torch.zeros(2, 2)).item() == 0.0
