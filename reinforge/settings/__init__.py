"""The settings of each part of a run, as typed sections: what the parts below the config take
(the engine its RolloutConfig, the reward composer its RewardConfig, the recorder its LogConfig
and AlertConfig), so that none of them imports the whole config. reinforge.config assembles
them into the Config that users write; every field is documented once, here, where it is
declared (STYLE principle 7).

The sections live in `model` (model, prompt), `rollout` (rollout, weight sync, watchdog), `training`
(sft, train, critic, curation), `preference` (dpo, rm, prm), `objective` (the objective section, derived
from ObjectiveSpec), `judge` and `run` (reward, eval, analytics, checkpoint, log, alerts, ray), all on
`base.Section`.
"""

from reinforge.settings.base import Section
from reinforge.settings.model import LORA_TARGETS, LoraConfig, ModelConfig, MoEConfig, PromptConfig
from reinforge.settings.preference import DPOConfig, ProcessRewardTrainingConfig, RewardModelTrainingConfig
from reinforge.settings.rollout import RolloutConfig
from reinforge.settings.run import (
    AlertConfig,
    AnalyticsConfig,
    CheckpointConfig,
    EvalConfig,
    LogConfig,
    OverlongConfig,
    RayConfig,
    RewardConfig,
    RewardFunctionConfig,
    RewardModelConfig,
)
from reinforge.settings.training import CriticConfig, CurationConfig, SFTConfig, TrainConfig

__all__ = [
    "AlertConfig",
    "AnalyticsConfig",
    "CheckpointConfig",
    "CriticConfig",
    "CurationConfig",
    "DPOConfig",
    "EvalConfig",
    "LORA_TARGETS",
    "LogConfig",
    "LoraConfig",
    "ModelConfig",
    "MoEConfig",
    "OverlongConfig",
    "PromptConfig",
    "RayConfig",
    "RewardConfig",
    "RewardFunctionConfig",
    "RewardModelConfig",
    "ProcessRewardTrainingConfig",
    "RewardModelTrainingConfig",
    "RolloutConfig",
    "SFTConfig",
    "Section",
    "TrainConfig",
]
