"""The int8 sampler (rollout.quantization=int8, models/quantize.py): the round-trip bound, a measurable
sampler-learner gap that the fp32 sampler does not have, and a correction that acts on it as its formula says."""

from __future__ import annotations

import pytest
import torch

from reinforge.config import build_config
from reinforge.errors import ConfigError
from reinforge.learner import build_sequences, completion_token_stats
from reinforge.models import Policy, build_tiny_qwen2
from reinforge.models.decoder import DecoderWeights
from reinforge.models.factory import build_tiny_moe
from reinforge.models.quantize import INT8_MAX, quantize_int8, quantize_weights
from reinforge.objectives.corrections import apply_correction, mismatch_metrics
from reinforge.rollout import NativeEngine, SamplingParams, build_engine
from reinforge.settings import ModelConfig

PROMPTS = ["12+34=", "7+8=", "999+1=", "3 5 7>22:", "1+1="]


def tiny() -> Policy:
    return build_tiny_qwen2(ModelConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                                        intermediate_size=128), seed=0)


def test_int8_round_trip_is_within_half_a_step_per_channel() -> None:
    # Hand-derived: row [0.5, -1.27, 0.3]: s = 1.27 / 127 = 0.01, q = [50, -127, 30], exact.
    # Row [2.54, 0.013, -0.006]: s = 0.02, q = round([127, 0.65, -0.3]) = [127, 1, 0] -> W~ = [2.54, 0.02, 0].
    w = torch.tensor([[0.5, -1.27, 0.3], [2.54, 0.013, -0.006], [0.0, 0.0, 0.0]])
    q = quantize_int8(w)
    assert q.codes.dtype == torch.int8
    assert q.codes.tolist() == [[50, -127, 30], [127, 1, 0], [0, 0, 0]]
    torch.testing.assert_close(q.scales, torch.tensor([0.01, 0.02, 1.0]))
    torch.testing.assert_close(q.dequantize(), torch.tensor([[0.5, -1.27, 0.3], [2.54, 0.02, 0.0], [0.0, 0.0, 0.0]]))
    # The bound |W - W~| <= s / 2 on a random matrix with rows of very different size.
    big = torch.randn(64, 96, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 1, 64)[:, None]
    qb = quantize_int8(big)
    err = (big - qb.dequantize()).abs()
    assert bool((err <= qb.scales[:, None] / 2 + 1e-7 * qb.scales[:, None]).all())
    assert float(err.max()) > 0     # it really rounds
    assert int(qb.codes.abs().amax(dim=1).min()) == INT8_MAX    # each row's largest weight maps to +-127


def test_int8_quantises_the_projections_and_keeps_the_head_unless_asked() -> None:
    w = DecoderWeights.of(tiny().model)
    q = quantize_weights(w, "int8")
    for name in ("qkv", "o", "gate_up", "down"):
        before, after = getattr(w.layers[0], name), getattr(q.layers[0], name)
        assert not torch.equal(before, after)
        torch.testing.assert_close(after, quantize_int8(before).dequantize())
    assert q.head is w.head and q.embed is w.embed
    assert not torch.equal(quantize_weights(w, "int8", head=True).head, w.head)
    assert quantize_weights(w, "none") is w
    with pytest.raises(ValueError, match="rollout.quantization"):
        quantize_weights(w, "int4")


def _rollout_and_learner(quantization: str):
    policy = tiny()
    torch.manual_seed(0)
    rollout = NativeEngine(policy, quantization=quantization).generate(PROMPTS, 4, SamplingParams(max_new_tokens=8))
    seq = build_sequences(rollout.prompt_ids, rollout.completion_ids, rollout.completion_mask,
                          policy.tokenizer.pad_token_id)
    with torch.no_grad():
        learner = completion_token_stats(policy.model, seq).logprobs    # the fp32 learner
    return rollout, learner


def test_int8_sampler_has_a_measurable_gap_that_fp32_does_not() -> None:
    fp32, learner32 = _rollout_and_learner("none")
    torch.testing.assert_close(learner32, fp32.sampler_logprobs, atol=1e-5, rtol=0)
    assert mismatch_metrics(learner32, fp32.sampler_logprobs, fp32.completion_mask)["mismatch_kl"] < 1e-9

    int8, learner8 = _rollout_and_learner("int8")
    mask = int8.completion_mask
    assert mask.sum() > 40
    gap = ((learner8 - int8.sampler_logprobs).abs() * mask).amax()
    assert gap > 1e-3          # far above the fp32 engine's 1e-5
    metrics = mismatch_metrics(learner8, int8.sampler_logprobs, mask)
    assert metrics["mismatch_kl"] > 1e-7 and metrics["is_weight_max"] > 1.0

    # TIS (cap C = 2) on these numbers: w_t = min(exp(old_t - mu_t), C) on valid tokens, 0 on padding.
    rho = torch.exp(learner8 - int8.sampler_logprobs)
    tis = apply_correction("tis", old_logprobs=learner8, sampler_logprobs=int8.sampler_logprobs, mask=mask, cap=2.0)
    torch.testing.assert_close(tis.weights, torch.where(mask.bool(), rho.clamp(max=2.0), 0.0))
    assert ((tis.weights - 1).abs() * mask).amax() > 1e-3       # the weights really move off 1
    # A tighter cap truncates the tokens whose ratio passes it, exactly those.
    cap = float(rho[mask.bool()].quantile(0.9))
    capped = apply_correction("tis", old_logprobs=learner8, sampler_logprobs=int8.sampler_logprobs, mask=mask,
                              cap=cap)
    assert torch.equal(capped.metrics["is_clipped"].bool(), (rho > cap) & mask.bool())


def test_the_int8_engine_quantises_each_call_afresh() -> None:
    # The engine reads the training weights: an update shows at the next call, quantised.
    policy = tiny()
    engine = NativeEngine(policy, quantization="int8")
    proj = policy.model.model.layers[0].mlp.down_proj.weight
    with torch.no_grad():
        proj.mul_(1.5)
    torch.testing.assert_close(engine.decoder_weights().layers[0].down, quantize_int8(proj).dequantize())


def test_quantization_config_is_checked() -> None:
    cfg = build_config(["rollout.quantization=int8", "rollout.quantize_lm_head=true"])
    assert cfg.rollout.quantization == "int8"
    with pytest.raises(ConfigError, match="rollout.engine=native"):
        build_config(["rollout.quantization=int8", "rollout.engine=hf"])
    with pytest.raises(ConfigError, match="rollout.quantization=int8"):
        build_config(["rollout.quantize_lm_head=true"])
    policy = tiny()
    engine = build_engine(cfg.rollout, policy)
    assert engine.quantization == "int8" and engine.quantize_lm_head


def test_int8_quantises_every_expert_per_channel_and_keeps_the_router() -> None:
    """An MoE sampler: each expert's (and the shared expert's) rows move by at most half their own step;
    the router is untouched (module docstring of models/quantize.py)."""
    cfg = build_config(["model.moe.experts=4", "model.moe.architecture=qwen2_moe"]).model
    policy = build_tiny_moe(cfg, seed=0)
    exact = DecoderWeights.of(policy.model)
    rounded = quantize_weights(exact, "int8")
    for lw, qw in zip(exact.layers, rounded.layers, strict=True):
        assert torch.equal(qw.moe.router, lw.moe.router)
        for name in ("gate_up", "down", "shared_gate_up", "shared_down"):
            w, q = getattr(lw.moe, name), getattr(qw.moe, name)
            step = w.abs().amax(dim=-1, keepdim=True) / INT8_MAX
            assert (w - q).abs().le(step / 2 + 1e-7).all(), name
            assert (w - q).abs().max() > 0, name
    torch.manual_seed(0)
    rollout = NativeEngine(policy, quantization="int8").generate(PROMPTS, 2, SamplingParams(max_new_tokens=6))
    seq = build_sequences(rollout.prompt_ids, rollout.completion_ids, rollout.completion_mask,
                          policy.tokenizer.pad_token_id)
    with torch.no_grad():
        learner = completion_token_stats(policy.model, seq).logprobs
    gap = (rollout.sampler_logprobs - learner)[rollout.completion_mask.bool()].abs().max()
    assert 1e-5 < gap < 0.5        # the int8 experts' gap: present, and small
