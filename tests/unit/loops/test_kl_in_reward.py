"""The KL placed in the reward (objective.kl_placement=in_reward) with each estimator, by hand.

One batch for every test. delta = old - ref per token, beta = 0.1:

    row 0: delta = [ln 2, -ln 2, (5, padding)], R = 1
    row 1: delta = [1, (5, padding), (5, padding)], R = 0

Per token: k1 = delta; k2 = delta^2 / 2; k3 = exp(-delta) - 1 + delta, so
    k3(ln 2) = 1/2 - 1 + ln 2 = ln 2 - 0.5,   k3(-ln 2) = 2 - 1 - ln 2 = 1 - ln 2,   k3(1) = 1/e.
Per sequence (sum over valid tokens):
    k1: row 0 ln 2 - ln 2 = 0,            row 1 1
    k2: row 0 2 (ln 2)^2 / 2 = (ln 2)^2,  row 1 1/2
    k3: row 0 (ln 2 - 0.5) + (1 - ln 2) = 0.5 exactly,  row 1 1/e
"""

from __future__ import annotations

import math

import pytest
import torch

import reinforge.loops.credit as credit_module
from reinforge.config import build_config
from reinforge.learner import ForwardPlan, build_sequences
from reinforge.learner.critic import Critic
from reinforge.loops.credit import CriticCredit, GroupCredit
from reinforge.models import build_tiny_qwen2
from reinforge.objectives import resolve_spec, shaped_rewards

LN2 = math.log(2.0)
OLD = torch.tensor([[-1.0, -2.0, -1.0], [-0.5, -1.0, -1.0]])
REF = OLD - torch.tensor([[LN2, -LN2, 5.0], [1.0, 5.0, 5.0]])
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
REWARDS = torch.tensor([1.0, 0.0])
BETA = 0.1

# Sequence KL per row (see the module docstring), and the rewards R - beta * KL.
SEQUENCE_KL = {"k1": [0.0, 1.0], "k2": [LN2**2, 0.5], "k3": [0.5, math.exp(-1.0)]}
# Per-token rewards for GAE: -beta k_t on every valid token, R added on the last valid one.
TOKEN_REWARDS = {
    "k1": [[-BETA * LN2, 1 + BETA * LN2, 0.0], [-BETA, 0.0, 0.0]],
    "k2": [[-BETA * LN2**2 / 2, 1 - BETA * LN2**2 / 2, 0.0], [-BETA / 2, 0.0, 0.0]],
    "k3": [[-BETA * (LN2 - 0.5), 1 - BETA * (1 - LN2), 0.0], [-BETA * math.exp(-1.0), 0.0, 0.0]],
}


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_sequence_rewards_use_the_configured_estimator(estimator: str) -> None:
    spec = resolve_spec("grpo", kl_estimator=estimator, kl_placement="in_reward", kl_coef=BETA)
    expected = REWARDS - BETA * torch.tensor(SEQUENCE_KL[estimator])
    torch.testing.assert_close(shaped_rewards(spec, REWARDS, OLD, REF, MASK), expected)
    # k3 row 0 by value: 1 - 0.1 * 0.5 = 0.95; k2 row 1: 0 - 0.1 * 0.5 = -0.05.
    if estimator == "k3":
        assert float(shaped_rewards(spec, REWARDS, OLD, REF, MASK)[0]) == pytest.approx(0.95)
    if estimator == "k2":
        assert float(shaped_rewards(spec, REWARDS, OLD, REF, MASK)[1]) == pytest.approx(-0.05)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_group_credit_reports_the_estimators_sequence_kl(estimator: str) -> None:
    spec = resolve_spec("grpo", kl_estimator=estimator, kl_placement="in_reward", kl_coef=BETA)
    credit = GroupCredit(spec)
    seq = build_sequences([[5, 6], [7]], torch.tensor([[1, 2, 3], [4, 0, 0]]), MASK, pad_id=0)
    credit.assign(seq, REWARDS, torch.tensor([True, True]), torch.tensor([0, 0]), OLD, REF, torch.Generator())
    assert credit.metrics == pytest.approx({"kl_in_reward": sum(SEQUENCE_KL[estimator]) / 2, "kl_coef": BETA})


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_critic_token_rewards_use_the_configured_estimator(micro_overrides, monkeypatch, estimator: str) -> None:
    spec = resolve_spec("ppo", kl_estimator=estimator, kl_coef=BETA)     # ppo: kl_placement=in_reward
    assert spec.kl_placement == "in_reward"
    model = build_tiny_qwen2(build_config(micro_overrides).model, seed=0)
    credit = CriticCredit(spec, Critic(model.model, lr=1e-3), ForwardPlan(micro_batch_size=8), epochs=1,
                          mini_batches=1, grad_clip=1.0)
    monkeypatch.setattr(credit.critic, "values", lambda batch, plan: torch.zeros(2, 3))
    seen = []
    real_gae = credit_module.decoupled_gae
    monkeypatch.setattr(credit_module, "decoupled_gae", lambda token_rewards, *a, **k: seen.append(token_rewards)
                        or real_gae(token_rewards, *a, **k))
    seq = build_sequences([[5, 6], [7]], torch.tensor([[1, 2, 3], [4, 0, 0]]), MASK, pad_id=0)
    credit.assign(seq, REWARDS, torch.tensor([True, True]), torch.tensor([0, 1]), OLD, REF, torch.Generator())
    torch.testing.assert_close(seen[0], torch.tensor(TOKEN_REWARDS[estimator]))
    assert credit._pending[3] == pytest.approx({"kl_in_reward": sum(SEQUENCE_KL[estimator]) / 2, "kl_coef": BETA})
