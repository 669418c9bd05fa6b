"""Rollout engines behind one interface (`RolloutEngine.generate -> Rollout`)."""

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
    return HFEngine(policy, chat_template=chat_template)


__all__ = ["HFEngine", "NativeEngine", "Rollout", "RolloutEngine", "SamplingParams", "build_engine", "encode_prompts"]
