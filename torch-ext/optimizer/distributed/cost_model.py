"""`plan_step`: what one distributed Muon step costs each rank, predicted from the planning code the step runs.

The step's own decisions, not a model of them: the matrix views (`routing.matrix_view`), the shard layouts
(`layout.sharded_layout`), which matrices stay where they are (`assignment.holds_whole_matrices`), the owners and
chunks (`assignment.chunked_owners`), every all-to-all's split sizes (`plan.gather_exchange`,
`plan.scatter_exchange`) and the work of the iteration each matrix gets (`assignment.iteration_flops`). So the
bytes are the bytes the pipeline sends, exactly; the FLOPs are that iteration's products, and the times are a
roofline over a `DeviceModel`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from ..routing import MatrixView, matrix_view
from .assignment import chunked_owners, holds_whole_matrices, iteration_flops
from .dtensors import Placement
from .layout import box_numel, sharded_layout
from .plan import gather_exchange, scatter_exchange


@dataclass(frozen=True)
class DeviceModel:
    """What a prediction assumes of every rank: the Newton-Schulz products' sustained FLOP/s, the bytes per second
    a rank sends (and, at once, receives) in an all-to-all, and the fixed cost of launching one."""

    matmul_flops: float
    link_bytes_per_s: float
    collective_latency_s: float = 30e-6


@dataclass(frozen=True)
class StepPlan:
    """One rank per entry: Newton-Schulz FLOPs, bytes sent to and received from other ranks. `collectives`: the
    all-to-alls every rank launches; `chunks`: the pipeline's chunks. The times (None without a device) are the
    slowest rank's: `time_serial_s` with every transfer waited for, `time_overlapped_s` with the transfers hidden
    behind the products but for the first chunk's gather and the last chunk's scatter (see `_times`)."""

    flops_per_rank: list[float]
    bytes_sent_per_rank: list[int]
    bytes_received_per_rank: list[int]
    collectives: int
    chunks: int
    time_serial_s: float | None
    time_overlapped_s: float | None

    @property
    def bytes_per_rank(self) -> list[int]:
        """Bytes each rank sends (what its link carries out; receipts are the same total over the ranks)."""
        return self.bytes_sent_per_rank

    @property
    def balance(self) -> float:
        """The slowest rank's Newton-Schulz FLOPs over the mean (1.0: perfectly balanced)."""
        mean = sum(self.flops_per_rank) / len(self.flops_per_rank)
        return max(self.flops_per_rank) / mean if mean else 1.0


def plan_step(shapes: Sequence[Sequence[int]], world: int, *, placements: Sequence[Placement] | None = None,
              mesh_shape: Sequence[int] | None = None, chunk_size: int | None = None,
              comm_dtype: torch.dtype = torch.bfloat16, ns_steps: int = 5, ns_algorithm: str = "auto",
              ns_dtype: torch.dtype = torch.bfloat16, param_layout: str = "auto", conv_mode: str = "flatten",
              device: DeviceModel | None = None) -> StepPlan:
    """The cost of one Muon step over `world` ranks for parameters of `shapes` (global shapes, as DTensors have),
    laid out by `placements` over a mesh of `mesh_shape` (default: one mesh dim of `world` ranks, Shard(0), as
    FSDP2 shards). The mesh is the one the step spreads over: under HSDP, the shard dims (each replica group runs
    the same plan). `chunk_size`, `comm_dtype`, `ns_steps`, `ns_algorithm`, `ns_dtype` (None in Muon is the
    device's: bfloat16 on GPUs), `param_layout` and `conv_mode` are Muon's options."""
    from torch.distributed.tensor import Shard  # noqa: PLC0415 (torch.distributed is optional at import)

    placements = tuple(placements or (Shard(0),))
    mesh_shape = tuple(mesh_shape or (world,))
    if math.prod(mesh_shape) != world or len(mesh_shape) != len(placements):
        raise ValueError(f"Invalid mesh_shape: {mesh_shape} with placements {placements} for {world} ranks")
    views = [matrix_view(tuple(shape), param_layout, conv_mode) for shape in shapes]
    layouts = [sharded_layout(tuple(shape), mesh_shape, placements, tuple(range(world))) for shape in shapes]
    def work(view: MatrixView) -> float:
        return iteration_flops(view, ns_steps, ns_algorithm, ns_dtype)

    flops = [0.0] * world
    spread = []
    for j, (view, layout) in enumerate(zip(views, layouts)):
        if not holds_whole_matrices(view, layout):
            spread.append(j)
            continue
        for rank, box in enumerate(layout.boxes):  # each rank its own matrices, in place
            flops[rank] += work(replace(view, batch=box_numel(box) // (view.rows * view.cols)))
    costs = [work(views[j]) for j in spread]
    owners, chunks = chunked_owners(costs, world, chunk_size)
    for index, owner in enumerate(owners):
        flops[owner] += costs[index]
    sent, received = [0] * world, [0] * world
    itemsize = torch.empty((), dtype=comm_dtype).element_size()
    collectives = 0
    # Per chunk, the bytes each rank's link carries in its gather and in its scatter (the larger direction).
    link_bytes: list[tuple[list[int], list[int]]] = []
    for chunk in chunks:
        chunk_layouts = [layouts[spread[i]] for i in chunk]
        chunk_owners = [owners[i] for i in chunk]
        carried = []
        for exchange_of in (gather_exchange, scatter_exchange):
            exchanges = [exchange_of(chunk_layouts, chunk_owners, rank) for rank in range(world)]
            collectives += exchanges[0].moves_data  # the same on every rank
            for rank, exchange in enumerate(exchanges):
                sent[rank] += exchange.send_total * itemsize
                received[rank] += exchange.recv_total * itemsize
            carried.append([max(exchange.send_total, exchange.recv_total) * itemsize for exchange in exchanges])
        link_bytes.append((carried[0], carried[1]))
    serial = overlapped = None
    if device is not None:
        serial, overlapped = _times(flops, link_bytes, collectives, device)
    return StepPlan(flops, sent, received, collectives, len(chunks), serial, overlapped)


def _times(flops: list[float], link_bytes: list[tuple[list[int], list[int]]], collectives: int,
           device: DeviceModel) -> tuple[float, float]:
    """(serial, overlapped) step times of the slowest rank. A rank's transfer time is, per all-to-all, the larger of
    what it sends and receives over the link bandwidth, plus each collective's latency. Serial: products plus
    transfers. Overlapped: the first chunk's gather and the last chunk's scatter wait (nothing runs beside them), the
    other transfers run under the products."""
    serial = overlapped = 0.0
    for rank, rank_flops in enumerate(flops):
        compute = rank_flops / device.matmul_flops
        transfer = (sum(gather[rank] + scatter[rank] for gather, scatter in link_bytes) / device.link_bytes_per_s
                    + collectives * device.collective_latency_s)
        exposed = 0.0
        if link_bytes:
            exposed = (link_bytes[0][0][rank] + link_bytes[-1][1][rank]) / device.link_bytes_per_s
        serial = max(serial, compute + transfer)
        overlapped = max(overlapped, exposed + max(compute, transfer - exposed))
    return serial, overlapped
