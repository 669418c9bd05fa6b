"""Shared fixtures: micro configs, a saved tiny model directory, a local Llama with a chat template."""

from __future__ import annotations

import os
from pathlib import Path

# Set before torch loads libgomp: the CLI's short spin (reinforge/cli.py) for the tests' in-process runs too, whose
# two workers share the cores.
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", "1000")

import pytest  # noqa: E402
import torch  # noqa: E402

# Two xdist workers on two cores: one torch thread each avoids oversubscription.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

MICRO = [
    "model.hidden_size=32",
    "model.num_layers=1",
    "model.num_heads=2",
    "model.num_kv_heads=1",
    "model.intermediate_size=64",
    "sft.steps=3",
    "sft.batch_size=8",
    "sft.num_examples=32",
    "train.steps=3",
    "train.prompts_per_step=4",
    "train.group_size=4",
    "train.micro_batch_size=8",
    "rollout.max_new_tokens=4",
    "eval.num_prompts=6",
    "eval.num_samples=4",
    "log.progress=false",
    "threads=1",
]


@pytest.fixture
def micro_overrides() -> list[str]:
    return list(MICRO)


SPECIALS = ["<pad>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def byte_bpe(corpus: list[str], specials: list[str]):
    """A byte-level BPE tokenizer (300 ids) trained here on `corpus`, with `specials` as special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE(unk_token=None))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return bpe


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory) -> Path:
    """A tiny Llama and a byte-level BPE tokenizer trained here, with a chat template (CHAT_TEMPLATE)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    corpus = [f"What is {a} + {b}? The answer is {a + b}. Be brief, think." for a in range(20) for b in range(5)]
    tok = PreTrainedTokenizerFast(tokenizer_object=byte_bpe(corpus, SPECIALS), pad_token="<pad>", eos_token="<|end|>",
                                  additional_special_tokens=SPECIALS[2:])
    tok.chat_template = CHAT_TEMPLATE
    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=128, pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
        )
    )
    path = tmp_path_factory.mktemp("llama_bpe")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A built-in tiny model saved as a plain Hugging Face directory."""
    from reinforge.config import build_config
    from reinforge.models import build_tiny_qwen2, save_policy

    cfg = build_config(MICRO)
    path = tmp_path_factory.mktemp("tiny_model")
    save_policy(build_tiny_qwen2(cfg.model, seed=0), path)
    return str(path)
