"""The sections of the model a run trains: its folder or built-in size, LoRA, MoE, and its prompts."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from reinforge.errors import ConfigError
from reinforge.settings.base import Section

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class LoraConfig(Section):
    """LoRA adapters (Hu et al., arXiv 2106.09685) through peft: h = W x + (alpha / r) B A x, W frozen."""

    r: int = Field(gt=0, description="Rank of the adapters; setting it (model.lora.r=8) turns LoRA on.")
    alpha: float = Field(
        16.0,
        gt=0,
        description=(
            "Scale numerator: the update is (alpha / r) B A. Kept fixed when r changes, as in the LoRA paper (sec. "
            "4.1: r can then vary without retuning the learning rate); alpha = 2 r is another common choice."
        ),
    )
    dropout: float = Field(
        0.0,
        ge=0,
        lt=1,
        description=(
            "Dropout on the adapters' input in training mode; > 0 needs train.shared_prefix=false (the shared-prompt "
            "forward runs merged weights)."
        ),
    )
    target_modules: list[str] = Field(
        default_factory=lambda: list(LORA_TARGETS),
        min_length=1,
        description=(
            "Module names (suffixes) that get adapters; default the attention and MLP projections of Llama-family "
            "decoders. The native engine and shared-prompt forward also handle lm_head."
        ),
    )


class MoEConfig(Section):
    """The built-in model as a Mixture-of-Experts decoder (models/moe.py): each MLP becomes `experts`
    SwiGLU experts behind a top-k router, built with transformers' own class for `architecture`."""

    experts: int = Field(gt=1, description="Experts per layer; setting it (model.moe.experts=8) makes the model MoE.")
    architecture: Literal["qwen2_moe", "mixtral", "qwen3_moe"] = Field(
        "qwen2_moe",
        description=(
            "transformers architecture: qwen2_moe (with a sigmoid-gated shared expert), mixtral (always renormalises "
            "the top-k gates) or qwen3_moe (per-head q/k norm, no shared expert)."
        ),
    )
    top_k: int = Field(2, gt=0, description="Experts per token (num_experts_per_tok).")
    expert_size: int = Field(128, gt=0, description="Each expert's MLP width (moe_intermediate_size).")
    shared_expert_size: int = Field(256, gt=0, description="qwen2_moe only: the shared expert's MLP width.")
    norm_topk_prob: bool = Field(
        True,
        description="Renormalise the top-k router probabilities to sum to 1 (qwen2_moe, qwen3_moe; mixtral always)",
    )


class ModelConfig(Section):
    path: str = Field(
        "builtin", description="'builtin' for the tiny built-in Qwen2, or a local Hugging Face causal-LM directory."
    )
    hidden_size: int = Field(128, gt=0, description="Built-in model only: width.")
    num_layers: int = Field(4, gt=0, description="Built-in model only: decoder layers.")
    num_heads: int = Field(8, gt=0, description="Built-in model only: attention heads.")
    num_kv_heads: int = Field(
        8,
        gt=0,
        description=(
            "Built-in model only: key/value heads (GQA when fewer than num_heads; with 2 the default SFT stayed on "
            "its loss plateau for 2 of 3 seeds, with 8 it learned on all 4 seeds tried)."
        ),
    )
    intermediate_size: int = Field(512, gt=0, description="Built-in model only: MLP width.")
    max_positions: int = Field(64, gt=0, description="Built-in model only: context length.")
    added_tokens: list[str] = Field(
        default_factory=list,
        description=(
            "Built-in model only (a model folder's tokenizer is its own): strings the character tokenizer reads as "
            "one token each, appended to its vocabulary (tokenizer.add_tokens; not special, so decoded text keeps "
            "them). The tool task sets the Hermes tags (<tool_call>, <tool_response> and their closings), single "
            "tokens in Qwen2.5's tokenizer too."
        ),
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="Parameter dtype.")
    device: str = Field(
        "auto",
        pattern=r"^(auto|cpu|cuda(:\d+)?)$",
        description=(
            "Where the policy (and its reference and critic) live and run: auto (the first CUDA device when there is "
            "one, else the CPU), cpu, cuda or cuda:N. Rollouts, rewards and advantages stay on the CPU; each forward "
            "moves its batch to the model."
        ),
    )
    moe: MoEConfig | None = Field(
        None,
        description=(
            "Built-in model only: a Mixture-of-Experts decoder (model.moe.experts=8 turns it on); train.routing_replay "
            "replays the sampler's expert choices in the learner. None: dense MLPs."
        ),
    )
    lora: LoraConfig | None = Field(
        None,
        description=(
            "LoRA adapters on the model (model.lora.r=8 turns them on): only the adapters train; the KL reference "
            "runs the policy's own model with its own adapter weights or none (no copy, learner/reference.py); "
            "RUN_DIR/model and `reinforge export` hold the merged weights. None: full fine-tuning."
        ),
    )

    @field_validator("added_tokens")
    @classmethod
    def _check_added_tokens(cls, tokens: list[str]) -> list[str]:
        short = [t for t in tokens if len(t) < 2]
        if short or len(set(tokens)) < len(tokens):
            raise ConfigError(f"model.added_tokens={tokens}: each added token is a string of two or more characters "
                              "(one character is a token already), listed once")
        return tokens


class PromptConfig(Section):
    chat_template: Literal["auto", "always", "never"] = Field(
        "auto", description="Wrap prompts in the tokenizer's chat template: 'auto' uses it when the tokenizer has one."
    )
    system: str | None = Field(
        None,
        description=(
            "A system message before every prompt: a plain prompt becomes [system, user] for the chat template (the "
            "model's tokenizer must have one); a conversation from the data file (a list of messages) without a "
            "system message gets it, one with its own keeps that. None: no system message."
        ),
    )
