"""The sections of sampling: the rollout engine and its settings, the weight-sync probe and the hang watchdog."""

from __future__ import annotations

import importlib.util
from typing import Literal

from pydantic import Field, model_validator

from reinforge.errors import ConfigError
from reinforge.settings.base import Section

VLLM_INSTALL_HINT = "run `make vllm-env` and use .venv-vllm/bin/reinforge (docs/engine.md)"


class RolloutConfig(Section):
    engine: Literal["native", "hf", "vllm"] = Field(
        "native",
        description="Generation engine: 'native' is reinforge's KV-cache engine with continuous batching (Llama-family "
                    "decoders: Llama, Qwen2, Qwen3, Mistral), 'hf' is transformers generate, 'vllm' is vLLM in this "
                    "process over its own copy of the weights, synced after every update (its own environment: "
                    "`make vllm-env`, docs/engine.md).",
    )
    vllm_gpu_memory_utilization: float = Field(
        0.1, gt=0, le=1, description="rollout.engine=vllm: the share of the device's memory vLLM reserves for its "
        "weights and KV cache (on a CPU, of the machine's memory).")
    max_batch_rows: int | None = Field(
        None,
        gt=0,
        description="Native engine: completions decoded at once; a finished row's slot is refilled with a waiting one "
                    "(continuous batching). None: all rows of a call at once.",
    )
    cpu_kernels: bool = Field(
        True,
        description=(
            "Native engine on CPU in fp32: each decoder layer's decoding step runs as one fused C++ op "
            "(reinforge/kernels/csrc/decode.cpp: the matmuls stay ATen's, the norms, rotary, cache write, attention "
            "and SwiGLU between them are fused), compiled with the machine's C++ compiler on first use (~10 s) and "
            "cached in ~/.cache/reinforge; where it cannot be built (no compiler) the engine warns once and uses its "
            "PyTorch path, which gives the same tokens and log-probs within 1e-5. false: always the PyTorch path "
            "(also REINFORGE_CPU_KERNELS=0)."
        ),
    )
    temperature: float = Field(
        1.0, gt=0, description="Sampling temperature for training rollouts and pass@k evaluation."
    )
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling threshold (1.0 = off).")
    top_k: int = Field(0, ge=0, description="Top-k sampling (0 = off).")
    record_top_k: int = Field(
        0, ge=0, description="Native engine: at each sampled position, record the K most likely token ids and their "
        "log-probs under the sampling distribution (DPPO's top-K divergence, policy_loss=dppo_topk_tv|kl); 0 = off.")
    min_p: float = Field(
        0.0, ge=0, le=1,
        description="Min-p sampling: keep the tokens whose probability is at least min_p times the most likely "
                    "token's, after temperature, as HF and vLLM define it (0.0 = off).",
    )
    quantization: Literal["none", "int8"] = Field(
        "none",
        description=(
            "Native engine: the sampler's weight precision. int8: every q/k/v/o and MLP projection rounded to int8 per "
            "output channel (fp32 scales) each time the engine takes the weights, dequantised in the matmul; the "
            "learner stays fp32, so the sampler-learner mismatch (mismatch_kl, is_weight_max) widens as with "
            "a quantised inference server (reinforge/models/quantize.py). none: the training weights as they are."
        ),
    )
    quantize_lm_head: bool = Field(
        False, description="rollout.quantization=int8: quantise the LM head too (false: it stays fp32)."
    )
    max_new_tokens: int = Field(8, gt=0, description="Completion length limit; longer completions are truncated.")
    stop: list[str] = Field(
        default_factory=list,
        description="Stop strings: a completion ends with the token that completes one (eos always ends it).",
    )
    tools: list[str] | None = Field(
        None,
        description=(
            "Tools the model may call, making each sample a multi-turn episode (docs/agents.md): 'python' (the code "
            "sandbox), 'module:function' or 'path/to/file.py:function' (a typed function with a docstring, the "
            "transformers chat-template convention). None: the task's own (multiply_tool: its calculator); []: none."
        ),
    )
    tool_parser: str = Field(
        "auto", description="How tool calls are read from the model's text: hermes, or auto (from the chat template)."
    )
    tool_timeout_s: float = Field(10.0, gt=0, description="Wall-clock limit of one tool call; a late call is stopped.")
    tool_max_chars: int = Field(4096, ge=100, description="A tool's result is cut to this many characters.")
    max_tool_calls: int = Field(4, ge=1, description="Tool calls per trajectory; a call past it ends the trajectory.")
    max_turns: int = Field(8, ge=1, description="Multi-turn: model turns per trajectory (each up to max_new_tokens).")
    max_model_tokens: int | None = Field(
        None, gt=0, description="Multi-turn: the model's tokens per trajectory, all turns (None: no limit)."
    )
    max_environment_tokens: int | None = Field(
        None, ge=0, description="Multi-turn: tool-result and reply tokens per trajectory (None: no limit)."
    )
    continuation: bool = Field(
        True,
        description=(
            "Multi-turn on the native engine: a trajectory goes on from its cached keys/values after a tool result "
            "or reply (the prompt and earlier turns are not recomputed). false: each turn re-prefills its context."
        ),
    )

    @model_validator(mode="after")
    def _check_quantization(self) -> RolloutConfig:
        if self.engine == "vllm" and importlib.util.find_spec("vllm") is None:
            raise ConfigError(f"rollout.engine=vllm needs vLLM, which is not installed here: {VLLM_INSTALL_HINT}")
        if self.quantization != "none" and self.engine != "native":
            raise ConfigError(f"rollout.quantization={self.quantization} is built for the native engine only: "
                              "set rollout.engine=native, or rollout.quantization=none")
        if self.quantize_lm_head and self.quantization == "none":
            raise ConfigError("rollout.quantize_lm_head needs a quantised sampler: set rollout.quantization=int8")
        return self


class WeightSyncConfig(Section):
    verify: bool = Field(
        True,
        description=(
            "After every weight publication the sampler (the rollout engine, the async sampler thread, each Ray "
            "worker, each learner rank's plain copy) scores a fixed probe sequence with the weights it samples "
            "with; its next-token distributions must equal the learner's forward within `tolerance` (total "
            "variation), and an async worker must hold the version just published. Else an alert (weight_sync) "
            "and the run stops. Metric sync/probe_tv."
        ),
    )
    tolerance: float | None = Field(
        None,
        gt=0,
        description="Largest total variation between the sampler's and the learner's next-token distributions on the "
        "probe that passes. None: 1e-3 for fp32 models (rounding gives ~1e-6), 5e-2 for bf16/fp16 and for fp32 on a "
        "GPU with TF32 matmuls (the engine and the learner round differently).",
    )
    every: int | None = Field(
        None,
        ge=1,
        description="Probe after the first update and then after every `every`-th. None: after every update where "
        "weights are handed over (vLLM's copy, the async sampler, Ray workers, learner ranks' plain copy), since a "
        "handover can fail at any step; every 10th where the rollout engine reads the very tensors the optimizer "
        "steps (the native and HF engines in one process), where no copy can fall behind and what the probe "
        "checks, that the engine computes what the learner computes, is the same at every step.",
    )
    timeout_s: float = Field(
        60.0,
        gt=0,
        description="How long an async worker may take to apply published weights before it counts as stale "
        "(train.in_flight=finish applies them only once the samples in flight end).",
    )


class WatchdogConfig(Section):
    enabled: bool = Field(
        True,
        description=(
            "Hang watchdog: when no RL step ends for max(factor x median step time so far, min_seconds) "
            "(first_step_seconds before the first one), every thread's stack and every child process's are "
            "written to RUN_DIR/hang-<step>.txt and an alert (hang) names where each thread waits."
        ),
    )
    factor: float = Field(10.0, gt=0, description="Hang limit as a multiple of the median step time so far.")
    min_seconds: float = Field(300.0, gt=0, description="The hang limit is never below this many seconds.")
    first_step_seconds: float = Field(
        1800.0, gt=0, description="Hang limit before the first step has ended (no step time to scale yet)."
    )
    stop_after: int = Field(
        0,
        ge=0,
        description=(
            "0: after a dump keep waiting (dumping again each further limit without progress). N > 0: stop the "
            "run after N dumps of one hang (the main thread is interrupted; a thread stuck in C code may not stop)."
        ),
    )
