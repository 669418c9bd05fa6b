"""rollout/vllm_layout.py: a model with heads narrower than vLLM's CPU attention runs is served with padded
heads that compute the same function. Checked here with transformers alone (no vLLM): the padded model,
loaded as the served config says, gives the trained model's logits."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from reinforge.errors import ConfigError
from reinforge.rollout.vllm_layout import ServedLayout, padded_positions, served_layout

CPU_SIZES = [32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512]


def _qwen2(head_dim: int = 16, rope_theta: float = 10000.0) -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=50, hidden_size=4 * head_dim, intermediate_size=96,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=64, tie_word_embeddings=True,
                                         rope_parameters={"rope_type": "default", "rope_theta": rope_theta}))
    with torch.no_grad():                       # biases away from zero, so a misplaced one shows
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    return model.eval()


def _served(model, layout: ServedLayout) -> LlamaForCausalLM:
    """The padded model as vLLM builds it: a Llama with head_dim P and biases on q, k, v (transformers'
    Llama puts one on the output projection too under attention_bias: zero here, as vLLM has none)."""
    config = layout.config(model.config.to_dict())
    assert config["model_type"] == "llama" and config["qkv_bias"] and config["head_dim"] == 32
    served = LlamaForCausalLM(LlamaConfig(**{**config, "attention_bias": True})).eval()
    state = {name: layout.tensor(name, t) for name, t in model.state_dict().items()}
    for i in range(model.config.num_hidden_layers):
        state[f"model.layers.{i}.self_attn.o_proj.bias"] = torch.zeros(model.config.hidden_size)
    missing, unexpected = served.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    return served


@pytest.mark.parametrize("rope_theta", [10000.0, 1e6])
def test_padded_heads_compute_the_same_logits(rope_theta):
    model = _qwen2(rope_theta=rope_theta)
    layout = served_layout(model.config, CPU_SIZES)
    assert layout == ServedLayout(head_dim=16, served_head_dim=32)
    served = _served(model, layout)
    ids = torch.randint(0, 50, (3, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = model(input_ids=ids).logits, served(input_ids=ids).logits
    assert want.abs().max() > 0.1
    assert (got - want).abs().max() < 1e-5
    # Placed without the rotary pairing (dims in order), the padded model is another function.
    wrong = ServedLayout(16, 32)
    import reinforge.rollout.vllm_layout as vl

    real = vl.padded_positions
    try:
        vl.padded_positions = lambda d, p: torch.arange(d)
        with torch.no_grad():
            moved = _served(model, wrong)(input_ids=ids).logits
    finally:
        vl.padded_positions = real
    assert (moved - want).abs().max() > 1e-3      # 100x the tolerance above


def test_padded_positions_keep_rotary_pairs_and_frequencies():
    d, p = 16, 32
    where = padded_positions(d, p)
    assert where.tolist() == [0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30]
    freq = lambda i, width: 10000.0 ** (-2 * (i % (width // 2)) / width)   # noqa: E731 - rotate-half frequency
    for i in range(d):
        assert math.isclose(freq(i, d), freq(int(where[i]), p))
        partner, served_partner = (i + d // 2) % d, (int(where[i]) + p // 2) % p
        assert int(where[partner]) == served_partner


def test_padding_an_adapter_is_padding_the_merged_weights():
    """pad(W + B A) = pad(W) + pad(B) A for q, k, v (rows) and pad(W + B A) = pad(W) + B pad(A) for o
    (columns): the adapter padded alone gives what the merged weights padded give."""
    layout = ServedLayout(16, 32)
    g = torch.Generator().manual_seed(0)
    for proj, shape in [("q_proj", (64, 64)), ("k_proj", (32, 64)), ("o_proj", (64, 64))]:
        w, b, a = torch.randn(*shape, generator=g), torch.randn(shape[0], 4, generator=g), torch.randn(4, shape[1],
                                                                                                     generator=g)
        prefix = f"model.layers.0.self_attn.{proj}"
        merged = layout.tensor(f"{prefix}.weight", w + b @ a)
        adapted = layout.tensor(f"{prefix}.weight", w) + (layout.tensor(f"{prefix}.lora_B.weight", b)
                                                          @ layout.tensor(f"{prefix}.lora_A.weight", a))
        assert merged.shape == ((shape[0] * 2, 64) if proj != "o_proj" else (64, 128))
        assert (merged - adapted).abs().max() < 1e-4
    mlp = torch.randn(96, 64, generator=g)
    assert layout.tensor("model.layers.0.mlp.gate_proj.weight", mlp) is mlp


def _config(**kw) -> SimpleNamespace:
    base = dict(model_type="qwen2", hidden_size=64, num_attention_heads=4, head_dim=None,
                rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    return SimpleNamespace(**{**base, **kw})


def test_what_is_served_as_it_is_and_what_is_refused():
    assert not served_layout(_config(hidden_size=128), CPU_SIZES).padded          # 32 wide: supported
    assert not served_layout(_config(), None).padded                              # a GPU: any size
    assert served_layout(_config(model_type="llama", hidden_size=96), CPU_SIZES).served_head_dim == 96   # 24 -> 96
    for config, why in [
        (_config(model_type="mistral"), "padding is built for qwen2, llama, and this is mistral"),
        (_config(rope_parameters={"rope_type": "yarn", "factor": 4.0}), "rotary embedding"),
        (_config(partial_rotary_factor=0.5), "rotary embedding"),
        (_config(use_sliding_window=True), "sliding-window"),
    ]:
        with pytest.raises(ConfigError, match=r"needs an attention head size in \[32, 64.*is 16 .*" + why):
            served_layout(config, CPU_SIZES)
