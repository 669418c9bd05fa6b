"""Preference losses (DPO, cDPO, IPO): hand-derived values, gradients and invariances."""

import math

import pytest
import torch

from reinforge.objectives.preference import PREFERENCE_LOSSES, preference_loss

F64 = torch.float64


def _tensor(values):
    return torch.tensor(values, dtype=F64)


# Three pairs, beta = 0.1. h = logp - ref (summed), z = h_w - h_l:
#   chosen  ref_chosen  h_w   rejected  ref_rejected  h_l   z
#   -10     -12          2    -11       -10           -1     3
#    -4      -5          1     -6        -7            1     0   (a tie)
#    -9      -7         -2     -5        -8            3    -5
CHOSEN, REF_CHOSEN = [-10.0, -4.0, -9.0], [-12.0, -5.0, -7.0]
REJECTED, REF_REJECTED = [-11.0, -6.0, -5.0], [-10.0, -7.0, -8.0]
MARGINS = [3.0, 0.0, -5.0]


def _loss(chosen=CHOSEN, rejected=REJECTED, ref_chosen=REF_CHOSEN, ref_rejected=REF_REJECTED, **params):
    chosen_logprobs = _tensor(chosen).requires_grad_()
    rejected_logprobs = _tensor(rejected).requires_grad_()
    out = preference_loss(chosen_logprobs=chosen_logprobs, rejected_logprobs=rejected_logprobs,
                          ref_chosen_logprobs=_tensor(ref_chosen), ref_rejected_logprobs=_tensor(ref_rejected),
                          **params)
    out.losses.sum().backward()     # per-pair losses are independent: the sum's grad is per pair
    return out, chosen_logprobs.grad, rejected_logprobs.grad


# ---------------------------------------------------------------- DPO (sigmoid)

def test_dpo_hand_values_and_gradients():
    # l = -log sigmoid(beta z) = log(1 + e^{-beta z}), beta z = [0.3, 0, -0.5]:
    #   log(1 + e^-0.3) = 0.5543552,  log 2 = 0.6931472,  log(1 + e^0.5) = 0.9740770.
    # dl/dz = -beta sigmoid(-beta z) = -0.1 / (1 + e^{beta z}) = [-0.0425557, -0.05, -0.0622459];
    # dl/dchosen = dl/dz, dl/drejected = -dl/dz.
    out, grad_chosen, grad_rejected = _loss()
    torch.testing.assert_close(out.losses, _tensor([0.5543552444685, math.log(2), 0.9740769841801]))
    expected_grad = _tensor([-0.0425557483188, -0.05, -0.0622459331202])
    torch.testing.assert_close(grad_chosen, expected_grad)
    torch.testing.assert_close(grad_rejected, -expected_grad)


def test_metrics_by_hand():
    # reward_chosen = 0.1 mean(2, 1, -2) = 0.1/3, reward_rejected = 0.1 mean(-1, 1, 3) = 0.1,
    # reward_margin = 0.1 mean(3, 0, -5) = -0.2/3, accuracy: only pair 0 has h_w > h_l (the tie
    # does not count) = 1/3. The metrics are the same for every loss type.
    for params in ({}, {"loss_type": "ipo"}, {"label_smoothing": 0.2}):
        out, _, _ = _loss(**params)
        assert out.metrics == pytest.approx({
            "reward_chosen": 0.1 / 3,
            "reward_rejected": 0.1,
            "reward_margin": -0.2 / 3,
            "reward_accuracy": 1 / 3,
        })
        assert all(isinstance(value, float) for value in out.metrics.values())


def test_beta_scales_the_logits():
    # beta = 1, z = 3: l = log(1 + e^-3) = 0.0485874; rewards scale with beta: 1 * h_w mean = 1/3.
    out, _, _ = _loss(beta=1.0)
    assert out.losses[0].item() == pytest.approx(math.log1p(math.exp(-3.0)))
    assert out.metrics["reward_chosen"] == pytest.approx(1 / 3)


def test_reference_is_frozen():
    ref_chosen = _tensor(REF_CHOSEN).requires_grad_()
    ref_rejected = _tensor(REF_REJECTED).requires_grad_()
    out = preference_loss(chosen_logprobs=_tensor(CHOSEN).requires_grad_(),
                          rejected_logprobs=_tensor(REJECTED).requires_grad_(),
                          ref_chosen_logprobs=ref_chosen, ref_rejected_logprobs=ref_rejected)
    out.losses.sum().backward()
    assert ref_chosen.grad is None and ref_rejected.grad is None


# ---------------------------------------------------------------- cDPO (label smoothing)

def test_label_smoothing_zero_is_dpo():
    plain, grad_chosen, _ = _loss()
    smoothed, smoothed_grad, _ = _loss(loss_type="sigmoid", label_smoothing=0.0)
    torch.testing.assert_close(smoothed.losses, plain.losses)
    torch.testing.assert_close(smoothed_grad, grad_chosen)


def test_label_smoothing_hand_values_and_gradients():
    # l = -(1 - s) log sigmoid(beta z) - s log sigmoid(-beta z); with
    # log sigmoid(x) - log sigmoid(-x) = x this is l_DPO + s beta z. s = 0.1, beta z = [0.3, 0, -0.5]:
    #   [0.5543552 + 0.03, 0.6931472 + 0, 0.9740770 - 0.05] = [0.5843552, 0.6931472, 0.9240770];
    # dl/dz = dl_DPO/dz + s beta = [-0.0425557, -0.05, -0.0622459] + 0.01.
    out, grad_chosen, grad_rejected = _loss(label_smoothing=0.1)
    torch.testing.assert_close(out.losses, _tensor([0.5843552444685, math.log(2), 0.9240769841801]))
    expected_grad = _tensor([-0.0325557483188, -0.04, -0.0522459331202])
    torch.testing.assert_close(grad_chosen, expected_grad)
    torch.testing.assert_close(grad_rejected, -expected_grad)


def test_label_smoothing_half_is_symmetric_in_chosen_and_rejected():
    # s = 0.5: l(z) = -(log sigmoid(beta z) + log sigmoid(-beta z)) / 2 is even in z; swapping
    # the responses (and their references) flips z.
    out, _, _ = _loss(label_smoothing=0.5)
    swapped, _, _ = _loss(chosen=REJECTED, rejected=CHOSEN, ref_chosen=REF_REJECTED,
                          ref_rejected=REF_CHOSEN, label_smoothing=0.5)
    torch.testing.assert_close(out.losses, swapped.losses)
    # at s = 0.5 the gradient vanishes at z = 0 (pair 1) and points z back towards 0 elsewhere
    _, grad_chosen, _ = _loss(label_smoothing=0.5)
    assert grad_chosen[0] > 0 and grad_chosen[1] == 0 and grad_chosen[2] < 0


# ---------------------------------------------------------------- IPO

def test_ipo_hand_values_and_gradients():
    # beta = 0.1: target 1/(2 beta) = 5; l = (z - 5)^2 = [4, 25, 100]; dl/dz = 2(z - 5) = [-4, -10, -20].
    out, grad_chosen, grad_rejected = _loss(loss_type="ipo")
    torch.testing.assert_close(out.losses, _tensor([4.0, 25.0, 100.0]))
    torch.testing.assert_close(grad_chosen, _tensor([-4.0, -10.0, -20.0]))
    torch.testing.assert_close(grad_rejected, _tensor([4.0, 10.0, 20.0]))


@pytest.mark.parametrize("beta", [0.1, 0.5, 2.0])
def test_ipo_minimum_at_half_inverse_beta(beta):
    # h_l = 0, h_w = z: the loss is 0 with zero gradient at z = 1/(2 beta) and larger on both sides.
    target = 1 / (2 * beta)
    margins = [target - 0.1, target, target + 0.1]
    out, grad_chosen, _ = _loss(chosen=margins, rejected=[0.0] * 3, ref_chosen=[0.0] * 3,
                                ref_rejected=[0.0] * 3, beta=beta, loss_type="ipo")
    torch.testing.assert_close(out.losses, _tensor([0.01, 0.0, 0.01]))
    torch.testing.assert_close(grad_chosen, _tensor([-0.2, 0.0, 0.2]))


# ---------------------------------------------------------------- stability and errors

@pytest.mark.parametrize("params", [{}, {"label_smoothing": 0.1}, {"loss_type": "ipo"}])
def test_huge_margins_are_finite(params):
    # z = +-1e4, beta z = +-1e3: sigmoid(1e3) rounds to 1 and a naive -log(sigmoid(-1e3)) is inf;
    # logsigmoid gives l ~ 0 resp. 1e3 exactly. IPO: (1e4 - 5)^2 ~ 1e8, finite.
    out, grad_chosen, grad_rejected = _loss(chosen=[1e4, -1e4], rejected=[0.0, 0.0], ref_chosen=[0.0, 0.0],
                                            ref_rejected=[0.0, 0.0], **params)
    assert torch.isfinite(out.losses).all()
    assert torch.isfinite(grad_chosen).all() and torch.isfinite(grad_rejected).all()
    if not params:
        torch.testing.assert_close(out.losses, _tensor([0.0, 1e3]))
        torch.testing.assert_close(grad_chosen, _tensor([0.0, -0.1]))


def test_registry_and_errors():
    assert sorted(PREFERENCE_LOSSES) == ["ipo", "sigmoid"]
    with pytest.raises(ValueError, match="did you mean 'sigmoid'"):
        _loss(loss_type="sigmoidd")
    with pytest.raises(ValueError, match="label_smoothing"):
        _loss(loss_type="ipo", label_smoothing=0.1)
    with pytest.raises(ValueError, match="label_smoothing"):
        _loss(label_smoothing=0.6)
    with pytest.raises(ValueError, match="beta"):
        _loss(beta=0.0)
    with pytest.raises(ValueError, match=r"\[P\]"):
        _loss(chosen=[[-1.0, -2.0, -3.0]])
    # an import path resolves to user code with the same signature
    out, _, _ = _loss(loss_type="reinforge.objectives.preference:ipo")
    torch.testing.assert_close(out.losses, _tensor([4.0, 25.0, 100.0]))


def test_empty_batch_metrics_are_zero():
    out = preference_loss(chosen_logprobs=_tensor([]), rejected_logprobs=_tensor([]),
                          ref_chosen_logprobs=_tensor([]), ref_rejected_logprobs=_tensor([]))
    assert out.losses.shape == (0,)
    assert out.metrics == dict.fromkeys(out.metrics, 0.0) and len(out.metrics) == 4
