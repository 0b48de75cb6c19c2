"""Which dtype each device multiplies matrices fastest in: the Newton-Schulz default, and a warning for slow choices.

On CPUs the answer is read from the matrix instructions the CPU has (those oneDNN, which runs torch's 16-bit CPU
products, is allowed to use) and its vendor, not timed: a probe would make the default (and so the results) depend on
how busy the machine was, and the gaps are far wider than any timer's noise. Measured with torch 2.13's CPU kernels,
2048x2048 `torch.mm`:
  - AMX (Sapphire Rapids, 2 cores): bf16 ~1.6 TFLOP/s against fp32 ~0.27, 6x faster;
  - AVX512-BF16 without AMX on AMD (EPYC, 2 cores): bf16 20 ms against fp32 89 ms, 4.4x faster; on another such
    EPYC 41 ms against 110 ms, 2.7x (414 against 156 GFLOP/s);
  - AVX512-BF16 without AMX on Intel (the same Sapphire Rapids cores with oneDNN kept off AMX by
    ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16): bf16 74 ms against fp32 42 ms, 1.8x slower. Intel cores issue one 512-bit
    bf16 dot product (32 multiply-adds) per cycle where they issue two fp32 FMAs (16 each): no faster on paper, and
    the conversions make bf16 lose. AMD's Zen 4/5 issue the bf16 dot products at twice their fp32 FMA rate;
  - neither (AMD EPYC with AVX2 only): bf16 58 s against fp32 97 ms (another such CPU: 3x slower), so fp32;
  - float16 without AMX-FP16 or AVX512-FP16 runs a reference kernel (67 s at 2048 on the AVX512-BF16 machine).
And the products run in the dtype chosen, whatever `torch.autocast` region they are called in (`without_autocast`).
"""

from __future__ import annotations

import functools
import os
import platform
import sys
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple, ParamSpec, TypeVar

import torch


# The x86 instruction sets that oneDNN, which runs torch's 16-bit CPU products, uses for matrix products.
CPU_MATRIX_UNITS: tuple[str, ...] = ("amx_bf16", "avx512_bf16", "amx_fp16", "avx512_fp16")
_UNITS_FOR: dict[torch.dtype, tuple[str, ...]] = {torch.bfloat16: ("amx_bf16", "avx512_bf16"),
                                                  torch.float16: ("amx_fp16", "avx512_fp16")}
_WITHOUT_UNITS: dict[torch.dtype, str] = {torch.bfloat16: "emulated, measured 3x to 480x slower than float32",
                                          torch.float16: "a reference kernel, measured 700x slower than float32"}


class NsDtypeChoice(NamedTuple):
    """The dtype `ns_dtype=None` resolves to on a device, and why."""

    dtype: torch.dtype
    reason: str


# ONEDNN_MAX_CPU_ISA (DNNL_MAX_CPU_ISA before oneDNN 2.5) keeps oneDNN off the instructions above the named set: the
# units each name leaves it. "ALL", "DEFAULT", the sets above AMX, and names oneDNN does not know (it ignores them)
# leave all of them.
_ONEDNN_ISA_UNITS: dict[str, frozenset[str]] = {
    **dict.fromkeys(("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI"),
                    frozenset()),
    "AVX512_CORE_BF16": frozenset({"avx512_bf16"}),
    **dict.fromkeys(("AVX512_CORE_FP16", "AVX10_1_512"), frozenset({"avx512_bf16", "avx512_fp16"})),
    **dict.fromkeys(("AVX512_CORE_AMX", "AVX10_1_512_AMX"), frozenset({"amx_bf16", "avx512_bf16", "avx512_fp16"})),
}


@functools.cache
@torch.compiler.disable  # torch's probes cannot be traced; a compiled step reads the choice as a constant
def cpu_matrix_units() -> frozenset[str]:
    """Which of CPU_MATRIX_UNITS this CPU has and oneDNN may use: torch's own probes, /proc/cpuinfo for AVX512-FP16
    (which torch does not probe), less what ONEDNN_MAX_CPU_ISA rules out. Empty on non-x86 CPUs."""
    if platform.machine().lower() not in ("x86_64", "amd64", "i686", "x86"):
        return frozenset()
    found = {"amx_bf16": torch.cpu._is_amx_tile_supported(), "avx512_bf16": torch.cpu._is_avx512_bf16_supported(),
             "amx_fp16": torch.cpu._is_amx_fp16_supported(), "avx512_fp16": "avx512_fp16" in _linux_cpu_flags()}
    allowed = _ONEDNN_ISA_UNITS.get((onednn_isa_cap() or "ALL").upper(), frozenset(CPU_MATRIX_UNITS))
    return frozenset(unit for unit, present in found.items() if present and unit in allowed)


def onednn_isa_cap() -> str | None:
    """The instruction set oneDNN is capped at by the environment (ONEDNN_MAX_CPU_ISA, or DNNL_MAX_CPU_ISA as oneDNN
    before 2.5 named it), or None where nothing caps it."""
    return os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or None


@functools.cache
@torch.compiler.disable
def cpu_vendor() -> str:
    """The CPU's vendor string (GenuineIntel, AuthenticAMD, ...): /proc/cpuinfo's, else what `platform` reports."""
    vendor = next((line.partition(":")[2].strip() for line in _linux_cpuinfo_lines() if line.startswith("vendor_id")),
                  "")
    return vendor or next((name for name in ("GenuineIntel", "AuthenticAMD") if name in platform.processor()), "")


def _linux_cpu_flags() -> set[str]:
    line = next((line for line in _linux_cpuinfo_lines() if line.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def _linux_cpuinfo_lines() -> list[str]:
    try:
        return Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []


def cuda_capability(device: torch.device) -> tuple[int, int] | None:
    return torch.cuda.get_device_capability(device) if torch.cuda.is_available() else None


def ns_dtype_choice(device: torch.device | str) -> NsDtypeChoice:
    """What `ns_dtype=None` picks on `device`, with the reason (the optimizer's repr shows it)."""
    device = torch.device(device)
    if device.type == "cpu":
        units = cpu_matrix_units()
        if "amx_bf16" in units:
            return NsDtypeChoice(torch.bfloat16, "the CPU has AMX bf16 tiles (bf16 products ~6x fp32's speed)"
                                 + _small_matrices("amx_bf16"))
        if "avx512_bf16" in units and cpu_vendor() == "AuthenticAMD":
            return NsDtypeChoice(torch.bfloat16, "the CPU has AVX512-BF16 on AMD cores (bf16 products 2.7x-4.4x "
                                                 "fp32's speed)" + _small_matrices("avx512_bf16"))
        if "avx512_bf16" in units:
            return NsDtypeChoice(torch.float32, "the CPU has AVX512-BF16 without AMX, on cores other than AMD's: "
                                                "Intel's issue bf16 dot products at their fp32 rate (bf16 products "
                                                "~1.8x slower)")
        return NsDtypeChoice(torch.float32, "the CPU has no bf16 matrix instructions (AMX, AVX512-BF16): bf16 "
                                            "products are emulated there, 3x to 480x slower than fp32")
    if device.type == "cuda":
        capability = cuda_capability(device)
        if capability is not None and capability < (8, 0):
            return NsDtypeChoice(torch.float16, f"compute capability {capability[0]}.{capability[1]} has fp16 tensor "
                                                "cores and no bf16 ones (below 8.0); scaling stays in fp32")
        return NsDtypeChoice(torch.bfloat16, "bf16 tensor cores (compute capability 8.0 and newer)")
    return NsDtypeChoice(torch.bfloat16, f"{device.type} accelerators multiply bf16 on their matrix units")


# Multiply-adds per product (their mean over a Newton-Schulz step) below which a lone matrix iterates faster in float32
# than in a CPU's 16-bit default, by the unit that default runs on: oneDNN, which runs torch's 16-bit CPU products,
# costs ~20-30 us a call however small the matrices, where MKL's float32 products of small ones take 2-5 us; the
# faster the CPU's float32 products against its bf16 ones, the larger the matrices float32 wins on. zeropower, 5 steps,
# the standard iteration (where ns_algorithm="auto" gives a wide float32 matrix the cheaper Gram one, float32 may win
# on larger ones still: `make bench`'s lone-matrix rows run auto's), bf16 against float32 (us, paired):
#   - 2-core Xeon with AMX (fp32 ~0.37 TFLOP/s): 10x256 527 / 133; 128x512 (6.3M a product) 1579 / 1397; 192x192
#     (7.1M) 1491 / 1277; 224x224 (11.2M) 1687 / 1847; 256x256 (16.8M) 1983 / 2442;
#   - 2-core AMD EPYC with AVX512-BF16 (fp32 ~0.17 TFLOP/s, 2026-11-26): 10x256 278 / 127; 64x512 (1.5M) 613 / 527;
#     128x128 (2.1M) 649 / 571; 128x256 (3.5M) 816 / 831; 160x160 (4.1M) 927 / 954; 128x384 (4.9M) 941 / 1092;
#     128x512 1078 / 1371; 192x192 1125 / 1406.
# A stack of several keeps the default: a batched product pays that cost once for all of its matrices (48 of 32x32:
# float32 1.6x slower, 12 of 32x128 1.1x faster, on the Xeon).
SMALL_MATRIX_MACS: dict[str, int] = {"amx_bf16": 1 << 23, "avx512_bf16": 1 << 22}


def _small_matrices(unit: str) -> str:
    """The reason's clause on lone small matrices for a CPU whose 16-bit products run on `unit`."""
    return (f"; a lone matrix of fewer than 2^{SMALL_MATRIX_MACS[unit].bit_length() - 1} multiply-adds a product runs "
            "in float32, faster there (`matrix_ns_dtype`)")


@torch.compiler.assume_constant_result
def small_matrix_macs() -> int:
    """SMALL_MATRIX_MACS for this CPU: AMX's where it has AMX tiles, AVX512-BF16's elsewhere."""
    return SMALL_MATRIX_MACS["amx_bf16" if "amx_bf16" in cpu_matrix_units() else "avx512_bf16"]


def matrix_ns_dtype(default: torch.dtype, device: torch.device | str, shape: Sequence[int]) -> torch.dtype:
    """The dtype `ns_dtype=None` iterates a stack of `shape` ((m, n) or (B, m, n)) in on `device`, where it resolves
    to `default` (`default_ns_dtype`): float32 for a lone matrix below `small_matrix_macs()` on a CPU whose default is
    16-bit, `default` everywhere else. Shapes and the CPU's units only: the same answer every time."""
    if isinstance(device, str):  # a step passes its tensors' devices; a caller may name one
        device = torch.device(device)
    if device.type != "cpu" or default.itemsize > 2 or (len(shape) == 3 and shape[0] != 1):
        return default
    short, long = min(shape[-2:]), max(shape[-2:])  # not sorted(): the compiler's tracer cannot sort sizes
    return torch.float32 if 2 * short * short * long + short ** 3 < 3 * small_matrix_macs() else default


@torch.compiler.assume_constant_result
def default_ns_dtype(device: torch.device | str) -> torch.dtype:
    """The dtype Newton-Schulz runs in when `ns_dtype` is None: the one this device multiplies fastest (see
    `ns_dtype_choice`). Fixed for the process, so torch.compile takes it as a constant."""
    return ns_dtype_choice(device).dtype


def slow_dtype_reason(dtype: torch.dtype, device: torch.device | str) -> str | None:
    """Why products in `dtype` are far slower than in the default on `device`, or None where they are not."""
    device = torch.device(device)
    if device.type != "cpu" or dtype not in _UNITS_FOR or cpu_matrix_units() & set(_UNITS_FOR[dtype]):
        return None
    units = " or ".join(unit.upper().replace("_", "-") for unit in _UNITS_FOR[dtype])
    return f"this CPU has no {units} instructions, so its {dtype} products are {_WITHOUT_UNITS[dtype]}"


_warned: set[tuple[torch.dtype, str]] = set()


def warn_if_slow(dtype: torch.dtype, device: torch.device | str, option: str = "ns_dtype") -> None:
    """Once per dtype and device type: an explicit `option` (the optimizer's ns_dtype, zeropower's dtype) that this
    device multiplies far slower than the default. It is still honoured; the warning names the faster choice."""
    device = torch.device(device)
    reason = slow_dtype_reason(dtype, device)
    if reason is None or (dtype, device.type) in _warned:
        return
    _warned.add((dtype, device.type))
    faster = ns_dtype_choice(device)
    warnings.warn(f"{option}={dtype} on {device.type}: {reason}. It is used as asked; {option}=None would use "
                  f"{faster.dtype} here: {faster.reason}.", UserWarning, stacklevel=_user_stacklevel())


def _user_stacklevel() -> int:
    """The stacklevel of the first caller outside this package and torch (Muon(...) or add_param_group through
    torch.optim, zeropower through torch.no_grad's wrapper)."""
    frame, level = sys._getframe(2), 2
    while frame is not None and _inside_the_library(frame.f_globals.get("__name__", "")):
        frame, level = frame.f_back, level + 1
    return level


def _inside_the_library(module: str) -> bool:
    return module == "torch" or module.startswith((__package__, "torch."))


_AUTOCAST_DEVICE_TYPES = ("cpu", "cuda", "xpu", "mps", "hpu")
_Params = ParamSpec("_Params")
_Result = TypeVar("_Result")


def without_autocast(function: Callable[_Params, _Result]) -> Callable[_Params, _Result]:
    """`function` run with autocast off on every device type: its products run in the dtypes it chose (ns_dtype, the
    state's), not in a surrounding `torch.autocast` region's (a step that Lightning's manual optimization calls under
    precision="bf16-mixed" is in one), as torch.optim.Muon's results do not change in one either. Under autocast a
    float32 Gram iteration ran its products in bfloat16 without the guards its 16-bit form has, and diverged."""

    @functools.wraps(function)
    def run(*args: _Params.args, **kwargs: _Params.kwargs) -> _Result:
        if not torch._C._is_any_autocast_enabled():
            return function(*args, **kwargs)
        enabled = [device_type for device_type in _AUTOCAST_DEVICE_TYPES
                   if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type)]
        return _with_autocast_off(enabled, lambda: function(*args, **kwargs))

    return run


def _with_autocast_off(device_types: list[str], call: Callable[[], _Result]) -> _Result:
    """call() with autocast off on these device types (nested `with`: torch.compile traces no ExitStack of them)."""
    if not device_types:
        return call()
    with torch.autocast(device_types[0], enabled=False):
        return _with_autocast_off(device_types[1:], call)
