"""What a local Hugging Face model folder holds, read before anything is loaded or written: its
config.json, weights and tokenizer files, and whether its architecture is one the native decoder
runs (rollout.engine=native, train.shared_prefix).

Everything here reads files only (no torch, no weights), so that the config check can call it:
a broken folder is one ConfigError naming the file and what to do, never a traceback from deep in
transformers after the run directory was created.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reinforge.errors import ConfigError

# The decoders the native engine and the shared-prompt learner forward implement (the list
# models/decoder.py checks loaded models against; kept here so that reading it needs no torch).
LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3")
# Their Mixture-of-Experts relatives (models/moe.py): the native decoder runs them; the learner runs the
# model's own forward, where routing replay swaps the routers' choice (learner/routing.py).
MOE_MODEL_TYPES = ("qwen2_moe", "mixtral", "qwen3_moe")
# Rotary variants whose frequencies do not depend on the sequence length, so one table serves a whole call.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")

WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
# One of these is a tokenizer's vocabulary (tokenizer_config.json alone is not: transformers then
# builds an empty tokenizer, and generation fails much later on empty prompts).
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model", "sentencepiece.bpe.model",
)


def read_model_config(path: str | Path) -> dict[str, Any]:
    """The parsed config.json of the model folder `path`; ConfigError for a folder that is missing,
    holds no config.json, or whose config.json is not a JSON mapping with a model_type."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise ConfigError(f"model path '{path}' does not exist or is not a directory (no hub downloads: give a local "
                          "Hugging Face model directory, or model=builtin)")
    file = folder / "config.json"
    if not file.is_file():
        raise ConfigError(f"model path '{path}' has no config.json: it is not a Hugging Face model directory")
    try:
        config = json.loads(file.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(f"{file}: not valid JSON (line {err.lineno}, column {err.colno}: {err.msg}); "
                          "repair it or save the model again with save_pretrained") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{file} cannot be read ({err}); check its permissions and encoding") from None
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise ConfigError(f"{file} has no model_type: it is not a transformers model config; save the model again "
                          "with save_pretrained")
    return config


def check_model_files(path: str | Path) -> Path:
    """The folder `path` once it holds a readable config.json, weights and tokenizer files."""
    read_model_config(path)
    folder = Path(path).expanduser()
    names = {p.name for p in folder.iterdir()}
    if not names.intersection(WEIGHT_FILES) and not any(n.endswith(".safetensors") for n in names):
        raise ConfigError(f"model path '{path}' holds no weights (none of {', '.join(WEIGHT_FILES)}): "
                          "copy the weight files into it, or save the model with save_pretrained")
    if not names.intersection(TOKENIZER_FILES):
        raise ConfigError(f"model path '{path}' holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}): "
                          "save the tokenizer into it too (tokenizer.save_pretrained(path))")
    return folder


def native_refusal(config: dict[str, Any]) -> str | None:
    """Why the native decoder cannot run the model of `config` (a parsed config.json), or None
    when it can. The same conditions as models.decoder.decoder_shape, read from the file."""
    model_type = config.get("model_type")
    if model_type not in LLAMA_FAMILY + MOE_MODEL_TYPES:
        return f"{model_type} is not Llama-family ({', '.join(LLAMA_FAMILY + MOE_MODEL_TYPES)})"
    rope = config.get("rope_scaling") or config.get("rope_parameters") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    if rope_type not in STATIC_ROPE_TYPES:
        return (
            f"{model_type} with rope_type '{rope_type}' is not one the native decoder implements "
            f"({', '.join(STATIC_ROPE_TYPES)})"
        )
    if config.get("final_logit_softcapping") is not None:
        return f"{model_type} soft-caps its logits, which the native decoder does not"
    if (
        model_type in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe")
        and config.get("use_sliding_window")
        and config.get("sliding_window") is not None
    ):
        return f"{model_type} uses sliding-window layers, which the native decoder does not model"
    return None


def shared_prefix_refusal(config: dict[str, Any]) -> str | None:
    """Why the shared-prompt learner forward cannot run the model of `config`, or None."""
    reason = native_refusal(config)
    if reason is not None:
        return reason
    if config.get("model_type") in MOE_MODEL_TYPES:
        return (f"{config.get('model_type')} is a Mixture-of-Experts model, whose routing is recorded and replayed "
                "on the model's own forward")
    if config.get("model_type") == "mistral" and config.get("sliding_window") is not None:
        return "mistral uses sliding-window attention, which the shared-prompt learner forward does not model"
    if config.get("attention_dropout"):
        return f"{config.get('model_type')} applies attention dropout, which the shared-prompt learner forward does not"
    return None


def chunked_head_refusal(config: dict[str, Any]) -> str | None:
    """Why the chunked log-prob path (train.logprob_chunk_size > 0: the LM head applied to the
    decoder's hidden states, learner/logprobs.py) cannot run the model of `config`, or None."""
    if config.get("final_logit_softcapping") is not None:
        return f"{config.get('model_type')} soft-caps its logits after the LM head"
    if config.get("logit_scale") not in (None, 1.0):
        return f"{config.get('model_type')} rescales its logits after the LM head"
    return None


@dataclass(frozen=True)
class ArchitecturePlan:
    """What runs a model folder's architecture, decided from its config.json before anything loads."""

    model_type: str
    native_reason: str | None          # why the native engine cannot run it; None: it can
    shared_prefix_reason: str | None   # why the shared-prompt learner forward cannot; None: it can
    head_reason: str | None = None     # why the chunked log-prob head cannot; None: it can

    def note(self, engine: str, shared_prefix: bool, lora_targets: list[str] | None = None,
             logprob_chunk_size: int = 0) -> str | None:
        """The one line that says what runs the model and why, for a model that one of the native
        paths does not run; None for one they both run. `lora_targets`: the adapters' modules, named
        when the model is not Llama-family (its projections have other names)."""
        reason = self.native_reason or self.shared_prefix_reason
        if reason is None:
            return None
        rollout = (
            "the transformers engine (rollout.engine=hf)"
            if engine == "hf"
            else "the native engine (rollout.engine=native)"
        )
        learner = (
            "the model's own forward (train.shared_prefix=false)" if not shared_prefix else "the shared-prompt forward"
        )
        if self.head_reason is not None and logprob_chunk_size == 0:
            learner += f" with full logits (train.logprob_chunk_size=0: {self.head_reason})"
        lora = (f", LoRA adapters on {', '.join(lora_targets)} (model.lora.target_modules)"
                if lora_targets and self.native_reason is not None else "")
        return f"model: {reason}; rollout uses {rollout}, learner uses {learner}{lora}"


def architecture_plan(path: str | Path) -> ArchitecturePlan | None:
    """The plan for the model folder `path`, or None when its config.json cannot be read (the run's
    input check then says why, naming the file)."""
    try:
        config = read_model_config(path)
    except ConfigError:
        return None
    return plan_for(config)


def plan_for(config: dict[str, Any]) -> ArchitecturePlan:
    return ArchitecturePlan(config["model_type"], native_refusal(config), shared_prefix_refusal(config),
                            chunked_head_refusal(config))


def lora_targets(model_type: str, path: str) -> list[str]:
    """peft's default LoRA targets of an architecture whose projections are not named as Llama's."""
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as TARGETS

    if model_type not in TARGETS:
        raise ConfigError(f"model.lora on '{path}' ({model_type}): the default targets name Llama-family projections; "
                          "set model.lora.target_modules to this model's linear layers")
    return list(TARGETS[model_type])
