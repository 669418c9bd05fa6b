"""LoRA adapters through peft (Hu et al., arXiv 2106.09685): h = W x + (alpha / r) B A x, with W frozen.

This module owns
- `apply_lora`: the policy's model wrapped as a peft `PeftModel` whose adapters alone are
  trainable, initialised deterministically under the run's seed (A random, B = 0: the wrapped
  model starts as the base model);
- `linear_weight`: the weight and bias a projection computes with, adapters included
  (W + (alpha / r) B A). The native rollout engine and the shared-prompt learner forward run
  fused weight tensors, not modules: they read every projection through it, so an adapter is
  never silently ignored, and gradients reach A and B through the sum;
- `base_model` and `merged`: the Hugging Face model under the wrapper, and a plain Hugging Face
  model with the adapters merged into its weights (what an export writes).

peft is imported only where a LoRA model is built or met: a run without LoRA never loads it.
"""

from __future__ import annotations

import copy
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from transformers import PreTrainedModel

from reinforge.errors import ConfigError
from reinforge.settings import LoraConfig


def is_peft(model: torch.nn.Module) -> bool:
    """Whether `model` is a peft PeftModel (one exists only once peft is imported)."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def apply_lora(model: PreTrainedModel, cfg: LoraConfig, seed: int) -> torch.nn.Module:
    """`model` with LoRA adapters on `cfg.target_modules` (in place), as a PeftModel; the base weights
    are frozen. The adapters' initialisation draws from its own generator state, seeded by `seed`."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    config = PeftLoraConfig(r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                            target_modules=list(cfg.target_modules), task_type="CAUSAL_LM")
    with torch.random.fork_rng(), _quiet_peft(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*tie_word_embeddings", category=UserWarning)   # refused below
        # GPT-2's Conv1D layers store W transposed: peft notices and sets fan_in_fan_out itself.
        warnings.filterwarnings("ignore", message="fan_in_fan_out is set to False", category=UserWarning)
        torch.manual_seed(seed)
        try:
            wrapped = get_peft_model(model, config)
        except ValueError as err:   # e.g. a target module the model does not have
            raise ConfigError(f"model.lora.target_modules={list(cfg.target_modules)}: {err}") from None
    inner = wrapped.get_base_model()
    if getattr(inner.config, "tie_word_embeddings", False) and not (
        type(inner.get_input_embeddings()) is torch.nn.Embedding
        and type(inner.get_output_embeddings()) is torch.nn.Linear
    ):
        # One tensor serves both: merging an adapter of one into it would change the other too.
        raise ConfigError(
            f"model.lora.target_modules={list(cfg.target_modules)} puts an adapter on the input or output "
            "embedding, which this model ties to the other; leave lm_head and embed_tokens out"
        )
    return wrapped


@contextmanager
def _quiet_peft() -> Iterator[None]:
    """peft reads a transformers attribute deprecated in transformers 5 (`is_gradient_checkpointing`);
    the FutureWarning it prints at every wrap and merge is peft's to fix, not the user's."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
        yield


def base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The Hugging Face model under a PeftModel (its LoRA layers in place), or `model` itself."""
    return model.get_base_model() if is_peft(model) else model


def linear_weight(module: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight [out, in], bias [out] or None) that `module`, a Linear or a peft LoRA Linear, computes with.

    For a LoRA layer: W + sum over its active adapters of (alpha / r) B A (peft's own
    `get_delta_weight`), or W alone while the adapters are disabled (`disable_adapter()`) or merged
    into W. Differentiable in A and B. In the base weight's dtype (peft may keep adapters in fp32),
    so the result equals the layer's forward up to float rounding. Raises NotImplementedError for any
    other module, and for LoRA variants whose output is not linear in W + delta (DoRA, LoRA bias).
    """
    if type(module) is torch.nn.Linear:
        return module.weight, module.bias
    from peft.tuners.lora import Linear as LoraLinear

    if type(module) is not LoraLinear or type(module.get_base_layer()) is not torch.nn.Linear:
        raise NotImplementedError(f"expected a Linear or LoRA Linear layer, found {type(module).__name__}")
    base = module.get_base_layer()
    weight = base.weight
    if module.disable_adapters or module.merged:
        return weight, base.bias
    for name in module.active_adapters:
        if name not in module.lora_A:
            continue
        if name in module.lora_variant or module.lora_bias.get(name, False):
            raise NotImplementedError(
                f"LoRA variant of adapter '{name}' (DoRA or LoRA bias) is not a plain weight delta"
            )
        weight = weight + module.get_delta_weight(name).to(weight.dtype)
    return weight, base.bias


def merged(model: torch.nn.Module) -> PreTrainedModel:
    """A plain Hugging Face model: for a PeftModel, a copy with its adapters merged into the weights
    (W + (alpha / r) B A; the policy itself is left as it is: the copy costs one model's memory
    while it lives); any other model is returned as it is."""
    if not is_peft(model):
        return model
    with _quiet_peft():
        return copy.deepcopy(model).merge_and_unload()


def lora_dropouts(model: torch.nn.Module) -> list[float]:
    """The input dropout rate of each adapter of a PeftModel; [] for any other model."""
    return [config.lora_dropout for config in model.peft_config.values()] if is_peft(model) else []


def trainable_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The parameters an optimizer trains (requires_grad), by name: with LoRA, the adapters only."""
    return {name: p for name, p in model.named_parameters() if p.requires_grad}
