"""Every torch.distributed call of the distributed update: process groups, the all-to-alls and the flag reduction."""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from .dtensors import Placement
from .plan import Exchange


def mesh_group(mesh: "dist.DeviceMesh") -> dist.ProcessGroup:
    """One process group over all ranks of a device mesh (any number of dims)."""
    if mesh.ndim == 1:
        return mesh.get_group()
    if mesh.size() == dist.get_world_size():
        return dist.group.WORLD
    return _flattened_group(mesh)


def spread_mesh_dims(mesh: "dist.DeviceMesh", placements: Sequence["Placement"]) -> tuple[int, ...]:
    """The mesh dims a DTensor's update runs over: those that shard it, so that each replica group (HSDP's
    replicate dim) runs its own owners and no traffic crosses replicas; every dim when nothing shards it (the
    replicas then split the Newton-Schulz work, as under DDP). Several sharding dims beside a replicate dim need
    a flattened sub-mesh, which only a mesh with dim names offers; without names the update spans the mesh."""
    dims = tuple(i for i, placement in enumerate(placements) if not placement.is_replicate())
    if not dims or len(dims) == mesh.ndim or (len(dims) > 1 and not mesh.mesh_dim_names):
        return tuple(range(mesh.ndim))
    return dims


def spread_group(mesh: "dist.DeviceMesh", dims: tuple[int, ...]) -> dist.ProcessGroup:
    """One process group over the ranks of `mesh` that share this rank's coordinates outside `dims`."""
    if len(dims) == mesh.ndim:
        return mesh_group(mesh)
    if len(dims) == 1:
        return mesh.get_group(dims[0])
    return _flattened_group(mesh[tuple(mesh.mesh_dim_names[i] for i in dims)])


def _flattened_group(mesh: "dist.DeviceMesh") -> dist.ProcessGroup:
    """One process group over the ranks of a sub-mesh of several dims, made as `DeviceMesh._flatten()` makes it but
    not registered with the root mesh: once registered, torch 2.13's redistribution gathers a DTensor sharded over
    those dims in one collective, and for uneven shards put the rows out of order (`full_tensor()` of a (10, 6)
    tensor placed (Replicate(), Shard(0), Shard(0)) on a (1, 2, 2) mesh), in the user's code after our step. Torch
    versions whose meshes have no layouts flatten as they do (no public API for either)."""
    layout = getattr(mesh, "_layout", None)
    if layout is None:
        return mesh._flatten().get_group()
    root = mesh._get_root_mesh()
    # Kept with the root mesh, as torch keeps its flattened meshes, and made once per layout (every rank of the root
    # takes part in making it): meshes compare by value, so a cache of our own would hand a mesh rebuilt after a new
    # init_process_group the destroyed group of an equal one.
    groups = root.__dict__.setdefault("_muon_flattened_groups", {})
    if layout not in groups:
        flat = type(mesh)(root.device_type, _layout=_flat_layout(layout), _rank_map=root._rank_map,
                          mesh_dim_names=("_".join(mesh.mesh_dim_names),), _root_mesh=root)
        groups[layout] = flat.get_group()
    return groups[layout]


def _flat_layout(layout: Any) -> Any:
    """The one-dim layout over all of a mesh layout's ranks, in the form torch's own `_flatten` makes it: torch
    2.13's layouts collapse into one flat axis, torch 2.12's coalesce and nest (its layouts have no `collapse`)."""
    from torch.distributed._mesh_layout import _MeshLayout

    if hasattr(layout, "collapse"):
        return _MeshLayout([layout.collapse()])
    flat = layout.coalesce()
    return flat.nest() if len(flat) > 1 else flat


@lru_cache(maxsize=256)  # every step asks for every parameter: at 512 ranks an answer took over 0.7 ms of Python
def spread_group_ranks(mesh: "dist.DeviceMesh", dims: tuple[int, ...], group: dist.ProcessGroup) -> tuple[int, ...]:
    """The group rank at each coordinate of the sub-mesh over `dims` that holds this rank, in row-major order."""
    coordinate = mesh.get_coordinate()
    index = tuple(slice(None) if i in dims else coordinate[i] for i in range(mesh.ndim))
    return tuple(dist.get_group_rank(group, rank) for rank in mesh.mesh[index].reshape(-1).tolist())


def rank_and_world(group: dist.ProcessGroup) -> tuple[int, int]:
    return dist.get_rank(group), dist.get_world_size(group)


def launch_all_to_all(send: Tensor, exchange: Exchange,
                      group: dist.ProcessGroup) -> tuple[dist.Work | None, Tensor]:
    """Starts the exchange and returns (work, receive buffer); the buffer is valid once `wait` returned.
    When the plan says no rank sends anything, nothing is launched (every rank decides the same)."""
    received = torch.empty(exchange.recv_total, dtype=send.dtype, device=send.device)
    if not exchange.moves_data:
        return None, received
    work = dist.all_to_all_single(received, send, output_split_sizes=exchange.recv_counts,
                                  input_split_sizes=exchange.send_counts, group=group, async_op=True)
    return work, received


def wait(work: dist.Work | None) -> None:
    if work is not None:
        work.wait()


def all_reduce_min_(flags: Tensor, group: dist.ProcessGroup) -> Tensor:
    """In place: each flag becomes its minimum over the group's ranks."""
    dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=group)
    return flags


def all_reduce_sum_(tensor: Tensor, group: dist.ProcessGroup) -> Tensor:
    """In place: each entry becomes its sum over the group's ranks."""
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor
