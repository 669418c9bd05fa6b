"""The learner: log-probs of completions, the policy update, optimizers."""

from reinforge.learner.optim import build_optimizer, warmup_constant, warmup_cosine
from reinforge.learner.reference import Reference
from reinforge.learner.sequences import (
    SequenceBatch,
    TokenStats,
    build_sequences,
    completion_token_stats,
    token_logprobs,
)
from reinforge.learner.update import LearnerBatch, UpdateStats, policy_update

__all__ = [
    "LearnerBatch",
    "Reference",
    "SequenceBatch",
    "TokenStats",
    "UpdateStats",
    "build_optimizer",
    "build_sequences",
    "completion_token_stats",
    "policy_update",
    "token_logprobs",
    "warmup_constant",
    "warmup_cosine",
]
