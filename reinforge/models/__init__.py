"""Models and tokenizers: the built-in tiny Qwen2 and local Hugging Face models."""

from reinforge.models.factory import (
    Policy,
    build_tiny_qwen2,
    load_policy,
    model_device,
    resolve_device,
    save_policy,
)

__all__ = ["Policy", "build_tiny_qwen2", "load_policy", "model_device", "resolve_device", "save_policy"]
