"""Rollout engines behind one interface (`RolloutEngine.generate -> Rollout`)."""

from reinforge.rollout.base import Rollout, RolloutEngine, SamplingParams
from reinforge.rollout.hf import HFEngine
from reinforge.rollout.prompts import encode_prompts

ENGINES = {"hf": HFEngine}

__all__ = ["ENGINES", "HFEngine", "Rollout", "RolloutEngine", "SamplingParams", "encode_prompts"]
