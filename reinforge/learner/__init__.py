"""The learner: log-probs of completions, the policy update, optimizers."""

from reinforge.learner.forward import ForwardPlan, token_logprobs, token_stats
from reinforge.learner.logprobs import completion_token_stats_chunked
from reinforge.learner.optim import build_optimizer, warmup_constant, warmup_cosine
from reinforge.learner.reference import Reference
from reinforge.learner.sequences import (
    SequenceBatch,
    TokenStats,
    build_sequences,
    completion_token_stats,
)
from reinforge.learner.shared_prefix import completion_token_stats_shared
from reinforge.learner.update import (
    WHOLE,
    BatchShare,
    LearnerBatch,
    UpdateSettings,
    UpdateStats,
    policy_update,
)

__all__ = [
    "WHOLE",
    "BatchShare",
    "ForwardPlan",
    "LearnerBatch",
    "Reference",
    "SequenceBatch",
    "TokenStats",
    "UpdateSettings",
    "UpdateStats",
    "build_optimizer",
    "build_sequences",
    "completion_token_stats",
    "completion_token_stats_chunked",
    "completion_token_stats_shared",
    "policy_update",
    "token_logprobs",
    "token_stats",
    "warmup_constant",
    "warmup_cosine",
]
