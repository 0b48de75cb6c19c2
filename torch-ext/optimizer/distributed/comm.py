"""Every torch.distributed call of the distributed update: process groups, the all-to-alls and the flag reduction."""

from __future__ import annotations

from itertools import product

import torch
import torch.distributed as dist
from torch import Tensor

from .plan import Exchange


def mesh_group(mesh: "dist.DeviceMesh") -> dist.ProcessGroup:
    """One process group over all ranks of a device mesh (any number of dims)."""
    if mesh.ndim == 1:
        return mesh.get_group()
    if mesh.size() == dist.get_world_size():
        return dist.group.WORLD
    return mesh._flatten().get_group()  # a sub-mesh of several dims: its flattened group (no public API yet)


def mesh_group_ranks(mesh: "dist.DeviceMesh", group: dist.ProcessGroup) -> dict[tuple[int, ...], int]:
    """The group rank at each coordinate of the mesh."""
    global_ranks = mesh.mesh
    return {coordinate: dist.get_group_rank(group, int(global_ranks[coordinate]))
            for coordinate in product(*(range(size) for size in global_ranks.shape))}


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
