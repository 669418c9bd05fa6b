"""Scale-out on existing engines (torch.distributed, later Ray): never a home-made RPC."""

from reinforge.distributed.reduce import DistributedReduce

__all__ = ["DistributedReduce"]
