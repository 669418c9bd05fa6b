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


# ---------------------------------------------------------------- DPPO, top-K divergence

# K = 2, the sampled token is id 0 of the top-K at every position; mu_o / p_o the lumped rest.
#   pos  mu (k1, k2, o)     p (k1, k2, o)        TV = 0.5 (sum |p - mu| incl. o)    A   p/p_mu  masked?        loss
#   0    .5  .3  .2         .6   .2   .2         0.5 (.1 + .1 + 0)    = 0.1         +1  1.2     no             -1.2
#   1    .5  .3  .2         .8   .1   .1         0.5 (.3 + .2 + .1)   = 0.3         +1  1.6     up, A > 0      0
#   2    .5  .3  .2         .8   .1   .1         0.3                                -1  1.6     no (A < 0)     1.6
#   3    .5  .3  .2         .52  .05  .43        0.5 (.02 + .25 + .23) = 0.25       +1  1.04    up, A > 0      0
# Position 3: the binary TV |p - p_mu| = 0.02 < 0.15 would not mask it; the top-K TV sees the mass moved.
# grad = d(-J)/dlogp = -(p/p_mu) A where unmasked, 0 where masked (same numbers as the loss here).
MU = [[[0.5, 0.3]] * 4]
P = [[[0.6, 0.2], [0.8, 0.1], [0.8, 0.1], [0.52, 0.05]]]
A_TOPK = [[1.0, 1.0, -1.0, 1.0]]


def _topk_call(name, p=P, mu=MU, advantages=A_TOPK, **params):
    top, sampler_top = torch.log(_t(p)), torch.log(_t(mu))
    logprobs = top[..., 0].clone().requires_grad_()
    if "topk" in name:
        params = {**params, "top_logprobs": top, "sampler_top_logprobs": sampler_top}
    terms = POLICY_LOSSES[name](logprobs=logprobs, old_logprobs=logprobs.detach(), advantages=_t(advantages),
                                mask=torch.ones_like(logprobs), sampler_logprobs=sampler_top[..., 0], **params)
    terms.loss.sum().backward()
    return terms, logprobs.grad


def test_dppo_topk_tv_hand_values_and_gradients():
    terms, grad = _topk_call("dppo_topk_tv", delta=0.15)
    torch.testing.assert_close(terms.metrics["tv"], _t([[0.1, 0.3, 0.3, 0.25]]))
    torch.testing.assert_close(terms.loss, _t([[-1.2, 0.0, 1.6, 0.0]]))
    torch.testing.assert_close(grad, _t([[-1.2, 0.0, 1.6, 0.0]]))
    torch.testing.assert_close(terms.metrics["clip_frac_high"], _t([[0, 1.0, 0, 1.0]]))
    # The binary approximation misses position 3's move.
    binary, _ = _topk_call("dppo_tv", delta=0.15)
    torch.testing.assert_close(binary.loss, _t([[-1.2, 0.0, 1.6, -1.04]]))


# KL(mu || p) over the three outcomes, delta 0.05:
#   pos 0: .5 ln(.5/.6) + .3 ln(.3/.2) + .2 ln(1)  = -0.091161 + 0.121640 + 0         = 0.030479 (inside: loss -1.2)
#   pos 1: .5 ln(.5/.8) + .3 ln(.3/.1) + .2 ln(.2/.1) = -0.235002 + 0.329584 + 0.138629 = 0.233211 (up, A > 0: masked)
#   pos 3: .5 ln(.5/.52) + .3 ln 6 + .2 ln(.2/.43) = -0.019610 + 0.537528 - 0.153094 = 0.364824 (up: masked)
def test_dppo_topk_kl_hand_values_and_gradients():
    terms, grad = _topk_call("dppo_topk_kl", delta=0.05)
    ln = math.log
    kl = [0.5 * ln(0.5 / 0.6) + 0.3 * ln(1.5), 0.5 * ln(0.5 / 0.8) + 0.3 * ln(3.0) + 0.2 * ln(2.0)]
    kl = [kl[0], kl[1], kl[1], 0.5 * ln(0.5 / 0.52) + 0.3 * ln(6.0) + 0.2 * ln(0.2 / 0.43)]
    torch.testing.assert_close(terms.metrics["top_k_kl"], _t([kl]))
    assert kl[0] == pytest.approx(0.030479, abs=1e-6) and kl[1] == pytest.approx(0.233211, abs=1e-6)
    assert kl[3] == pytest.approx(0.364824, abs=1e-6)
    torch.testing.assert_close(terms.loss, _t([[-1.2, 0.0, 1.6, 0.0]]))
    torch.testing.assert_close(grad, _t([[-1.2, 0.0, 1.6, 0.0]]))
    # A token the sampler's filter removed (mu = 0, log-prob -inf) adds nothing; the rest stays finite.
    terms, _ = _topk_call("dppo_topk_kl", p=[[[0.6, 0.2]]], mu=[[[0.8, 0.0]]], advantages=[[1.0]])
    torch.testing.assert_close(terms.metrics["top_k_kl"], _t([[0.8 * ln(0.8 / 0.6) + 0.2 * ln(0.2 / 0.2)]]))


@pytest.mark.parametrize(("topk", "binary"), [("dppo_topk_tv", "dppo_tv"), ("dppo_topk_kl", "dppo_kl")])
def test_top_1_of_the_sampled_token_is_the_binary_approximation(topk, binary):
    # K = 1 with the sampled token as the id: the K + 1 outcomes are "sampled token or not".
    gen = torch.Generator().manual_seed(0)
    logprobs = torch.log(torch.rand(3, 5, generator=gen, dtype=F64) * 0.9 + 0.05)
    sampler = torch.log(torch.rand(3, 5, generator=gen, dtype=F64) * 0.9 + 0.05)
    advantages = torch.randn(3, 5, generator=gen, dtype=F64)
    out = []
    for name, extra in ((topk, {"top_logprobs": logprobs.unsqueeze(-1), "sampler_top_logprobs": sampler.unsqueeze(-1)}),
                        (binary, {})):
        leaf = logprobs.clone().requires_grad_()
        terms = POLICY_LOSSES[name](logprobs=leaf, old_logprobs=logprobs, advantages=advantages,
                                    mask=torch.ones_like(leaf), sampler_logprobs=sampler, delta=0.1, **extra)
        terms.loss.sum().backward()
        out.append((terms, leaf.grad))
    (a, grad_a), (b, grad_b) = out
    torch.testing.assert_close(a.loss, b.loss)
    torch.testing.assert_close(grad_a, grad_b)
    torch.testing.assert_close(a.metrics["clip_frac"], b.metrics["clip_frac"])
    assert 0 < b.metrics["clip_frac"].sum() < 15      # some masked, some not: the comparison has teeth


def test_dppo_topk_needs_the_recorded_top_k():
    with pytest.raises(ValueError, match="record_top_k"):
        POLICY_LOSSES["dppo_topk_tv"](logprobs=_t([[-1.0]]), old_logprobs=_t([[-1.0]]), advantages=_t([[1.0]]),
                                      mask=_t([[1.0]]), sampler_logprobs=_t([[-1.0]]))
    from reinforge.errors import ConfigError
    with pytest.raises(ConfigError, match="rollout.engine=native"):
        build_config(["recipe=dppo_topk", "rollout.engine=hf"])
    with pytest.raises(ConfigError, match="set rollout.record_top_k"):
        build_config(["recipe=dppo_topk", "rollout.record_top_k=0"])
    assert build_config(["recipe=dppo_topk"]).rollout.record_top_k == 20


def _native_topk_rollout(policy, k, temperature):
    from reinforge.rollout.native import NativeEngine

    engine = NativeEngine(policy, max_batch_rows=3)    # 3 slots for 6 rows: slots refill and pack
    return engine.generate(["12+34=", "7+8="], 3, SamplingParams(temperature=temperature, max_new_tokens=6,
                                                                 record_top_k=k),
                           generator=torch.Generator().manual_seed(0))


def test_native_top_k_equals_the_full_vocabulary_computation(policy):
    k, temperature = 5, 0.7
    rollout = _native_topk_rollout(policy, k, temperature)
    seq = build_sequences(rollout.prompt_ids, rollout.completion_ids, rollout.completion_mask,
                          policy.tokenizer.pad_token_id, group_ids=rollout.group_ids)
    with torch.no_grad():
        logits = policy.model(input_ids=seq.input_ids, attention_mask=seq.attention_mask).logits.float()
    mask = rollout.completion_mask.bool()
    assert rollout.sampler_top_ids.shape == (6, rollout.completion_ids.shape[1], k) and mask.sum() > 12
    for row in range(6):
        for t in range(int(mask[row].sum())):
            full = torch.log_softmax(logits[row, int(seq.starts[row]) - 1 + t] / temperature, dim=-1)   # [V]
            top = torch.topk(full, k)
            assert rollout.sampler_top_ids[row, t].tolist() == top.indices.tolist()
            torch.testing.assert_close(rollout.sampler_top_logprobs[row, t], top.values, atol=1e-5, rtol=0)
            # the sampled token's log-prob is of the same distribution
            torch.testing.assert_close(rollout.sampler_logprobs[row, t], full[rollout.completion_ids[row, t]],
                                       atol=1e-5, rtol=0)
    assert torch.all(rollout.sampler_top_logprobs[~mask] == 0)


def test_learner_top_k_logprobs_match_the_sampler_and_the_first_update_has_no_divergence(policy):
    temperature = 0.7
    rollout = _native_topk_rollout(policy, 4, temperature)
    seq = build_sequences(rollout.prompt_ids, rollout.completion_ids, rollout.completion_mask,
                          policy.tokenizer.pad_token_id, group_ids=rollout.group_ids, top_ids=rollout.sampler_top_ids)
    # The learner's log-probs of the sampler's ids: the full-logits path, the chunked LM head (chunks of
    # 5 tokens, never [tokens x vocab]) and the shared-prompt path give the sampler's numbers.
    for plan in (ForwardPlan(), ForwardPlan(chunk_size=5), ForwardPlan(shared_prefix=True, chunk_size=5)):
        from reinforge.learner.forward import token_stats
        with torch.no_grad():
            stats = token_stats(policy.model, seq, temperature, plan)
        torch.testing.assert_close(stats.top_logprobs, rollout.sampler_top_logprobs, atol=1e-5, rtol=0)
    # At the first update (policy == sampler) the top-K TV is ~0: nothing is masked.
    batch = LearnerBatch(sequences=seq, advantages=torch.tensor([1.0, -1.0, 0.5, -0.5, 1.5, -1.5]),
                         old_logprobs=None, sampler_logprobs=rollout.sampler_logprobs, group_ids=rollout.group_ids,
                         sampler_top_logprobs=rollout.sampler_top_logprobs)
    model = copy.deepcopy(policy.model)
    opt = build_optimizer(model, lr=1e-3)
    settings = UpdateSettings(ppo_epochs=1, mini_batches=1, temperature=temperature,
                              forward=ForwardPlan(micro_batch_size=2))
    stats = policy_update(model, opt, warmup_constant(opt, 0), batch, resolve_spec("dppo_topk"), settings,
                          torch.Generator().manual_seed(0))
    assert stats.optimizer_steps == 1
    assert stats.metrics["tv"] < 1e-5 and stats.metrics["clip_frac"] == 0.0


def test_dppo_topk_update_does_not_depend_on_micro_batches_or_the_head_path(policy):
    rollout = _native_topk_rollout(policy, 4, 1.0)
    seq = build_sequences(rollout.prompt_ids, rollout.completion_ids, rollout.completion_mask,
                          policy.tokenizer.pad_token_id, group_ids=rollout.group_ids, top_ids=rollout.sampler_top_ids)
    # A sampler a little off the learner, so that some tokens leave the (small) trust region.
    shift = 0.3 * torch.randn(rollout.sampler_top_logprobs.shape, generator=torch.Generator().manual_seed(1))
    sampled_shift = 0.3 * torch.randn(rollout.sampler_logprobs.shape, generator=torch.Generator().manual_seed(2))
    batch = LearnerBatch(sequences=seq, advantages=torch.tensor([1.0, -1.0, 0.5, -0.5, 1.5, -1.5]), old_logprobs=None,
                         sampler_logprobs=(rollout.sampler_logprobs + sampled_shift) * rollout.completion_mask,
                         group_ids=rollout.group_ids,
                         sampler_top_logprobs=(rollout.sampler_top_logprobs + shift).clamp(max=0.0))
    spec = resolve_spec("dppo_topk", delta=0.003)

    def grads(**plan):
        model = copy.deepcopy(policy.model)
        opt = build_optimizer(model, lr=1e-3)
        for group in opt.param_groups:
            group["lr"] = 0.0
        settings = UpdateSettings(ppo_epochs=1, mini_batches=1, grad_clip=1e9, forward=ForwardPlan(**plan))
        stats = policy_update(model, opt, warmup_constant(opt, 0), batch, spec, settings,
                              torch.Generator().manual_seed(0))
        return [p.grad.clone() for p in model.parameters()], stats.metrics

    whole, metrics = grads(micro_batch_size=6)
    assert 0 < metrics["clip_frac"] < 1      # some tokens masked, some not
    for plan in ({"micro_batch_size": 1}, {"micro_batch_size": 4, "chunk_size": 3}):
        split, _ = grads(**plan)
        for a, b in zip(whole, split, strict=True):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_top_k_under_a_truncated_sampler_matches_the_truncated_learner(policy):
    from reinforge.learner.forward import token_stats
    from reinforge.learner.truncation import Truncation
    from reinforge.rollout.native import NativeEngine

    # Top-k 3 sampling, K = 5 recorded: the 4th and 5th ids are outside the kept set (log-prob -inf), and
    # the learner, renormalised over the same kept set (learner/truncation.py), says the same.
    params = SamplingParams(temperature=0.8, top_k=3, max_new_tokens=5, record_top_k=5)
    rollout = NativeEngine(policy).generate(["12+34=", "7+8="], 2, params, generator=torch.Generator().manual_seed(0))
    mask = rollout.completion_mask.bool()
    assert torch.all(torch.isinf(rollout.sampler_top_logprobs[mask][:, 3:]))
    seq = build_sequences(rollout.prompt_ids, rollout.completion_ids, rollout.completion_mask,
                          policy.tokenizer.pad_token_id, group_ids=rollout.group_ids, top_ids=rollout.sampler_top_ids)
    truncation = Truncation.of(3, 1.0, 0.0)
    for plan in (ForwardPlan(truncation=truncation), ForwardPlan(chunk_size=4, truncation=truncation)):
        with torch.no_grad():
            stats = token_stats(policy.model, seq, 0.8, plan)
        torch.testing.assert_close(stats.top_logprobs, rollout.sampler_top_logprobs, atol=1e-5, rtol=0)
