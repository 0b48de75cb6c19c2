"""The kernel dispatcher: every backend gives float64 torch.mm's answer, the choice is inspectable and overridable."""

from __future__ import annotations

import os

import pytest
import torch

from kernel_under_test import compiled_ops, load_cpu_variant, submodule

# CPU tensors, so the compiled CPU variant (on a GPU machine `optimizer` is the CUDA one, whose library has no CPU op).
optimizer = load_cpu_variant()
dispatch = submodule(optimizer, "dispatch")
native = submodule(optimizer, "native")

# Backends that can run on CPU tensors here: the compiled CPU op, and Triton under the interpreter (conftest sets
# TRITON_INTERPRET=1 unless the run asks for compiled Triton on a GPU). The interpreter is slow per tile, so shapes
# stay small.
INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"
CPU_BACKENDS = ["torch", pytest.param("cpu", marks=compiled_ops), pytest.param("triton", marks=pytest.mark.skipif(
    not INTERPRETER, reason="Triton runs on CPU tensors only under its interpreter"))]


@compiled_ops
def test_compiled_cpu_kernel_is_in_this_build() -> None:
    assert native.has_compiled_symmetric_gram("cpu")


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("shape", [(37, 300), (3, 130, 70)])
def test_gram_backends_match_float64(backend: str, shape: tuple[int, ...]) -> None:
    X = torch.randn(shape)
    result = optimizer.gram(X, backend=backend)
    expected = X.double() @ X.double().mT
    # fp32 accumulation over k <= 300 terms of products of N(0, 1) numbers: error ~ sqrt(k) * 2^-24 * |X||X|^T,
    # far below 1e-4 relative to the diagonal (~k).
    torch.testing.assert_close(result.double(), expected, rtol=1e-5, atol=1e-4)
    assert torch.equal(result, result.mT)


@pytest.mark.parametrize("backend", CPU_BACKENDS[1:])
def test_zeropower_backends_agree_with_torch_backend(backend: str) -> None:
    G = torch.randn(2, 96, 160)
    reference = optimizer.zeropower(G, steps=5, dtype=torch.float32, backend="torch")
    result = optimizer.zeropower(G, steps=5, dtype=torch.float32, backend=backend)
    # Same fp32 iteration with products summed in another order: Newton-Schulz contracts singular values towards 1,
    # so rounding differences stay at a few fp32 ulps of O(1) entries times the five steps.
    torch.testing.assert_close(result, reference, rtol=0, atol=1e-4)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("shape", [(128, 256), (2, 48, 200)])
def test_the_gram_iteration_is_as_near_its_float64_result_through_every_backend(backend: str, shape) -> None:
    # The symmetric kernels read one triangle of the Gram matrix the iteration updates with general products: its
    # triangles drifting apart ~10x a step took the float32 error through the compiled op to 1.6e-5 on 128x256, where
    # torch's products gave 8e-7.
    G = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    exact = optimizer.zeropower(G.double(), steps=5, dtype=torch.float64, backend="torch", algorithm="gram")
    result = optimizer.zeropower(G, steps=5, dtype=torch.float32, backend=backend, algorithm="gram")
    error = (result.double() - exact).abs().max().item()
    assert error <= 2.5e-6, error  # measured 9.6e-7 and 7.7e-7 through torch, 9.2e-7 and 9.2e-7 through the op


@compiled_ops
def test_a_forced_backend_runs_the_products_of_a_16_bit_gram_iteration(monkeypatch: pytest.MonkeyPatch) -> None:
    # On a CPU a bfloat16 Gram iteration runs its m x m part in float32: there the choice for float32 replaced the
    # backend the caller forced.
    newton_schulz = submodule(optimizer, "newton_schulz")
    used: list[str] = []
    real = newton_schulz.symmetric_gram
    monkeypatch.setattr(newton_schulz, "symmetric_gram",
                        lambda X, backend, out=None: used.append(backend) or real(X, backend, out=out))
    for backend in ("cpu", "torch"):
        used.clear()
        optimizer.zeropower(torch.randn(16, 48), steps=5, dtype=torch.bfloat16, backend=backend, algorithm="gram")
        assert used and set(used) == {backend}


def test_backend_that_cannot_run_here_is_named() -> None:
    X = torch.randn(8, 8)
    with pytest.raises(RuntimeError, match="'cuda'"):
        optimizer.gram(X, backend="cuda")
    with pytest.raises(RuntimeError, match="'cuda'"):
        optimizer.zeropower(X, backend="cuda")


@compiled_ops
def test_the_cpu_op_refuses_tensors_on_another_device_and_dtypes_it_lacks() -> None:
    # The compiled CPU op is in this build, so only the device and the dtype can rule it out: a meta tensor (as a
    # model built on the meta device has) and a float8 or complex matrix must not reach it.
    assert "cpu" not in dispatch.available_backends(torch.float32, "meta")
    with pytest.raises(RuntimeError, match="backend='cpu'.*on meta"):
        dispatch.check_backend("cpu", torch.float32, torch.device("meta"))
    for dtype in (torch.float8_e4m3fn, torch.complex64):
        assert "cpu" not in dispatch.available_backends(dtype, "cpu"), dtype
        with pytest.raises(RuntimeError, match=rf"backend='cpu'.*{dtype}"):
            dispatch.check_backend("cpu", dtype, torch.device("cpu"))


def test_a_name_that_is_no_backend_is_a_value_error() -> None:
    # As every other bad argument of gram and zeropower; RuntimeError stays for a backend that cannot run here.
    X = torch.randn(8, 8)
    expected = r"Invalid backend: 'blas' \(expected one of 'torch', 'cpu', 'cuda', 'triton'\)"
    with pytest.raises(ValueError, match=expected):
        optimizer.gram(X, backend="blas")
    with pytest.raises(ValueError, match="Invalid backend: 'blas'"):
        optimizer.zeropower(X, backend="blas")


@pytest.mark.parametrize("units", [("amx_bf16", "avx512_bf16"), ("avx512_bf16",), ()])
@compiled_ops
def test_kernel_choice_by_device_dtype_and_shape(monkeypatch: pytest.MonkeyPatch, units: tuple[str, ...]) -> None:
    monkeypatch.setattr(dispatch, "cpu_matrix_units", lambda: frozenset(units))
    small, large = (64, 256), (dispatch.CPU_MIN_ROWS, 2 * dispatch.CPU_MIN_ROWS)
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        assert optimizer.kernel_choice(small, dtype, "cpu") == "torch"
        # 16-bit products on AMX tiles: the BLAS's full product beats the op's panels; everywhere else the op wins.
        wins = dtype in (torch.float32, torch.float64) or "amx_bf16" not in units
        assert optimizer.kernel_choice(large, dtype, "cpu") == ("cpu" if wins else "torch"), dtype


@compiled_ops
def test_kernel_choice_sizes_the_gram_matrix_by_the_shorter_side_from_512_rows() -> None:
    # README: the compiled op "from 512 rows up for fp32/fp64", `torch.mm` below. zeropower iterates on the wide
    # orientation, so a tall (4096, 64) matrix's Gram matrix is 64 x 64 whichever way the shape is given.
    for shape in ((511, 4096), (4096, 511), (4096, 64)):
        assert optimizer.kernel_choice(shape, torch.float32, "cpu") == "torch", shape
    for shape in ((512, 4096), (4096, 512), (3, 512, 512)):
        assert optimizer.kernel_choice(shape, torch.float32, "cpu") == "cpu", shape


def recorded_gram_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """The shapes of X the compiled Gram op is called with from now on, in order."""
    calls: list[tuple[int, ...]] = []
    real = native.symmetric_gram_

    def counting(out, X, *args, **kwargs):
        calls.append(tuple(X.shape))
        return real(out, X, *args, **kwargs)

    monkeypatch.setattr(native, "symmetric_gram_", counting)
    return calls


@compiled_ops
def test_gram_of_a_tall_matrix_sizes_the_choice_by_its_gram_matrix(monkeypatch: pytest.MonkeyPatch) -> None:
    # X Xᵀ of a (512, 64) X is 512 x 512, the size from which the compiled op runs, though X's shorter side is 64.
    calls = recorded_gram_calls(monkeypatch)
    X = torch.randn(dispatch.CPU_MIN_ROWS, 64, dtype=torch.float64)
    torch.testing.assert_close(optimizer.gram(X), X @ X.mT)
    assert calls == [tuple(X.shape)]
    assert optimizer.gram(X.mT).shape == (64, 64) and calls == [tuple(X.shape)]


@pytest.mark.parametrize("capability", [(9, 0), (8, 0), (7, 5), None])
def test_kernel_choice_on_gpus_follows_the_measured_table(monkeypatch: pytest.MonkeyPatch, capability) -> None:
    monkeypatch.setattr(dispatch, "cuda_capability", lambda device: capability)
    min_rows = dispatch.TRITON_MIN_ROWS.get(capability)
    for rows in (1024, 4096, 8192, 16384):
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            chosen = optimizer.kernel_choice((rows, 2 * rows), dtype, "cuda")
            # Triton only where it was measured faster: a listed capability, 16-bit, from its row count on.
            wins = min_rows is not None and rows >= min_rows and dtype != torch.float32
            assert chosen == ("triton" if wins else "torch"), (capability, rows, dtype, chosen)


@compiled_ops
def test_muon_step_uses_the_chosen_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = recorded_gram_calls(monkeypatch)
    rows = dispatch.CPU_MIN_ROWS
    param = torch.randn(rows, rows + 64)
    param.grad = torch.randn_like(param)
    optimizer.Muon([param], ns_steps=2, ns_dtype=torch.float32).step()
    # Two steps, each a Gram product of X and a polynomial product of A, on the parameter's matrix (a stack of one
    # matrix this small runs as that matrix).
    assert calls == [(rows, rows + 64), (rows, rows)] * 2


@pytest.mark.parametrize("precision,exact", [("highest", True), ("high", False)])
def test_triton_float32_products_follow_torch_matmul_precision(monkeypatch: pytest.MonkeyPatch, precision: str,
                                                               exact: bool) -> None:
    # Triton's TF32 truncates (measured 2.2x cuBLAS's TF32 error on an H100), so it is used only where torch.mm
    # itself would use TF32.
    seen: list[bool] = []
    monkeypatch.setattr(dispatch, "gram_product", lambda X, exact_fp32: seen.append(exact_fp32) or X @ X.mT)
    monkeypatch.setattr(dispatch, "polynomial_product", lambda A, b, c, exact_fp32: seen.append(exact_fp32) or A)
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        A = dispatch.symmetric_gram(torch.randn(4, 6), "triton")
        dispatch.symmetric_polynomial(A, 1.0, 1.0, "triton")
    finally:
        torch.set_float32_matmul_precision(previous)
    assert seen == [exact, exact]


def test_a_t4_gets_float16_and_a_kernel_that_runs_there(monkeypatch: pytest.MonkeyPatch) -> None:
    # Compute capability 7.5, as Colab's and Kaggle's free T4: the default Newton-Schulz dtype and the kernel chosen
    # for it at every size must be one that check_backend accepts there (no bf16 tensor cores, no sm_80 code).
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    device = torch.device("cuda")
    dtype = optimizer.default_ns_dtype(device)
    assert dtype == torch.float16
    for rows in (64, 1024, 4096, 8192, 16384):
        backend = optimizer.kernel_choice((rows, 2 * rows), dtype, device)
        dispatch.check_backend(backend, dtype, device)
        assert backend in dispatch.available_backends(dtype, device)


def test_gpu_kernels_refuse_bfloat16_below_sm80(monkeypatch: pytest.MonkeyPatch) -> None:
    # A T4 (7.5) has fp16 tensor cores only: forcing a GPU kernel in bf16 there is a clear error, fp16 runs.
    monkeypatch.setattr(native, "has_compiled_symmetric_gram", lambda device_type: True)
    monkeypatch.setattr(dispatch, "cuda_capability", lambda device: (7, 5))
    for backend in ("cuda", "triton"):
        with pytest.raises(RuntimeError, match=rf"backend='{backend}'.*compute capability 8\.0.*7\.5"):
            dispatch.check_backend(backend, torch.bfloat16, torch.device("cuda"))
        dispatch.check_backend(backend, torch.float16, torch.device("cuda"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch", [1, 3])
def test_matmul_of_transposed_batches_is_torch_matmuls_product(batch: int, dtype: torch.dtype) -> None:
    # A batch of one runs as a 2D product (dispatch.matmul): the same answer as torch.matmul, into `out` if given.
    generator = torch.Generator().manual_seed(batch)
    a = torch.randn(batch, 40, 24, generator=generator).to(dtype).mT  # tall matrices seen wide: transposed views
    b = torch.randn(batch, 40, 16, generator=generator).to(dtype)
    out = torch.empty(batch, 24, 16, dtype=dtype)
    assert dispatch.matmul(a, b, out=out) is out
    torch.testing.assert_close(out, torch.matmul(a, b))
    torch.testing.assert_close(dispatch.matmul(a, b), torch.matmul(a, b))
    exact = torch.matmul(a.double(), b.double())
    torch.testing.assert_close(out.double(), exact, rtol=0, atol=40 * torch.finfo(dtype).eps * exact.abs().max())
