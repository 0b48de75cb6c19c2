"""DTensor access that also works on torch builds without torch.distributed (there, nothing is a DTensor)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

from ..torch_support import UNEVEN_STRIDED_SHARDS_TORCH, places_uneven_strided_shards, release_name

try:
    from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
    # FSDP2 on top of tensor parallelism shards a dim twice and labels the outer split this way; private, but
    # DTensor's own layout code treats it as a Shard kind, and so must anything that reads placements.
    from torch.distributed.tensor.placement_types import _StridedShard
except ImportError:  # a torch built without distributed support
    DTensor = Placement = Replicate = Shard = _StridedShard = None


def is_dtensor(tensor: Tensor) -> bool:
    return DTensor is not None and isinstance(tensor, DTensor)


def any_dtensor(tensors: Iterable[Tensor]) -> bool:
    """Whether any of the tensors is a DTensor, from their types, each asked once (a step asks this of every gradient
    and parameter)."""
    return DTensor is not None and any(issubclass(kind, DTensor) for kind in {type(tensor) for tensor in tensors})


def local_tensor(tensor: Tensor) -> Tensor:
    """The rank's own part of a DTensor (an alias: in-place changes reach the DTensor), or the tensor itself."""
    return tensor.to_local() if is_dtensor(tensor) else tensor


def local_or_none(tensor: Tensor | None) -> Tensor | None:
    """`local_tensor` of optional state (a normalization's second moment, 8-bit codes' scales)."""
    return None if tensor is None else local_tensor(tensor)


def placed_like(grad: Tensor, param: Tensor) -> Tensor:
    """A DTensor gradient with its parameter's placements (a tensor-parallel gradient may arrive Partial)."""
    if is_dtensor(grad) and tuple(grad.placements) != tuple(param.placements):
        return grad.redistribute(param.device_mesh, param.placements)
    return grad


def is_shard(placement: "Placement") -> bool:
    """Shard(dim) or _StridedShard(dim, split_factor): the placement splits a tensor dim over a mesh dim."""
    return isinstance(placement, (Shard, _StridedShard))


def sharded_tensor_dim(placement: "Placement", ndim: int) -> int | None:
    """The (non-negative) tensor dim a Shard kind splits, else None."""
    return placement.dim % ndim if is_shard(placement) else None


def misplaced_strided_runs(shape: tuple[int, ...], mesh_shape: tuple[int, ...], placements: Sequence["Placement"],
                           version: str = torch.__version__) -> str | None:
    """Why torch `version`'s DTensor misplaces the rows of these placements, or None: a _StridedShard cutting its dim
    into unequal runs, on a torch that puts their rows elsewhere than FSDP2 does (`torch_support`). A step or clip
    through them would work on rows reassembled in another order, silently: local shapes often match."""
    if places_uneven_strided_shards(version):
        return None
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, _StridedShard):
            dim, runs = sharded_tensor_dim(placement, len(shape)), placement.split_factor * mesh_shape[mesh_dim]
            if shape[dim] % runs:
                return (f"placement {placement!r} on a mesh dim of {mesh_shape[mesh_dim]} cuts its dim {dim} "
                        f"({shape[dim]}) into {runs} unequal runs, whose rows torch {version}'s DTensor places "
                        f"elsewhere than FSDP2 puts them: use torch >= {release_name(UNEVEN_STRIDED_SHARDS_TORCH)}, "
                        f"or a dim {dim} divisible by {runs}")
    return None


def splits_last_dim(tensor: Tensor) -> bool:
    """Whether a DTensor is split along its last dim on some mesh dim."""
    return is_dtensor(tensor) and any(sharded_tensor_dim(placement, tensor.ndim) == tensor.ndim - 1
                                      for placement in tensor.placements)


def resized_placements(tensor: Tensor, shape: Sequence[int]) -> tuple["Placement", ...] | None:
    """The placements of state of `shape`, DTensor `tensor`'s shape with some dims resized, laid out like it: its own
    along the dims kept, Replicate over a dim it is split along that is reduced to 1; None where such a dim takes
    another size (no layout fits)."""
    placements = []
    for placement in tensor.placements:
        dim = sharded_tensor_dim(placement, tensor.ndim)
        if dim is not None and shape[dim] != tensor.shape[dim]:
            if shape[dim] != 1:
                return None
            placement = Replicate()
        placements.append(placement)
    return tuple(placements)


def zeros_like_resized(tensor: Tensor, shape: Sequence[int], dtype: torch.dtype) -> Tensor:
    """Zeros of `shape`, `tensor`'s shape with some dims resized, on its device. For a DTensor, a DTensor on its mesh
    placed as `resized_placements` says."""
    if not is_dtensor(tensor):
        return torch.zeros(shape, dtype=dtype, device=tensor.device)
    placements = resized_placements(tensor, shape)
    if placements is None:
        raise ValueError(f"a DTensor of shape {tuple(tensor.shape)} placed {tensor.placements} has no state of shape "
                         f"{tuple(shape)} (a dim it is split along may only be reduced to 1)")
    local = tensor.to_local()
    local_shape = [size if shape[dim] == full else shape[dim]
                   for dim, (size, full) in enumerate(zip(local.shape, tensor.shape))]
    zeros = torch.zeros(local_shape, dtype=dtype, device=local.device)
    return DTensor.from_local(zeros, tensor.device_mesh, placements, run_check=False, shape=torch.Size(shape),
                              stride=torch.empty(shape, device="meta").stride())


def laid_out_as(value: Tensor, param: Tensor) -> bool:
    """Whether per-element state `value` (of a shape `zeros_like_resized` makes for `param`) is laid out as the step
    makes it: a plain tensor for a plain parameter; for a DTensor one, a DTensor on its mesh placed as
    `resized_placements` says (a rank's shard of state placed otherwise is another block of the tensor than its
    parameter's shard, which the step would pair with it). State of a shape no layout fits is its shape's problem
    (a second moment of another normalization), reported as such."""
    if not is_dtensor(param):
        return not is_dtensor(value)
    expected = resized_placements(param, value.shape)
    return expected is None or (is_dtensor(value) and value.device_mesh == param.device_mesh
                                and tuple(value.placements) == expected)


def layout_name(tensor: Tensor) -> str:
    """How a tensor is laid out, for messages."""
    return _placed(tensor.placements, tensor.device_mesh) if is_dtensor(tensor) else "a tensor"


def state_layout_name(param: Tensor, shape: Sequence[int]) -> str:
    """How per-element state of `shape` is laid out for `param` (`laid_out_as`), for messages."""
    return _placed(resized_placements(param, shape), param.device_mesh) if is_dtensor(param) else "a tensor"


def _placed(placements: Sequence["Placement"], mesh: object) -> str:
    return f"a DTensor placed {tuple(placements)} on {mesh}"
