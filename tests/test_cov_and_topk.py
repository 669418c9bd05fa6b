"""Clip-Cov / KL-Cov (arXiv 2505.22617) and DPPO's top-K divergence (arXiv 2602.04879): hand-derived
selections, loss values and gradients, and the learner's invariance to micro-batching. float64.

Conventions: "grad" is d(loss)/d(logprobs) per token, loss = -J.
"""

from __future__ import annotations

import copy
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
from reinforge.objectives import objective_loss, recipe_loss, resolve_spec
from reinforge.objectives.covariance import clip_cov_selection, kl_cov_selection, token_covariance
from reinforge.objectives.policy import POLICY_LOSSES
from reinforge.rollout import HFEngine, SamplingParams

F64 = torch.float64


def _t(values):
    return torch.tensor(values, dtype=F64)


# ---------------------------------------------------------------- the covariance and the selections

# Two rows, five trained tokens (row 1's last column is padding):
#   logp = [[-1, -2, -3], [-1, -2, pad]],  A = [[1, 1, 1], [-1, -1, pad]]
#   mean logp = -9/5 = -1.8,  mean A = 1/5 = 0.2
#   Cov = (logp + 1.8)(A - 0.2):
#     row 0:  0.8 * 0.8 = 0.64,  -0.2 * 0.8 = -0.16,  -1.2 * 0.8 = -0.96
#     row 1:  0.8 * -1.2 = -0.96,  -0.2 * -1.2 = 0.24,  pad 0
LOGP = [[-1.0, -2.0, -3.0], [-1.0, -2.0, 0.0]]
ADV = [[1.0, 1.0, 1.0], [-1.0, -1.0, 0.0]]
MASK = [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]
COV = [[0.64, -0.16, -0.96], [-0.96, 0.24, 0.0]]


def test_token_covariance_is_centred_over_the_trained_tokens():
    torch.testing.assert_close(token_covariance(_t(LOGP), _t(ADV), _t(MASK)), _t(COV))
    # The padding's values play no part.
    noisy = _t(LOGP)
    noisy[1, 2] = 50.0
    torch.testing.assert_close(token_covariance(noisy, _t(ADV), _t(MASK)), _t(COV))


def test_kl_cov_selects_the_top_fraction_of_the_batch():
    inputs = {"logprobs": _t(LOGP), "old_logprobs": _t(LOGP), "advantages": _t(ADV), "mask": _t(MASK)}
    # k = max(1, floor(0.4 * 5)) = 2: the covariances 0.64 and 0.24.
    assert kl_cov_selection(**inputs, k_ratio=0.4).tolist() == [[True, False, False], [False, True, False]]
    # k = max(1, floor(2e-3 * 5)) = 1: just 0.64 (the paper's "at least one token").
    assert kl_cov_selection(**inputs, k_ratio=2e-3).tolist() == [[True, False, False], [False, False, False]]


def test_clip_cov_draws_among_the_tokens_inside_the_covariance_band():
    inputs = {"logprobs": _t(LOGP), "old_logprobs": _t(LOGP), "advantages": _t(ADV), "mask": _t(MASK)}
    # Band (0.2, 1.0): candidates 0.64 (row 0, t 0) and 0.24 (row 1, t 1); 0.4 * 5 = 2 of them: both.
    both = clip_cov_selection(**inputs, clip_ratio=0.4, cov_low=0.2, cov_high=1.0)
    assert both.tolist() == [[True, False, False], [False, True, False]]
    # Band (0.5, 1.0): only 0.64.
    one = clip_cov_selection(**inputs, clip_ratio=0.4, cov_low=0.5, cov_high=1.0)
    assert one.tolist() == [[True, False, False], [False, False, False]]
    # floor(0.2 * 5) = 1 of the two candidates, uniformly: over 400 draws each is picked ~200 times.
    picks = torch.zeros(2, 3, dtype=F64)
    for seed in range(400):
        chosen = clip_cov_selection(**inputs, clip_ratio=0.2, cov_low=0.2, cov_high=1.0,
                                    generator=torch.Generator().manual_seed(seed))
        assert int(chosen.sum()) == 1
        picks += chosen
    assert picks[0, 0] + picks[1, 1] == 400 and 160 < picks[0, 0] < 240
    # A token whose PPO clip is already active is no candidate: r = e^0.5 > 1.2 with A > 0.
    old = _t(LOGP)
    old[0, 0] -= 0.5
    clipped = clip_cov_selection(**{**inputs, "old_logprobs": old}, clip_ratio=0.4, cov_low=0.2, cov_high=1.0)
    assert clipped.tolist() == [[False, False, False], [False, True, False]]


# ---------------------------------------------------------------- the losses

def _call(name, logprobs, advantages, old_logprobs, mask, **params):
    logprobs = logprobs.detach().clone().requires_grad_()
    terms = POLICY_LOSSES[name](logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, mask=mask,
                                **params)
    terms.loss.sum().backward()
    return terms, logprobs.grad


# KL-Cov, k_ratio 0.4 (selected: row 0 t 0 and row 1 t 1, as above), penalty_coef 0.5;
# old = logp except old[0, 0] = -1.1 (d = logp - old = 0.1) and old[1, 1] = -2.2 (d = 0.2).
#   token   r        A    selected  J = r A - 0.5 |d|         loss = -J          grad = -(r A - 0.5 sign d)
#   (0,0)   e^0.1    1    yes       e^0.1 - 0.05              0.05 - e^0.1       0.5 - e^0.1
#   (0,1)   1        1    no        1                         -1                 -1
#   (0,2)   1        1    no        1                         -1                 -1
#   (1,0)   1       -1    no        -1                        1                  1
#   (1,1)   e^0.2   -1    yes       -e^0.2 - 0.1              e^0.2 + 0.1        e^0.2 + 0.5
#   pad                                                       0                  0
def test_kl_cov_hand_values_and_gradients():
    old = _t(LOGP)
    old[0, 0], old[1, 1] = -1.1, -2.2
    terms, grad = _call("kl_cov", _t(LOGP), _t(ADV), old, _t(MASK), k_ratio=0.4, penalty_coef=0.5)
    e1, e2 = math.exp(0.1), math.exp(0.2)
    torch.testing.assert_close(terms.loss, _t([[0.05 - e1, -1.0, -1.0], [1.0, e2 + 0.1, 0.0]]))
    torch.testing.assert_close(grad, _t([[0.5 - e1, -1.0, -1.0], [1.0, e2 + 0.5, 0.0]]))
    torch.testing.assert_close(terms.metrics["cov_kl_frac"], _t([[1.0, 0, 0], [0, 1.0, 0]]))
    torch.testing.assert_close(terms.metrics["cov_kl"], _t([[0.1, 0, 0], [0, 0.2, 0]]))
    # Rounding noise at pi_old (|d| = 1e-7 <= tolerance 1e-5) gets no penalty and no +-1 gradient.
    noise = _t(LOGP) - 1e-7
    terms, grad = _call("kl_cov", _t(LOGP), _t(ADV), noise, _t(MASK), k_ratio=0.4)
    torch.testing.assert_close(terms.metrics["cov_kl"], torch.zeros(2, 3, dtype=F64))
    torch.testing.assert_close(grad, -_t(ADV) * math.exp(1e-7))


# Clip-Cov, eps 0.2, band (0.2, 1.0), clip_ratio 0.4; old = logp except old[0, 1] = -2.5 (r = e^0.5,
# A = 1: PPO clip active, J = 1.2, grad 0). Candidates: (0,0) cov 0.64 and (1,1) cov 0.24, both drawn.
#   token   J                       loss    grad
#   (0,0)   selected: 0             0       0
#   (0,1)   clip(e^0.5) A = 1.2    -1.2     0
#   (0,2)   r A = 1                -1      -1
#   (1,0)   r A = -1                1       1
#   (1,1)   selected: 0             0       0
def test_clip_cov_hand_values_and_gradients():
    old = _t(LOGP)
    old[0, 1] = -2.5
    terms, grad = _call("clip_cov", _t(LOGP), _t(ADV), old, _t(MASK), clip_ratio=0.4, cov_low=0.2, cov_high=1.0)
    torch.testing.assert_close(terms.loss, _t([[0.0, -1.2, -1.0], [1.0, 0.0, 0.0]]))
    torch.testing.assert_close(grad, _t([[0.0, 0.0, -1.0], [1.0, 0.0, 0.0]]))
    torch.testing.assert_close(terms.metrics["cov_clip_frac"], _t([[1.0, 0, 0], [0, 1.0, 0]]))
    torch.testing.assert_close(terms.metrics["clip_frac_high"], _t([[0, 1.0, 0], [0, 0, 0]]))


def test_a_passed_selection_overrides_the_local_one():
    """What the learner does: the selection of the whole mini-batch, sliced, goes into each micro-batch."""
    old = _t(LOGP)
    old[1, 1] = -2.2
    spec = resolve_spec("kl_cov", k_ratio=0.4, penalty_coef=0.5)
    weights = torch.full((1, 3), 1 / 3, dtype=F64)
    # Row 1 alone has A = -1 on both tokens, so its own covariances are both 0 (a tie: both would be
    # penalised); the whole batch's selection names t 1 only: loss = (1 + e^0.2 + 0.1) / 3 (weights 1/3).
    selected = torch.tensor([[False, True, False]])
    out = objective_loss(spec, logprobs=_t(LOGP)[1:], old_logprobs=old[1:], advantages=_t(ADV)[1:],
                         mask=_t(MASK)[1:], weights=weights, selected=selected)
    assert out.loss.item() == pytest.approx((1.0 + math.exp(0.2) + 0.1) / 3)
    assert out.metrics["cov_kl_frac"] == pytest.approx(0.5)


def test_recipes_resolve_with_the_paper_defaults():
    assert dict(resolve_spec("kl_cov").policy_params) == {"k_ratio": 2e-3, "penalty_coef": 1.0}
    clip = resolve_spec("clip_cov")
    assert dict(clip.policy_params) == {"clip_ratio": 2e-4, "cov_low": 1.0, "cov_high": 5.0, "eps_low": 0.2,
                                        "eps_high": 0.2}
    assert clip.aggregation == "token_mean" and clip.advantage == "grpo" and not clip.needs_reference
    # recipe_loss on a whole batch: token_mean of the kl_cov terms above.
    old = _t(LOGP)
    old[0, 0], old[1, 1] = -1.1, -2.2
    out = recipe_loss("kl_cov", logprobs=_t(LOGP), old_logprobs=old, advantages=_t(ADV), mask=_t(MASK),
                      k_ratio=0.4, penalty_coef=0.5)
    e1, e2 = math.exp(0.1), math.exp(0.2)
    assert out.loss.item() == pytest.approx((0.05 - e1 - 1.0 - 1.0 + 1.0 + e2 + 0.1) / 5)


# ---------------------------------------------------------------- micro-batch invariance in the learner

@pytest.fixture
def policy(micro_overrides):
    return build_tiny_qwen2(build_config(micro_overrides).model, seed=0)


def _grads(policy, batch, spec, micro_batch_size):
    model = copy.deepcopy(policy.model)
    opt = build_optimizer(model, lr=1e-3)
    for group in opt.param_groups:
        group["lr"] = 0.0
    settings = UpdateSettings(ppo_epochs=1, mini_batches=1, grad_clip=1e9, temperature=1.0,
                              forward=ForwardPlan(micro_batch_size=micro_batch_size), max_length=6)
    stats = policy_update(model, opt, warmup_constant(opt, 0), batch, spec, settings, torch.Generator().manual_seed(0))
    return [p.grad.clone() for p in model.parameters()], stats.metrics


@pytest.mark.parametrize(("recipe", "params", "metric"), [
    ("kl_cov", {"k_ratio": 0.25, "penalty_coef": 1.0}, "cov_kl_frac"),
    ("clip_cov", {"clip_ratio": 0.25, "cov_low": -10.0, "cov_high": 10.0}, "cov_clip_frac"),
])
def test_selection_over_the_whole_mini_batch_does_not_depend_on_micro_batches(policy, recipe, params, metric):
    torch.manual_seed(3)
    rollout = HFEngine(policy).generate(["12+34=", "7+8="], 4, SamplingParams(max_new_tokens=6))
    seq = build_sequences(rollout.prompt_ids, rollout.completion_ids, rollout.completion_mask,
                          policy.tokenizer.pad_token_id, group_ids=rollout.group_ids)
    with torch.no_grad():
        current = completion_token_stats(policy.model, seq).logprobs
    # pi_old away from the current policy, so that the KL penalty has a gradient.
    old = current - 0.1 * torch.randn_like(current).sign() * rollout.completion_mask
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5, 1.5, -1.5, 0.3, -0.3])
    batch = LearnerBatch(sequences=seq, advantages=advantages, old_logprobs=old, sampler_logprobs=old,
                         group_ids=rollout.group_ids)
    spec = resolve_spec(recipe, **params)
    whole, metrics = _grads(policy, batch, spec, micro_batch_size=8)
    # A quarter of the tokens selected, over the batch (the metric is a mean over micro-batches of 8 rows = 1).
    tokens = int(rollout.completion_mask.sum())
    assert metrics[metric] == pytest.approx(int(0.25 * tokens) / tokens)
    for size in (1, 3):
        split, _ = _grads(policy, batch, spec, micro_batch_size=size)
        for a, b in zip(whole, split, strict=True):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    # And the selection matters: without it (k or r -> one token) the gradient differs.
    fewer = resolve_spec(recipe, **{**params, ("k_ratio" if recipe == "kl_cov" else "clip_ratio"): 1e-9})
    other, _ = _grads(policy, batch, fewer, micro_batch_size=8)
    assert any(not torch.allclose(a, b, atol=1e-6) for a, b in zip(whole, other, strict=True))
