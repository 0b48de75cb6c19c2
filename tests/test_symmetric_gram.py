"""`native.symmetric_gram_` (the compiled op) against torch.mm in float64.

out = alpha * X @ X^T + beta * C is checked element by element against float64 products of the same stored inputs,
within a bound derived below from how the op accumulates; symmetry is checked bit for bit.
"""

from __future__ import annotations

import re
from types import ModuleType

import pytest
import torch
from kernel_under_test import compiled_ops, load_cpu_variant, load_fallback_variant, optimizer, submodule

pytestmark = compiled_ops
HAS_CUDA = torch.cuda.is_available()
DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
# (m, k) and (B, m, k) around the CPU kernel's tilings. SMALL_SHAPES fit one 256-row panel (a batch of them is one
# batched GEMM; (2, 3, 5) is small enough for torch's own loop instead of BLAS). TILED_SHAPES take several panels
# (below 1024 rows, and always in 16-bit dtypes, whose diagonal blocks take 128-row sub-panels: 450 rows cut the last
# panel's second one short) or recursive halving into 128-row blocks (float32 and float64 from 1024 rows; 1030 and
# 1100 cut the last tile of each level short). Both tall (m > k) and wide X appear.
SMALL_SHAPES = ((1, 1), (1, 9), (7, 3), (7, 300), (130, 517), (256, 9), (2, 3, 5), (4, 7, 33), (3, 200, 130))
TILED_SHAPES = ((300, 7), (517, 300), (450, 300), (300, 1100), (1100, 1000), (2, 517, 300), (2, 1030, 64))


@pytest.fixture(params=[pytest.param("cpu"), pytest.param("cuda", marks=pytest.mark.skipif(
    not HAS_CUDA, reason="no CUDA device"))])
def gram(request: pytest.FixtureRequest) -> tuple[ModuleType, str]:
    """(native module, device) for the build that has the compiled kernel of that device."""
    device = request.param
    native = submodule(load_cpu_variant() if device == "cpu" else optimizer, "native")
    assert native.has_compiled_symmetric_gram(device), native.ops_summary()
    return native, device


def _random(shape: tuple[int, ...], dtype: torch.dtype, seed: int, device: str) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype).to(device)


def _random_symmetric(shape: tuple[int, ...], dtype: torch.dtype, seed: int, device: str) -> torch.Tensor:
    R = torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return (R + R.mT).to(dtype).to(device)  # rounding is elementwise, so it keeps the symmetry exactly


def _unit_roundoff(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps / 2


def _assert_matches_float64(out: torch.Tensor, X: torch.Tensor, C: torch.Tensor | None, alpha: float,
                            beta: float) -> None:
    """out against alpha * X X^T + beta * C computed in float64 from the same stored values, and exact symmetry.

    The bound, per element, in terms of S = |alpha| (|X| |X|^T) + |beta| |C| (a bound on every partial sum):
    a length-k dot product summed in any order, fused or not, errs by at most k unit roundoffs of the accumulation
    dtype (float32, float64 for float64) times S; scaling by alpha and adding beta * C cost two more. Storing in
    out's dtype rounds once, or twice if the product is stored before C is added: 2 unit roundoffs of out's dtype.
    Products of two bfloat16 or float16 values are exact in float32, so reduced inputs add nothing.
    """
    assert torch.equal(out, out.mT), "out must be exactly symmetric"
    Xd = X.cpu().double()
    expected = alpha * Xd @ Xd.mT
    scale = abs(alpha) * Xd.abs() @ Xd.abs().mT
    if C is not None:
        expected = expected + beta * C.cpu().double()
        scale = scale + abs(beta) * C.cpu().double().abs()
    accumulate = torch.float64 if X.dtype == torch.float64 else torch.float32
    relative = (X.size(-1) + 2) * _unit_roundoff(accumulate) + 2 * _unit_roundoff(out.dtype)
    error = (out.cpu().double() - expected).abs()
    worst = (error / (relative * scale)).nan_to_num(nan=float("inf"), posinf=float("inf")).max().item()
    assert worst <= 1.0, f"error up to {worst:.2f}x the allowed bound"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gram_matches_float64_mm(gram, dtype: torch.dtype) -> None:
    native, device = gram
    for seed, shape in enumerate(SMALL_SHAPES + TILED_SHAPES):
        X = _random(shape, dtype, seed, device)
        m = shape[-2]
        # NaN everywhere: without C the op must write every element and read none.
        out = torch.full((*shape[:-2], m, m), float("nan"), dtype=dtype, device=device)
        assert native.symmetric_gram_(out, X) is out
        _assert_matches_float64(out, X, None, 1.0, 0.0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_alpha_beta_c_form_matches_float64(gram, dtype: torch.dtype) -> None:
    native, device = gram
    for seed, shape in enumerate(((7, 3), (300, 517), (4, 7, 33), (3, 300, 130), (517, 300), (2, 517, 300),
                                  (1100, 64))):
        X = _random(shape, dtype, seed, device)
        m = shape[-2]
        C = _random_symmetric((*shape[:-2], m, m), dtype, 100 + seed, device)
        out = torch.full_like(C, float("nan"))
        native.symmetric_gram_(out, X, C, alpha=-0.75, beta=1.5)
        _assert_matches_float64(out, X, C, -0.75, 1.5)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_newton_schulz_polynomial(gram, dtype: torch.dtype) -> None:
    # The use it is made for: B = b*A + c*A@A with A = X X^T symmetric, passed as both X and C.
    native, device = gram
    b, c = -4.7750, 2.0315  # the quintic coefficients of Keller Jordan's Muon
    for seed, shape in enumerate(((300, 517), (2, 517, 300))):
        X = _random(shape, torch.float64, seed, device)
        A = (X @ X.mT / shape[-1]).to(dtype)  # singular values near [0, 4]: NS iterates are of this size
        out = torch.empty_like(A)
        native.symmetric_gram_(out, A, A, alpha=c, beta=b)
        _assert_matches_float64(out, A, A, c, b)


def test_tiled_shapes_take_several_gemms_on_cpu() -> None:
    # Guards the tests above: TILED_SHAPES must reach the tiled paths (several GEMMs per matrix, batched or not).
    native = submodule(load_cpu_variant(), "native")
    for shape in TILED_SHAPES:
        with torch.profiler.profile() as profile:
            native.symmetric_gram_(torch.empty(*shape[:-2], shape[-2], shape[-2]), torch.zeros(shape))
        gemms = sum(event.name in ("aten::addmm", "aten::baddbmm") for event in profile.events())
        assert gemms >= 2 * (shape[0] if len(shape) == 3 else 1), f"{shape}: {gemms} GEMMs, so not tiled"


def test_beta_ignored_without_c(gram) -> None:
    native, device = gram
    X = _random((300, 40), torch.float32, 0, device)
    out = torch.full((300, 300), float("nan"), device=device)
    native.symmetric_gram_(out, X, None, alpha=2.0, beta=float("nan"))
    _assert_matches_float64(out, X, None, 2.0, 0.0)


def test_any_strides_for_x_and_c(gram) -> None:
    native, device = gram
    G = _random((517, 300), torch.float32, 1, device)
    R = _random((600, 600), torch.float32, 2, device)
    C = (R + R.mT)[::2, ::2]  # symmetric, with gaps between rows and elements
    # Column-major X (a transposed tall matrix, as Newton-Schulz passes it), and X with gaps along both dimensions.
    for X in (G.mT, G[::2, ::3].mT):
        m = X.size(0)
        out = torch.full((m, m), float("nan"), device=device)
        native.symmetric_gram_(out, X)
        _assert_matches_float64(out, X, None, 1.0, 0.0)
        out = torch.full((m, m), float("nan"), device=device)
        native.symmetric_gram_(out, X, C[:m, :m], alpha=0.5, beta=-1.0)
        _assert_matches_float64(out, X, C[:m, :m], 0.5, -1.0)


def test_empty_dimensions(gram) -> None:
    native, device = gram
    out = torch.full((5, 5), float("nan"), device=device)
    native.symmetric_gram_(out, torch.empty(5, 0, device=device))  # k = 0: an empty sum is zero
    assert torch.equal(out, torch.zeros(5, 5, device=device))
    C = _random_symmetric((5, 5), torch.float32, 0, device)
    native.symmetric_gram_(out, torch.empty(5, 0, device=device), C, alpha=3.0, beta=0.5)
    assert torch.equal(out, 0.5 * C)  # halving is exact
    native.symmetric_gram_(torch.empty(0, 0, device=device), torch.empty(0, 4, device=device))
    native.symmetric_gram_(torch.empty(0, 3, 3, device=device), torch.empty(0, 3, 4, device=device))


def _bad_calls(device: str) -> list[tuple[str, tuple, str]]:
    """(case, arguments of symmetric_gram_, text the ValueError must contain)."""
    def t(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, device=device)

    shared = t(4, 4)
    return [
        ("X 1D", (t(3), t(3)), "X must be (m, k) or (B, m, k), got shape [3]"),
        ("X 4D", (t(1, 2, 2, 2), t(1, 2, 2, 3)), "X must be (m, k) or (B, m, k)"),
        ("X integer", (t(3, 3, dtype=torch.int32), t(3, 4, dtype=torch.int32)), "X has dtype Int"),
        ("out dtype", (t(3, 3, dtype=torch.float64), t(3, 4)), "out has dtype Double but X has dtype Float"),
        ("out shape", (t(3, 4), t(3, 4)), "out has shape [3, 4] but X of shape [3, 4] needs [3, 3]"),
        ("out batch", (t(3, 3, 3), t(2, 3, 4)), "out has shape [3, 3, 3] but X of shape [2, 3, 4] needs [2, 3,"),
        ("out 2D for 3D X", (t(3, 3), t(2, 3, 4)), "out has shape"),
        ("out not contiguous", (t(6, 3)[::2], t(3, 4)), "out must be contiguous"),
        ("C shape", (t(3, 3), t(3, 4), t(4, 4), 1.0, 1.0), "C has shape [4, 4]"),
        ("C dtype", (t(3, 3), t(3, 4), t(3, 3, dtype=torch.bfloat16), 1.0, 1.0), "C has dtype BFloat16"),
        ("X inside out", (shared, shared[:, :3]), "X shares memory with out"),
        ("C is out", (shared, t(4, 2), shared, 1.0, 1.0), "C shares memory with out"),
    ]


@pytest.mark.parametrize("case", range(len(_bad_calls("cpu"))), ids=[case for case, _, _ in _bad_calls("cpu")])
def test_bad_arguments_raise_value_error_naming_them(gram, case: int) -> None:
    native, device = gram
    _, arguments, message = _bad_calls(device)[case]
    with pytest.raises(ValueError, match=re.escape(message)):
        native.symmetric_gram_(*arguments)


def test_device_mismatch_raises_value_error(gram) -> None:
    native, device = gram
    X = torch.zeros(3, 4, device=device)
    with pytest.raises(ValueError, match="out is on meta but X is on"):
        native.symmetric_gram_(torch.zeros(3, 3, device="meta"), X)
    with pytest.raises(ValueError, match="C is on meta but X is on"):
        native.symmetric_gram_(torch.zeros(3, 3, device=device), X, torch.zeros(3, 3, device="meta"), beta=1.0)


def test_no_compiled_kernel_raises_runtime_error_naming_device_and_build() -> None:
    fallback = submodule(load_fallback_variant(), "native")
    assert not fallback.has_compiled_symmetric_gram("cpu")
    with pytest.raises(RuntimeError, match="no compiled kernel for device type 'cpu' .pure PyTorch fallback"):
        fallback.symmetric_gram_(torch.zeros(3, 3), torch.zeros(3, 4))
    compiled = submodule(load_cpu_variant(), "native")
    assert not compiled.has_compiled_symmetric_gram("meta")
    with pytest.raises(RuntimeError, match=r"no compiled kernel for device type 'meta' \(compiled ops \(cpu"):
        compiled.symmetric_gram_(torch.zeros(3, 3, device="meta"), torch.zeros(3, 4, device="meta"))


def test_compiled_op_really_runs_and_is_listed(gram) -> None:
    # The profiler records every dispatcher call: the op's namespaced name appears when the compiled op ran.
    native, device = gram
    assert f"symmetric_gram_: {device}" in native.ops_summary()
    with torch.profiler.profile() as profile:
        native.symmetric_gram_(torch.empty(3, 3, device=device), torch.ones(3, 2, device=device))
    assert any(event.name.endswith("::symmetric_gram_") for event in profile.events())


def test_op_schema_marks_only_out_as_written() -> None:
    ops = submodule(load_cpu_variant(), "_ops").ops
    arguments = ops.symmetric_gram_.default._schema.arguments
    assert [arg.name for arg in arguments if arg.alias_info is not None and arg.alias_info.is_write] == ["out"]
