"""DTensor access that also works on torch builds without torch.distributed (there, nothing is a DTensor)."""

from __future__ import annotations

from torch import Tensor

try:
    from torch.distributed.tensor import DTensor, Placement, Shard
except ImportError:  # a torch built without distributed support
    DTensor = Placement = Shard = None


def is_dtensor(tensor: Tensor) -> bool:
    return DTensor is not None and isinstance(tensor, DTensor)


def local_tensor(tensor: Tensor) -> Tensor:
    """The rank's own part of a DTensor (an alias: in-place changes reach the DTensor), or the tensor itself."""
    return tensor.to_local() if is_dtensor(tensor) else tensor


def shard_dim(placement: "Placement") -> int | None:
    """The tensor dim a plain Shard placement splits, else None (Replicate, or a placement of another kind)."""
    return placement.dim if type(placement) is Shard else None  # not subclasses: _StridedShard rows interleave
