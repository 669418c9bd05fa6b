"""Models and tokenizers: the built-in tiny Qwen2, and any local Hugging Face
causal-LM directory, through one code path (`load_policy`).

Nothing is downloaded: a path that is not a local directory is an error.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from reinforge.config import ConfigError, ModelConfig
from reinforge.models.tokenizer import build_char_tokenizer, load_tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Policy:
    """A causal LM with its tokenizer; what every loop trains or samples from."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase

    @property
    def eos_token_ids(self) -> list[int]:
        """All ids that end a completion (the tokenizer's eos and the generation config's)."""
        ids = {self.tokenizer.eos_token_id}
        gen_eos = getattr(self.model.generation_config, "eos_token_id", None)
        if isinstance(gen_eos, int):
            ids.add(gen_eos)
        elif gen_eos:
            ids.update(gen_eos)
        return sorted(i for i in ids if i is not None)


def build_tiny_qwen2(cfg: ModelConfig, seed: int) -> Policy:
    """A randomly initialised `Qwen2ForCausalLM` sized by `cfg`, with the char tokenizer."""
    tokenizer = build_char_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_positions,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id
    )
    return Policy(model=model.to(DTYPES[cfg.dtype]), tokenizer=tokenizer)


def check_model_path(path: str) -> Path:
    """Fail early, before a run directory exists, on a path that cannot be a model."""
    p = Path(path).expanduser()
    if not p.is_dir():
        raise ConfigError(f"model path '{path}' does not exist or is not a directory (no hub downloads: give a local Hugging Face model directory, or model=builtin)")
    if not (p / "config.json").is_file():
        raise ConfigError(f"model path '{path}' has no config.json: it is not a Hugging Face model directory")
    return p


def load_policy(cfg: ModelConfig, seed: int) -> Policy:
    """The built-in model for path 'builtin', else the local HF model and its own tokenizer."""
    if cfg.path == "builtin":
        return build_tiny_qwen2(cfg, seed)
    path = check_model_path(cfg.path)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=DTYPES[cfg.dtype])
    return Policy(model=model, tokenizer=load_tokenizer(path))


def save_policy(policy: Policy, directory: str | Path) -> None:
    """Weights as safetensors plus config, generation config and tokenizer, loadable by `load_policy`."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    policy.model.save_pretrained(str(directory), safe_serialization=True)
    policy.tokenizer.save_pretrained(str(directory))
