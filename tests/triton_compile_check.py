"""Compiles the AdamW part's, the Muon update's and the symmetric products' Triton kernels to machine code for GPUs of
given capabilities, with no GPU: run by tests/test_triton_compile.py in a process of its own, since the tests'
TRITON_INTERPRET=1 makes `triton.jit` return interpreted functions, which do not compile. Prints one JSON object:
each case's name, "ok" or the error.

    TRITON_INTERPRET=0 python tests/triton_compile_check.py 75 90
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "torch-ext"))
from optimizer.triton_kernels import adamw, apply_update  # noqa: E402 (the source tree's package, after its path)

symmetric_kernels = [importlib.import_module(f"optimizer.triton_kernels.{name}") for name in ("xxt", "symmetric_poly")]

TABLES = {"table": "*i64", "block_tensor": "*i64", "block_start": "*i64"}
RULE = {name: "fp32" for name in ("lr", "beta1", "beta2", "log2_beta1", "log2_beta2", "eps", "weight_decay")}
UNITS = {"*fp32": 4, "*bf16": 8, "*fp16": 8, "*i16": 8, "*i8": 16}  # elements per 16-byte unit


# The rates' pointer for each RATES mode of the AdamW kernels: none (the table in its slot), lr, per-tensor pairs.
RATES = {0: "*i64", 1: "*fp32", 2: "*fp64"}


def _plain(like: str, rates: int) -> tuple:
    signature = {**TABLES, "skipped": "*fp32", "like": like, "rates": RATES[rates], **RULE}
    return adamw._adamw_blocks_kernel, signature, dict(RATES=rates, COLUMNS=adamw._COLUMNS,
                                                       ELEMENTS_PER_UNIT=UNITS[like], BLOCK=adamw.BLOCK)


def _rounded(like: str, codes: bool, rates: int = 0) -> tuple:
    moment = "*i8" if codes else "*i16"
    signature = {**TABLES, "skipped": "*fp32", "like": like, "moment_like": moment, "rates": RATES[rates], **RULE}
    return adamw._adamw_rounded_blocks_kernel, signature, dict(
        RATES=rates, CODES=codes, COLUMNS=adamw._ROUNDED_COLUMNS, ELEMENTS_PER_UNIT=UNITS[like],
        MOMENT_ELEMENTS_PER_UNIT=UNITS[moment], BLOCK=adamw.BLOCK, CODE_BLOCK=adamw.CODE_BLOCK)


def _nonfinite(like: str) -> tuple:
    signature = {**TABLES, "flags": "*fp32", "like": like}
    return adamw._nonfinite_blocks_kernel, signature, dict(COLUMNS=adamw._COLUMNS, ELEMENTS_PER_UNIT=UNITS[like],
                                                           BLOCK=adamw.BLOCK)


def _counts(rounded: bool) -> tuple:
    columns = adamw._ROUNDED_COLUMNS if rounded else adamw._COLUMNS
    return adamw._counts_kernel, {"table": "*i64", "skipped": "*fp32"}, dict(COLUMNS=columns, ROUNDED=rounded,
                                                                             SKIP_COUNTS=True)


def _apply(param: str, update: str, transposed: bool, decay: bool) -> tuple:
    signature = {"table": "*i64", "tile_matrix": "*i64", "tile_index": "*i64", "decay": param if decay else "*fp32",
                 "step_sizes": "*fp32", "param_like": param, "update_like": update}
    return apply_update._apply_tiles_kernel, signature, dict(
        COLUMNS=apply_update._COLUMNS, TRANSPOSED=transposed, DECAY=decay, PARAM_ELEMENTS_PER_UNIT=UNITS[param],
        UPDATE_ELEMENTS_PER_UNIT=UNITS[update], SIDE_MULTIPLE=apply_update.SIDE_MULTIPLE, TILE=apply_update.TILE)


def _symmetric(kernel, band: int) -> tuple:
    """A symmetric product's kernel through pointers (no TMA descriptors, which need a GPU to build), fp16 operands,
    128x256 tiles, in the programs' order `band` picks."""
    kernel = kernel.fn.fn  # under the autotuner's and the heuristics' wrappers
    signature = {name: "*fp16" if name.endswith("_ptr") else "fp32" if name in ("b", "c") else "i32"
                 for name in kernel.arg_names if name.endswith("_ptr") or name in ("M", "K", "b", "c")
                 or name.startswith("stride")}
    constants = dict(TMA_READY=False, TMA_STORE_READY=False, UPCAST_DOT=False, IEEE_FP32=False, BLOCK_M=128,
                     BLOCK_N=256, BLOCK_K=64, TMA=False, TMA_STORE=False, BAND=band, EVEN_K=True,
                     **{name: None for name in kernel.arg_names if name.endswith("_desc")})
    return kernel, signature, {name: value for name, value in constants.items() if name in kernel.arg_names}


CASES = {
    "update fp32": _plain("*fp32", 0), "update bf16, lr on the device": _plain("*bf16", 1),
    "update fp16, rates per tensor": _plain("*fp16", 2), "rounded bf16 moments": _rounded("*fp32", False),
    "rounded 8-bit codes, bf16 parameters": _rounded("*bf16", True),
    "rounded 8-bit codes, rates per tensor": _rounded("*fp32", True, 2), "flags bf16": _nonfinite("*bf16"),
    "flags fp32": _nonfinite("*fp32"), "counts": _counts(False), "counts, rounded": _counts(True),
    "Muon update, fp32 parameters, bf16 updates": _apply("*fp32", "*bf16", False, True),
    "Muon update, transposed, no decay": _apply("*fp32", "*bf16", True, False),
    "Muon update, bf16 parameters, transposed": _apply("*bf16", "*bf16", True, True),
}
# Only where kernel_choice sends the products to Triton (sm_90), and only the programs' banded order, which no GPU has
# run yet: each takes 5-10 s to compile.
SM90_CASES = {f"{module.__name__.rsplit('.', 1)[1]}, in bands": _symmetric(getattr(module, kernel), 16)
              for module, kernel in zip(symmetric_kernels, ("_xxt_lower_kernel", "_ba_plus_caa_lower_kernel"))}


def compile_case(kernel, signature: dict, constants: dict, capability: int) -> str:
    names = kernel.arg_names
    # As the launches specialize them: every pointer argument starts on a 16-byte boundary.
    aligned = {(names.index(name),): [["tt.divisibility", 16]] for name, kind in signature.items()
               if kind.startswith("*")}
    source = ASTSource(fn=kernel, signature={**signature, **{name: "constexpr" for name in constants}},
                       constexprs={(names.index(name),): value for name, value in constants.items()}, attrs=aligned)
    try:
        triton.compile(source, target=GPUTarget("cuda", capability, 32))
    except Exception as error:  # noqa: BLE001 (the report names it)
        return f"{type(error).__name__}: {error}"
    return "ok"


def main() -> None:
    capabilities = list(map(int, sys.argv[1:]))
    results = {f"{name} sm_{capability}": compile_case(*case, capability)
               for capability in capabilities for name, case in CASES.items()}
    if 90 in capabilities:
        results |= {f"{name} sm_90": compile_case(*case, 90) for name, case in SM90_CASES.items()}
    print(json.dumps(results))


if __name__ == "__main__":
    main()
