"""Stochastic rounding and float8 e4m3 codes inside Triton kernels: bit for bit what
kernels-src/common/stochastic_rounding.h computes for the compiled ops (and state_precision.py with tensor ops), in
integer arithmetic on uint32 words, so the interpreter and a GPU agree exactly. Stored moments travel as their bits
(bfloat16 as int16, codes as int8) and are decoded here, which the interpreter, without a bfloat16 or float8 type of
its own, could not do by casting."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _mix(word):
    """MurmurHash3's 32-bit finalizer: every input bit flips about half of the output bits."""
    word = word ^ (word >> 16)
    word = word * 0x85EBCA6B
    word = word ^ (word >> 13)
    word = word * 0xC2B2AE35
    return word ^ (word >> 16)


@triton.jit
def random_bits(position, count):
    """32 random bits (uint32) of each entry from its index in the whole tensor (its low 32 bits) and the tensor's
    count of rounded writes (int64)."""
    return _mix(_mix(position.to(tl.uint32)) ^ (count.to(tl.uint32) * 0x9E3779B9))


@triton.jit
def _fraction(bits):
    """Uniform in [0, 1) from the upper 24 of the 32 bits: exact in float32."""
    return (bits >> 8).to(tl.int32).to(tl.float32) * 0.000000059604644775390625  # 2^-24


@triton.jit
def bfloat16_value(stored):
    """The float32 value of bfloat16 bits loaded as int16."""
    return ((stored.to(tl.int32) & 0xFFFF).to(tl.uint32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def bfloat16_rounded(value, bits):
    """`value` rounded to bfloat16 down or up in magnitude at random, as int16 bits to store: random bits added to
    the 16 bits bfloat16 drops, then truncated; NaN gives bfloat16's canonical NaN, as torch's conversion does."""
    rounded = (value.to(tl.uint32, bitcast=True) + (bits & 0xFFFF)) >> 16
    return tl.where(value != value, 0x7FC0, rounded).to(tl.int32).to(tl.int16)


@triton.jit
def e4m3_value(stored):
    """The float32 value of float8 e4m3 codes loaded as int8."""
    code = (stored.to(tl.int32) & 0xFF).to(tl.uint32)
    exponent = (code >> 3) & 15
    mantissa = code & 7
    normal = (((exponent + 120) << 23) | (mantissa << 20)).to(tl.uint32)
    normal = tl.where((code & 0x7F) == 0x7F, 0x7FC00000, normal).to(tl.float32, bitcast=True)
    magnitude = tl.where(exponent == 0, mantissa.to(tl.float32) * 0.001953125, normal)  # 2^-9 apart below 2^-6
    return tl.where((code & 0x80) != 0, -magnitude, magnitude)


@triton.jit
def e4m3_rounded(scaled, bits):
    """`scaled` (within +-448) rounded at random to a float8 e4m3 value, as int8 code bits to store: random bits added
    to the 20 mantissa bits e4m3 drops, then truncated; below the smallest normal (2^-6), in fixed point with the
    same bits; a NaN gives the NaN code."""
    magnitude = tl.abs(scaled)
    sign = (scaled.to(tl.uint32, bitcast=True) >> 24) & 0x80
    fixed = tl.floor(magnitude * 512.0 + _fraction(bits)).to(tl.int32).to(tl.uint32)
    truncated = ((magnitude.to(tl.uint32, bitcast=True) + (bits & 0xFFFFF)) & 0xFFF00000).to(tl.float32, bitcast=True)
    pattern = tl.where(truncated < 448.0, truncated, 448.0).to(tl.uint32, bitcast=True)  # e4m3's largest value
    normal = (((pattern >> 23) - 120) << 3) | ((pattern >> 20) & 7)
    code = tl.where(scaled != scaled, 0x7F, tl.where(magnitude < 0.015625, fixed, normal))
    return (code | sign).to(tl.int32).to(tl.int8)


@triton.jit
def e4m3_block_codes(values, bits):
    """Each row of `values` (a block) as e4m3 codes to store and its float32 scale: the row scaled so its largest
    magnitude is e4m3's largest value (448), then rounded at random; a row of zeros has scale 0 and codes 0."""
    scale = _largest_magnitude(values) / 448.0
    scaled = scale[:, None] > 0.0
    return e4m3_rounded(tl.where(scaled, tl.div_rn(values, tl.where(scaled, scale[:, None], 1.0)), 0.0), bits), scale


@triton.jit
def _largest_magnitude(values):
    """Each row's largest magnitude, as the largest of the magnitudes' bit patterns, which order as the values do, a
    NaN above all (as the compiled ops take it, and torch.amax); an infinite one as float32's largest (see
    `state_precision._quantized`)."""
    largest = tl.max(values.to(tl.uint32, bitcast=True) & 0x7FFFFFFF, axis=1)
    return tl.where(largest == 0x7F800000, 0x7F7FFFFF, largest).to(tl.float32, bitcast=True)
