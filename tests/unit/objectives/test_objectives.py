"""Policy losses, KL estimators and recipe losses: hand-derived values and gradients."""

import math

import pytest
import torch

from reinforge.objectives import POLICY_LOSSES, RECIPE_OBJECTIVES, recipe_loss, resolve_spec
from reinforge.objectives.kl import kl_terms
from reinforge.objectives.policy import ppo_clip

F64 = torch.float64


def _tensor(values):
    return torch.tensor(values, dtype=F64)


# ---------------------------------------------------------------- ppo_clip

# (ratio r, advantage A) per token, eps = 0.2 (band [0.8, 1.2]); J = min(r A, clip(r) A),
# dJ/dlogp = r A where the unclipped branch is the min, 0 where the clipped one is.
#   r    A    r A   clip(r) A   J      d(-J)/dlogp   why
#   1.5  +2   3.0   2.4         2.4    0             above the band, A > 0: clipped
#   1.5  -1  -1.5  -1.2        -1.5    +1.5          above the band, A < 0: not clipped
#   0.5  -1  -0.5  -0.8        -0.8    0             below the band, A < 0: clipped
#   0.5  +2   1.0   1.6         1.0    -1.0          below the band, A > 0: not clipped
#   1.1  +2   2.2   2.2         2.2    -2.2          inside the band
#   1.0  -3  -3.0  -3.0        -3.0    +3.0          at theta = theta_old
RATIOS = [1.5, 1.5, 0.5, 0.5, 1.1, 1.0]
ADVANTAGES = [2.0, -1.0, -1.0, 2.0, 2.0, -3.0]
PPO_LOSS = [-2.4, 1.5, 0.8, -1.0, -2.2, 3.0]
PPO_GRAD = [0.0, 1.5, 0.0, -1.0, -2.2, 3.0]


def _ppo(ratios, advantages, mask=None, **params):
    old_logprobs = _tensor([[-1.0] * len(ratios)])
    logprobs = (old_logprobs + torch.log(_tensor([ratios]))).requires_grad_()
    mask = torch.ones_like(old_logprobs) if mask is None else _tensor([mask])
    terms = ppo_clip(logprobs=logprobs, old_logprobs=old_logprobs, advantages=_tensor([advantages]),
                     mask=mask, **params)
    terms.loss.sum().backward()     # terms are independent per token: the sum's grad is per-token
    return terms, logprobs.grad[0]


def test_ppo_clip_hand_values_and_gradients():
    terms, grad = _ppo(RATIOS, ADVANTAGES)
    torch.testing.assert_close(terms.loss[0], _tensor(PPO_LOSS))
    torch.testing.assert_close(grad, _tensor(PPO_GRAD))
    # clip_frac_high: r > 1.2 with A > 0 (token 0); clip_frac_low: r < 0.8 with A < 0 (token 2).
    torch.testing.assert_close(terms.metrics["clip_frac_high"][0], _tensor([1, 0, 0, 0, 0, 0]))
    torch.testing.assert_close(terms.metrics["clip_frac_low"][0], _tensor([0, 0, 1, 0, 0, 0]))
    torch.testing.assert_close(terms.metrics["clip_frac"][0], _tensor([1, 0, 1, 0, 0, 0]))
    torch.testing.assert_close(terms.metrics["ratio"][0], _tensor(RATIOS))


def test_ppo_clip_gradient_zero_exactly_where_clipped_in_the_direction_of_a():
    terms, grad = _ppo(RATIOS, ADVANTAGES)
    clipped = (terms.metrics["clip_frac"][0] > 0)
    assert torch.all(grad[clipped] == 0)
    assert torch.all(grad[~clipped] != 0)


def test_ppo_clip_at_theta_old_has_gradient_minus_a():
    # r = 1 everywhere: J = A r, dJ/dlogp = A r = A, so d(-J)/dlogp = -A (for every eps).
    advantages = [0.7, -1.3, 0.0, 2.5, -0.1]
    for eps_low, eps_high in [(0.2, 0.2), (0.2, 0.28), (1e-3, 1e-3)]:
        _, grad = _ppo([1.0] * 5, advantages, eps_low=eps_low, eps_high=eps_high)
        torch.testing.assert_close(grad, -_tensor(advantages))


def test_clip_higher_widens_the_upper_band_only():
    # r = 1.25, A = +1: with eps_high 0.2 it is clipped (J = 1.2, grad 0); with 0.28 it is
    # inside (J = 1.25, d(-J)/dlogp = -1.25). r = 0.75, A = -1 is clipped either way (J = -0.8).
    terms, grad = _ppo([1.25, 0.75], [1.0, -1.0], eps_low=0.2, eps_high=0.2)
    torch.testing.assert_close(terms.loss[0], _tensor([-1.2, 0.8]))
    torch.testing.assert_close(grad, _tensor([0.0, 0.0]))
    terms, grad = _ppo([1.25, 0.75], [1.0, -1.0], eps_low=0.2, eps_high=0.28)
    torch.testing.assert_close(terms.loss[0], _tensor([-1.25, 0.8]))
    torch.testing.assert_close(grad, _tensor([-1.25, 0.0]))


def test_masked_tokens_have_zero_loss_zero_grad_and_zero_metrics():
    terms, grad = _ppo([1.5, 0.5, 1.1], [2.0, -1.0, 2.0], mask=[1.0, 0.0, 0.0])
    torch.testing.assert_close(terms.loss[0], _tensor([-2.4, 0.0, 0.0]))
    torch.testing.assert_close(grad, _tensor([0.0, 0.0, 0.0]))
    for values in terms.metrics.values():
        assert torch.all(values[0, 1:] == 0)


def test_extreme_log_ratios_are_clamped_not_inf():
    # log r = +-50 is clamped to +-20: r = exp(20) resp. exp(-20), the loss stays finite.
    old_logprobs = _tensor([[0.0, 0.0]])
    logprobs = _tensor([[50.0, -50.0]]).requires_grad_()
    terms = ppo_clip(logprobs=logprobs, old_logprobs=old_logprobs, advantages=_tensor([[-1.0, 1.0]]),
                     mask=torch.ones(1, 2, dtype=F64))
    terms.loss.sum().backward()
    torch.testing.assert_close(terms.metrics["ratio"][0], _tensor([math.exp(20), math.exp(-20)]))
    assert torch.isfinite(terms.loss).all() and torch.isfinite(logprobs.grad).all()


def test_reinforce_is_advantage_times_logprob():
    # J = A logp: logp = [-0.5, -2], A = [2, -1] -> loss -J = [1, -2]; d(-J)/dlogp = -A = [-2, 1].
    logprobs = _tensor([[-0.5, -2.0]]).requires_grad_()
    terms = POLICY_LOSSES["reinforce"](logprobs=logprobs, old_logprobs=logprobs.detach(),
                                       advantages=_tensor([[2.0, -1.0]]), mask=torch.ones(1, 2, dtype=F64))
    terms.loss.sum().backward()
    torch.testing.assert_close(terms.loss, _tensor([[1.0, -2.0]]))
    torch.testing.assert_close(logprobs.grad, _tensor([[-2.0, 1.0]]))


# ---------------------------------------------------------------- KL estimators

# delta = logp - ref = [0, 1, -1, ln 2]:
#   k1 = delta
#   k2 = delta^2 / 2            = [0, 0.5, 0.5, 0.2402265]
#   k3 = exp(-delta) - 1 + delta = [0, e^-1 = 0.3678794, e - 2 = 0.7182818, 0.5 - 1 + ln 2 = 0.1931472]
DELTA = [0.0, 1.0, -1.0, math.log(2)]
KL_HAND = {
    "k1": DELTA,
    "k2": [0.0, 0.5, 0.5, math.log(2) ** 2 / 2],
    "k3": [0.0, math.exp(-1), math.e - 2, math.log(2) - 0.5],
}


@pytest.mark.parametrize("name", sorted(KL_HAND))
def test_kl_hand_values(name):
    ref_logprobs = _tensor([[-1.0, -2.0, -0.5, -3.0]])
    logprobs = ref_logprobs + _tensor([DELTA])
    torch.testing.assert_close(kl_terms(name, logprobs, ref_logprobs), _tensor([KL_HAND[name]]))


def test_k3_gradient_is_one_minus_exp_minus_delta():
    delta = _tensor([[-2.0, -0.5, 0.0, 0.5, 2.0]])
    ref_logprobs = torch.full_like(delta, -1.5)
    logprobs = (ref_logprobs + delta).requires_grad_()
    kl_terms("k3", logprobs, ref_logprobs).sum().backward()
    torch.testing.assert_close(logprobs.grad, 1 - torch.exp(-delta))


def test_kl_log_ratio_is_clamped():
    # delta = 50 -> clamped to 20: k1 = 20, k3 = exp(-20) - 1 + 20.
    zeros = torch.zeros(1, 1, dtype=F64)
    assert kl_terms("k1", zeros + 50, zeros).item() == 20.0
    assert kl_terms("k3", zeros + 50, zeros).item() == pytest.approx(math.exp(-20) + 19)


# ---------------------------------------------------------------- recipes

# Tiny batch: row 0 has 2 tokens, row 1 has 1 (its second position is padding).
MASK = _tensor([[1.0, 1.0], [1.0, 0.0]])
LOGPROBS = _tensor([[math.log(0.5), math.log(0.5)], [math.log(0.25), 0.0]])
SEQ_ADVANTAGES = _tensor([1.0, -0.5])
# delta = logp - ref = [[ln 2, 0], [-ln 2, (pad)]]: k3 = [[ln 2 - 0.5, 0], [2 - 1 - ln 2, .]]
REF_LOGPROBS = LOGPROBS - _tensor([[math.log(2), 0.0], [-math.log(2), 0.0]])


def _recipe(name, old_logprobs=None, **kwargs):
    logprobs = LOGPROBS.clone().requires_grad_()
    old = LOGPROBS if old_logprobs is None else old_logprobs
    out = recipe_loss(name, logprobs=logprobs, old_logprobs=old, advantages=SEQ_ADVANTAGES, mask=MASK,
                      ref_logprobs=REF_LOGPROBS, **kwargs)
    out.loss.backward()
    return out, logprobs.grad


def test_grpo_recipe_hand_value_and_gradient():
    # theta = theta_old, so the policy term is -A per token. seq_mean_token_mean weights:
    # row 0: 1 / (2 * 2) = 0.25 per token; row 1: 1 / (1 * 2) = 0.5.
    # policy = 0.25 (-1) + 0.25 (-1) + 0.5 (0.5) = -0.25
    # kl (k3) = 0.25 (ln 2 - 0.5) + 0.25 * 0 + 0.5 (1 - ln 2) = 0.2017132
    # loss = -0.25 + 0.04 * 0.2017132 = -0.2419315
    out, grad = _recipe("grpo")
    kl = 0.25 * (math.log(2) - 0.5) + 0.5 * (1 - math.log(2))
    assert out.loss.item() == pytest.approx(-0.25 + 0.04 * kl, abs=1e-12)
    # d loss / d logp = w (-A + 0.04 (1 - exp(-delta))):
    # [0.25 (-1 + 0.04 * 0.5), 0.25 (-1 + 0)], [0.5 (0.5 + 0.04 (1 - 2)), 0 (padding)]
    torch.testing.assert_close(grad, _tensor([[-0.245, -0.25], [0.23, 0.0]]))
    # Metrics are token means over the 3 valid tokens: policy (-1 - 1 + 0.5) / 3 = -0.5,
    # kl (ln 2 - 0.5 + 0 + 1 - ln 2) / 3 = 1/6; one of 4 positions is masked.
    assert out.metrics["policy_loss"] == pytest.approx(-0.5)
    assert out.metrics["kl"] == pytest.approx(1 / 6)
    assert out.metrics["masked_frac"] == pytest.approx(0.25)
    assert out.metrics["ratio_mean"] == out.metrics["ratio_min"] == out.metrics["ratio_max"] == 1.0


def test_dr_grpo_recipe_hand_value_and_eps_high_override():
    # Row 0 token 0 has r = 1.5 with A = +1 (clipped at 1.2); elsewhere r = 1.
    # Terms -J: [[-1.2, -1], [0.5, 0]]; seq_mean_token_sum_norm with L_norm = 4, N = 2:
    # loss = (-1.2 - 1 + 0.5) / (2 * 4) = -0.2125. No KL in the loss, although ref_logprobs are
    # passed: they only give the diagnostic k3 metric (1/6, as in the grpo test above).
    old_logprobs = LOGPROBS - _tensor([[math.log(1.5), 0.0], [0.0, 0.0]])
    out, grad = _recipe("dr_grpo", old_logprobs=old_logprobs, max_length=4)
    assert out.loss.item() == pytest.approx(-1.7 / 8, abs=1e-12)
    # Gradient w (-A) where unclipped: [[0, -1/8], [0.5/8, 0]].
    torch.testing.assert_close(grad, _tensor([[0.0, -0.125], [0.0625, 0.0]]))
    assert out.metrics["kl"] == pytest.approx(1 / 6)
    assert out.metrics["clip_frac_high"] == pytest.approx(1 / 3)
    # eps_high = 0.28: the 1.5 ratio is clipped at 1.28 instead: (-1.28 - 1 + 0.5) / 8 = -0.2225.
    out, _ = _recipe("dr_grpo", old_logprobs=old_logprobs, max_length=4, eps_high=0.28)
    assert out.loss.item() == pytest.approx(-1.78 / 8, abs=1e-12)
    # Without max_length, L_norm = T = 2: -1.7 / (2 * 2) = -0.425.
    out, _ = _recipe("dr_grpo", old_logprobs=old_logprobs)
    assert out.loss.item() == pytest.approx(-1.7 / 4, abs=1e-12)


def test_entropy_bonus():
    # grpo with kl_coef 0 and entropy_coef 0.1, H = 2 on every token: the weights sum to 1
    # (seq_mean_token_mean, no empty rows), so loss = -0.25 - 0.1 * 2 = -0.45.
    out, _ = _recipe("grpo", kl_coef=0.0, entropy_coef=0.1, entropy=torch.full_like(MASK, 2.0))
    assert out.loss.item() == pytest.approx(-0.45, abs=1e-12)
    assert out.metrics["entropy"] == pytest.approx(2.0)


def test_a_zero_entropy_coefficient_logs_the_entropy_and_sends_it_no_gradient():
    # The same loss as without the entropy, its metric still logged, and no gradient path to it (so the
    # chunked LM head's backward skips its entropy terms).
    entropy = torch.full_like(MASK, 2.0).requires_grad_()
    out, _ = _recipe("grpo", kl_coef=0.0, entropy_coef=0.0, entropy=entropy)
    assert out.loss.item() == pytest.approx(-0.25, abs=1e-12)
    assert out.metrics["entropy"] == pytest.approx(2.0)
    assert entropy.grad is None


def test_recipe_specs_match_the_formula_sheet():
    grpo, dr_grpo = RECIPE_OBJECTIVES["grpo"], RECIPE_OBJECTIVES["dr_grpo"]
    assert (grpo.advantage, grpo.aggregation, grpo.kl_estimator, grpo.kl_coef) == (
        "grpo", "seq_mean_token_mean", "k3", 0.04)
    assert dict(grpo.policy_params) == {"eps_low": 0.2, "eps_high": 0.2} == dict(dr_grpo.policy_params)
    assert grpo.needs_reference and not dr_grpo.needs_reference
    assert (dr_grpo.advantage, dr_grpo.aggregation) == ("dr_grpo", "seq_mean_token_sum_norm")


def test_resolve_spec_overrides_and_immutability():
    spec = resolve_spec("grpo", eps_high=0.28, kl_coef=0.0)
    assert dict(spec.policy_params) == {"eps_low": 0.2, "eps_high": 0.28} and not spec.needs_reference
    assert RECIPE_OBJECTIVES["grpo"].policy_params["eps_high"] == 0.2       # the table is untouched
    with pytest.raises(TypeError):
        spec.policy_params["eps_low"] = 0.1                                  # read-only mapping
    # A new policy loss drops the recipe's params, which belong to ppo_clip.
    assert dict(resolve_spec("grpo", policy_loss="reinforce").policy_params) == {}


def test_errors_name_the_closest_match():
    with pytest.raises(ValueError, match="did you mean 'grpo'"):
        resolve_spec("grop")
    with pytest.raises(ValueError, match="did you mean 'eps_high'"):
        resolve_spec("grpo", eps_hihg=0.28)
    with pytest.raises(ValueError, match="did you mean 'seq_mean_token_sum'"):
        resolve_spec("grpo", aggregation="seq_mean_token_summ")
    with pytest.raises(ValueError, match="needs ref_logprobs"):
        recipe_loss("grpo", logprobs=LOGPROBS, old_logprobs=LOGPROBS, advantages=SEQ_ADVANTAGES, mask=MASK)
    with pytest.raises(ValueError, match="needs entropy"):
        _recipe("grpo", entropy_coef=0.1)
    with pytest.raises(ValueError, match="advantages must be"):
        recipe_loss("dr_grpo", logprobs=LOGPROBS, old_logprobs=LOGPROBS, advantages=MASK[:, :1], mask=MASK)
