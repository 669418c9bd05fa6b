"""Data-parallel learner ranks under torch.distributed, with FSDP2 (`fully_shard`).

This module owns the process group of the learner ranks, the sharding of a
decoder, its full (gathered) state dict, and which rows of a rollout batch
each rank holds.

The contract with the learner (learner/update.py): each rank holds whole
prompt groups of the rollout batch (`rank_rows`) and computes its share of the
global-batch loss, the aggregation's counts being global
(`DistributedReduce`, objectives/aggregation.py). The loss of the whole batch
is then the SUM of the ranks' losses, and so is its gradient. FSDP, like DDP,
AVERAGES gradients over ranks by default, which would divide the gradient by
the world size; `shard_model` makes it sum them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FSDPModule, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor
from transformers import PreTrainedModel

from reinforge.distributed.reduce import DistributedReduce
from reinforge.objectives import LOCAL, BatchReduce


@dataclass(frozen=True)
class LearnerGroup:
    """This process's place among the data-parallel learner ranks."""

    rank: int              # 0 .. world_size - 1
    world_size: int
    device: torch.device   # cuda:LOCAL_RANK when CUDA is available, else cpu
    reduce: BatchReduce    # the aggregation's batch-wide counts over all ranks (LOCAL when world_size == 1)


def torchrun_world_size() -> int:
    """How many learner ranks torchrun started (WORLD_SIZE), 1 without torchrun; nothing is initialised."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_learner_group() -> LearnerGroup:
    """The learner group that torchrun's environment (WORLD_SIZE, RANK, LOCAL_RANK, MASTER_ADDR/PORT)
    describes: the default process group joined through env:// (nccl on CUDA, gloo on CPU), or,
    without torchrun (WORLD_SIZE unset or 1), a world of one, with nothing initialised."""
    world = torchrun_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    if world == 1:
        return LearnerGroup(rank=0, world_size=1, device=device, reduce=LOCAL)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # On CUDA, nccl for the model's tensors and gloo for CPU ones (the aggregation's counts may be
    # CPU tensors: DistributedReduce reduces whatever device it is given).
    dist.init_process_group("cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo", init_method="env://")
    return LearnerGroup(rank=dist.get_rank(), world_size=dist.get_world_size(), device=device,
                        reduce=DistributedReduce())


def leave_learner_group(finished: bool) -> None:
    """Leave the default process group; nothing when none was initialised (a world of one).

    `finished`: this rank completed its work, as every rank should have: the ranks first meet at a
    barrier, so that none tears its gloo connections down while another is still inside its last
    collective. Without it, the rank still in a collective aborted at exit ("terminate called
    without an active exception", SIGABRT) in about one 2-rank CPU run in four. After an error the
    barrier is skipped: a rank that failed may never reach it.
    """
    if not dist.is_initialized() or torchrun_world_size() <= 1:
        return       # not learner ranks' group: one that a library in this process made (vLLM's own) stays
    if finished:
        dist.barrier()
    dist.destroy_process_group()


def shard_model(model: PreTrainedModel) -> PreTrainedModel:
    """FSDP2 on every decoder layer (one all-gather / reduce-scatter unit each), then on the root
    (embeddings, final norm, LM head); in place, returned for convenience. Llama-family decoders
    (`model.model.layers`: Llama, Qwen2, Qwen3, Mistral).

    Gradients are summed over ranks (divide factor 1, a plain SUM reduce-scatter: gloo has no AVG or
    pre-multiplied sum), since each rank's loss is already its share of the global loss.

    The root keeps its parameters gathered from a forward until the next backward (FSDP2's default
    for the root). After a forward without gradient, they stay gathered: a change to the weights
    before the next backward (an optimizer step without one) would leave that forward's copy in use.
    `policy_update` always steps after a backward, and the state-dict functions here reshard first.
    """
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise NotImplementedError(f"shard_model shards Llama-family decoders (model.model.layers); "
                                  f"{type(model).__name__} has none")
    for layer in layers:
        fully_shard(layer)
    fully_shard(model)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    # The chunked learner forward (learner/logprobs.py) runs model.get_decoder()(...) and then reads the
    # head's weight, never calling model.forward, so the root's all-gather hook would not fire. Run it
    # on get_decoder instead: the root keeps its parameters gathered after its forward (FSDP2's default
    # for the root) until the backward reshards them, so the decoder call and the head both see them.
    register_fsdp_forward_method(model, "get_decoder")
    return model


def _reshard(model: torch.nn.Module) -> None:
    """Every FSDP unit back on its shards. The root keeps its gathered parameters from a forward until
    the next backward (FSDP2's default for the root), so after a forward without gradient they are
    still registered; the state-dict functions read and write the shards."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def full_state_dict(model: torch.nn.Module) -> dict[str, Tensor]:
    """The whole model's weights, gathered from the shards, on CPU, for checkpoints and weight sync.

    Every rank must call it (it all-gathers each tensor in turn); rank 0 gets the state, the
    others {} (one CPU copy per job, not per rank). Unsharded in a world of one: the plain state.
    """
    _reshard(model)
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_full_state_dict(model: torch.nn.Module, state: dict[str, Tensor]) -> None:
    """Load a full state dict (as `full_state_dict` returns it) into a sharded or plain model.

    Every rank must call it; under torch.distributed rank 0's `state` is broadcast and each rank
    keeps its shards (the other ranks may pass {}).
    """
    _reshard(model)
    # set_model_state_dict replaces the values of the dict it is given: load from a copy.
    set_model_state_dict(model, dict(state),
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=dist.is_initialized()))


def copy_full_weights(sharded: torch.nn.Module, plain: torch.nn.Module) -> None:
    """Copy the weights of a sharded model into `plain`, an unsharded model of the same architecture
    (parameter names as FSDP2 keeps them), on every rank: each parameter all-gathered in turn, so
    the peak memory is one full parameter beyond `plain`. Every rank must call it."""
    _reshard(sharded)
    target = dict(plain.named_parameters())
    with torch.no_grad():
        for name, param in sharded.named_parameters():
            target[name].copy_(param.full_tensor() if isinstance(param, DTensor) else param)


def full_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer state of a sharded model gathered into a full one on CPU (parameters named by their
    fully qualified names), for checkpoints; rank 0 gets it, the others {}. Every rank must call it."""
    _reshard(model)
    return get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_full_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Load a state `full_optimizer_state` returned; every rank passes the full state (each keeps its shards)."""
    _reshard(model)
    set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))


def rank_rows(group_ids: Tensor, rank: int, world: int) -> Tensor:
    """Which rows [N] (bool) of a rollout batch `rank` of `world` holds: whole prompt groups, so that
    per-group work (advantages, curation) needs no other rank's rows.

    Groups, in order of id, are cut into `world` contiguous runs: a group goes to the rank whose even
    share of the rows, [r N / world, (r + 1) N / world), holds the group's middle, so each rank holds
    N / world rows give or take a group. Deterministic: every rank computes the same split. A rank
    gets no rows when there are fewer groups than ranks.
    """
    if not 0 <= rank < world:
        raise ValueError(f"rank must be in [0, {world}), got {rank}")
    n = group_ids.shape[0]
    if n == 0:
        return torch.zeros(0, dtype=torch.bool)
    _, group = torch.unique(group_ids, return_inverse=True)     # [N] in 0 .. G-1
    sizes = torch.bincount(group)                                # [G] rows of each group
    starts = torch.cumsum(sizes, 0) - sizes                      # [G] rows of the groups before it
    owner = ((2 * starts + sizes) * world) // (2 * n)            # [G] the share holding the group's middle
    return owner[group] == rank
