"""Exact importance ratios under top-k / top-p / min-p (learner/truncation.py): at policy == sampler the
full-softmax ratio is Z_kept, the truncated one is 1, on every learner forward path; the truncated
log-prob's gradient is the truncated policy's score function."""

from __future__ import annotations

import math

import pytest
import torch

from reinforge.config import build_config
from reinforge.learner import build_sequences
from reinforge.learner.forward import ForwardPlan, token_logprobs
from reinforge.learner.logprobs import chunked_kept_log_mass
from reinforge.learner.truncation import Truncation, kept_log_mass
from reinforge.models import build_tiny_qwen2
from reinforge.rollout import NativeEngine, SamplingParams
from reinforge.rollout.sampling import filter_logits
from reinforge.settings import ModelConfig

PROMPTS = ["12+34=", "7+8=", "999+1=", "3 5 7>22:", "1+1="]
TRUNCATIONS = {"top_k": dict(top_k=4), "top_p": dict(top_p=0.7), "min_p": dict(min_p=0.3)}
PATHS = {
    "full_logits": ForwardPlan(chunk_size=0),
    "chunked": ForwardPlan(chunk_size=7),
    "shared_prefix": ForwardPlan(chunk_size=7, shared_prefix=True),
}


def test_min_p_keeps_tokens_above_a_fraction_of_the_top_probability() -> None:
    # p = [0.5, 0.3, 0.15, 0.05], min_p = 0.25: floor 0.125 keeps the first three, whatever top-p does.
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    kept = torch.isfinite(filter_logits(logits, 0, 1.0, 0.25))
    assert kept.tolist() == [[True, True, True, False]]
    # After top-k = 2 the ratio p_k / p_max is unchanged: min-p keeps the intersection.
    assert torch.isfinite(filter_logits(logits, 2, 1.0, 0.25)).tolist() == [[True, True, False, False]]
    # 0.6 * 0.5 = 0.3: the second token sits on the floor and stays (>=).
    assert torch.isfinite(filter_logits(logits, 0, 1.0, 0.6)).tolist() == [[True, True, False, False]]


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("name", sorted(TRUNCATIONS))
def test_on_policy_ratio_is_z_kept_without_and_one_with_truncated_logprobs(name: str, path: str) -> None:
    policy = build_tiny_qwen2(ModelConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                                          intermediate_size=128), seed=0)
    temperature = 0.8
    params = SamplingParams(temperature=temperature, max_new_tokens=8, **TRUNCATIONS[name])
    assert params.truncates
    torch.manual_seed(0)
    rollout = NativeEngine(policy).generate(PROMPTS, 4, params)
    seq = build_sequences(rollout.prompt_ids, rollout.completion_ids, rollout.completion_mask,
                          policy.tokenizer.pad_token_id, group_ids=rollout.group_ids)
    mask = rollout.completion_mask.bool()
    sampler = rollout.sampler_logprobs
    truncation = Truncation.of(params.top_k, params.top_p, params.min_p)

    full = token_logprobs(policy.model, seq, temperature, PATHS[path])
    exact = token_logprobs(policy.model, seq, temperature, ForwardPlan(**{**PATHS[path].__dict__,
                                                                          "truncation": truncation}))
    # Z_kept of each token's distribution, from the model's own full logits: the mass the sampler kept.
    with torch.no_grad():
        logits = policy.model(input_ids=seq.input_ids, attention_mask=seq.attention_mask).logits.float()
    t = seq.completion_ids.shape[1]
    at = seq.starts[:, None] - 1 + torch.arange(t)[None, :]
    scores = logits.gather(1, at.clamp(max=logits.shape[1] - 1)[..., None].expand(-1, -1, logits.shape[-1]))
    scores = scores / temperature
    flat = scores.flatten(0, 1)                                                     # [N T, V]
    kept = truncation.kept(flat)
    z_kept = torch.where(kept, flat.softmax(-1), 0.0).sum(-1).view(at.shape)
    # A token whose logit ties the kept set's boundary to float rounding may fall on either side in the
    # engine and the learner (their logits differ by ~1e-6): positions whose set changes under 1e-5 noise
    # are set aside (rare: a few tokens in ~160 here).
    g = torch.Generator().manual_seed(0)
    fragile = torch.zeros(len(flat), dtype=torch.bool)
    for _ in range(4):
        fragile |= (truncation.kept(flat + 1e-5 * torch.randn(flat.shape, generator=g)) != kept).any(-1)
    mask = mask & ~fragile.view(at.shape)
    assert fragile.view(at.shape)[rollout.completion_mask.bool()].float().mean() < 0.02

    ratio_full = torch.exp(full - sampler)[mask]
    ratio_exact = torch.exp(exact - sampler)[mask]
    assert mask.sum() > 40
    # Without the fix the ratio is the kept mass (biased below 1), with it 1.
    torch.testing.assert_close(ratio_full, z_kept[mask], atol=1e-5, rtol=0)
    assert float(ratio_full.min()) < 0.9
    torch.testing.assert_close(ratio_exact, torch.ones_like(ratio_exact), atol=1e-5, rtol=0)


def test_truncated_logprob_gradient_is_hand_derived() -> None:
    # z = [2, 1, 0, -1], top-k = 2, target y = 0. p = softmax(z) = e^z / 11.475217;
    # pi^K = [e^2, e] / (e^2 + e) = [0.731059, 0.268941, 0, 0]; log Z_K = log(10.107338 / 11.475217) = -0.126928.
    # log pi^K(y) = 2 - log(e^2 + e) = -log(1 + e^-1) = -0.313262, and d/dz = [1, 0, 0, 0] - pi^K.
    # d log Z_K / dz = pi^K - p = [0.087145, 0.032058, -0.087144, -0.032059].
    z = torch.tensor([[2.0, 1.0, 0.0, -1.0]], dtype=torch.float64, requires_grad=True)
    truncation = Truncation(top_k=2)
    log_z = kept_log_mass(z, truncation)
    assert math.isclose(float(log_z.detach()), -0.126928, abs_tol=1e-6)
    logp = torch.log_softmax(z, -1)[0, 0] - log_z[0]
    assert math.isclose(float(logp.detach()), -math.log1p(math.exp(-1)), abs_tol=1e-12)
    (grad,) = torch.autograd.grad(logp, z)
    expected = torch.tensor([[1 - 0.731059, -0.268941, 0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(grad, expected, atol=1e-6, rtol=0)

    # The chunked head path (h = z, W = I: the logits are z) gives the same value and gradient.
    h = z.detach().clone().requires_grad_(True)
    w = torch.eye(4, dtype=torch.float64, requires_grad=True)
    chunked = chunked_kept_log_mass(h, w, None, truncation, chunk_size=1)
    (gh, gw) = torch.autograd.grad(chunked.sum(), (h, w))
    pi_k_minus_p = torch.tensor([[0.087145, 0.032058, -0.087144, -0.032059]], dtype=torch.float64)
    torch.testing.assert_close(chunked, log_z.detach(), atol=1e-12, rtol=0)
    torch.testing.assert_close(gh, pi_k_minus_p, atol=1e-6, rtol=0)
    torch.testing.assert_close(gw, pi_k_minus_p.t() @ h.detach(), atol=3e-6, rtol=0)   # dW = dz^T h


@pytest.mark.parametrize("name", sorted(TRUNCATIONS))
def test_chunked_kept_log_mass_passes_gradcheck(name: str) -> None:
    # Finite differences in fp64 through hidden, weight and bias at temperature 0.7, chunks of 2 rows
    # (the kept sets do not change under the 1e-6 perturbations of these random logits).
    g = torch.Generator().manual_seed(1)
    h = torch.randn(5, 3, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(9, 3, dtype=torch.float64, generator=g, requires_grad=True)
    b = torch.randn(9, dtype=torch.float64, generator=g, requires_grad=True)
    truncation = Truncation(**TRUNCATIONS[name])

    def fn(h, w, b):
        return chunked_kept_log_mass(h, w, b, truncation, temperature=0.7, chunk_size=2)

    assert torch.autograd.gradcheck(fn, (h, w, b), eps=1e-6, atol=1e-7)
    full = kept_log_mass(torch.addmm(b, h, w.t()) / 0.7, truncation)
    torch.testing.assert_close(fn(h, w, b), full, atol=1e-12, rtol=0)
    assert float(full.detach().min()) < -0.05     # the kept set really drops mass


def test_config_switch_and_the_untruncated_reference() -> None:
    cfg = build_config(["rollout.top_p=0.9", "rollout.min_p=0.05"])
    plan = ForwardPlan.from_config(cfg.train, cfg.rollout)
    assert plan.truncation == Truncation(top_k=0, top_p=0.9, min_p=0.05)
    assert plan.for_reference().truncation is None
    assert ForwardPlan.from_config(cfg.train).truncation is None            # no rollout: SFT, critics
    off = build_config(["rollout.top_p=0.9", "train.truncated_logprobs=false"])
    assert ForwardPlan.from_config(off.train, off.rollout).truncation is None
    plain = build_config([])
    assert ForwardPlan.from_config(plain.train, plain.rollout).truncation is None   # nothing truncates
