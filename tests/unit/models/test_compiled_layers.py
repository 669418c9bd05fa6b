"""train.compile's layers (models/compiled_layers.py) against the eager decoder layers, on the CPU.

The compiled path is meant for CUDA (tests/e2e/test_device_paths.py checks it there in bf16); here the
same compiled functions run through inductor's CPU backend in fp32, which is the evidence that they
trace and compile at all. Skipped where torch.compile cannot build code (no C++ compiler).
"""

from __future__ import annotations

import logging

import pytest
import torch

from reinforge.models import build_tiny_qwen2, compiled_layers
from reinforge.models.compiled_layers import LayerSteps, rope_real
from reinforge.models.decoder import DecoderWeights, _rope, decoder_shape, run_pass
from reinforge.models.positions import pass_geometry, rotary_factors
from reinforge.settings import ModelConfig


# train.compile needs inductor to build C++ code; where it cannot (no compiler, a torch without it), the option
# is off by default and these checks have nothing to compare, so they skip with inductor's own error.
@pytest.fixture(scope="module")
def inductor() -> None:
    try:
        torch.compile(lambda x: torch.sin(x) + 1)(torch.ones(3))
    except Exception as err:  # noqa: BLE001 - whatever stops inductor here
        pytest.skip(f"torch.compile cannot build code on this machine: {type(err).__name__}: {err}")


def _pass(policy, ids: torch.Tensor, compiled: bool):
    """Hidden states and keys of one whole-row pass over ids, and the gradient of a fixed function of both
    with respect to the first layer's fused q/k/v weight and the embedding."""
    shape = decoder_shape(policy.model)
    w = DecoderWeights.of(policy.model, logits=False)
    freqs = rotary_factors(policy.model, shape.head_dim, ids.shape[1])
    geometry = pass_geometry(freqs, ids.shape[1], torch.zeros(ids.shape[0], dtype=torch.long))
    hidden, keys, _ = run_pass(shape, w, ids, geometry, freqs, fused=False, compiled=compiled)
    loss = (hidden * torch.linspace(-1, 1, hidden.shape[-1])).sum() + keys[1].square().sum()
    grads = torch.autograd.grad(loss, [policy.model.model.embed_tokens.weight,
                                       policy.model.model.layers[0].self_attn.q_proj.weight])
    return hidden.detach(), keys[1].detach(), grads


def test_rope_in_real_arithmetic_is_the_complex_rotation() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 3, 8, generator=g)
    freqs = torch.polar(torch.ones(2, 5, 1, 4), torch.randn(2, 5, 1, 4, generator=g))
    torch.testing.assert_close(rope_real(x, torch.view_as_real(freqs)), _rope(x, freqs), rtol=0, atol=1e-6)


@pytest.mark.slow
def test_compiled_layers_give_the_eager_hidden_states_and_gradients(inductor) -> None:
    from torch._dynamo.utils import counters

    policy = build_tiny_qwen2(ModelConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                                          intermediate_size=128), seed=0)
    g = torch.Generator().manual_seed(1)
    graphs = []
    # two batch shapes: the second runs the code compiled for the first (dynamic shapes), no recompile
    for rows, length in ((3, 7), (2, 11)):
        ids = torch.randint(3, policy.model.config.vocab_size, (rows, length), generator=g)
        hidden, keys, grads = _pass(policy, ids, compiled=False)
        c_hidden, c_keys, c_grads = _pass(policy, ids, compiled=True)
        graphs.append(counters["stats"]["unique_graphs"])
        assert compiled_layers.compiled_layers_on()      # compiled, not the eager fallback
        torch.testing.assert_close(c_hidden, hidden, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(c_keys, keys, rtol=1e-4, atol=1e-5)
        for c, e in zip(c_grads, grads, strict=True):    # gradients of magnitude ~0.1: fp32 rounding ~1e-5
            torch.testing.assert_close(c, e, rtol=1e-3, atol=1e-4)
        assert float(grads[1].abs().max()) > 1e-3        # the gradient reaches the first layer's queries
    assert graphs[1] == graphs[0]


def test_a_failing_compile_warns_once_and_runs_the_eager_layers(monkeypatch, caplog) -> None:
    monkeypatch.setitem(compiled_layers._COMPILED, "on", True)
    policy = build_tiny_qwen2(ModelConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                                          intermediate_size=128), seed=0)
    eps = policy.model.config.rms_norm_eps
    steps = LayerSteps(heads=4, kv_heads=2, head_dim=16, eps=eps)
    calls = []

    def refuse(*args):
        calls.append(1)
        raise RuntimeError("no compiler")

    steps._compiled = (refuse, refuse)
    monkeypatch.setitem(compiled_layers._STEPS, (4, 2, 16, eps), steps)
    ids = torch.randint(3, policy.model.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(2))
    with caplog.at_level(logging.WARNING, logger="reinforge.models.compiled_layers"):
        hidden, keys, grads = _pass(policy, ids, compiled=True)
    assert not compiled_layers.compiled_layers_on()
    assert len(calls) == 1
    warnings = [r.getMessage() for r in caplog.records if "train.compile" in r.getMessage()]
    assert warnings == ["train.compile: compiling the decoder layers failed (RuntimeError: no compiler); running "
                        "them eagerly"]
    e_hidden, e_keys, e_grads = _pass(policy, ids, compiled=False)
    torch.testing.assert_close(hidden, e_hidden, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(keys, e_keys, rtol=1e-5, atol=1e-6)
