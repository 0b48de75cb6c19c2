"""Optimizer state kept in fewer bytes than float32: bfloat16 moments, or 8-bit codes with one float32 scale per block.

The update math runs in float32 on a working copy of the state. Writing it back rounds each entry down or up at
random, up with probability equal to its distance from the lower representable value in units of their spacing, so
the rounding is unbiased: a momentum fed a small constant gradient keeps moving, where round-to-nearest would stall it
as soon as each step's change falls below half a spacing (bfloat16: 0.4% of the value; 8-bit codes: 6%).

"int8" stores each moment as 8-bit codes times a float32 scale per block of `BLOCK` entries along the last dim (the
block's largest magnitude maps to the largest code). Blocks along the last dim, not along the flattened tensor, keep
a parameter's blocks whole under sharding on any other dim. Muon's momentum (signed, about Gaussian within a block,
and orthogonalized next, which lifts noise in its weak directions to full size) takes linear codes -127..127: an
error of at most 1/127 of the block's largest. AdamW's moments take the values of float8 e4m3 (3 mantissa bits: a
nonlinear code, fine near zero, like bitsandbytes' dynamic map), the second moment's codes holding its square root
so a block spans the same range of gradient sizes: both keep the same relative precision, so m / sqrt(v) stays near
its true size for small entries (linear codes for m would round a small m up to the block's step, a far larger
ratio). Measured on the demo GPT (300 steps, seed 0), final held-out loss above float32 state's: e4m3 codes for Muon's
momentum alone, 2.1%; linear codes for it and e4m3 for AdamW's, 0.6% (bfloat16 state: 0.6%).

The random bits are a hash of each entry's index in the whole tensor (a shard's entries too, so the result does not
depend on how a tensor is split over ranks) and the parameter's count of rounded writes: no generator, so a step is
reproducible, traces into a compiled graph, and a checkpoint resumes exactly, resharded or not (the count is state).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

import torch
from torch import Tensor
from torch.nn import functional

# None: the moments have the parameter's dtype; bfloat16: half the bytes of float32; "int8": 8-bit codes and a scale
# per block, a quarter of the bytes and 1/64 more.
STATE_DTYPES: tuple[torch.dtype | str | None, ...] = (None, torch.bfloat16, "int8")
# Measured on the demo GPT's moments after 40 steps (relative RMS error of one storing): Muon's linear codes 0.77%
# with blocks of 32, 0.94% of 128, 0.97% of 256, 1.01% of whole 512-entry rows; AdamW's e4m3 codes 3.4-3.8% for every
# size. 256 keeps the scales at 1.6% of the codes' bytes (4 / 256) for an error within 0.2 points of 32's.
BLOCK = 256
# State keys of the moments. Their "int8" form is kept under keys of its own: the codes under "<key>_codes", their
# scales under "<key>_scale". DCP loads a checkpoint into the state at hand, cast to its dtypes: codes under the
# moment's own key loaded into another form's values as numbers (and torch's flatten_optimizer_state_dict rebuilds a
# state's keys from the live state, so a state dict keyed apart from it would not load there).
MOMENT_KEYS = ("momentum_buffer", "exp_avg", "exp_avg_sq")
_LINEAR_CODED = ("momentum_buffer",)  # the other moments take e4m3 codes
_STORED_AS_ROOT = ("exp_avg_sq",)


def _int32(word: int) -> int:
    """A 32-bit constant as the int32 of the same bits."""
    return word - (1 << 32) if word >= 1 << 31 else word


_GOLDEN = _int32(0x9E3779B9)  # 2^32 / golden ratio: consecutive counts land far apart
_MURMUR_1, _MURMUR_2 = _int32(0x85EBCA6B), _int32(0xC2B2AE35)
_CODE_DTYPE = torch.float8_e4m3fn
_CODE_MAX = torch.finfo(_CODE_DTYPE).max  # 448
_LINEAR_MAX = 127.0
_CODE_MIN_NORMAL = torch.finfo(_CODE_DTYPE).smallest_normal  # 2^-6; below it, codes are 2^-9 apart
_SUBNORMAL_STEPS = 2.0 ** 9
# float32 mantissa bits the stored form drops: bfloat16 keeps 7 of 23, e4m3 keeps 3.
_DROPPED_BITS = {torch.bfloat16: 16, _CODE_DTYPE: 20}


def stored_dtype(param_dtype: torch.dtype, state_dtype: torch.dtype | str | None) -> torch.dtype:
    """The dtype a parameter's moments are stored in under a group's `state_dtype`."""
    if state_dtype is None:
        return param_dtype
    return torch.int8 if state_dtype == "int8" else state_dtype


def rounds_stochastically(state_dtype: torch.dtype | str | None) -> bool:
    return state_dtype is not None


def is_quantized(state_dtype: torch.dtype | str | None) -> bool:
    return state_dtype == "int8"


def scale_key(key: str) -> str:
    return f"{key}_scale"


def codes_key(key: str) -> str:
    return f"{key}_codes"


CODES_KEYS = tuple(map(codes_key, MOMENT_KEYS))


def stored_moment(state: Mapping[str, Tensor], key: str) -> tuple[Tensor, Tensor | None]:
    """A parameter's moment `key` as its state keeps it: its 8-bit codes and their scales, or its values and None."""
    codes = state.get(codes_key(key))
    return (state[key], None) if codes is None else (codes, state[scale_key(key)])


def scales_shape(shape: Sequence[int]) -> tuple[int, ...]:
    """The scales of an "int8" moment of `shape`: one per block of BLOCK entries along the last dim."""
    if not shape:
        return (1,)
    return (*shape[:-1], math.ceil(shape[-1] / BLOCK))


def moment_code(key: str, scales: Tensor | None) -> str:
    """The stored form of moment `key` as the compiled ops name it: "bfloat16", or for "int8" state "linear" (codes
    -127..127), "e4m3" or "e4m3_root" (e4m3 values of the square root)."""
    if scales is None:
        return "bfloat16"
    if key in _LINEAR_CODED:
        return "linear"
    return "e4m3_root" if key in _STORED_AS_ROOT else "e4m3"


def working_copy(key: str, stored: Tensor, scales: Tensor | None) -> Tensor:
    """The float32 values of the stored moment `key` (a new tensor)."""
    code = moment_code(key, scales)
    if code == "bfloat16":
        return stored.float()
    codes = stored if code == "linear" else stored.view(_CODE_DTYPE)
    values = _unblocked(_blocks(codes.float()) * scales.unsqueeze(-1), stored.shape).contiguous()
    return values.square_() if code == "e4m3_root" else values


class EntryPositions(NamedTuple):
    """Where a shard's entries lie in the whole tensor, the index their random bits are hashed from: entry k of the
    shard (row-major), with (r, c) = divmod(k, len(columns)), lies at rows[r] + columns[c]. Two int64 vectors on the
    shard's device, each the positions of a block of dims (each dim's global index times its stride), where a
    shard-sized int64 tensor took 8 bytes per entry at every step; the compiled ops read them as they are."""

    rows: Tensor
    columns: Tensor

    def of(self, shape: Sequence[int], offset: int = 0) -> Tensor:
        """The positions of the entries of `shape` from entry `offset` on, as one tensor (the torch fallbacks')."""
        entries = torch.arange(offset, offset + math.prod(shape), device=self.rows.device)
        columns = max(len(self.columns), 1)  # an empty shard's may be empty: no entries to divide
        return (self.rows[entries // columns] + self.columns[entries % columns]).view(shape)


def store_(keys: Sequence[str], stored: Sequence[Tensor], scales: Sequence[Tensor | None], values: Sequence[Tensor],
           rounding_counts: Sequence[Tensor], taken: Tensor, positions: Sequence[EntryPositions | None]) -> None:
    """stored[i], the moment keys[i] (with scales[i] for "int8"), <- values[i] (float32), rounded stochastically with
    random bits salted by rounding_counts[i] and by each entry's index in the whole tensor, positions[i] (None: the
    tensor is whole); where taken[i] is 0.0 (a skipped step) nothing changes. Each count then moves by taken[i]; a
    count listed several times (one parameter's two moments) moves once."""
    for key, state, scale, value, count, step_taken, position in zip(keys, stored, scales, values, rounding_counts,
                                                                     taken.unbind(), positions):
        write_rounded_(key, state, scale, value, count, step_taken, position)
    moved: dict[int, tuple[Tensor, Tensor]] = {}
    for count, step_taken in zip(rounding_counts, taken.unbind()):
        moved.setdefault(id(count), (count, step_taken))
    advance_counts_([count for count, _ in moved.values()], torch.stack([flag for _, flag in moved.values()]))


def write_rounded_(key: str, stored: Tensor, scale: Tensor | None, value: Tensor, rounding_count: Tensor,
                   taken: Tensor, positions: EntryPositions | None, offset: int = 0) -> None:
    """One moment of `store_`, leaving its count as it is; `value` holds the entries from `offset` on (a chunk)."""
    if positions is not None:
        position = positions.of(value.shape, offset)
    else:
        end = offset + value.numel()
        position = torch.arange(offset, end, dtype=_index_dtype(end), device=value.device).view(value.shape)
    code = moment_code(key, scale)
    if code == "bfloat16":
        rounded = _stochastically_rounded(value, _random_bits(rounding_count, position), stored.dtype)
        stored.copy_(torch.where(taken > 0, rounded, stored))
        return
    if code == "linear":
        codes, new_scales = _quantized(value, rounding_count, position, _LINEAR_MAX, _linear_codes)
    else:
        root = value.sqrt() if code == "e4m3_root" else value
        codes, new_scales = _quantized(root, rounding_count, position, _CODE_MAX, _e4m3_codes)
    stored.copy_(torch.where(taken > 0, codes, stored))
    scale.copy_(torch.where(taken > 0, new_scales, scale))


def advance_counts_(rounding_counts: Sequence[Tensor], taken: Tensor) -> None:
    """Each count of rounded writes moves by its parameter's taken flag (0.0 or 1.0)."""
    if rounding_counts:
        torch._foreach_add_(list(rounding_counts), list(taken.to(rounding_counts[0].dtype).unbind()))


def _quantized(value: Tensor, count: Tensor, position: Tensor, largest_code: float,
               codes_of: Callable[[Tensor, Tensor], Tensor]) -> tuple[Tensor, Tensor]:
    """(int8 codes of value's shape, float32 scales): each block scaled so its largest magnitude is the largest code,
    then `codes_of(scaled, random bits)`. An infinite largest magnitude (a second moment whose square overflowed
    float32) counts as float32's largest, so the block keeps a finite scale, that entry the largest code and the
    others their codes: an infinite scale decoded them as 0 * inf = NaN, the whole block's parameters' next update."""
    blocks = _blocks(value)
    scales = blocks.abs().amax(dim=-1).clamp_(max=torch.finfo(torch.float32).max) / largest_code  # a NaN stays
    scaled = torch.where(scales.unsqueeze(-1) > 0, blocks / scales.unsqueeze(-1), 0.0)
    codes = codes_of(scaled, _random_bits(count, _blocks(position)))
    return _unblocked(codes, value.shape), scales


def _linear_codes(scaled: Tensor, random: Tensor) -> Tensor:
    """Integers -127..127, rounded down or up at random (up with probability equal to the fraction)."""
    return torch.floor(scaled + _fraction(random)).clamp_(-_LINEAR_MAX, _LINEAR_MAX).to(torch.int8)


def _e4m3_codes(scaled: Tensor, random: Tensor) -> Tensor:
    return _stochastically_rounded(scaled, random, _CODE_DTYPE).view(torch.int8)


def _fraction(random: Tensor) -> Tensor:
    """Uniform in [0, 1) from the upper 24 of 32 random bits."""
    return ((random >> 8) & 0xFFFFFF).to(torch.float32) * 2.0 ** -24


def _blocks(tensor: Tensor) -> Tensor:
    """(..., blocks, BLOCK) view of a tensor's last dim, zero-padded (a 0-dim tensor is one entry)."""
    lines = tensor if tensor.dim() else tensor.reshape(1)
    padded = functional.pad(lines, (0, -lines.shape[-1] % BLOCK))
    return padded.reshape(*padded.shape[:-1], padded.shape[-1] // BLOCK, BLOCK)


def _unblocked(blocks: Tensor, shape: torch.Size) -> Tensor:
    lines = blocks.flatten(-2)
    length = shape[-1] if len(shape) else 1
    return lines[..., :length].reshape(shape)


def _stochastically_rounded(value: Tensor, random: Tensor, dtype: torch.dtype) -> Tensor:
    """`value` (float32) in `dtype` (bfloat16 or e4m3), rounded at random: its bit pattern (sign and magnitude, so
    rounding is symmetric about zero) plus random bits in the mantissa bits `dtype` drops, truncated, which the
    conversion then keeps exactly (below e4m3's smallest normal, in fixed point)."""
    dropped = (1 << _DROPPED_BITS[dtype]) - 1
    # On the int32 pattern a negative value's magnitude is its low 31 bits too: adding to them and clearing the
    # dropped bits rounds it the same way, and never reaches the sign bit (but from a NaN).
    rounded = (value.view(torch.int32) + (random & dropped)) & ~dropped
    result = rounded.view(torch.float32)
    if dtype == _CODE_DTYPE:
        # Below e4m3's smallest normal its codes are evenly spaced, fewer bits than the above kept: round there in
        # fixed point with the same random bits, else the conversion would round to nearest, a bias.
        fixed = torch.floor(value.abs() * _SUBNORMAL_STEPS + _fraction(random)).copysign(value) / _SUBNORMAL_STEPS
        result = torch.where(value.abs() < _CODE_MIN_NORMAL, fixed, result)
        result = result.clamp(-_CODE_MAX, _CODE_MAX)  # rounding up from just below the largest code leaves the range
    return result.to(dtype)


def _random_bits(count: Tensor, position: Tensor) -> Tensor:
    """32 random bits per entry from its index in the whole tensor and the rounding count: independent of the value
    (so the rounding is unbiased, and a value off by a rounding error rounds the same way but for the rare entries
    that straddle a threshold), fresh at every write, different between entries (a constant gradient's equal values
    do not all round the same way at once)."""
    return _mix(_mix(position.to(torch.int32)) ^ (count.to(torch.int32) * _GOLDEN))


def _mix(word: Tensor) -> Tensor:
    """MurmurHash3's 32-bit finalizer on int32 tensors: every input bit flips about half of the output bits.
    Products wrap (two's complement); the masks make the arithmetic right shifts logical ones."""
    word = word ^ ((word >> 16) & 0xFFFF)
    word = word * _MURMUR_1
    word = word ^ ((word >> 13) & 0x7FFFF)
    word = word * _MURMUR_2
    return word ^ ((word >> 16) & 0xFFFF)


def _index_dtype(numel: int) -> torch.dtype:
    """int32 indices where they fit (half the bytes to hash); beyond, int64, of which the hash takes the low 32 bits."""
    return torch.int32 if numel <= torch.iinfo(torch.int32).max else torch.int64
