"""Scale-out on existing engines (torch.distributed, later Ray): never a home-made RPC."""

from reinforge.distributed.fsdp import (
    LearnerGroup,
    copy_full_weights,
    full_optimizer_state,
    full_state_dict,
    init_learner_group,
    leave_learner_group,
    load_full_optimizer_state,
    load_full_state_dict,
    rank_rows,
    shard_model,
    torchrun_world_size,
)
from reinforge.distributed.reduce import DistributedReduce

__all__ = [
    "DistributedReduce",
    "LearnerGroup",
    "copy_full_weights",
    "full_optimizer_state",
    "full_state_dict",
    "init_learner_group",
    "leave_learner_group",
    "load_full_optimizer_state",
    "load_full_state_dict",
    "rank_rows",
    "shard_model",
    "torchrun_world_size",
]
