"""Which kernel computes Newton-Schulz's symmetric products for a given device, dtype and shape.

Two products are symmetric in every step: the Gram matrix `A = X Xᵀ` and the polynomial `b·A + c·A²` (for symmetric A,
`A² = A Aᵀ`). Each backend computes them:
  "torch":  plain `X @ X.mT` and `addmm`/`baddbmm` (cuBLAS / the CPU BLAS), full products;
  "cpu":    the compiled CPU op `symmetric_gram_` (lower tiles only, each a BLAS GEMM, then mirrored);
  "cuda":   the compiled CUDA op `symmetric_gram_` (tensor-core tiles on and below the diagonal, mirrored);
  "triton": the Triton kernels (lower tiles only, mirrored).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
from torch import Tensor

from . import native
from .option_values import check_choice
from .precision import cpu_matrix_units, cuda_capability, without_autocast
from .triton_kernels import TRITON_AVAILABLE
from .triton_ops import gram_product, polynomial_product

BACKENDS: tuple[str, ...] = ("torch", "cpu", "cuda", "triton")

# Below these sizes of the Gram matrix (rows of the wide-oriented X), the full BLAS product wins: a symmetric kernel
# saves half the multiply-adds, but small tiles run below the BLAS's peak. Measured with `make bench` (README).
CPU_MIN_ROWS = 512
# Rows from which the Triton kernels beat cuBLAS, per CUDA capability, from `make bench` on the GPU
# (benchmarks/results/nvidia-h200-2026-11-26-tma-stores.md: 128x256 tiles, TMA loads and stores). On an H200
# Triton's Gram products ran 1.49x as fast as cuBLAS's at 4096 rows (4096x16384: 1.76x), 1.55-1.69x from 8192, and
# its 5-step Newton-Schulz 1.28x at 4096 rows; at 2048 rows and below 0.08-0.30x. A capability not listed has not
# been measured and keeps cuBLAS, so the automatic choice is never slower than cuBLAS where nobody looked. The
# compiled CUDA op (WMMA tiles, no wgmma) ran its Gram products at 0.14-0.40x of cuBLAS's speed at every size on an
# H100 and an H200: it is never chosen automatically (backend="cuda" forces it).
TRITON_MIN_ROWS: dict[tuple[int, int], int] = {(9, 0): 4096}

_COMPILED_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@torch.compiler.assume_constant_result  # fixed for the process: a compiled step takes it as a constant, unbroken
def _cpu_op_pays(dtype: torch.dtype) -> bool:
    """Whether the compiled CPU op beats the CPU BLAS's full product for this dtype on this CPU (from CPU_MIN_ROWS
    rows). float32 and float64: always (1.5-1.8x on Gram products from 1024 rows, MKL on AMD and Intel). 16-bit: not
    where the CPU has AMX tiles, on which oneDNN runs the op's 256-row panels so far below its full speed that the
    saving is lost (`make bench`, 2-core Xeon: slower than torch.mm on GPT-2's bf16 buckets); elsewhere yes: on an
    AMD EPYC with AVX512-BF16 the panels run at the full product's rate, and 5-step bf16 Newton-Schulz on GPT-2's
    (12, 768, 3072) and (12, 768, 768) buckets ran 1.18x faster with it (benchmarks/results/)."""
    return dtype in (torch.float32, torch.float64) or "amx_bf16" not in cpu_matrix_units()


def _unavailable_reason(backend: str, dtype: torch.dtype, device: torch.device) -> str | None:
    """Why `backend` cannot compute a product of this dtype on this device here, or None when it can."""
    if backend == "torch":
        return None
    if backend in ("cpu", "cuda"):
        if device.type != backend:
            return f"it runs on {backend} tensors and this one is on {device}"
        if not native.has_compiled_symmetric_gram(backend):
            return f"this build has no compiled {backend} kernel ({native.ops_summary()})"
        if dtype not in _COMPILED_DTYPES:
            return f"it does not support {dtype}"
        return _bfloat16_unsupported(dtype, device)
    if not TRITON_AVAILABLE:  # "triton", the last of BACKENDS
        return "Triton is not installed"
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return f"Triton kernels need a GPU tensor and this one is on {device}"
    if dtype not in _TRITON_DTYPES:
        return f"it does not support {dtype}"
    return _bfloat16_unsupported(dtype, device)


def _bfloat16_unsupported(dtype: torch.dtype, device: torch.device) -> str | None:
    """Why bf16 tensor-core products cannot run on this GPU (below compute capability 8.0: T4, V100), or None."""
    capability = cuda_capability(device) if device.type == "cuda" else None
    if dtype == torch.bfloat16 and capability is not None and capability < (8, 0):
        return (f"bfloat16 tensor cores need compute capability 8.0 or newer and this GPU has "
                f"{capability[0]}.{capability[1]}")
    return None


def available_backends(dtype: torch.dtype, device: torch.device | str) -> list[str]:
    """The backends that can compute products of this dtype on this device here, in BACKENDS order."""
    device = torch.device(device)
    return [backend for backend in BACKENDS if _unavailable_reason(backend, dtype, device) is None]


def check_backend(backend: str, dtype: torch.dtype, device: torch.device) -> None:
    """A ValueError for a name that is no backend, as for every other bad argument; a RuntimeError for a backend that
    cannot run here."""
    check_choice("backend", backend, BACKENDS)
    reason = _unavailable_reason(backend, dtype, device)
    if reason is not None:
        raise RuntimeError(f"backend={backend!r} cannot run here: {reason}")


def kernel_choice(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, device: torch.device | str) -> str:
    """The backend `gram` and `zeropower` use for a matrix (or batch of matrices) of `shape` when none is given.

    rows = min(shape[-2:]), the side of the Gram matrix. On CPUs: "cpu" (the compiled symmetric op) from CPU_MIN_ROWS
    rows for float32 and float64, and for bfloat16 and float16 on CPUs without AMX tiles (`_cpu_op_pays`), else
    "torch". On CUDA GPUs: "triton" for bfloat16 and float16 from
    TRITON_MIN_ROWS[capability] rows on the capabilities measured faster there (sm_90: 4096), else "torch"
    (cuBLAS). The compiled "cuda" op is never chosen here; pass backend="cuda" to use it.
    """
    device = torch.device(device)
    rows = min(shape[-2:])
    if (device.type == "cpu" and rows >= CPU_MIN_ROWS and _unavailable_reason("cpu", dtype, device) is None
            and _cpu_op_pays(dtype)):
        return "cpu"
    if device.type == "cuda" and dtype in (torch.bfloat16, torch.float16):
        min_rows = TRITON_MIN_ROWS.get(cuda_capability(device))
        if min_rows is not None and rows >= min_rows and _unavailable_reason("triton", dtype, device) is None:
            return "triton"
    return "torch"


def resolve_backend(backend: str | None, shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> str:
    """`backend` checked against products of `dtype` on `device`, or the automatic choice for a wide matrix (or batch)
    of `shape`."""
    if backend is None:
        return kernel_choice(tuple(shape), dtype, device)
    check_backend(backend, dtype, device)
    return backend


def matmul(a: Tensor, b: Tensor, out: Tensor | None = None) -> Tensor:
    """a @ b for matrices or batches, into `out` if given. A 16-bit batch of one runs as a 2D product: torch's CPU
    `bmm` (oneDNN) first copies a transposed operand of a batch of one (a tall matrix seen wide), which doubled the
    time of a (768, 3072) bfloat16 X Xᵀ (2-core Xeon), where `mm` hands it over as it is. Larger batches are not
    copied, nor float32 ones, whose products keep `bmm`'s rounding."""
    if a.ndim == 3 and a.shape[0] == 1 and a.element_size() <= 2:
        product = torch.mm(a[0], b[0], out=None if out is None else out[0])
        return product.unsqueeze(0) if out is None else out
    return torch.matmul(a, b, out=out)


def symmetric_gram(X: Tensor, backend: str, out: Tensor | None = None) -> Tensor:
    """X @ X.mT for X (m, k) or (B, m, k) with a resolved backend, into `out` (contiguous) if given."""
    if backend == "torch":
        return matmul(X, X.mT, out=out)
    if backend == "triton":
        return _into(out, gram_product(X, _exact_fp32()))
    if out is None:
        out = torch.empty((*X.shape[:-1], X.shape[-2]), dtype=X.dtype, device=X.device)
    return native.symmetric_gram_(out, X)


def symmetric_polynomial(A: Tensor, b: float, c: float, backend: str, out: Tensor | None = None) -> Tensor:
    """b*A + c*A@A for symmetric A (m, m) or (B, m, m) with a resolved backend, into `out` (contiguous, not A) if
    given."""
    if backend == "torch":
        add_matmul = torch.addmm if A.ndim == 2 else torch.baddbmm
        return add_matmul(A, A, A, beta=b, alpha=c, out=out)
    if backend == "triton":
        return _into(out, polynomial_product(A, b, c, _exact_fp32()))
    if out is None:
        out = torch.empty_like(A, memory_format=torch.contiguous_format)
    return native.symmetric_gram_(out, A, A, c, b)


def _into(out: Tensor | None, result: Tensor) -> Tensor:
    """A GPU kernel's fresh result, or that result copied into `out`: the Triton kernels allocate their own
    output, and the CUDA caching allocator makes a fresh one as cheap as a given one."""
    return result if out is None else out.copy_(result)


# A constant of a compiled step (dynamo cannot trace the string it reads), which dynamo's global-state guard on
# TF32 recompiles when the precision changes.
@torch.compiler.assume_constant_result
def _exact_fp32() -> bool:
    """float32 products as torch.mm makes them: full precision unless the user allowed TF32
    (`torch.set_float32_matmul_precision("high")`). On an H100 Triton's TF32 Gram erred 2.2x more than cuBLAS's TF32
    (benchmarks/results/), so TF32 is taken only when asked for."""
    return torch.get_float32_matmul_precision() == "highest"


@torch.no_grad()
@without_autocast
def gram(X: Tensor, backend: str | None = None) -> Tensor:
    """`X @ X.mT` for a matrix (m, k) or a batch (B, m, k) through the fastest available path.

    `backend` ("torch", "cpu", "cuda", "triton") forces a path; one that cannot run here raises a RuntimeError that
    names it. `kernel_choice((*X.shape[:-1], X.shape[-2]), X.dtype, X.device)` (the Gram matrix's shape) says which
    path None picks. Computed without autograd and in X's dtype inside a `torch.autocast` region too, whichever path
    runs.
    """
    if not isinstance(X, Tensor) or X.ndim not in (2, 3):
        raise ValueError(f"Invalid X: expected a matrix (m, k) or a batch (B, m, k), got "
                         f"{tuple(X.shape) if isinstance(X, Tensor) else type(X).__name__}")
    if backend is None:
        backend = kernel_choice((*X.shape[:-1], X.shape[-2]), X.dtype, X.device)
    else:
        check_backend(backend, X.dtype, X.device)
    return symmetric_gram(X, backend)
