"""The symmetric Triton kernels against float64 `torch` products, under the Triton interpreter on the CPU."""

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from triton_under_test import DEVICE, INTERPRETER, load_package_by_path, needs_kernels, triton_kernels

xxt, ba_plus_caa = triton_kernels.xxt, triton_kernels.ba_plus_caa

if triton_kernels.TRITON_AVAILABLE:
    import triton
    import triton.language as tl

    launch_rules = importlib.import_module(f"{triton_kernels.__name__}._launch")
    KERNELS = [importlib.import_module(f"{triton_kernels.__name__}.xxt")._xxt_lower_kernel,
               importlib.import_module(f"{triton_kernels.__name__}.symmetric_poly")._ba_plus_caa_lower_kernel]
    tile_coords = importlib.import_module(f"{triton_kernels.__name__}._tiling").tile_coords
    # Sizes are built from the tile the kernels use here so every case straddles tile edges and has off-diagonal
    # tiles to mirror, whatever the tile is; K_STEP-multiple sizes take the kernels' unmasked K loop.
    BLOCK = launch_rules.INTERPRETER_BLOCK_M if INTERPRETER else 128
    K_STEP = launch_rules.INTERPRETER_BLOCK_K if INTERPRETER else 64

    @triton.jit
    def _tile_coords_probe(row_out, col_out, first_pid, count, row_tiles, BLOCK_SIZE: tl.constexpr,
                           WIDTH: tl.constexpr, BAND: tl.constexpr):
        index = tl.program_id(0) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
        row, col = tile_coords(first_pid + index, row_tiles, WIDTH, BAND)
        inside = index < count
        tl.store(row_out + index, row, mask=inside)
        tl.store(col_out + index, col, mask=inside)
else:
    BLOCK, K_STEP = 128, 64

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
FP32_EPS = torch.finfo(torch.float32).eps
# Keller Jordan's quintic Newton-Schulz coefficients (a, b, c), as published with Muon.
QUINTIC = (3.4445, -4.7750, 2.0315)


def output_ulp(magnitude: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One ulp of dtype at each magnitude, bounded above: eps * |v| for normal numbers, eps * smallest_normal for
    subnormals. Casting the fp32 result costs half an ulp when rounding and up to a full ulp when the
    interpreter truncates fp32 -> bf16, so one ulp covers both."""
    finfo = torch.finfo(dtype)
    return finfo.eps * (magnitude + finfo.smallest_normal)


def assert_within(result: torch.Tensor, reference: torch.Tensor, fp32_error: torch.Tensor) -> None:
    """`fp32_error` bounds what the float32 arithmetic may lose before the final cast to result's dtype."""
    bound = fp32_error + output_ulp(reference.abs() + fp32_error, result.dtype)
    excess = (result.double() - reference).abs() - bound
    assert excess.max() <= 0, f"exceeds the error bound by {excess.max().item():.3e}"


def assert_exactly_symmetric(result: torch.Tensor) -> None:
    assert torch.equal(result, result.mT)


def random_matrix(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator).to(dtype).to(DEVICE)


def random_symmetric(batch: tuple[int, ...], m: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Symmetric in fp32 before the cast, so symmetric after it; scaled like a normalized Gram matrix."""
    generator = torch.Generator().manual_seed(seed)
    half = torch.randn((*batch, m, m), generator=generator) / m**0.5
    return (half + half.mT).to(dtype).to(DEVICE)


@pytest.fixture(params=["pointers", "tma", "tma_store"])
def operand_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both kernels restricted to the configs that load their operands that way, and with "tma_store" write the
    tiles below the diagonal through TMA too. The interpreter's one config is copied with TMA switched on."""
    tma, tma_store = request.param != "pointers", request.param == "tma_store"
    for kernel in KERNELS:
        configs = [triton.Config({**config.kwargs, "TMA": tma, "TMA_STORE": tma_store}, num_warps=config.num_warps,
                                 num_stages=config.num_stages, pre_hook=config.pre_hook)
                   for config in kernel.configs
                   if INTERPRETER or (config.kwargs["TMA"], config.kwargs["TMA_STORE"]) == (tma, tma_store)]
        monkeypatch.setattr(kernel, "configs", configs)
        monkeypatch.setattr(kernel, "cache", {})
    return request.param


def skip_unless_readable(operand: torch.Tensor, path: str) -> None:
    """Skips a TMA path that cannot read the operand, or (TMA stores) write the Gram matrix the kernels return."""
    if path != "pointers" and launch_rules.tma_descriptors(launch_rules.as_batched(operand))[0] is None:
        pytest.skip(f"TMA cannot read a {tuple(operand.shape)} {operand.dtype} operand")
    output = torch.empty((*operand.shape[:-1], operand.shape[-2]), dtype=operand.dtype, device=operand.device)
    if path == "tma_store" and launch_rules.tma_descriptors(launch_rules.as_batched(output))[0] is None:
        pytest.skip(f"TMA cannot write a {tuple(output.shape)} {output.dtype} result")


def xxt_fp32_error(X: torch.Tensor) -> torch.Tensor:
    # Products of bf16/fp16 values are exact in fp32, fp32 products round once; a float32 sum of n such terms in
    # any order is off by at most about n * u * sum|terms| (u = eps / 2), so n * eps is a safe worst case.
    magnitudes = X.double().abs()
    return X.shape[-1] * FP32_EPS * (magnitudes @ magnitudes.mT)


# --- xxt ---------------------------------------------------------------------------------------------------

XXT_SHAPES = {
    "tall": (2 * BLOCK + 13, 45),
    "wide": (2 * BLOCK + 13, 2 * BLOCK + 31),
    "one_tile": (37, 101),
    "batched": (3, BLOCK + 17, 150),
    "k_multiple_of_step": (3 * BLOCK + 5, 2 * K_STEP),
    # Rows of a multiple of 16 bytes in every dtype, which TMA needs; the K tail is not a multiple of the K step.
    "tma_rows": (2 * BLOCK + 13, 200),
    "tma_batched": (3, BLOCK + 17, 152),
    # Gram matrices whose rows are too, for TMA stores: a tile wholly below the diagonal, its rows past the matrix.
    "tma_store_rows": (2 * BLOCK + 16, 200),
    "tma_store_batched": (2, 2 * BLOCK + 16, 152),
    # Six row tiles: under the interpreter two bands of programs (INTERPRETER_BAND), the second cut short.
    "two_bands": (5 * BLOCK + 16, 48),
}


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", XXT_SHAPES.values(), ids=XXT_SHAPES.keys())
def test_xxt_matches_float64_product(shape: tuple[int, ...], dtype: torch.dtype, operand_path: str) -> None:
    X = random_matrix(shape, dtype, seed=len(shape) + shape[-1])
    skip_unless_readable(X, operand_path)
    result = xxt(X, exact_fp32=True)
    assert result.shape == (*shape[:-1], shape[-2]) and result.dtype == dtype
    assert_within(result, X.double() @ X.double().mT, xxt_fp32_error(X))
    assert_exactly_symmetric(result)


@needs_kernels
def test_xxt_reads_strided_input_and_writes_strided_out() -> None:
    # X^T of a contiguous tensor (column-major X) and an out that is itself a transposed view.
    X = random_matrix((90, 2 * BLOCK + 5), torch.float32, seed=1).mT
    buffer = torch.full((X.shape[0], X.shape[0]), float("nan"), device=DEVICE)
    returned = xxt(X, out=buffer.mT, exact_fp32=True)
    assert returned.data_ptr() == buffer.data_ptr()
    assert_within(buffer, X.double() @ X.double().mT, xxt_fp32_error(X))


@needs_kernels
def test_xxt_of_batch_slice_uses_batch_stride() -> None:
    X = random_matrix((5, BLOCK + 3, 70), torch.bfloat16, seed=2)[1::2]
    result = xxt(X)
    assert_within(result, X.double() @ X.double().mT, xxt_fp32_error(X))


@needs_kernels
def test_xxt_of_empty_rows_is_zero() -> None:
    assert torch.equal(xxt(torch.ones(3, 0, device=DEVICE)), torch.zeros(3, 3, device=DEVICE))
    assert xxt(torch.ones(0, 5, device=DEVICE)).shape == (0, 0)


# --- ba_plus_caa -------------------------------------------------------------------------------------------

POLY_SHAPES = {"three_tiles": ((), 2 * BLOCK + 13), "one_tile": ((), 37), "batched": ((2,), BLOCK + 29),
               "k_multiple_of_step": ((), K_STEP), "tma_rows": ((2,), 2 * BLOCK + 16)}


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("batch_and_size", POLY_SHAPES.values(), ids=POLY_SHAPES.keys())
def test_ba_plus_caa_matches_float64(batch_and_size: tuple[tuple[int, ...], int], dtype: torch.dtype,
                                     operand_path: str) -> None:
    batch, m = batch_and_size
    _, b, c = QUINTIC
    A = random_symmetric(batch, m, dtype, seed=m)
    skip_unless_readable(A, operand_path)
    exact = A.double()
    result = ba_plus_caa(A, b, c, exact_fp32=True)
    # A @ A accumulates like xxt (m terms); then c * (A @ A), b * A and their sum round once each in fp32.
    magnitudes = exact.abs()
    fp32_error = FP32_EPS * ((m + 2) * abs(c) * (magnitudes @ magnitudes) + 2 * abs(b) * magnitudes)
    assert result.dtype == dtype
    assert_within(result, b * exact + c * (exact @ exact), fp32_error)
    assert_exactly_symmetric(result)


@needs_kernels
def test_one_newton_schulz_step_matches_float64() -> None:
    """xxt and ba_plus_caa composed into X <- a X + (b A + c A^2) X, the step they exist for."""
    a, b, c = QUINTIC
    X = random_matrix((BLOCK + 21, 2 * BLOCK + 9), torch.float32, seed=3)
    X = X / torch.linalg.matrix_norm(X)
    step = a * X + ba_plus_caa(xxt(X, exact_fp32=True), b, c, exact_fp32=True) @ X
    exact = X.double()
    gram = exact @ exact.mT
    expected = a * exact + (b * gram + c * gram @ gram) @ exact
    # Entries are O(1) after normalization with coefficients below 5; the fp32 chain (three products of length
    # <= n, a few scalings) loses ~n * eps relative to O(1) inputs. 100x that is still far below the step's size.
    assert (step.double() - expected).abs().max() < 100 * X.shape[-1] * FP32_EPS


# --- shared rules ------------------------------------------------------------------------------------------


def row_major_lower_tiles(first_row: int, end_row: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, col) of every tile that reaches the diagonal or below it, in rows [first_row, end_row), straight from
    the definition: tile (r, c) spans rows [r b, r b + b) and columns [c w b, c w b + w b), and some column of it is
    at most some row of it."""
    block = 4
    tiles = [(r, c) for r in range(first_row, end_row) for c in range(r + 1)
             if c * width * block <= r * block + block - 1]
    return torch.tensor([r for r, _ in tiles], dtype=torch.int32), torch.tensor([c for _, c in tiles], dtype=torch.int32)


@needs_kernels
@pytest.mark.parametrize("width", [1, 2, 4])
@pytest.mark.parametrize(
    ("first_row", "end_row"),
    # Rows from 4607 on are where float32 sqrt(8 pid + 1) alone first lands one row too far (checked in numpy),
    # so the second window tests the correction steps (at width 2 its groups of rows reach there from row 9214);
    # the first tests small rows and the diagonal start.
    [(0, 300), (4590, 4650), (9200, 9240)],
)
def test_lower_tile_coords_enumerates_the_lower_tiles_row_by_row(first_row: int, end_row: int, width: int) -> None:
    expected_rows, expected_cols = row_major_lower_tiles(first_row, end_row, width)
    rows, cols = probed_tile_coords(first_row, end_row, width, band=0)
    assert torch.equal(rows, expected_rows) and torch.equal(cols, expected_cols)


@needs_kernels
@pytest.mark.parametrize(("width", "band"), [(1, 1), (1, 16), (2, 2), (2, 4), (2, 16), (4, 16)])
@pytest.mark.parametrize(("first_row", "end_row"), [(0, 1), (0, 7), (0, 37), (0, 300), (4592, 4650)])
def test_banded_tile_coords_take_each_lower_tile_once_band_by_band(first_row: int, end_row: int, width: int,
                                                                    band: int) -> None:
    """Banded, the programs of each band of rows compute that band's lower tiles, each once (end_row closes the
    matrix, so its last band may be short), the columns all its rows need first, column by column."""
    rows, cols = probed_tile_coords(first_row, end_row, width, band)
    expected_rows, expected_cols = row_major_lower_tiles(first_row, end_row, width)
    for start in range(first_row, end_row, band):
        in_band = (expected_rows >= start) & (expected_rows < start + band)
        taken = (rows >= start) & (rows < start + band)
        assert torch.equal(taken, in_band), "a band's programs must be the row-major order's programs of its rows"
        listed = sorted(zip(expected_rows[in_band].tolist(), expected_cols[in_band].tolist()))
        got = list(zip(rows[taken].tolist(), cols[taken].tolist()))
        assert sorted(got) == listed, "each lower tile of the band once"
        shared = start // width + 1
        height = min(band, end_row - start)
        assert got[:shared * height] == [(r, c) for c in range(shared) for r in range(start, start + height)]


def probed_tile_coords(first_row: int, end_row: int, width: int, band: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What tile_coords gives the programs of the rows [first_row, end_row), of a matrix of end_row row tiles."""
    first_pid = launch_rules.lower_tile_count(first_row, 1, width)
    count = launch_rules.lower_tile_count(end_row, 1, width) - first_pid
    rows = torch.empty(count, dtype=torch.int32, device=DEVICE)
    cols = torch.empty_like(rows)
    probe_block = 1 << 14
    _tile_coords_probe[(triton.cdiv(count, probe_block),)](rows, cols, first_pid, count, end_row,
                                                           BLOCK_SIZE=probe_block, WIDTH=width, BAND=band)
    return rows.cpu(), cols.cpu()


@pytest.mark.skipif(not triton_kernels.TRITON_AVAILABLE, reason="needs Triton")
@pytest.mark.parametrize("width", [1, 2, 4])
@pytest.mark.parametrize("rows", [1, 63, 64, 65, 200, 8192])
def test_lower_tile_count_counts_the_tiles_the_definition_lists(rows: int, width: int) -> None:
    block = 64
    row_tiles = -(-rows // block)
    listed = sum(1 for r in range(row_tiles) for c in range(row_tiles) if c * width * block <= r * block + block - 1)
    assert launch_rules.lower_tile_count(rows, block, width * block) == listed


@needs_kernels
@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: xxt(torch.ones(4, 4, dtype=torch.int32, device=DEVICE)), "X has dtype torch.int32"),
        (lambda: xxt(torch.ones(4, device=DEVICE)), r"X must be \(m, n\)"),
        (lambda: xxt(torch.ones(2, 2, 4, 4, device=DEVICE)), r"X must be \(m, n\)"),
        (lambda: ba_plus_caa(torch.ones(3, 4, device=DEVICE), 1.0, 1.0), "A must be square"),
        (lambda: ba_plus_caa(torch.eye(3, device=DEVICE), float("nan"), 1.0), "b must be a finite number"),
        (lambda: xxt(torch.ones(3, 5, device=DEVICE), out=torch.empty(5, 5, device=DEVICE)), r"expected \(3, 3\)"),
        (
            lambda: xxt(torch.ones(3, 5, device=DEVICE), out=torch.empty(3, 3, dtype=torch.float16, device=DEVICE)),
            "torch.float32",
        ),
    ],
)
def test_bad_arguments_raise_value_error_naming_them(call, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()


@needs_kernels
def test_out_sharing_storage_with_input_is_refused() -> None:
    A = torch.eye(4, device=DEVICE)
    with pytest.raises(ValueError, match="out shares storage with A"):
        ba_plus_caa(A, 1.0, 1.0, out=A)


def test_launchers_explain_a_missing_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    # None in sys.modules makes `import triton` raise ImportError, as on a machine without it.
    monkeypatch.setitem(sys.modules, "triton", None)
    name = "triton_kernels_without_triton"
    try:
        package = load_package_by_path(name)
        assert package.TRITON_AVAILABLE is False
        with pytest.raises(RuntimeError, match="Triton is not installed"):
            package.xxt(torch.ones(2, 2))
        with pytest.raises(RuntimeError, match="Triton is not installed"):
            package.ba_plus_caa(torch.eye(2), 1.0, 1.0)
        with pytest.raises(RuntimeError, match="Triton is not installed"):
            package.adamw_flagged_([], [], [], [], [], torch.zeros(0), lr=0.1, betas=(0.9, 0.99), eps=1e-8,
                                   weight_decay=0.0)
    finally:
        for module_name in [m for m in sys.modules if m == name or m.startswith(f"{name}.")]:
            del sys.modules[module_name]


def test_the_package_loads_and_steps_without_triton() -> None:
    """torch's CPU wheels bring no Triton: the built package loads without it and steps Muon and AdamW parameters
    (a module importing from the Triton launchers directly once broke this)."""
    code = """
import sys
sys.modules["triton"] = None  # as on a machine without it
import torch
from kernel_under_test import optimizer, submodule
params = [torch.nn.Parameter(torch.randn(8, 16)), torch.nn.Parameter(torch.randn(16))]
for param in params:
    param.grad = torch.randn_like(param)
before = [param.detach().clone() for param in params]
optimizer.Muon(params, lr=0.02).step()
assert not submodule(optimizer, "functional").TRITON_AVAILABLE
assert all(not torch.equal(param, then) for param, then in zip(params, before))
"""
    tests = Path(__file__).resolve().parent
    # Beside the caller's own path: where `kernels` is installed under a --target folder, as on the GPU machines.
    path = os.pathsep.join(filter(None, [str(tests), os.environ.get("PYTHONPATH")]))
    result = subprocess.run([sys.executable, "-c", code], cwd=tests, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": path})
    assert result.returncode == 0, result.stderr


@pytest.mark.skipif(not triton_kernels.TRITON_AVAILABLE, reason="needs Triton")
@pytest.mark.parametrize("dtype,rows,tma,tma_store,shared_memory,expected", [
    # An H100 (227 KiB per block): all eleven candidates for small bf16 Gram matrices, the 128-row ones for large.
    (torch.bfloat16, 1024, True, True, 232448,
     [(128, 256, 64, 4, True, True, 0), (128, 256, 64, 3, True, True, 0), (128, 256, 64, 4, True, True, 16),
      (128, 128, 64, 4, True, True, 16), (128, 256, 64, 3, True, False, 0),
      (128, 128, 64, 4, True, True, 0), (128, 128, 64, 4, True, False, 0), (128, 256, 64, 3, False, False, 0),
      (128, 128, 64, 4, False, False, 0), (64, 64, 64, 4, True, False, 0), (64, 64, 64, 4, False, False, 0)]),
    (torch.bfloat16, 8192, True, True, 232448,
     [(128, 256, 64, 4, True, True, 0), (128, 256, 64, 3, True, True, 0), (128, 256, 64, 4, True, True, 16),
      (128, 128, 64, 4, True, True, 16), (128, 256, 64, 3, True, False, 0),
      (128, 128, 64, 4, True, True, 0), (128, 128, 64, 4, True, False, 0), (128, 256, 64, 3, False, False, 0),
      (128, 128, 64, 4, False, False, 0)]),
    # An output TMA cannot write (a transposed view): TMA loads, stores through pointers.
    (torch.bfloat16, 8192, True, False, 232448,
     [(128, 256, 64, 3, True, False, 0), (128, 128, 64, 4, True, False, 0), (128, 256, 64, 3, False, False, 0),
      (128, 128, 64, 4, False, False, 0)]),
    # An operand TMA cannot read (a transposed view, a row of an odd number of bytes): the pointer candidates.
    (torch.bfloat16, 8192, False, True, 232448,
     [(128, 256, 64, 3, False, False, 0), (128, 128, 64, 4, False, False, 0)]),
    # fp32 operands take twice the bytes: the 128-row pipelines (256 KiB and more) do not fit, the 64-row ones do.
    (torch.float32, 8192, True, True, 232448, [(64, 64, 64, 4, True, False, 0), (64, 64, 64, 4, False, False, 0)]),
    # A T4 (64 KiB, no TMA): no candidate leaves room for the epilogue, so the smaller pipelines.
    (torch.float16, 1024, False, False, 65536, [(128, 128, 32, 3, False, False, 0), (64, 64, 32, 2, False, False, 0)]),
    (torch.float32, 8192, False, False, 65536, [(64, 64, 32, 2, False, False, 0)]),
])
def test_tile_configs_fit_shared_memory(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, rows: int, tma: bool,
                                        tma_store: bool, shared_memory: int,
                                        expected: list[tuple[int, int, int, int, bool, bool, int]]) -> None:
    monkeypatch.setattr(launch_rules, "INTERPRETER", False)
    monkeypatch.setattr(launch_rules, "_max_shared_memory", lambda: shared_memory)
    configs = launch_rules.symmetric_tile_configs()
    kept = launch_rules.prune_tile_configs(configs, {"x_ptr": torch.empty(0, dtype=dtype), "M": rows}, TMA_READY=tma,
                                           TMA_STORE_READY=tma_store)
    tiles = [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"], c.num_stages, c.kwargs["TMA"],
              c.kwargs["TMA_STORE"], c.kwargs["BAND"]) for c in kept]
    assert tiles == expected
    element_size = torch.empty(0, dtype=dtype).element_size()
    assert all(launch_rules._operand_bytes(c, element_size) <= shared_memory for c in kept)
