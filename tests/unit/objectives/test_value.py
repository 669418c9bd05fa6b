"""Critic math: GAE (plain, decoupled, length-adaptive), per-token rewards,
the clipped value loss and its gradient, and VAPO's positive NLL."""

import pytest
import torch

from reinforge.objectives.value import (
    decoupled_gae,
    gae,
    length_adaptive_lambda,
    outcome_token_rewards,
    positive_nll,
    value_loss,
)

# Two sequences, T = 3: row 0 has 3 valid tokens and reward 1, row 1 has 2 and reward 2.
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
REWARDS = torch.tensor([1.0, 2.0])
# The 9.0 sits on padding: it must not enter any result.
VALUES = torch.tensor([[0.5, 0.6, 0.7], [0.2, 0.4, 9.0]])


def token_rewards():
    return outcome_token_rewards(REWARDS, MASK)


def test_outcome_token_rewards_on_the_last_valid_token():
    torch.testing.assert_close(token_rewards(), torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]]))


def test_outcome_token_rewards_with_kl_in_reward():
    # r_t = R [last] - 0.5 kl_t on valid tokens: row 0 [-.05, -.1, 1 - .15]; row 1 [-.2, 2 - .25, 0 (padding)].
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6]], requires_grad=True)
    rewards = outcome_token_rewards(REWARDS, MASK, kl=kl, kl_coef=0.5)
    torch.testing.assert_close(rewards, torch.tensor([[-0.05, -0.1, 0.85], [-0.2, 1.75, 0.0]]))
    assert not rewards.requires_grad       # sg(kl): the penalty is a reward, not a loss


def test_gae_hand_example():
    # gamma = 1, lam = 0.5. Row 0: r = [0, 0, 1], V = [.5, .6, .7], V after EOS = 0:
    #   delta = [0 + .6 - .5, 0 + .7 - .6, 1 + 0 - .7] = [.1, .1, .3];
    #   A2 = .3, A1 = .1 + .5 * .3 = .25, A0 = .1 + .5 * .25 = .225; returns = A + V = [.725, .85, 1].
    # Row 1: r = [0, 2], V = [.2, .4]: delta = [.2, 1.6]; A1 = 1.6, A0 = .2 + .5 * 1.6 = 1; returns [1.2, 2].
    out = gae(token_rewards(), VALUES, MASK, gamma=1.0, lam=0.5)
    torch.testing.assert_close(out.advantages, torch.tensor([[0.225, 0.25, 0.3], [1.0, 1.6, 0.0]]))
    torch.testing.assert_close(out.returns, torch.tensor([[0.725, 0.85, 1.0], [1.2, 2.0, 0.0]]))


def test_gae_hand_example_with_discount():
    # gamma = 0.9, lam = 0.5 (gamma lam = .45), row 0: delta = [.9 * .6 - .5, .9 * .7 - .6, 1 - .7] = [.04, .03, .3];
    # A2 = .3, A1 = .03 + .45 * .3 = .165, A0 = .04 + .45 * .165 = .11425.
    out = gae(token_rewards(), VALUES, MASK, gamma=0.9, lam=0.5)
    torch.testing.assert_close(out.advantages[0], torch.tensor([0.11425, 0.165, 0.3]))


def test_lam_one_gives_reward_to_go_whatever_the_values():
    # gamma = lam = 1: A_t + V_t telescopes to sum_{t' >= t} r_t' (Monte-Carlo return), for any V.
    generator = torch.Generator().manual_seed(0)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]])
    rewards = torch.randn(3, 4, generator=generator) * mask
    values = torch.randn(3, 4, generator=generator)
    reward_to_go = rewards.flip(1).cumsum(1).flip(1) * mask
    torch.testing.assert_close(gae(rewards, values, mask, gamma=1.0, lam=1.0).returns, reward_to_go)


def test_lam_zero_gives_one_step_td():
    # lam = 0: A_t = delta_t, returns_t = r_t + gamma V_{t+1} (0 after the last valid token).
    rewards = outcome_token_rewards(REWARDS, MASK, kl=torch.full((2, 3), 0.1), kl_coef=1.0)
    out = gae(rewards, VALUES, MASK, gamma=0.9, lam=0.0)
    next_values = torch.tensor([[0.6, 0.7, 0.0], [0.4, 0.0, 0.0]])
    torch.testing.assert_close(out.returns, (rewards + 0.9 * next_values) * MASK)
    torch.testing.assert_close(out.advantages, (rewards + 0.9 * next_values - VALUES) * MASK)


def test_per_sequence_lambda():
    # lam = [0.5, 1.0]: each row equals the call with its own scalar lambda.
    out = gae(token_rewards(), VALUES, MASK, lam=torch.tensor([0.5, 1.0]))
    torch.testing.assert_close(out.advantages[0], gae(token_rewards(), VALUES, MASK, lam=0.5).advantages[0])
    torch.testing.assert_close(out.advantages[1], gae(token_rewards(), VALUES, MASK, lam=1.0).advantages[1])


def test_masked_token_inside_a_row_is_skipped():
    # mask [1, 0, 1]: the recursion links token 0 to token 2. r = [0, (5), 1], V = [.5, (9), .7], lam = .5:
    # A2 = 1 - .7 = .3; delta0 = 0 + .7 - .5 = .2; A0 = .2 + .5 * .3 = .35; the masked token gets 0.
    out = gae(torch.tensor([[0.0, 5.0, 1.0]]), torch.tensor([[0.5, 9.0, 0.7]]), torch.tensor([[1, 0, 1]]), lam=0.5)
    torch.testing.assert_close(out.advantages, torch.tensor([[0.35, 0.0, 0.3]]))
    torch.testing.assert_close(out.returns, torch.tensor([[0.85, 0.0, 1.0]]))


def test_empty_rows_are_zero_not_nan():
    mask = torch.tensor([[0, 0, 0], [1, 1, 0]])
    rewards = outcome_token_rewards(torch.tensor([1.0, 2.0]), mask)
    torch.testing.assert_close(rewards, torch.tensor([[0.0, 0.0, 0.0], [0.0, 2.0, 0.0]]))
    out = decoupled_gae(rewards, VALUES, mask, length_adaptive_alpha=0.05)
    for tensor in (out.advantages, out.returns):
        assert torch.isfinite(tensor).all() and (tensor[0] == 0).all()
    values = torch.ones(2, 3, requires_grad=True)
    terms = value_loss(values, torch.zeros(2, 3), torch.zeros(2, 3), mask)
    assert (terms.loss[0] == 0).all() and torch.isfinite(terms.loss).all()
    assert (positive_nll(torch.full((2, 3), -1.0), mask, torch.tensor([True, True]))[0] == 0).all()


def test_gae_outputs_are_detached():
    values = VALUES.clone().requires_grad_(True)
    out = gae(token_rewards(), values, MASK)
    assert not out.advantages.requires_grad and not out.returns.requires_grad


def test_length_adaptive_lambda():
    # alpha = 0.05: alpha l = [0, .5, 1, 5, 50] -> 1 - 1/(alpha l) = [-inf, -1, 0, .8, .98], clamped to [0, 1].
    lam = length_adaptive_lambda(torch.tensor([0, 10, 20, 100, 1000]))
    torch.testing.assert_close(lam, torch.tensor([0.0, 0.0, 0.0, 0.8, 0.98]))


def test_decoupled_gae_uses_lam_critic_for_returns():
    rewards = token_rewards()
    out = decoupled_gae(rewards, VALUES, MASK, lam_actor=0.5, lam_critic=1.0)
    torch.testing.assert_close(out.advantages, gae(rewards, VALUES, MASK, lam=0.5).advantages)
    # lam_critic = 1: value targets are the reward-to-go, [[1, 1, 1], [2, 2, 0]].
    torch.testing.assert_close(out.returns, torch.tensor([[1.0, 1.0, 1.0], [2.0, 2.0, 0.0]]))


def test_decoupled_gae_length_adaptive_actor_lambda():
    # alpha = 0.5, lengths [3, 2]: lam = 1 - 1/1.5 = 1/3 and 1 - 1/1 = 0.
    # Row 0 (delta [.1, .1, .3]): A2 = .3, A1 = .1 + .3/3 = .2, A0 = .1 + .2/3 = .1666667.
    # Row 1 (lam 0, one-step TD): A = delta = [.2, 1.6].
    out = decoupled_gae(token_rewards(), VALUES, MASK, length_adaptive_alpha=0.5)
    torch.testing.assert_close(out.advantages, torch.tensor([[0.1 + 0.2 / 3, 0.2, 0.3], [0.2, 1.6, 0.0]]))
    torch.testing.assert_close(out.returns, gae(token_rewards(), VALUES, MASK, lam=1.0).returns)


# Value loss, clip 0.2, one token per column (the last one masked):
#   a: V 1.0, old .5, R 1.2: V_clip = .7; (V-R)^2 = .04 < (V_clip-R)^2 = .25 -> .125, clipped branch: grad 0
#   b: V 1.0, old .5, R 0.0: (V-R)^2 = 1 > .49 -> .5, grad V - R = 1
#   c: V 0.6, old .5, R 1.0: inside the band, V_clip = V -> .5 * .16 = .08, grad -.4
#   d: V 0.0, old .5, R 1.0: V_clip = .3; 1 > .49 -> .5, grad -1
#   e: V 0.0, old .5, R -.5: V_clip = .3; .25 < .64 -> .32, clipped branch: grad 0
#   f: masked -> 0, grad 0
V = [1.0, 1.0, 0.6, 0.0, 0.0, 5.0]
OLD = torch.tensor([[0.5, 0.5, 0.5, 0.5, 0.5, 0.0]])
RETURNS = torch.tensor([[1.2, 0.0, 1.0, 1.0, -0.5, 0.0]])
LOSS_MASK = torch.tensor([[1, 1, 1, 1, 1, 0]])


def test_clipped_value_loss_hand_values_and_gradient():
    values = torch.tensor([V], requires_grad=True)
    terms = value_loss(values, OLD, RETURNS, LOSS_MASK, clip=0.2)
    torch.testing.assert_close(terms.loss, torch.tensor([[0.125, 0.5, 0.08, 0.5, 0.32, 0.0]]))
    torch.testing.assert_close(terms.clip_frac, torch.tensor([[1.0, 0.0, 0.0, 0.0, 1.0, 0.0]]))
    terms.loss.sum().backward()
    torch.testing.assert_close(values.grad, torch.tensor([[0.0, 1.0, -0.4, -1.0, 0.0, 0.0]]))
    # Zero gradient exactly where the clipped branch is the strict max (clipping active).
    assert torch.equal(values.grad[0, :5] == 0, terms.clip_frac[0, :5] == 1)


def test_unclipped_value_loss_hand_values_and_gradient():
    # 0.5 (V - R)^2 = [.02, .5, .08, .5, .125, 0]; gradient V - R = [-.2, 1, -.4, -1, .5, 0 (masked)].
    values = torch.tensor([V], requires_grad=True)
    terms = value_loss(values, OLD, RETURNS, LOSS_MASK, clip=None)
    torch.testing.assert_close(terms.loss, torch.tensor([[0.02, 0.5, 0.08, 0.5, 0.125, 0.0]]))
    assert not terms.clip_frac.any()
    terms.loss.sum().backward()
    torch.testing.assert_close(values.grad, torch.tensor([[-0.2, 1.0, -0.4, -1.0, 0.5, 0.0]]))
    torch.testing.assert_close(terms.error, torch.tensor([[-0.2, 1.0, -0.4, -1.0, 0.5, 0.0]]))


def test_value_loss_targets_get_no_gradient():
    old = OLD.clone().requires_grad_(True)
    returns = RETURNS.clone().requires_grad_(True)
    values = torch.tensor([V], requires_grad=True)
    value_loss(values, old, returns, LOSS_MASK).loss.sum().backward()
    assert old.grad is None and returns.grad is None


def test_positive_nll():
    # -logp on valid tokens of correct samples: row 0 correct -> [1, 2, 0 (padding)]; row 1 wrong -> 0.
    logprobs = torch.tensor([[-1.0, -2.0, -float("inf")], [-3.0, -4.0, -5.0]], requires_grad=True)
    nll = positive_nll(logprobs, torch.tensor([[1, 1, 0], [1, 1, 1]]), torch.tensor([True, False]))
    torch.testing.assert_close(nll, torch.tensor([[1.0, 2.0, 0.0], [0.0, 0.0, 0.0]]))
    nll.sum().backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-1.0, -1.0, 0.0], [0.0, 0.0, 0.0]]))


@pytest.mark.parametrize("lam", [0.0, 0.95, 1.0])
def test_gae_matches_the_per_token_sum_definition(lam):
    # A_t = sum_l (gamma lam)^l delta_{t+l} over the valid tokens, computed directly (float64).
    generator = torch.Generator().manual_seed(1)
    rewards = torch.randn(2, 5, generator=generator, dtype=torch.float64)
    values = torch.randn(2, 5, generator=generator, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    out = gae(rewards, values, mask, gamma=0.9, lam=lam)
    for i in range(2):
        n = int(mask[i].sum())
        v = torch.cat([values[i, :n], values.new_zeros(1)])
        delta = rewards[i, :n] + 0.9 * v[1:] - v[:-1]
        expected = [sum((0.9 * lam) ** k * delta[t + k] for k in range(n - t)) for t in range(n)]
        torch.testing.assert_close(out.advantages[i, :n], torch.stack(expected))
