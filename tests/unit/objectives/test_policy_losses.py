"""Policy objectives beyond ppo_clip / reinforce: hand-derived values and gradients, and the
identities of ALGORITHMS.md ("Identities a test can check"). All in float64.

Conventions: r is a ratio, A an advantage, "grad" is d(loss)/d(logprobs) where loss = -J.
Token-level objectives are checked per token (loss.sum() has the per-token gradient);
sequence-level ones after seq_mean_token_mean aggregation, weights w_it = 1 / (N |y_i|).
"""

import math
from pathlib import Path

import pytest
import torch
from repo_paths import TESTS

from reinforge.objectives.aggregation import loss_weights
from reinforge.objectives.policy import POLICY_LOSSES

F64 = torch.float64


def _t(values):
    return torch.tensor(values, dtype=F64)


def _sigmoid(x):
    return 1.0 / (1.0 + math.exp(-x))


def _call(name, logprobs, advantages, *, old_logprobs=None, mask=None, sampler_logprobs=None, **params):
    """POLICY_LOSSES[name] on [N, T] inputs; returns (terms, logprobs leaf that requires grad)."""
    logprobs = logprobs.detach().clone().requires_grad_()
    old_logprobs = logprobs.detach() if old_logprobs is None else old_logprobs
    mask = torch.ones_like(old_logprobs) if mask is None else mask
    if name.startswith("dppo_topk") and sampler_logprobs is not None:
        # K = 1, the sampled token: the binary approximation (tests/unit/objectives/test_cov_and_topk.py checks K > 1)
        params = {"top_logprobs": logprobs.detach().unsqueeze(-1),
                  "sampler_top_logprobs": sampler_logprobs.unsqueeze(-1), **params}
    terms = POLICY_LOSSES[name](logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages,
                                mask=mask, sampler_logprobs=sampler_logprobs, **params)
    return terms, logprobs


def _token_grad(terms, logprobs):
    """Per-token gradient of a token-level objective: terms are independent per token."""
    terms.loss.sum().backward()
    return logprobs.grad


def _aggregated(terms, logprobs, mask):
    """(loss, grad) after seq_mean_token_mean aggregation."""
    loss = (loss_weights("seq_mean_token_mean", mask) * terms.loss).sum()
    loss.backward()
    return loss, logprobs.grad


def _ratios(ratios, old=-1.0):
    """(logprobs, old_logprobs) [1, T] with exp(logprobs - old_logprobs) = ratios."""
    old_logprobs = torch.full((1, len(ratios)), old, dtype=F64)
    return old_logprobs + torch.log(_t([ratios])), old_logprobs


# ---------------------------------------------------------------- dual_clip

# eps 0.2 (band [0.8, 1.2]), c = 3. J_ppo = min(r A, clip(r) A); for A < 0, J = max(J_ppo, 3 A).
#   r    A    J_ppo                  3 A   J      loss   grad = d(-J)/dlogp        flag
#   4   -1    min(-4, -1.2) = -4     -3    -3     3      0 (c A bound active)      dual_clip
#   2   -1    min(-2, -1.2) = -2     -3    -2     2      -r A = 2                  -
#   4   +1    min(4, 1.2) = 1.2      -     1.2   -1.2    0                         clip_high
#   0.5 -2    min(-1, -1.6) = -1.6   -6    -1.6   1.6    0                         clip_low
#   1   -3    -3                     -9    -3     3      3                         -
def test_dual_clip_hand_values_and_gradients():
    logprobs, old_logprobs = _ratios([4.0, 2.0, 4.0, 0.5, 1.0])
    terms, logprobs = _call("dual_clip", logprobs, _t([[-1.0, -1.0, 1.0, -2.0, -3.0]]), old_logprobs=old_logprobs)
    grad = _token_grad(terms, logprobs)
    torch.testing.assert_close(terms.loss, _t([[3.0, 2.0, -1.2, 1.6, 3.0]]))
    torch.testing.assert_close(grad, _t([[0.0, 2.0, 0.0, 0.0, 3.0]]))
    torch.testing.assert_close(terms.metrics["dual_clip_frac"], _t([[1.0, 0, 0, 0, 0]]))
    torch.testing.assert_close(terms.metrics["clip_frac_high"], _t([[0, 0, 1.0, 0, 0]]))
    torch.testing.assert_close(terms.metrics["clip_frac_low"], _t([[0, 0, 0, 1.0, 0]]))
    torch.testing.assert_close(terms.metrics["clip_frac"], _t([[0, 0, 1.0, 1.0, 0]]))
    torch.testing.assert_close(terms.metrics["ratio"], _t([[4.0, 2.0, 4.0, 0.5, 1.0]]))
    with pytest.raises(ValueError, match="clip_c > 1"):
        _call("dual_clip", logprobs, _t([[1.0] * 5]), clip_c=1.0)


def test_dual_clip_gradient_zero_exactly_where_a_bound_is_active():
    # Every region: r below / inside / above the band and beyond c, both signs of A.
    ratios = [0.3, 0.7, 0.9, 1.0, 1.1, 1.3, 2.5, 3.5, 10.0]
    logprobs, old_logprobs = _ratios(ratios * 2)
    advantages = _t([[1.5] * len(ratios) + [-0.5] * len(ratios)])
    terms, logprobs = _call("dual_clip", logprobs, advantages, old_logprobs=old_logprobs)
    grad = _token_grad(terms, logprobs)[0]
    active = (terms.metrics["clip_frac"] + terms.metrics["dual_clip_frac"])[0] > 0
    # A = +1.5: clipped above 1.2 (r = 1.3, 2.5, 3.5, 10); A = -0.5: clipped below 0.8 (r = 0.3,
    # 0.7) and dual-clipped where r A < 3 A, i.e. r > 3 (r = 3.5, 10).
    assert active.sum() == 4 + 2 + 2
    assert torch.all(grad[active] == 0) and torch.all(grad[~active] != 0)


# ---------------------------------------------------------------- cispo

# r_max = 5; J = sg(min(r, 5)) A logp, so loss = -w A logp and grad = -w A.
#   logp  r    A    w     J                      loss   grad   r > r_max
#   -1    1    2    1     1 * 2 * -1 = -2        2      -2     0
#   -2    2   -1    2     2 * -1 * -2 = 4       -4       2     0
#   -0.5  8    1    5     5 * 1 * -0.5 = -2.5    2.5    -5     1
#   -3    0.1  1    0.1   0.1 * 1 * -3 = -0.3    0.3    -0.1   0   (no lower bound)
def test_cispo_hand_values_and_gradients():
    logprobs = _t([[-1.0, -2.0, -0.5, -3.0]])
    old_logprobs = logprobs - torch.log(_t([[1.0, 2.0, 8.0, 0.1]]))
    terms, logprobs = _call("cispo", logprobs, _t([[2.0, -1.0, 1.0, 1.0]]), old_logprobs=old_logprobs)
    grad = _token_grad(terms, logprobs)
    torch.testing.assert_close(terms.loss, _t([[2.0, -4.0, 2.5, 0.3]]))
    torch.testing.assert_close(grad, _t([[-2.0, 2.0, -5.0, -0.1]]))
    torch.testing.assert_close(terms.metrics["clip_frac_high"], _t([[0, 0, 1.0, 0]]))
    torch.testing.assert_close(terms.metrics["clip_frac"], _t([[0, 0, 1.0, 0]]))
    torch.testing.assert_close(terms.metrics["ratio"], _t([[1.0, 2.0, 8.0, 0.1]]))


def test_cispo_gradient_equals_ppo_clip_inside_the_band():
    # Inside [0.8, 1.2] ppo_clip's gradient is r A, and cispo's is min(r, 5) A = r A.
    gen = torch.Generator().manual_seed(0)
    ratios = 0.85 + 0.3 * torch.rand(3, 7, generator=gen, dtype=F64)
    advantages = torch.randn(3, 7, generator=gen, dtype=F64)
    old_logprobs = -torch.rand(3, 7, generator=gen, dtype=F64) * 3
    grads = {}
    for name in ("cispo", "ppo_clip"):
        terms, logprobs = _call(name, old_logprobs + ratios.log(), advantages, old_logprobs=old_logprobs)
        grads[name] = _token_grad(terms, logprobs)
    torch.testing.assert_close(grads["cispo"], grads["ppo_clip"])


def test_cispo_keeps_the_gradient_of_tokens_ppo_clip_clips():
    # r = 1.5 with A = +1 and r = 0.5 with A = -1 leave PPO's band in the direction of A:
    # ppo_clip's gradient is 0 there, cispo's is -min(r, 5) A = -1.5 and +0.5.
    old_logprobs = _t([[-1.0, -1.0]])
    logprobs = old_logprobs + torch.log(_t([[1.5, 0.5]]))
    advantages = _t([[1.0, -1.0]])
    grads = {}
    for name in ("ppo_clip", "cispo"):
        terms, leaf = _call(name, logprobs, advantages, old_logprobs=old_logprobs)
        grads[name] = _token_grad(terms, leaf)
    torch.testing.assert_close(grads["ppo_clip"], _t([[0.0, 0.0]]))
    torch.testing.assert_close(grads["cispo"], _t([[-1.5, 0.5]]))


# ---------------------------------------------------------------- sapo

# f(r) = sigmoid(tau (r - 1)) 4 / tau, tau = 1 for A > 0, 1.05 for A < 0; J = f(r) A.
# grad = d(-J)/dlogp = -f'(r) r A, f'(r) = 4 s (1 - s), s = sigmoid(tau (r - 1)).
#   r    A   tau   s                          J = 4 s A / tau        f'(r)     grad
#   1    2   1     0.5                        4                      1         -2
#   2    1   1     sigmoid(1) = 0.7310586     2.9242343              0.7864477 -1.5728955
#   0.5 -1   1.05  sigmoid(-0.525) = 0.3716838 -1.4159383            0.9341398 +0.4670699
def test_sapo_hand_values_and_gradients():
    logprobs, old_logprobs = _ratios([1.0, 2.0, 0.5])
    terms, logprobs = _call("sapo", logprobs, _t([[2.0, 1.0, -1.0]]), old_logprobs=old_logprobs)
    grad = _token_grad(terms, logprobs)
    s1, s2 = _sigmoid(1.0), _sigmoid(-0.525)
    torch.testing.assert_close(terms.loss, _t([[-4.0, -4 * s1, 4 * s2 / 1.05]]))
    gate = [1.0, 4 * s1 * (1 - s1), 4 * s2 * (1 - s2)]
    torch.testing.assert_close(grad, _t([[-2.0, -gate[1] * 2.0, gate[2] * 0.5]]))
    torch.testing.assert_close(terms.metrics["soft_gate"], _t([gate]))
    torch.testing.assert_close(terms.metrics["ratio"], _t([[1.0, 2.0, 0.5]]))


def test_sapo_gradient_is_never_zero_and_one_at_theta_old():
    # f'(1) = 4 * 0.5 * 0.5 = 1; far outside any band (r = 0.05 or 20) the gate is small, not 0.
    ratios = [0.05, 0.3, 0.8, 1.0, 1.2, 3.0, 10.0, 20.0]
    logprobs, old_logprobs = _ratios(ratios * 2)
    advantages = _t([[1.0] * len(ratios) + [-1.0] * len(ratios)])
    terms, logprobs = _call("sapo", logprobs, advantages, old_logprobs=old_logprobs)
    grad = _token_grad(terms, logprobs)[0]
    assert torch.all(grad != 0)
    torch.testing.assert_close(grad[[3, 11]], _t([-1.0, 1.0]))          # r = 1: -A
    torch.testing.assert_close(terms.metrics["soft_gate"][0, [3, 11]], _t([1.0, 1.0]))


# ---------------------------------------------------------------- dppo

# dppo_tv, delta = 0.15, ratio p / p_mu against the sampler; masked (m = 0) when the move is
# beyond delta in the direction A pushes: A > 0 and p - p_mu > 0.15, A < 0 and p_mu - p > 0.15.
#   p     p_mu  A    |p - p_mu|  m   J = m (p / p_mu) A    loss     grad = -m (p / p_mu) A
#   0.5   0.3   +1   0.2         0   0                     0        0        (too far up)
#   0.5   0.3   -1   0.2         1   -5/3                  5/3      5/3      (safe side)
#   0.1   0.4   -1   0.3         0   0                     0        0        (too far down)
#   0.1   0.2   -2   0.1         1   -1                    1        1
#   0.9   0.8   +3   0.1         1   3.375                 -3.375   -3.375
#   0.05  0.5   +1   0.45        1   0.1                   -0.1     -0.1     (safe side)
DPPO_P = [0.5, 0.5, 0.1, 0.1, 0.9, 0.05]
DPPO_P_MU = [0.3, 0.3, 0.4, 0.2, 0.8, 0.5]
DPPO_A = [1.0, -1.0, -1.0, -2.0, 3.0, 1.0]


def test_dppo_tv_masks_exactly_the_hand_chosen_tokens():
    logprobs, sampler = torch.log(_t([DPPO_P])), torch.log(_t([DPPO_P_MU]))
    # old_logprobs play no part: the ratio is anchored on the sampler.
    terms, logprobs = _call("dppo_tv", logprobs, _t([DPPO_A]), old_logprobs=logprobs - 0.7,
                            sampler_logprobs=sampler)
    grad = _token_grad(terms, logprobs)
    torch.testing.assert_close(terms.loss, _t([[0.0, 5 / 3, 0.0, 1.0, -3.375, -0.1]]))
    torch.testing.assert_close(grad, _t([[0.0, 5 / 3, 0.0, 1.0, -3.375, -0.1]]))
    torch.testing.assert_close(terms.metrics["clip_frac_high"], _t([[1.0, 0, 0, 0, 0, 0]]))
    torch.testing.assert_close(terms.metrics["clip_frac_low"], _t([[0, 0, 1.0, 0, 0, 0]]))
    torch.testing.assert_close(terms.metrics["clip_frac"], _t([[1.0, 0, 1.0, 0, 0, 0]]))
    torch.testing.assert_close(terms.metrics["ratio"], _t([[5 / 3, 5 / 3, 0.25, 0.5, 1.125, 0.1]]))
    torch.testing.assert_close(terms.metrics["tv"], _t([[0.2, 0.2, 0.3, 0.1, 0.1, 0.45]]))


# dppo_kl, delta = 0.05: D = p_mu ln(p_mu / p) + (1 - p_mu) ln((1 - p_mu) / (1 - p)).
#   p_mu  p     A    D                                            unsafe?  m   loss    grad
#   0.5   0.8   +1   0.5 ln(0.625) + 0.5 ln(2.5) = 0.2231436      up, A>0  0   0       0
#   0.5   0.8   -1   0.2231436                                    no       1   1.6     1.6
#   0.5   0.55  +1   0.5 ln(0.5/0.55) + 0.5 ln(0.5/0.45) = 0.0050252 (< delta) 1  -1.1  -1.1
#   0.3   0.1   -1   0.3 ln 3 + 0.7 ln(0.7/0.9) = 0.1536636       down, A<0 0  0       0
#   1     0.5   +1   p_mu clamped to 1 - 1e-12: ~ ln 2            no       1   -0.5    -0.5
#   0.5   1     +1   p clamped to 1 - 1e-12: ~ 0.5 ln(0.5e12) = 13.12 up, A>0  0  0     0
#   0.5   0     -1   p clamped to 1e-12: ~ 13.12                  down, A<0 0  0       0
def test_dppo_kl_hand_values_gradients_and_edge_probabilities():
    p_mu = _t([[0.5, 0.5, 0.5, 0.3, 1.0, 0.5, 0.5]])
    logprobs = torch.log(_t([[0.8, 0.8, 0.55, 0.1, 0.5, 1.0, 0.5]]))
    logprobs[0, 6] = -800.0                              # p = exp(-800) = 0 in float64
    terms, logprobs = _call("dppo_kl", logprobs, _t([[1.0, -1.0, 1.0, -1.0, 1.0, 1.0, -1.0]]),
                            sampler_logprobs=torch.log(p_mu))
    grad = _token_grad(terms, logprobs)
    torch.testing.assert_close(terms.loss, _t([[0.0, 1.6, -1.1, 0.0, -0.5, 0.0, 0.0]]))
    torch.testing.assert_close(grad, _t([[0.0, 1.6, -1.1, 0.0, -0.5, 0.0, 0.0]]))
    torch.testing.assert_close(terms.metrics["clip_frac_high"], _t([[1.0, 0, 0, 0, 0, 1.0, 0]]))
    torch.testing.assert_close(terms.metrics["clip_frac_low"], _t([[0, 0, 0, 1.0, 0, 0, 1.0]]))
    kl = terms.metrics["binary_kl"][0]
    torch.testing.assert_close(kl[:4], _t([0.5 * math.log(1.5625)] * 2 + [0.5 * math.log(0.25 / 0.2475),
                                          0.3 * math.log(3) + 0.7 * math.log(0.7 / 0.9)]))
    torch.testing.assert_close(kl[4], _t(math.log(2)), atol=1e-10, rtol=0)
    assert torch.all(kl[5:] > 13) and torch.all(torch.isfinite(kl))
    assert all(torch.isfinite(value).all() for value in terms.metrics.values())


@pytest.mark.parametrize("name", ["dppo_tv", "dppo_kl", "decoupled_ppo", "dppo_topk_tv", "dppo_topk_kl"])
def test_sampler_logprobs_are_required(name):
    with pytest.raises(ValueError, match=f"{name}.*needs sampler_logprobs"):
        _call(name, _t([[-1.0]]), _t([[1.0]]))


# ---------------------------------------------------------------- decoupled_ppo

# eps 0.2, w_max 5; u = exp(logp - prox), w = exp(prox - mu) (detached); J = w min(u A, clip(u) A),
# 0 where w > 5. grad = -w u A on unclipped tokens.
#   u    w    A    min(u A, clip(u) A)        J      loss   grad   flag
#   1.1  2    +1   1.1                        2.2    -2.2   -2.2   -
#   1.5  0.5  +2   min(3, 2.4) = 2.4          1.2    -1.2   0      clip_high
#   1.0  8    +1   (w > 5: masked)            0      0      0      behav_masked
#   0.5  1    -1   min(-0.5, -0.8) = -0.8     -0.8   0.8    0      clip_low
#   0.9  4    -1   -0.9                       -3.6   3.6    3.6    -
def test_decoupled_ppo_hand_values_and_gradients():
    logprobs, prox = _ratios([1.1, 1.5, 1.0, 0.5, 0.9])
    behav_weight = [2.0, 0.5, 8.0, 1.0, 4.0]
    sampler = prox - torch.log(_t([behav_weight]))
    terms, logprobs = _call("decoupled_ppo", logprobs, _t([[1.0, 2.0, 1.0, -1.0, -1.0]]),
                            old_logprobs=prox, sampler_logprobs=sampler)
    grad = _token_grad(terms, logprobs)
    torch.testing.assert_close(terms.loss, _t([[-2.2, -1.2, 0.0, 0.8, 3.6]]))
    torch.testing.assert_close(grad, _t([[-2.2, 0.0, 0.0, 0.0, 3.6]]))
    torch.testing.assert_close(terms.metrics["clip_frac_high"], _t([[0, 1.0, 0, 0, 0]]))
    torch.testing.assert_close(terms.metrics["clip_frac_low"], _t([[0, 0, 0, 1.0, 0]]))
    torch.testing.assert_close(terms.metrics["behav_masked_frac"], _t([[0, 0, 1.0, 0, 0]]))
    torch.testing.assert_close(terms.metrics["behav_weight"], _t([behav_weight]))
    torch.testing.assert_close(terms.metrics["ratio"], _t([[1.1, 1.5, 1.0, 0.5, 0.9]]))


def test_decoupled_ppo_with_sampler_equal_to_prox_is_ppo_clip():
    gen = torch.Generator().manual_seed(1)
    old_logprobs = -torch.rand(4, 6, generator=gen, dtype=F64) * 4
    logprobs = old_logprobs + 0.5 * torch.randn(4, 6, generator=gen, dtype=F64)   # many clipped
    advantages = torch.randn(4, 6, generator=gen, dtype=F64)
    decoupled, lp_d = _call("decoupled_ppo", logprobs, advantages, old_logprobs=old_logprobs,
                            sampler_logprobs=old_logprobs, eps=0.2)
    ppo, lp_p = _call("ppo_clip", logprobs, advantages, old_logprobs=old_logprobs)
    torch.testing.assert_close(decoupled.loss, ppo.loss)
    torch.testing.assert_close(_token_grad(decoupled, lp_d), _token_grad(ppo, lp_p))
    assert ppo.metrics["clip_frac"].sum() > 0
    for key in ("clip_frac_low", "clip_frac_high", "clip_frac", "ratio"):
        torch.testing.assert_close(decoupled.metrics[key], ppo.metrics[key])


# ---------------------------------------------------------------- gpg

def test_gpg_is_advantage_times_logprob():
    # J = A logp: logp = [-0.5, -2], A = [2, -1] -> loss = [1, -2]; grad = -A = [-2, 1].
    terms, logprobs = _call("gpg", _t([[-0.5, -2.0]]), _t([[2.0, -1.0]]))
    torch.testing.assert_close(terms.loss, _t([[1.0, -2.0]]))
    torch.testing.assert_close(_token_grad(terms, logprobs), _t([[-2.0, 1.0]]))


# ---------------------------------------------------------------- gspo / gspo_token

# eps 0.2 / 0.2 for a readable example. Three rows (N = 3), T = 3; rows 0 and 1 have 2 tokens.
#   row  d = logp - old     s = exp(mean d)      A    J = min(s A, clip(s) A)          clipped
#   0    [ln 2, 0]          sqrt 2 = 1.4142136   +1   1.2                              high
#   1    [0.1, -0.3]        e^-0.1 = 0.9048374   -1   -0.9048374 (inside)              -
#   2    [0.3, 0.3, 0.3]    e^0.3 = 1.3498588    -2   min(-2.6997, -2.4) = -2.6997176  - (A < 0)
# Terms -J_i at each valid token. seq_mean_token_mean (w = 1 / (3 |y_i|)): loss = -(1/3) sum J_i
#   = -(1.2 - 0.9048374 - 2.6997176) / 3 = 0.8015183.
# Gradient: dJ_i/dlogp_it = s_i A_i / |y_i| where unclipped; aggregated grad = -(1/3) of it:
#   row 0: 0; row 1: e^-0.1 / 6 = 0.1508062; row 2: 2 e^0.3 / 9 = 0.2999686.
GSPO_MASK = _t([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
GSPO_OLD = _t([[-1.0, -2.0, 0.0], [-0.5, -1.5, 0.0], [-3.0, -1.0, -2.0]])
GSPO_LOGPROBS = GSPO_OLD + _t([[math.log(2), 0.0, 0.0], [0.1, -0.3, 0.0], [0.3, 0.3, 0.3]])
GSPO_A = _t([[1.0] * 3, [-1.0] * 3, [-2.0] * 3])


@pytest.mark.parametrize("name", ["gspo", "gspo_token"])
def test_gspo_hand_values_and_gradients(name):
    terms, logprobs = _call(name, GSPO_LOGPROBS, GSPO_A, old_logprobs=GSPO_OLD, mask=GSPO_MASK,
                            eps_low=0.2, eps_high=0.2)
    loss, grad = _aggregated(terms, logprobs, GSPO_MASK)
    s1, s2 = math.exp(-0.1), math.exp(0.3)
    torch.testing.assert_close(terms.loss, _t([[-1.2, -1.2, 0.0], [s1, s1, 0.0], [2 * s2] * 3]))
    assert loss.item() == pytest.approx(-(1.2 - s1 - 2 * s2) / 3, abs=1e-12)
    torch.testing.assert_close(grad, _t([[0.0, 0.0, 0.0], [s1 / 6, s1 / 6, 0.0], [2 * s2 / 9] * 3]))
    torch.testing.assert_close(terms.metrics["ratio"], _t([[math.sqrt(2)] * 2 + [0.0], [s1, s1, 0.0], [s2] * 3]))
    torch.testing.assert_close(terms.metrics["clip_frac_high"], _t([[1.0, 1.0, 0], [0, 0, 0], [0, 0, 0]]))
    torch.testing.assert_close(terms.metrics["clip_frac"], terms.metrics["clip_frac_high"])


def test_gspo_default_band_is_tiny():
    # Defaults 3e-4 / 4e-4: d = [1e-3, 0] gives s = e^5e-4 = 1.000500 > 1.0004, clipped for A = 1:
    # J = 1.0004; d = [-1e-3, 0] gives s = e^-5e-4 = 0.9995 < 0.9997, clipped for A = -1: J = -0.9997.
    logprobs = _t([[1e-3, 0.0], [-1e-3, 0.0]]) - 1.0
    terms, _ = _call("gspo", logprobs, _t([[1.0, 1.0], [-1.0, -1.0]]), old_logprobs=torch.full((2, 2), -1.0, dtype=F64))
    torch.testing.assert_close(terms.loss, _t([[-1.0004, -1.0004], [0.9997, 0.9997]]))
    torch.testing.assert_close(terms.metrics["clip_frac"], torch.ones(2, 2, dtype=F64))


@pytest.mark.parametrize("eps", [3e-4, 0.2])
def test_gspo_token_equals_gspo_for_constant_in_sequence_advantages(eps):
    gen = torch.Generator().manual_seed(2)
    mask = (torch.rand(6, 5, generator=gen) < 0.8).to(F64)
    mask[:, 0] = 1.0
    old_logprobs = -torch.rand(6, 5, generator=gen, dtype=F64) * 3
    logprobs = old_logprobs + 0.8 * torch.randn(6, 5, generator=gen, dtype=F64)
    advantages = torch.randn(6, 1, generator=gen, dtype=F64).expand(6, 5)
    out = {}
    for name in ("gspo", "gspo_token"):
        terms, lp = _call(name, logprobs, advantages, old_logprobs=old_logprobs, mask=mask,
                          eps_low=eps, eps_high=eps)
        out[name] = (terms, *_aggregated(terms, lp, mask))
    (seq, seq_loss, seq_grad), (tok, tok_loss, tok_grad) = out["gspo"], out["gspo_token"]
    torch.testing.assert_close(tok_loss, seq_loss)
    torch.testing.assert_close(tok_grad, seq_grad)
    torch.testing.assert_close(tok.loss, seq.loss)
    for key in ("clip_frac", "ratio"):
        torch.testing.assert_close(tok.metrics[key], seq.metrics[key])
    assert 0 < seq.metrics["clip_frac"].sum() < mask.sum()       # both clipped and unclipped rows


# ---------------------------------------------------------------- gmpo

# eps = 0.4. d* clips d only in the direction of sgn(A): above 0.4 for A > 0, below -0.4 for A < 0.
#   row  A    d                  d*                 mean d*   J = A exp(mean d*)     clip_frac
#   0    +1   [0.6, -0.6, 0.2]   [0.4, -0.6, 0.2]   0         1                      [1, 0, 0]
#   1    -2   [0.6, -0.6, pad]   [0.6, -0.4]        0.1       -2 e^0.1 = -2.2103418  [0, 1, 0]
# dJ_i/dlogp_it = A_i exp(mean d*) / |y_i| where d_t is not clipped: row 0 [0, 1/3, 1/3],
# row 1 [-e^0.1, 0] (= -2 e^0.1 / 2). Aggregated (N = 2): loss = (-1 + 2 e^0.1) / 2 = 0.6051709,
# grad = -(1/2) dJ: row 0 [0, -1/6, -1/6], row 1 [e^0.1 / 2 = 0.5525855, 0, 0].
# ratio metric: the unclipped geometric mean, exp(0.2 / 3) = 1.0689391 and exp(0) = 1.
def test_gmpo_hand_values_and_gradients():
    mask = _t([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    old_logprobs = _t([[-1.0, -1.0, -2.0], [-1.5, -1.0, 0.0]])
    logprobs = old_logprobs + _t([[0.6, -0.6, 0.2], [0.6, -0.6, 0.0]])
    terms, logprobs = _call("gmpo", logprobs, _t([[1.0] * 3, [-2.0] * 3]), old_logprobs=old_logprobs, mask=mask)
    loss, grad = _aggregated(terms, logprobs, mask)
    e = math.exp(0.1)
    torch.testing.assert_close(terms.loss, _t([[-1.0, -1.0, -1.0], [2 * e, 2 * e, 0.0]]))
    assert loss.item() == pytest.approx((-1 + 2 * e) / 2, abs=1e-12)
    torch.testing.assert_close(grad, _t([[0.0, -1 / 6, -1 / 6], [e / 2, 0.0, 0.0]]))
    torch.testing.assert_close(terms.metrics["clip_frac"], _t([[1.0, 0, 0], [0, 1.0, 0]]))
    torch.testing.assert_close(terms.metrics["ratio"], _t([[math.exp(0.2 / 3)] * 3, [1.0, 1.0, 0.0]]))


def test_gmpo_inside_the_band_is_advantage_times_geometric_mean_ratio():
    gen = torch.Generator().manual_seed(3)
    old_logprobs = -torch.rand(4, 5, generator=gen, dtype=F64) * 3
    d = 0.7 * (torch.rand(4, 5, generator=gen, dtype=F64) - 0.5)                # |d| < 0.35 < eps
    mask = _t([[1] * 5, [1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 0]])
    advantages = _t([[0.5], [-1.5], [2.0], [-0.3]]).expand(4, 5)
    terms, _ = _call("gmpo", old_logprobs + d, advantages, old_logprobs=old_logprobs, mask=mask)
    geometric_mean = torch.exp((d * mask).sum(1) / mask.sum(1))                 # [N]
    expected = -advantages[:, 0] * geometric_mean                                # -J_i
    torch.testing.assert_close(terms.loss, expected.unsqueeze(1) * mask)
    assert terms.metrics["clip_frac"].sum() == 0


# ---------------------------------------------------------------- identities for every objective

@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_gradient_at_theta_old_is_advantage(name):
    # At theta = theta_old (= sampler): r = 1 inside every band and trust region, so each
    # objective's gradient is A grad logp. After seq_mean_token_mean aggregation the gradient is
    # -A_it w_it for token- and sequence-level objectives alike (for gspo / gmpo:
    # dJ_i/dlogp_it = A_i / |y_i| and the row's weight sums to 1 / N).
    gen = torch.Generator().manual_seed(4)
    mask = _t([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0]])
    logprobs = -torch.rand(3, 4, generator=gen, dtype=F64) * 3
    advantages = _t([[1.3], [-0.7], [0.4]]).expand(3, 4)
    terms, logprobs = _call(name, logprobs, advantages, mask=mask, sampler_logprobs=logprobs)
    _, grad = _aggregated(terms, logprobs, mask)
    # Clip-Cov takes its selected tokens (here 1 of 9) out of the gradient by design (arXiv 2505.22617).
    kept = 1.0 - terms.metrics.get("cov_clip_frac", torch.zeros_like(mask))
    torch.testing.assert_close(grad, -advantages * loss_weights("seq_mean_token_mean", mask) * kept)


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_masked_tokens_have_zero_loss_zero_grad_and_finite_values(name):
    # Padding holds garbage log-probs (-1e9); valid tokens have extreme ratios (log r = +-50,
    # beyond the +-20 clamp). Everything stays finite, padding gets exactly 0.
    mask = _t([[1, 1, 0], [1, 0, 0]])
    old_logprobs = _t([[-60.0, -1.0, 0.0], [-2.0, 0.0, -1e9]])
    logprobs = _t([[-10.0, -51.0, -1e9], [-1.0, -1e9, -1e9]])
    sampler_logprobs = _t([[-30.0, -0.5, -1e9], [-1.5, 0.0, 0.0]])
    terms, logprobs = _call(name, logprobs, _t([[1.0, -1.0, 5.0], [-2.0, 3.0, 1.0]]),
                            old_logprobs=old_logprobs, mask=mask, sampler_logprobs=sampler_logprobs)
    _, grad = _aggregated(terms, logprobs, mask)
    padding = mask == 0
    assert torch.isfinite(terms.loss).all() and torch.isfinite(grad).all()
    assert torch.all(terms.loss[padding] == 0) and torch.all(grad[padding] == 0)
    for key, values in terms.metrics.items():
        assert torch.isfinite(values).all(), key
        assert torch.all(values[padding] == 0), key
        assert not values.requires_grad, key


# ---------------------------------------------------------------- coverage

# Every registered objective -> the test that checks its hand-derived values and gradients.
HAND_VALUE_TESTS = {
    "ppo_clip": "test_objectives.py::test_ppo_clip_hand_values_and_gradients",
    "reinforce": "test_objectives.py::test_reinforce_is_advantage_times_logprob",
    "dual_clip": "test_dual_clip_hand_values_and_gradients",
    "cispo": "test_cispo_hand_values_and_gradients",
    "sapo": "test_sapo_hand_values_and_gradients",
    "dppo_tv": "test_dppo_tv_masks_exactly_the_hand_chosen_tokens",
    "dppo_kl": "test_dppo_kl_hand_values_gradients_and_edge_probabilities",
    "decoupled_ppo": "test_decoupled_ppo_hand_values_and_gradients",
    "gpg": "test_gpg_is_advantage_times_logprob",
    "gspo": "test_gspo_hand_values_and_gradients",
    "gspo_token": "test_gspo_hand_values_and_gradients",
    "gmpo": "test_gmpo_hand_values_and_gradients",
    "clip_cov": "test_cov_and_topk.py::test_clip_cov_hand_values_and_gradients",
    "kl_cov": "test_cov_and_topk.py::test_kl_cov_hand_values_and_gradients",
    "dppo_topk_tv": "test_cov_and_topk.py::test_dppo_topk_tv_hand_values_and_gradients",
    "dppo_topk_kl": "test_cov_and_topk.py::test_dppo_topk_kl_hand_values_and_gradients",
}


def test_every_registered_objective_is_covered():
    missing = sorted(set(POLICY_LOSSES) - set(HAND_VALUE_TESTS))
    assert not missing, f"policy objectives without a hand-value test: {missing}"
    for test in HAND_VALUE_TESTS.values():
        file, _, function = test.rpartition("::")
        source = next(TESTS.rglob(file)).read_text() if file else Path(__file__).read_text()
        assert f"def {function}(" in source, test
