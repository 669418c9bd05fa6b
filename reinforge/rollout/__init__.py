"""Rollout engines behind one interface (`RolloutEngine.generate -> Rollout`)."""

from collections.abc import Callable

import torch

from reinforge.models import Policy
from reinforge.rollout.base import Rollout, RolloutEngine, SamplingParams
from reinforge.rollout.hf import HFEngine
from reinforge.rollout.native import NativeEngine
from reinforge.rollout.prompts import encode_prompts
from reinforge.settings import RolloutConfig


def build_engine(rollout: RolloutConfig, policy: Policy, chat_template: str = "auto") -> RolloutEngine:
    """The configured engine over `policy` (the native engine raises NotImplementedError for a
    decoder it does not support, naming rollout.engine=hf as the way out)."""
    if rollout.engine == "native":
        return NativeEngine(policy, chat_template=chat_template, max_batch_rows=rollout.max_batch_rows,
                            cpu_kernels=rollout.cpu_kernels, quantization=rollout.quantization,
                            quantize_lm_head=rollout.quantize_lm_head)
    if rollout.engine == "vllm":
        from reinforge.rollout.vllm_engine import VLLMEngine  # imports vLLM: only where it is asked for

        return VLLMEngine(policy, chat_template=chat_template,
                          gpu_memory_utilization=rollout.vllm_gpu_memory_utilization)
    return HFEngine(policy, chat_template=chat_template)


def engine_publisher(engine: RolloutEngine, default: Callable[[torch.nn.Module], None]) -> Callable:
    """What hands the trained weights to `engine` after an update: its `publish` where it holds its own copy
    (vLLM), else `default` (the native and HF engines read the trained tensors themselves). Wrappers
    (agent rollouts, learner ranks' split) are unwrapped to the engine they drive."""
    while not hasattr(engine, "publish") and hasattr(engine, "engine"):
        engine = engine.engine
    return getattr(engine, "publish", default)


__all__ = ["HFEngine", "NativeEngine", "Rollout", "RolloutEngine", "SamplingParams", "build_engine", "encode_prompts",
           "engine_publisher"]
