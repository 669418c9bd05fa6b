"""Models and tokenizers: the built-in tiny Qwen2, local Hugging Face models, LoRA, and the
Llama-family decoder forward that the native engine and the learner run (`models.decoder`)."""

from reinforge.models.factory import (
    Policy,
    build_tiny_moe,
    build_tiny_qwen2,
    load_policy,
    model_device,
    resolve_device,
    save_policy,
)

__all__ = [
    "Policy", "build_tiny_moe", "build_tiny_qwen2", "load_policy", "model_device", "resolve_device", "save_policy",
]
