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
