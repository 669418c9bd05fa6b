"""Where verl or OpenRLHF give a name a different meaning than reinforge: the peer's name leads to the
peer's meaning (a hint naming the settings that reproduce it), or to a refusal that says the difference.
Each convention's numbers are derived by hand. float64."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from reinforge.config import build_config
from reinforge.errors import ConfigError
from reinforge.jobs.start import objective_spec
from reinforge.learner.sequences import SequenceBatch
from reinforge.loops.credit import CriticCredit
from reinforge.objectives import RECIPE_OBJECTIVES, loss_weights, objective_loss, resolve_spec
from reinforge.objectives.kl import kl_terms
from reinforge.objectives.policy import POLICY_LOSSES
from reinforge.objectives.token_advantages import masked_whiten

F64 = torch.float64


def _t(values):
    return torch.tensor(values, dtype=F64)


def _refusal(override: str) -> str:
    with pytest.raises(ConfigError) as err:
        build_config([override])
    return str(err.value)


# ---------------------------------------------------------------- GAE whitening


class _ZeroCritic:
    """V = 0 everywhere: GAE's advantages are then the discounted returns, by hand."""

    def values(self, sequences, plan):
        return torch.zeros_like(sequences.completion_mask)


def _gae_advantages(whiten: bool) -> torch.Tensor:
    spec = dataclasses.replace(RECIPE_OBJECTIVES["ppo"], kl_estimator=None, kl_coef=0.0, whiten_advantages=whiten)
    mask = _t([[1, 1, 0], [1, 1, 1], [1, 0, 0]])
    sequences = SequenceBatch(input_ids=torch.zeros(3, 4, dtype=torch.long), attention_mask=torch.ones(3, 4),
                              starts=torch.ones(3, dtype=torch.long),
                              completion_ids=torch.zeros(3, 3, dtype=torch.long), completion_mask=mask)
    credit = CriticCredit(spec, _ZeroCritic(), plan=None, epochs=1, mini_batches=1, grad_clip=1.0)
    # row 2 has no reward (valid False): its tokens must not move the statistics
    result = credit.assign(sequences, _t([1.0, 0.0, 5.0]), torch.tensor([True, True, False]),
                           torch.tensor([0, 0, 1]), None, None, torch.Generator())
    return result.advantages


def test_whiten_advantages_whitens_gae_over_the_valid_tokens_with_bessel():
    # V = 0, gamma 1, lambda 0.95: row 0 (R = 1 on its 2nd token): A = [0.95, 1]; row 1 (R = 0): [0, 0, 0].
    raw = _gae_advantages(False)
    torch.testing.assert_close(raw[:2], _t([[0.95, 1.0, 0.0], [0.0, 0.0, 0.0]]))
    # Over the 5 valid tokens: mean 1.95 / 5 = 0.39; squared deviations 0.56^2 + 0.61^2 + 3 * 0.39^2 = 1.142;
    # verl's unbiased variance 1.142 / 4 = 0.2855.
    std = math.sqrt(1.142 / 4)
    white = _gae_advantages(True)
    torch.testing.assert_close(white[:2], _t([[0.56 / std, 0.61 / std, 0.0], [-0.39 / std] * 3]))
    # The same numbers as the function alone, which OpenRLHF's form (unbiased=False) divides by 5 instead.
    values, valid = _t([[0.95, 1.0, 0.0], [0.0, 0.0, 0.0]]), _t([[1, 1, 0], [1, 1, 1]])
    torch.testing.assert_close(masked_whiten(values, valid, unbiased=False)[0, 0],
                               torch.tensor(0.56 / math.sqrt(1.142 / 5), dtype=F64))


def test_peers_gae_maps_to_whitened_advantages_and_the_group_estimators_refuse_it():
    assert "did you mean 'recipe=ppo objective.whiten_advantages=true'?" in _refusal("algorithm.adv_estimator=gae")
    assert "did you mean 'recipe=ppo objective.whiten_advantages=true'?" in _refusal("advantage_estimator=gae")
    assert objective_spec(build_config(["recipe=ppo", "objective.whiten_advantages=true"])).whiten_advantages
    with pytest.raises(ValueError, match="whiten_advantages whitens a critic's GAE advantages"):
        resolve_spec("grpo", whiten_advantages=True)


# ---------------------------------------------------------------- verl's vanilla loss is dual-clip


def test_verl_vanilla_is_dual_clip_with_c_3():
    hint = "objective.policy_loss=dual_clip objective.policy_params.clip_c=3"
    assert f"did you mean '{hint}'?" in _refusal("actor_rollout_ref.actor.policy_loss.loss_mode=vanilla")
    spec = objective_spec(build_config(["objective.policy_loss=dual_clip", "objective.policy_params.clip_c=3"]))
    # ratio e^2 = 7.389 on a token with A = -1: ppo_clip's min(rA, clip(r)A) = -7.389; dual-clip's
    # max(-7.389, 3 A) = -3, so the loss term is 3 (ppo_clip's would be 7.389).
    terms = POLICY_LOSSES[spec.policy_loss](logprobs=_t([[0.0]]), old_logprobs=_t([[-2.0]]), advantages=_t([[-1.0]]),
                                            mask=_t([[1.0]]), **spec.policy_params)
    torch.testing.assert_close(terms.loss, _t([[3.0]]))


def test_verl_dppo_caps_the_ratio_at_clip_ratio_c():
    assert "objective.policy_loss=dppo_tv objective.policy_params.ratio_cap=3" in _refusal(
        "actor_rollout_ref.actor.policy_loss.loss_mode=dppo_tv")
    # p = 0.5, p_mu = 0.1: ratio 5; A = -1 pushes p down, which the TV mask allows (p rose, not fell).
    # Uncapped: l = -r A = 5, dl/dlogp = 5. Capped at 3: l = 3, dl/dlogp = 3.
    for cap, expected in ((None, 5.0), (3.0, 3.0)):
        logprobs = _t([[math.log(0.5)]]).requires_grad_()
        params = {} if cap is None else {"ratio_cap": cap}
        terms = POLICY_LOSSES["dppo_tv"](logprobs=logprobs, old_logprobs=logprobs.detach(), advantages=_t([[-1.0]]),
                                         mask=_t([[1.0]]), sampler_logprobs=_t([[math.log(0.1)]]), **params)
        terms.loss.sum().backward()
        torch.testing.assert_close(terms.loss.detach(), _t([[expected]]))
        torch.testing.assert_close(logprobs.grad, _t([[expected]]))


# ---------------------------------------------------------------- target KL: per token vs per sequence


def test_verl_target_kl_is_refused_with_the_conversion():
    message = _refusal("algorithm.kl_ctrl.target_kl=0.01")
    assert "did you mean 'train.kl_target'?" in message
    assert "not the same quantity: verl's target is the batch mean of each sequence's mean per-token KL" in message
    assert "target_kl x the mean completion length in tokens" in message


# ---------------------------------------------------------------- KL estimators: clamp, straight-through, abs


def _kl_value_and_grad(name: str, delta: float, clamp: float | None = None) -> tuple[float, float]:
    logprobs = _t([[delta]]).requires_grad_()
    k = kl_terms(name, logprobs, _t([[0.0]]), clamp)
    k.sum().backward()
    return float(k.detach()), float(logprobs.grad)


def test_k3_clamp_at_10_as_verl_and_openrlhf():
    # delta = -3: k3 = e^3 - 1 - 3 = 16.0855, dk3/dlogp = 1 - e^3 = -19.0855. Clamped at 10: 10, no gradient.
    value, grad = _kl_value_and_grad("k3", -3.0)
    assert value == pytest.approx(math.exp(3) - 4) and grad == pytest.approx(1 - math.exp(3))
    assert _kl_value_and_grad("k3", -3.0, clamp=10.0) == (10.0, 0.0)
    # Inside the clamp nothing changes: delta = 0.5, k3 = e^-0.5 - 0.5 = 0.10653
    assert _kl_value_and_grad("k3", 0.5, clamp=10.0) == pytest.approx((math.exp(-0.5) - 0.5, 1 - math.exp(-0.5)))
    assert "did you mean 'objective.kl_estimator=k3 objective.kl_clamp=10'?" in _refusal(
        "actor_rollout_ref.actor.kl_loss_type=low_var_kl")
    spec = objective_spec(build_config(["objective.kl_estimator=k3", "objective.kl_clamp=10"]))
    assert (spec.kl_estimator, spec.kl_clamp) == ("k3", 10.0)
    assert objective_spec(build_config([])).kl_clamp is None          # reinforge's default: no clamp


def test_straight_through_and_abs_estimators():
    # delta = 0.5: k3_st reports k3 = 0.10653 and takes k2's gradient, delta = 0.5; k1_st reports 0.5, gradient 0.5.
    assert _kl_value_and_grad("k3_st", 0.5) == pytest.approx((math.exp(-0.5) - 0.5, 0.5))
    assert _kl_value_and_grad("k1_st", 0.5) == pytest.approx((0.5, 0.5))
    # The clamp bounds the reported value only: delta = -3 gives 10 with k2's gradient -3.
    assert _kl_value_and_grad("k3_st", -3.0, clamp=10.0) == pytest.approx((10.0, -3.0))
    # abs: |delta| with gradient sign(delta)
    assert _kl_value_and_grad("abs", -0.5) == pytest.approx((0.5, -1.0))
    assert "did you mean 'objective.kl_estimator=k3_st objective.kl_clamp=10'?" in _refusal(
        "actor_rollout_ref.actor.kl_loss_type=k3+")
    assert "did you mean 'objective.kl_estimator=abs'?" in _refusal("actor_rollout_ref.actor.kl_loss_type=abs")
    assert "did you mean 'objective.kl_estimator=k1_st'?" in _refusal("algorithm.kl_penalty=k1+")


# ---------------------------------------------------------------- token-sum aggregation


def test_token_sum_is_the_plain_sum_over_every_token():
    assert "did you mean 'objective.aggregation=token_sum'?" in _refusal(
        "actor_rollout_ref.actor.loss_agg_mode=token-sum")
    mask = _t([[1, 1, 0], [1, 0, 0]])
    torch.testing.assert_close(loss_weights("token_sum", mask), mask)
    # reinforce terms l = -A logp: row 0 (A = 1, logp = -1 on two tokens) 1 + 1 = 2; row 1 (A = -2,
    # logp = -0.5 on one token) -1. The sum, with no normaliser: 1.
    spec = resolve_spec("rloo", aggregation="token_sum")
    out = objective_loss(spec, logprobs=_t([[-1.0, -1.0, 0.0], [-0.5, 0.0, 0.0]]), old_logprobs=torch.zeros(2, 3,
                         dtype=F64), advantages=_t([1.0, -2.0]), mask=mask, weights=loss_weights("token_sum", mask))
    assert float(out.loss) == pytest.approx(2.0 - 1.0)


# ---------------------------------------------------------------- advantage names


def test_verl_advantage_names_give_verls_estimators():
    assert "did you mean 'objective.advantage=max_loo'?" in _refusal("algorithm.adv_estimator=grpo_passk")
    assert "did you mean 'recipe=opo'?" in _refusal("algorithm.adv_estimator=opo")
    # GPG: the recipe keeps the paper's alpha, and the hint says so rather than mapping verl's silently.
    message = _refusal("algorithm.adv_estimator=gpg")
    assert "gpg is recipe=gpg, whose alpha is the paper's B / (B - M)" in message
    assert "not verl's B / (samples with a non-zero reward)" in message
