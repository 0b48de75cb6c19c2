"""The kernel dispatcher: every backend gives float64 torch.mm's answer, the choice is inspectable and overridable."""

from __future__ import annotations

import pytest
import torch

from kernel_under_test import optimizer, submodule

dispatch = submodule(optimizer, "dispatch")
native = submodule(optimizer, "native")

# Backends that can run on CPU tensors here: the compiled CPU op, and Triton under the interpreter (conftest sets
# TRITON_INTERPRET=1). The interpreter is slow per tile, so shapes stay small.
CPU_BACKENDS = ["torch", "cpu", "triton"]


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


@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_zeropower_backends_agree_with_torch_backend(backend: str) -> None:
    G = torch.randn(2, 96, 160)
    reference = optimizer.zeropower(G, steps=5, dtype=torch.float32, backend="torch")
    result = optimizer.zeropower(G, steps=5, dtype=torch.float32, backend=backend)
    # Same fp32 iteration with products summed in another order: Newton-Schulz contracts singular values towards 1,
    # so rounding differences stay at a few fp32 ulps of O(1) entries times the five steps.
    torch.testing.assert_close(result, reference, rtol=0, atol=1e-4)


def test_backend_that_cannot_run_here_is_named() -> None:
    X = torch.randn(8, 8)
    with pytest.raises(RuntimeError, match="'cuda'"):
        optimizer.gram(X, backend="cuda")
    with pytest.raises(RuntimeError, match="'cuda'"):
        optimizer.zeropower(X, backend="cuda")
    with pytest.raises(RuntimeError, match="'blas'"):
        optimizer.gram(X, backend="blas")


def test_kernel_choice_by_device_dtype_and_shape() -> None:
    small, large = (64, 256), (dispatch.CPU_MIN_ROWS, 2 * dispatch.CPU_MIN_ROWS)
    assert optimizer.kernel_choice(small, torch.float32, "cpu") == "torch"
    assert optimizer.kernel_choice(large, torch.float32, "cpu") == "cpu"
    assert optimizer.kernel_choice(large, torch.bfloat16, "cpu") == "torch"  # the CPU BLAS wins in 16-bit
    assert optimizer.kernel_choice((dispatch.CUDA_MIN_ROWS // 2,) * 2, torch.bfloat16, "cuda") == "torch"
    assert optimizer.kernel_choice((dispatch.CUDA_MIN_ROWS,) * 2, torch.bfloat16, "cuda") in ("triton", "cuda")


def test_muon_step_uses_the_chosen_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, ...]] = []
    real = native.symmetric_gram_

    def counting(out, X, *args, **kwargs):
        calls.append(tuple(X.shape))
        return real(out, X, *args, **kwargs)

    monkeypatch.setattr(native, "symmetric_gram_", counting)
    rows = dispatch.CPU_MIN_ROWS
    param = torch.randn(rows, rows + 64)
    param.grad = torch.randn_like(param)
    optimizer.Muon([param], ns_steps=2, ns_dtype=torch.float32).step()
    # Two steps, each a Gram product of X and a polynomial product of A, on the batched (1, rows, cols) stack.
    assert calls == [(1, rows, rows + 64), (1, rows, rows)] * 2
