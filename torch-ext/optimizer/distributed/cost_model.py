"""`plan_step`: what one distributed Muon step costs each rank, predicted from the planning code the step runs.

The step's own decisions, not a model of them: the matrix views (`routing.matrix_view`), the shard layouts
(`layout.sharded_layout`), which matrices stay where they are, the shares, their owners and the chunks
(`assignment.plan_spread`), every all-to-all's transfers (`plan.gather_transfers` and `plan.scatter_transfers`,
counted per rank by `plan.gather_numels` and `plan.scatter_numels`, and `split_newton_schulz.among_owners` for divided
matrices) and the work of the iteration each share gets (`assignment.rank_flops`). So the bytes are the bytes the
pipeline sends, exactly; the FLOPs are those iterations' products, and the times are a roofline over a `DeviceModel`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..newton_schulz import NS_ALGORITHMS
from ..option_values import as_integer, check_choice, check_chunk_size, check_float_dtype, check_ns_steps
from ..routing import CONV_MODES, PARAM_LAYOUTS, matrix_view
from .assignment import COLUMNS, plan_spread, rank_flops
from .dtensors import Placement
from .layout import sharded_layout
from .plan import gather_numels, scatter_numels, transfer_numels
from .split_newton_schulz import among_owners


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
              device: DeviceModel | None = None, mesh_device_type: str = "cuda") -> StepPlan:
    """The cost of one Muon step over `world` ranks for parameters of `shapes` (global shapes, as DTensors have),
    laid out by `placements` over a mesh of `mesh_shape` (default: one mesh dim of `world` ranks, Shard(0), as
    FSDP2 shards). The mesh is the one the step spreads over: under HSDP, the shard dims (each replica group runs
    the same plan). `chunk_size`, `comm_dtype`, `ns_steps`, `ns_algorithm`, `ns_dtype` (None in Muon is the
    device's: bfloat16 on GPUs), `param_layout` and `conv_mode` are Muon's options. `mesh_device_type` is the
    device type of the mesh ("cpu" meshes divide no matrix by columns, see `assignment.NO_COLUMN_DIVISION_ON`)."""
    from torch.distributed.tensor import Shard  # noqa: PLC0415 (torch.distributed is optional at import)

    _check_plan_options(world, chunk_size, comm_dtype, ns_steps, ns_algorithm, ns_dtype, param_layout, conv_mode,
                        mesh_device_type)
    placements = tuple(placements or (Shard(0),))
    mesh_shape = tuple(mesh_shape or (world,))
    if math.prod(mesh_shape) != world or len(mesh_shape) != len(placements):
        raise ValueError(f"Invalid mesh_shape: {mesh_shape} with placements {placements} for {world} ranks")
    views = [matrix_view(tuple(shape), param_layout, conv_mode) for shape in shapes]
    layouts = [sharded_layout(tuple(shape), mesh_shape, placements, tuple(range(world))) for shape in shapes]
    plan = plan_spread(tuple(views), tuple(layouts), world, ns_steps, ns_algorithm, ns_dtype, mesh_device_type,
                       chunk_size)
    spread, shares, chunks = plan.spread, plan.shares, plan.chunks
    flops = rank_flops(plan.works, shares, world, plan.base)
    sent, received = [0] * world, [0] * world
    collectives = 0
    # Per exchange, the bytes each rank's link carries (the larger direction): the first is a chunk's gather, the
    # last its scatter.
    link_bytes: list[list[int]] = []
    comm_size, gram_size = comm_dtype.itemsize, ns_dtype.itemsize
    for chunk in chunks:
        chunk_layouts = [layouts[spread[i]] for i in chunk]
        chunk_shares = [shares[i] for i in chunk]
        exchanges = [(gather_numels(chunk_layouts, chunk_shares), comm_size)]
        divided = {index: [share.owner for share in item_shares] for index, item_shares in enumerate(chunk_shares)
                   if item_shares[0].kind == COLUMNS}
        if divided:  # split Newton-Schulz: the squares for the norm, then each step's parts of X Xᵀ
            squares = {index: (1,) for index in divided}
            grams = {index: (min(views[spread[chunk[index]]].rows, views[spread[chunk[index]]].cols),) * 2
                     for index in divided}
            exchanges.append((transfer_numels(among_owners(divided, squares), world), 4))
            exchanges += [(transfer_numels(among_owners(divided, grams), world), gram_size)] * ns_steps
        exchanges.append((scatter_numels(chunk_layouts, chunk_shares), comm_size))
        for (out_numels, into_numels), itemsize in exchanges:
            out, into = [n * itemsize for n in out_numels], [n * itemsize for n in into_numels]
            collectives += any(out)
            sent = [a + b for a, b in zip(sent, out)]
            received = [a + b for a, b in zip(received, into)]
            link_bytes.append([max(a, b) for a, b in zip(out, into)])
    serial = overlapped = None
    if device is not None:
        serial, overlapped = _times(flops, link_bytes, collectives, device)
    return StepPlan(flops, sent, received, collectives, len(chunks), serial, overlapped)


def _times(flops: list[float], link_bytes: list[list[int]], collectives: int,
           device: DeviceModel) -> tuple[float, float]:
    """(serial, overlapped) step times of the slowest rank. A rank's transfer time is, per all-to-all, the larger of
    what it sends and receives over the link bandwidth, plus each collective's latency. Serial: products plus
    transfers. Overlapped: the first chunk's gather and the last chunk's scatter wait (nothing runs beside them), the
    other transfers run under the products."""
    serial = overlapped = 0.0
    for rank, own_flops in enumerate(flops):
        compute = own_flops / device.matmul_flops
        transfer = (sum(carried[rank] for carried in link_bytes) / device.link_bytes_per_s
                    + collectives * device.collective_latency_s)
        exposed = 0.0
        if link_bytes:
            exposed = (link_bytes[0][rank] + link_bytes[-1][rank]) / device.link_bytes_per_s
        serial = max(serial, compute + transfer)
        overlapped = max(overlapped, exposed + max(compute, transfer - exposed))
    return serial, overlapped


def _check_plan_options(world: int, chunk_size: int | None, comm_dtype: torch.dtype, ns_steps: int, ns_algorithm: str,
                        ns_dtype: torch.dtype, param_layout: str, conv_mode: str, mesh_device_type: str) -> None:
    """`plan_step`'s arguments, Muon's options checked as Muon checks them."""
    if not (as_integer(world) or 0) >= 1:
        raise ValueError(f"Invalid world: {world!r} (expected an integer >= 1)")
    check_chunk_size(chunk_size)
    check_float_dtype("comm_dtype", comm_dtype)
    check_ns_steps(ns_steps)
    check_choice("ns_algorithm", ns_algorithm, NS_ALGORITHMS)
    check_float_dtype("ns_dtype", ns_dtype)
    check_choice("param_layout", param_layout, PARAM_LAYOUTS)
    check_choice("conv_mode", conv_mode, CONV_MODES)
    try:
        torch.device(mesh_device_type)
    except (RuntimeError, TypeError):
        raise ValueError(f"Invalid mesh_device_type: {mesh_device_type!r} (expected a torch device type: 'cuda', "
                         "'cpu', ...)") from None
