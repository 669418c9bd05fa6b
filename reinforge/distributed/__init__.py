"""Scale-out on existing engines (torch.distributed, later Ray): never a home-made RPC."""

from reinforge.distributed.fsdp import (
    LearnerGroup,
    full_state_dict,
    init_learner_group,
    load_full_state_dict,
    rank_rows,
    shard_model,
)
from reinforge.distributed.reduce import DistributedReduce

__all__ = [
    "DistributedReduce",
    "LearnerGroup",
    "full_state_dict",
    "init_learner_group",
    "load_full_state_dict",
    "rank_rows",
    "shard_model",
]
