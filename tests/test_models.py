"""Built-in model and tokenizer: save/load round trips through the same code path as any HF model."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from reinforge.config import ModelConfig
from reinforge.models import load_policy
from reinforge.models.charset import CHARSET
from reinforge.models.tokenizer import build_char_tokenizer, load_tokenizer


def test_char_tokenizer_round_trip_next_to_a_qwen2_config(tiny_model_dir: str) -> None:
    # The saved directory holds a Qwen2 config.json: AutoTokenizer would swap in
    # Qwen2's byte-level tokenizer; load_tokenizer must not.
    tok = load_tokenizer(tiny_model_dir)
    text = "12+34=46 (3*5)/7\nabc XYZ"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text)                      # one token per character
    assert tok.decode(ids) == text
    assert len(tok) == len(CHARSET) + 3
    assert (tok.pad_token_id, tok.eos_token_id) == (0, 1)
    assert tok.decode(ids + [tok.eos_token_id], skip_special_tokens=True) == text


def test_unknown_characters_map_to_unk() -> None:
    tok = build_char_tokenizer()
    assert tok("é", add_special_tokens=False)["input_ids"] == [tok.unk_token_id]


def test_saved_model_reloads_with_identical_logits(tiny_model_dir: str) -> None:
    policy = load_policy(ModelConfig(path=tiny_model_dir), seed=123)   # seed must not matter for a path
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    ids = torch.tensor([[4, 5, 66, 6, 7, 72]])
    torch.testing.assert_close(policy.model(ids).logits, plain(ids).logits, rtol=0, atol=0)
    assert policy.eos_token_ids == [1]


def test_model_device_auto_is_the_cpu_without_cuda_and_cuda_is_refused_before_a_run() -> None:
    import pytest

    from reinforge.config import ConfigError, build_config
    from reinforge.models import model_device, resolve_device
    from reinforge.pipeline import prepare

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the refusal is for machines without it")
    assert resolve_device("auto") == torch.device("cpu") == resolve_device("cpu")
    policy = load_policy(ModelConfig(device="auto"), seed=0)
    assert model_device(policy.model) == torch.device("cpu")
    for name in ("cuda", "cuda:1"):
        with pytest.raises(ConfigError, match="0 CUDA device"):
            prepare(build_config([f"model.device={name}"]))
    with pytest.raises(ConfigError, match="model.device"):
        build_config(["model.device=gpu"])


def test_a_sequence_batch_moves_every_tensor() -> None:
    from reinforge.learner import build_sequences

    batch = build_sequences([[1, 2], [3]], torch.tensor([[4, 5], [6, 0]]), torch.tensor([[1.0, 1.0], [1.0, 0.0]]), 0,
                            group_ids=torch.tensor([0, 1]))
    assert batch.to(torch.device("cpu")) is batch
    moved = batch.to(torch.device("meta"))
    assert {f: getattr(moved, f).device.type for f in vars(moved)} == {f: "meta" for f in vars(batch)}
    assert moved.input_ids.shape == batch.input_ids.shape == (2, 4)
    without_groups = build_sequences([[1]], torch.tensor([[2]]), torch.tensor([[1.0]]), 0)
    assert without_groups.to(torch.device("meta")).group_ids is None
