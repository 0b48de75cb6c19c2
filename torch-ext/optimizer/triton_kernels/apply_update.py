"""The Muon update written into many matrices in one launch: each parameter decayed, then moved by its step size
times its Newton-Schulz result, read where Newton-Schulz left it (a tall matrix's result is the transpose of a
contiguous wide one).

On a GPU, torch's ops took two kernels per parameter for this (`mul_` by the decay, `add_` of the scaled update: 96
for GPT-2 small's 48 matrices), each costing more host time than its memory traffic; here a table of where each
parameter and update start, their sizes and their place in the step's decay and step-size vectors goes to one launch
per dtype pair and orientation, whose programs each write one tile of one parameter.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._launch import ALIGNMENT, SUPPORTED_DTYPES, device_values

# A tile's side: 64 x 64 entries, 16 KiB of float32 parameter, the update's transpose done in the tile.
TILE = 64
# Both sides of a matrix the kernel takes are multiples of this (transformers' are): told so, the compiler knows each
# row of 16-bit or wider entries starts on a 16-byte boundary and moves 16 bytes per access.
SIDE_MULTIPLE = 8
# A row of the address table per matrix: where its parameter and its update start (in 16-byte units from the first
# of each), its rows and columns, and its index in the decay and step-size vectors.
_COLUMNS = 5


@triton.jit
def _apply_tiles_kernel(table, tile_matrix, tile_index, decay, step_sizes, param_like, update_like,
                        COLUMNS: tl.constexpr, TRANSPOSED: tl.constexpr, DECAY: tl.constexpr,
                        PARAM_ELEMENTS_PER_UNIT: tl.constexpr, UPDATE_ELEMENTS_PER_UNIT: tl.constexpr,
                        SIDE_MULTIPLE: tl.constexpr, TILE: tl.constexpr):
    """param <- round(param * decay) + step_size * update on one tile of one matrix, in float32, each stored value
    rounded once to the parameter's dtype as torch's `mul_` and `add_` round them. With TRANSPOSED the update is the
    transpose of a contiguous (cols, rows) matrix, read along its own rows and turned in the tile."""
    tile = tl.program_id(0)
    matrix = tl.load(tile_matrix + tile)
    row = table + matrix * COLUMNS
    param = param_like + tl.load(row) * PARAM_ELEMENTS_PER_UNIT
    update = update_like + tl.load(row + 1) * UPDATE_ELEMENTS_PER_UNIT
    rows = tl.multiple_of(tl.load(row + 2), SIDE_MULTIPLE)
    cols = tl.multiple_of(tl.load(row + 3), SIDE_MULTIPLE)
    index = tl.load(row + 4)
    position = tl.load(tile_index + tile)
    tiles_across = tl.cdiv(cols, TILE)
    r = tl.max_contiguous(tl.multiple_of((position // tiles_across) * TILE + tl.arange(0, TILE), TILE), TILE)
    c = tl.max_contiguous(tl.multiple_of((position % tiles_across) * TILE + tl.arange(0, TILE), TILE), TILE)
    mask = (r[:, None] < rows) & (c[None, :] < cols)
    if TRANSPOSED:
        turned = tl.load(update + c[:, None] * rows + r[None, :], mask=(c[:, None] < cols) & (r[None, :] < rows))
        u = tl.trans(turned).to(tl.float32)
    else:
        u = tl.load(update + r[:, None] * cols + c[None, :], mask=mask).to(tl.float32)
    offsets = r[:, None] * cols + c[None, :]
    p = tl.load(param + offsets, mask=mask)
    if DECAY:
        p = (p.to(tl.float32) * tl.load(decay + index).to(tl.float32)).to(p.dtype)
    p = p.to(tl.float32) + tl.load(step_sizes + index) * u
    tl.store(param + offsets, p.to(param.dtype.element_ty), mask=mask)


def apply_takes(param: Tensor, update: Tensor) -> bool:
    """Whether the kernel writes this parameter's update: a contiguous matrix of a dtype it supports, both sides
    multiples of SIDE_MULTIPLE, and an update of its shape that is contiguous or the transpose of a contiguous matrix,
    both from 16-byte boundaries."""
    return (param.dtype in SUPPORTED_DTYPES and update.dtype in SUPPORTED_DTYPES and param.dim() == 2
            and param.shape[0] % SIDE_MULTIPLE == 0 and param.shape[1] % SIDE_MULTIPLE == 0
            and update.shape == param.shape and param.is_contiguous()
            and (update.is_contiguous() or update.t().is_contiguous())
            and param.data_ptr() % ALIGNMENT == 0 and update.data_ptr() % ALIGNMENT == 0)


def launch_apply_(params: Sequence[Tensor], updates: Sequence[Tensor], decay: Tensor | None,
                  step_sizes: Sequence[float] | Tensor, indices: Sequence[int]) -> None:
    """`param * decay[i] + step_sizes[i] * update` for the parameters at `indices`, which `apply_takes` took, of one
    parameter dtype, one update dtype and one orientation (all contiguous updates, or all transposed): one launch.
    `decay`: (N,) in `functional.decay_dtype` on the parameters' device, or None (no decay). `step_sizes`: (N,)
    float32 on the device, or numbers, which go there in one copy kept for the next launches with the same ones."""
    param_like, update_like = params[indices[0]], updates[indices[0]]
    param_base, update_base = param_like.data_ptr(), update_like.data_ptr()
    rows = tuple(value for i in indices
                 for value in ((params[i].data_ptr() - param_base) // ALIGNMENT,
                               (updates[i].data_ptr() - update_base) // ALIGNMENT, *params[i].shape, i))
    table = device_values(rows, torch.int64, param_like.device)
    tile_matrix, tile_index = _tile_tables(rows[2::_COLUMNS], rows[3::_COLUMNS], param_like.device)
    sizes = step_sizes if isinstance(step_sizes, Tensor) else device_values(tuple(step_sizes), torch.float32,
                                                                             param_like.device)
    _apply_tiles_kernel[(tile_matrix.numel(),)](
        table, tile_matrix, tile_index, decay if decay is not None else sizes, sizes, param_like,
        update_like, COLUMNS=_COLUMNS, TRANSPOSED=not update_like.is_contiguous(), DECAY=decay is not None,
        PARAM_ELEMENTS_PER_UNIT=ALIGNMENT // param_like.element_size(),
        UPDATE_ELEMENTS_PER_UNIT=ALIGNMENT // update_like.element_size(), SIDE_MULTIPLE=SIDE_MULTIPLE, TILE=TILE)


@functools.lru_cache(maxsize=32)  # a few rounds of buckets per step, each in one or two orientations
def _tile_tables(rows: tuple[int, ...], cols: tuple[int, ...], device: torch.device) -> tuple[Tensor, Tensor]:
    """Each program's matrix and its tile's place in that matrix (row-major over the tiles), for matrices of these
    sizes, kept on the device for the next steps."""
    tiles = torch.tensor([-(-r // TILE) * -(-c // TILE) for r, c in zip(rows, cols)], dtype=torch.int64, device="cpu")
    tile_matrix = torch.repeat_interleave(torch.arange(len(rows), device="cpu"), tiles)
    tile_index = torch.arange(tile_matrix.numel(), device="cpu") - (torch.cumsum(tiles, 0) - tiles)[tile_matrix]
    return tile_matrix.to(device), tile_index.to(device)
