"""Models and tokenizers: the built-in tiny Qwen2, and any local Hugging Face
causal-LM directory, through one code path (`load_policy`), optionally with
LoRA adapters (`model.lora`, models/lora.py).

Nothing is downloaded: a path that is not a local directory is an error.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (
    CONFIG_MAPPING,
    AutoModelForCausalLM,
    GenerationConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from reinforge.errors import ConfigError
from reinforge.models.lora import apply_lora, merged
from reinforge.models.model_dir import check_model_files, read_model_config
from reinforge.models.tokenizer import build_char_tokenizer, load_tokenizer
from reinforge.settings import ModelConfig, RolloutConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Policy:
    """A causal LM with its tokenizer; what every loop trains or samples from."""

    model: PreTrainedModel      # or, with model.lora, a peft PeftModel around one (its adapters alone train)
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
    tokenizer = build_char_tokenizer(cfg.added_tokens)
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


def build_tiny_moe(cfg: ModelConfig, seed: int) -> Policy:
    """The built-in model as a randomly initialised MoE decoder of `cfg.moe.architecture`, sized by
    `cfg` (attention, layers) and `cfg.moe` (experts, top-k, expert width), with the char tokenizer."""
    moe, tokenizer = cfg.moe, build_char_tokenizer(cfg.added_tokens)
    if moe.top_k > moe.experts:
        raise ConfigError(f"model.moe.top_k={moe.top_k} exceeds model.moe.experts={moe.experts}: lower model.moe.top_k")
    if moe.architecture == "mixtral" and not moe.norm_topk_prob:
        raise ConfigError("model.moe.architecture=mixtral always renormalises its gates: "
                          "remove model.moe.norm_topk_prob")
    routed = dict(num_experts=moe.experts, moe_intermediate_size=moe.expert_size, norm_topk_prob=moe.norm_topk_prob,
                  decoder_sparse_step=1, mlp_only_layers=[])
    experts = {
        "qwen2_moe": dict(**routed, shared_expert_intermediate_size=moe.shared_expert_size, ),
        "qwen3_moe": dict(**routed, head_dim=cfg.hidden_size // cfg.num_heads),
        "mixtral": dict(num_local_experts=moe.experts, intermediate_size=moe.expert_size),
    }[moe.architecture]
    config = CONFIG_MAPPING[moe.architecture](
        vocab_size=len(tokenizer), hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads, num_experts_per_tok=moe.top_k,
        max_position_embeddings=cfg.max_positions, tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=None, output_router_logits=False, **experts,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    model.generation_config = GenerationConfig(
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id
    )
    return Policy(model=model.to(DTYPES[cfg.dtype]), tokenizer=tokenizer)


def check_model_path(path: str) -> Path:
    """Fail early, before a run directory exists, on a path that cannot be a model: missing, no
    (readable) config.json, no weights or no tokenizer files (models/model_dir.py)."""
    return check_model_files(path)


def check_model_dir(path: str) -> Path:
    """check_model_path, and the tokenizer loads and fits the model: a tokenizer that encodes text to
    nothing, or to ids past the model's vocabulary, fails here and not in the middle of generation."""
    folder = check_model_files(path)
    try:
        tokenizer = load_tokenizer(folder)
    except Exception as err:
        # The tokenizers library reports a tokenizer.json it cannot parse as a plain Exception; any
        # other kind of error is a bug, and keeps its traceback.
        if not isinstance(err, (OSError, ValueError, TypeError)) and type(err) is not Exception:
            raise
        raise ConfigError(f"model path '{path}': its tokenizer does not load ({' '.join(str(err).split())}); "
                          "save it again with tokenizer.save_pretrained(path)") from None
    if len(tokenizer) == 0 or not tokenizer("1+1=")["input_ids"]:
        raise ConfigError(f"model path '{path}': its tokenizer has no vocabulary (it encodes text to no tokens); "
                          "save the model's tokenizer into it with tokenizer.save_pretrained(path)")
    vocab = read_model_config(folder).get("vocab_size")
    if isinstance(vocab, int) and len(tokenizer) > vocab:
        raise ConfigError(
            f"model path '{path}': its tokenizer has {len(tokenizer)} tokens and the model's config.json "
            f"vocab_size is {vocab}: the tokenizer is not this model's; save the right one into the folder"
        )
    return folder


def resolve_device(name: str) -> torch.device:
    """`model.device` as a torch device: auto is the first CUDA device when there is one, else the CPU.
    A CUDA device that this machine does not have is a ConfigError."""
    if name == "auto":
        return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(name)
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (device.index or 0) >= count:
            raise ConfigError(
                f"model.device={name}, but this machine has {count} CUDA device(s) visible to torch "
                f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'no'}): use model.device=cpu or auto"
            )
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    return device


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of a model's parameters (all on one device in reinforge)."""
    return next(model.parameters()).device


def load_policy(cfg: ModelConfig, seed: int) -> Policy:
    """The built-in model for path 'builtin', else the local HF model and its own tokenizer; with
    `cfg.lora`, wrapped with LoRA adapters (initialised under `seed`); on `cfg.device`. Weights and
    adapters are initialised on the CPU and then moved, so a seed gives the same weights on any device."""
    device = resolve_device(cfg.device)
    if cfg.path == "builtin":
        policy = build_tiny_qwen2(cfg, seed) if cfg.moe is None else build_tiny_moe(cfg, seed)
    else:
        path = check_model_path(cfg.path)
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=DTYPES[cfg.dtype])
        policy = Policy(model=model, tokenizer=load_tokenizer(path))
    if cfg.lora is not None:
        policy = Policy(model=apply_lora(policy.model, cfg.lora, seed), tokenizer=policy.tokenizer)
    policy.model.to(device)
    return policy


def save_policy(policy: Policy, directory: str | Path, sampling: RolloutConfig | None = None) -> None:
    """Weights as safetensors plus config, generation config and tokenizer: a plain Hugging Face
    folder, loadable by `load_policy` and `from_pretrained` (LoRA adapters merged into the weights).

    `sampling`: the run's rollout settings, written as the generation config's sampling defaults
    (do_sample, temperature, top_p, top_k, max_new_tokens), so that `generate` samples as RL did.
    Stop strings are left out: transformers needs the tokenizer passed to `generate` for them.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model = merged(policy.model)
    model.save_pretrained(str(directory), safe_serialization=True)
    policy.tokenizer.save_pretrained(str(directory))
    if sampling is not None:
        generation = copy.deepcopy(model.generation_config)
        eos = policy.eos_token_ids
        generation.update(do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                          min_p=sampling.min_p or None,
                          max_new_tokens=sampling.max_new_tokens, pad_token_id=policy.tokenizer.pad_token_id,
                          eos_token_id=eos[0] if len(eos) == 1 else eos)
        generation.save_pretrained(str(directory))
