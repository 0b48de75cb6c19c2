"""`kernels benchmark`: `gram`, `zeropower` and one `Muon.step()` against their PyTorch references, timed and verified.

`kernels benchmark <repo-id> --version 1` downloads the repository's `v1` branch (kernel-builder uploads this file
beside the build variants), loads the variant for this machine and runs every `benchmark_<workload>` method below;
`kernels benchmark .` does the same for a checkout after `make build`. This file must stand alone: it is the only one
of `benchmarks/` that reaches the Hub.

For each workload the runner times ours `--iterations` times, times `verify_<workload>` (the PyTorch reference) once,
and fails unless `torch.allclose(self.out, reference, atol=1e-2)` (rtol 1e-5, negligible here). That tolerance is the
runner's and cannot be changed, so each class shapes its data so that atol = 1e-2 means a tolerance chosen for that
computation (its docstring says which and why).

Shapes are per device: sizes where the kernels matter on a GPU; on a CPU, sizes that a 2-core machine ran in 43 s for
the whole file at the runner's default 100 iterations. Matrix products run in float32 on CPUs (where the compiled
symmetric kernel works) and in bfloat16 on GPUs (float16 below compute capability 8.0, which has no bfloat16 tensor
cores). A CUDA build of torch on a machine without a GPU, which the runner takes for a CUDA machine, runs the CPU
workloads.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from typing import ClassVar

import torch
from kernels.benchmark import Benchmark
from torch import Tensor

Triple = tuple[float, float, float]
Workloads = dict[str, dict[str, tuple[int, int]]]  # device kind ("cpu", "gpu") -> workload -> its two sizes

ATOL = 1e-2  # the runner's: torch.allclose(out, reference, atol=1e-2)
# torch.optim.Muon's default Newton-Schulz coefficients and steps, run by both sides so they compute one polynomial.
ORIGINAL: Triple = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
NS_EPS = 1e-7
# The Muon step's hyperparameters, given to both sides. lr sets the size of the update the runner compares (MuonStep).
LR = 0.15
WEIGHT_DECAY = 0.1
ADAMW_BETAS = (0.9, 0.95)


def runnable_device(device: str) -> str:
    """The runner's device, or the CPU where that is CUDA without a GPU: the runner names CUDA wherever torch is a
    CUDA build (PyPI's Linux wheels, a notebook's CPU runtime), GPU or not."""
    return "cpu" if device == "cuda" and not torch.cuda.is_available() else device


def device_kind(device: str) -> str:
    return "cpu" if device == "cpu" else "gpu"


def matmul_dtype(device: str) -> torch.dtype:
    if device == "cpu":
        return torch.float32
    return torch.bfloat16 if torch.cuda.is_bf16_supported(including_emulation=False) else torch.float16


def announce(benchmark: Benchmark, workload: str, description: str) -> None:
    """The runner's table names workloads only; the sizes behind them depend on the device."""
    print(f"    {type(benchmark).__name__}.{workload}: {description}", file=sys.stderr)


def newton_schulz_reference(G: Tensor, coefficients: Sequence[Triple], eps: float = NS_EPS) -> Tensor:
    """torch.optim.Muon's Newton-Schulz iteration written with public PyTorch operations, in G's dtype and in the
    same order (its own function is private): scale the wide orientation by its Frobenius norm, then for each
    (a, b, c): A = X Xᵀ, B = bA + cA², X = aX + BX. tests/test_hub_benchmark.py checks it bit for bit against
    torch's."""
    tall = G.size(0) > G.size(1)
    X = G.mT if tall else G
    X = X / X.norm().clamp(min=eps)
    for a, b, c in coefficients:
        A = X @ X.mT
        B = torch.addmm(A, A, A, beta=b, alpha=c)
        X = torch.addmm(X, B, X, beta=a)
    return X.mT if tall else X


def output_scale(long_side: int, dtype: torch.dtype) -> float:
    """The largest power of two s that keeps ATOL at least 1% (float32) or 25% (16-bit dtypes) of the RMS entry of s
    times a polar factor whose longer side is `long_side`: that entry is 1/sqrt(long_side), as the vectors along the
    shorter side are orthonormal. ATOL is then 1-2% or 25-50% of it (see Zeropower)."""
    fraction = 0.01 if dtype == torch.float32 else 0.25
    return 2.0 ** math.floor(math.log2(math.sqrt(long_side) * ATOL / fraction))


def gpt_blocks(width: int, blocks: int) -> tuple[list[tuple[int, int]], list[int]]:
    """Hidden matrices (out, in) and vector sizes of GPT-2-style blocks: fused QKV, attention output, MLP up and down;
    their biases and two LayerNorms' weights and biases. Width 768, 12 blocks: GPT-2 small."""
    matrices = [(3 * width, width), (width, width), (4 * width, width), (width, 4 * width)]
    vectors = [3 * width, width, 4 * width, width, width, width, width, width]
    return matrices * blocks, vectors * blocks


def flat_parameters(start: Tensor, shapes: Sequence[tuple[int, ...]],
                    grads: Sequence[Tensor]) -> tuple[Tensor, list[Tensor]]:
    """A copy of `start` and parameters that are views into it, each with its own copy of its gradient: an optimizer's
    in-place updates land in the one buffer, which one copy restores and the runner compares as a whole."""
    flat = start.clone()
    views = flat.split([math.prod(shape) for shape in shapes])
    params = [torch.nn.Parameter(view.view(shape)) for view, shape in zip(views, shapes)]
    for param, grad in zip(params, grads):
        param.grad = grad.clone()
    return flat, params


class OnRunnableDevice:
    """The device the runner sets, as `runnable_device` makes it, for every benchmark below. Not a Benchmark itself,
    so the runner does not run it on its own."""

    _device = "cpu"

    @property
    def device(self) -> str:
        return self._device

    @device.setter
    def device(self, device: str) -> None:
        self._device = runnable_device(device)


class SquareAndWide(OnRunnableDevice):
    """Two workloads, "square" and "wide", that differ only in their data. The class supplies `_setup(workload)`,
    `_ours()` and `_reference()`. Not a Benchmark itself, so the runner does not run it on its own."""

    def setup_square(self) -> None:
        self._setup("square")

    def setup_wide(self) -> None:
        self._setup("wide")

    def benchmark_square(self) -> None:
        self._ours()

    def verify_square(self) -> Tensor:
        return self._reference()

    benchmark_wide = benchmark_square
    verify_wide = verify_square


class Gram(SquareAndWide, Benchmark):
    """`optimizer.gram(X)` against `torch.mm(X, X.mT)`.

    X's rows have unit norm and share a common random component, so every entry of X Xᵀ lies in [-1, 1]
    (Cauchy-Schwarz), the diagonal is 1 and the rest sit near 0.5. atol = 1e-2 then rejects a 1% error on the
    diagonal and a 2% error off it, and a missing half of the symmetric product by far. It still allows the one
    bfloat16 unit in the last place (at most 0.0078 here) by which two correctly rounded float32 sums can differ; in
    float32 the two sides agreed exactly on the CPU workloads.
    """

    seed = 0
    # (rows, columns) of X per workload: square and 4x wider than tall.
    workloads: ClassVar[Workloads] = {
        "cpu": {"square": (2048, 2048), "wide": (1024, 4096)},
        "gpu": {"square": (8192, 8192), "wide": (4096, 16384)},
    }

    def _setup(self, workload: str) -> None:
        rows, columns = self.workloads[device_kind(self.device)][workload]
        X = torch.randn(rows, columns, device=self.device) + torch.randn(1, columns, device=self.device)
        self.X = torch.nn.functional.normalize(X, dim=1).to(matmul_dtype(self.device))
        announce(self, workload, f"X {rows}x{columns} {str(self.X.dtype).removeprefix('torch.')}")

    def _ours(self) -> None:
        self.out = self.kernel.gram(self.X)

    def _reference(self) -> Tensor:
        return torch.mm(self.X, self.X.mT)


class Zeropower(SquareAndWide, Benchmark):
    """`optimizer.zeropower` against `newton_schulz_reference` (torch.optim.Muon's iteration in public operations):
    5 steps of torch.optim.Muon's coefficients, both in the matmul dtype.

    The polar factor of an (m, n) matrix, m <= n, has entries of RMS 1/sqrt(n), about the runner's atol itself. So
    both sides run the last step's (a, b, c) times a power of two s (`output_scale`): that multiplies the result by s
    exactly (binary floating point rounds s·x as it rounds x) with the same products, so the timing and rounding are
    those of the plain iteration. atol is then 1-2% of the RMS entry in float32, where the two sides differed by at
    most 0.001% of it on the CPU workloads (float32 differs from float64 by up to 0.02%), and 25-50% in 16-bit dtypes:
    bfloat16 iterations that differ only in the order of their float32 sums differed by up to 10% of it (8192x8192;
    7-9% from 1024x1024 to 4096x4096), and one differed from float64 by up to 12% (768x3072). A result 20% too large
    fails in every dtype: its largest entries, ~5 times the RMS, move by twice the widest tolerance.
    """

    seed = 0
    # (rows, columns) of G per workload; "wide" on GPUs is a Llama-3-8B MLP matrix (4096 x 14336).
    workloads: ClassVar[Workloads] = {
        "cpu": {"square": (768, 768), "wide": (512, 2048)},
        "gpu": {"square": (8192, 8192), "wide": (4096, 14336)},
    }

    def _setup(self, workload: str) -> None:
        rows, columns = self.workloads[device_kind(self.device)][workload]
        dtype = matmul_dtype(self.device)
        self.G = torch.randn(rows, columns, device=self.device, dtype=dtype)
        s = output_scale(max(rows, columns), dtype)
        self.coefficients = [ORIGINAL] * (NS_STEPS - 1) + [(ORIGINAL[0] * s, ORIGINAL[1] * s, ORIGINAL[2] * s)]
        announce(self, workload, f"G {rows}x{columns} {str(dtype).removeprefix('torch.')}, {NS_STEPS} steps, "
                                 f"result x{s:g}")

    def _ours(self) -> None:
        self.out = self.kernel.zeropower(self.G, NS_STEPS, self.coefficients, dtype=self.G.dtype, eps=NS_EPS)

    def _reference(self) -> Tensor:
        return newton_schulz_reference(self.G, self.coefficients)


class MuonStep(OnRunnableDevice, Benchmark):
    """One `optimizer.Muon.step()` against `torch.optim.Muon` (the matrices) + `torch.optim.AdamW(fused=True)` (the
    vectors), on identical copies of the same parameters and gradients with the same hyperparameters (momentum 0.95,
    Nesterov, 5 steps and eps 1e-7 are both sides' defaults). Newton-Schulz runs in each side's default dtype:
    torch.optim.Muon's is always bfloat16; ours is `default_ns_dtype(device)`'s (bfloat16 on GPUs from compute
    capability 8.0, on CPUs with AMX and on AMD CPUs with AVX512-BF16; float16 on older GPUs; float32 on other
    CPUs).

    Each call, timed or not, restores the parameters (one copy of the flat buffer that holds them, on both sides)
    and steps. The gradients stay fixed, so every step of either optimizer computes the same update: Muon
    orthogonalizes a positive multiple of the gradient ((1 - 0.95^(t+1))·g) and Adam's bias-corrected moments are g
    and g². One call of ours is therefore compared with the reference's last; `out` is our flat buffer.

    With lr = 0.15 Muon's update (match_rms_adamw) has an RMS entry of ~0.026, so atol = 1e-2 is ~38% of it. On the
    CPU workload (3 seeds) the two sides differed by at most 0.24 atol with our Newton-Schulz in float32 and 0.33 atol
    with it in bfloat16, as on GPUs: bfloat16 iterations differ by a few units in the last place of their largest
    entries. A Muon update 10% too large fails (1.5 atol). AdamW's update is ±lr (Adam's steps are sign(g) for a
    fixed g), so there atol is 7% of it. Weight decay moves the unit-scale parameters by 1.5% of their size, more
    than atol for half of them, so a missing decay fails too.
    """

    seed = 0
    # (width, blocks) of GPT-2-style blocks per workload: on CPUs the size of `make demo`'s model, on GPUs GPT-2 small.
    workloads: ClassVar[Workloads] = {
        "cpu": {"gpt": (128, 4)},
        "gpu": {"gpt": (768, 12)},
    }

    def setup_gpt(self) -> None:
        width, blocks = self.workloads[device_kind(self.device)]["gpt"]
        matrices, vectors = gpt_blocks(width, blocks)
        shapes = [*matrices, *((size,) for size in vectors)]
        self.start = torch.randn(sum(math.prod(shape) for shape in shapes), device=self.device)
        grads = [torch.randn(shape, device=self.device) for shape in shapes]
        self.out, ours = flat_parameters(self.start, shapes, grads)
        self.theirs_flat, theirs = flat_parameters(self.start, shapes, grads)
        self.ours = self.kernel.Muon(ours, lr=LR, weight_decay=WEIGHT_DECAY, ns_coefficients=[ORIGINAL],
                                     adjust_lr_fn="match_rms_adamw", adamw_betas=ADAMW_BETAS)
        self.theirs = [
            torch.optim.Muon(theirs[:len(matrices)], lr=LR, weight_decay=WEIGHT_DECAY, ns_coefficients=ORIGINAL,
                             adjust_lr_fn="match_rms_adamw"),
            torch.optim.AdamW(theirs[len(matrices):], lr=LR, betas=ADAMW_BETAS, weight_decay=WEIGHT_DECAY,
                              fused=True),
        ]
        announce(self, "gpt", f"{blocks} GPT-2-style blocks of width {width}: {len(matrices)} matrices, "
                              f"{len(vectors)} vectors, {self.start.numel() / 1e6:.2f}M parameters")

    def benchmark_gpt(self) -> None:
        self.out.copy_(self.start)
        self.ours.step()

    def verify_gpt(self) -> Tensor:
        self.theirs_flat.copy_(self.start)
        for optimizer in self.theirs:
            optimizer.step()
        return self.theirs_flat
