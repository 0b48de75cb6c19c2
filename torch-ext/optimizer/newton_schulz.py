"""Approximate polar factor (the "zeroth power" U V^T of G = U S V^T) by odd quintic Newton-Schulz steps."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch
from torch import Tensor

from .coefficients import Coefficients, resolve_coefficients
from .dispatch import check_backend, matmul, resolve_backend, symmetric_gram, symmetric_polynomial
from .option_values import check_float_dtype, check_ns_steps, overflowed_to_infinity
from .precision import default_ns_dtype, matrix_ns_dtype, warn_if_slow, without_autocast
from .workspace import Workspace

NS_ALGORITHMS: tuple[str, ...] = ("standard", "gram", "auto")
PRECONDITIONERS: tuple[str | None, ...] = (None, "aol")

# A stack of one matrix up to this size (an optimizer's bucket of one small parameter) runs as that matrix: its 2D
# products take no batch views and no workspace blocks, which saved 0.18-0.29 ms per call from 10x256 to 256x784 in
# bf16 (0.45 against 0.27 ms at 10x256; torch.optim.Muon's own routine 0.24), up to 512x1024; from 512x2048 the
# workspace's reused blocks paid more (2-core AMD EPYC). A larger matrix, in a stack or alone, iterates in reused
# buffers (see `_Buffers`).
_LONE_MATRIX_NUMEL = 2**19


@torch.no_grad()
@without_autocast
def zeropower(G: Tensor, steps: int = 5, coefficients: str | Sequence[Coefficients] = "polar_express",
              dtype: torch.dtype | None = None, eps: float = 1e-7, backend: str | None = None,
              algorithm: str = "standard", preconditioner: str | None = None, safety_factor: float = 1.0,
              scale_eps: bool = False) -> Tensor:
    """Approximate U V^T for a matrix (m, n) or for each matrix of a batch (B, m, n), computed in `dtype` (None: the
    dtype G's device multiplies fastest in, `default_ns_dtype(G.device)`, or for a lone small matrix on a CPU the one
    `matrix_ns_dtype` says, as the optimizer's ns_dtype=None does).

    `coefficients` is a preset name ("original", "quintic", "polar_express") or a sequence of (a, b, c)
    triples, one per step (the last repeats). `backend` ("torch", "cpu", "cuda", "triton") forces the kernel for
    the symmetric products; None lets `kernel_choice` pick by device, dtype and shape. `algorithm`: "standard"
    (three products of X's size per step), "gram" (the same polynomial applied through X's Gram matrix, cheaper for
    rectangular X) or "auto" (see `resolve_algorithm`). `preconditioner="aol"` rescales X's rows before the first
    step (see `aol_scaled`), and the "polar_express" preset then assumes it (`resolve_coefficients`).
    `safety_factor` (>= 1) and `scale_eps` change the initial scaling as timm's options do (see `newton_schulz`). The
    result has G's shape and dtype. Computed without autograd (its products write into reused buffers), whether G
    requires grad or not, and in `dtype` inside a `torch.autocast` region too. A `dtype` this device multiplies far
    slower than the default (bf16 or fp16 on a CPU without their matrix instructions) is honoured and warns once, as
    the optimizer's ns_dtype does.
    """
    _check_matrix(G)
    steps = check_ns_steps(steps, "steps")
    explicit_dtype = dtype is not None
    if dtype is None:
        dtype = matrix_ns_dtype(default_ns_dtype(G.device), G.device, G.shape)
    check_float_dtype("dtype", dtype)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < math.inf:
        raise ValueError(f"Invalid eps: {eps!r} (expected a finite number > 0)")
    if backend is not None:
        check_backend(backend, dtype, G.device)
    if algorithm not in NS_ALGORITHMS:
        raise ValueError(f"Invalid algorithm: {algorithm!r} (expected one of {', '.join(map(repr, NS_ALGORITHMS))})")
    if preconditioner not in PRECONDITIONERS:
        raise ValueError(f"Invalid preconditioner: {preconditioner!r} (expected one of "
                         f"{', '.join(map(repr, PRECONDITIONERS))})")
    check_safety_factor(safety_factor)
    if not isinstance(scale_eps, bool):
        raise ValueError(f"Invalid scale_eps: {scale_eps!r} (expected True or False)")
    schedule = resolve_coefficients(coefficients, steps, preconditioner)
    if explicit_dtype:
        warn_if_slow(dtype, G.device, "dtype")
    staged = G.to(staging_dtype(dtype, G.dtype))
    return newton_schulz(staged, schedule, eps, backend, dtype, algorithm, preconditioner, safety_factor, scale_eps,
                         overwrite_input=staged is not G).to(G.dtype)


def check_safety_factor(safety_factor: float) -> None:
    """A factor below 1 could leave the scaled spectral norm above 1, where the iteration diverges."""
    if isinstance(safety_factor, bool) or not isinstance(safety_factor, (int, float)) or not (
            1 <= safety_factor < math.inf):
        raise ValueError(f"Invalid safety_factor: {safety_factor!r} (expected a finite number >= 1)")


# eq=False keeps object identity's hash: torch 2.11's compiler hashes a callable object built inside a traced step
# before its fields exist, which the fields' hash cannot survive (the GPT-2 step under torch.compile died there).
@dataclass(frozen=True, eq=False)
class Orthogonalizer:
    """One parameter group's Newton-Schulz recipe, applied to every stack of its matrices in a step."""

    coefficients: tuple[Coefficients, ...]
    eps: float
    dtype: torch.dtype
    algorithm: str = "standard"
    preconditioner: str | None = None
    safety_factor: float = 1.0
    scale_eps: bool = False
    # Whether `dtype` is what ns_dtype=None resolved to, which a lone small matrix on a CPU trades for float32
    # (`matrix_ns_dtype`); an explicit ns_dtype holds for every stack.
    dtype_is_default: bool = False

    def staging_dtype(self, source_dtype: torch.dtype) -> torch.dtype:
        """The dtype a matrix of `source_dtype` is held in until its norm has scaled it (see `staging_dtype`)."""
        return staging_dtype(self.dtype, source_dtype)

    @property
    def recipe(self) -> tuple:
        """Its fields: equal for two orthogonalizers that treat every stack alike."""
        return tuple(getattr(self, name) for name in _ORTHOGONALIZER_FIELDS)

    def stack_dtype(self, shape: Sequence[int], device: torch.device) -> torch.dtype:
        """The dtype a stack of `shape` on `device` iterates in: `dtype`, or what `matrix_ns_dtype` makes of it."""
        return matrix_ns_dtype(self.dtype, device, shape) if self.dtype_is_default else self.dtype

    def __call__(self, matrices: Tensor, workspace: Workspace | None = None) -> Tensor:
        """The orthogonalized stack. `matrices` is the caller's temporary: it is overwritten. With a `workspace`, the
        result may live in its blocks."""
        dtype = self.stack_dtype(matrices.shape, matrices.device)
        return newton_schulz(matrices, self.coefficients, self.eps, dtype=dtype, algorithm=self.algorithm,
                             preconditioner=self.preconditioner, safety_factor=self.safety_factor,
                             scale_eps=self.scale_eps, overwrite_input=True, workspace=workspace)


# Named once: `dataclasses.fields` filters the class's fields at every call, and a step asks each group's recipe.
_ORTHOGONALIZER_FIELDS = tuple(field.name for field in fields(Orthogonalizer))


def staging_dtype(dtype: torch.dtype, source_dtype: torch.dtype) -> torch.dtype:
    """The dtype a matrix of `source_dtype` is held in until its norm has scaled it into [-1, 1] for an iteration in
    `dtype`: float64 for a float64 source, whose entries may lie beyond float32's range (a cast first made them inf,
    and the scaled matrix NaN); float32 for a float16 iteration, whose range (65504) a gradient element or a
    Frobenius norm can exceed; `dtype` itself otherwise."""
    if source_dtype == torch.float64:
        return torch.float64
    return torch.float32 if dtype == torch.float16 else dtype


def newton_schulz(G: Tensor, coefficients: Sequence[Coefficients], eps: float, backend: str | None = None,
                  dtype: torch.dtype | None = None, algorithm: str = "standard",
                  preconditioner: str | None = None, safety_factor: float = 1.0, scale_eps: bool = False,
                  overwrite_input: bool = False, workspace: Workspace | None = None) -> Tensor:
    """The iteration itself for validated inputs: G is (m, n) or (B, m, n), one step per triple.

    Works on the wide orientation (the Gram matrix is min(m, n) squared) and scales each matrix by its
    Frobenius norm, an upper bound on its spectral norm, so every singular value starts in [0, 1]. The scaling
    happens in G's dtype, the iteration in `dtype` (None: G's), so a float16 iteration can start from a float32
    G, and any from a float64 G whose entries lie beyond its range (see `staging_dtype`). For a 2D G in the
    iteration's dtype the operations and their order are those of
    torch.optim.Muon, so with the "torch" backend results match it bit for bit. The symmetric products go
    through `backend` (None: chosen per device, dtype and shape). `algorithm` is "standard", "gram" (the iteration on
    the Gram matrix, `_gram_iteration`) or "auto" (see `resolve_algorithm`). `preconditioner` None or "aol"
    (`aol_scaled`, on the first Gram matrix, which the first step then reuses). `safety_factor` multiplies the
    norm before the division (timm's; Polar Express uses 1.01). `scale_eps` (timm's, for μP, arXiv 2512.05620):
    eps * sqrt(cols / rows) of G as given ((out, in)) is added to the norm instead of clamping it.
    `overwrite_input`: G is a temporary of the caller's, which the scaling may overwrite (one tensor fewer).
    `workspace`: where a CPU batch's buffers come from (None: a fresh one, dropped on return). A batch of one small
    matrix runs as that matrix, without the workspace (see `_LONE_MATRIX_NUMEL`).
    """
    if G.ndim == 3 and G.size(0) == 1 and G[0].numel() <= _LONE_MATRIX_NUMEL:
        return newton_schulz(G[0], coefficients, eps, backend, dtype, algorithm, preconditioner, safety_factor,
                             scale_eps, overwrite_input).unsqueeze(0)
    tall = G.size(-2) > G.size(-1)
    X = G.mT if tall else G
    # The full reduction for 2D is torch.optim.Muon's, and so is its rounding (see `norm_denominator`).
    norm = X.norm() if X.ndim == 2 else X.norm(dim=(-2, -1), keepdim=True)
    denominator = norm_denominator(norm, G.shape, eps, safety_factor, scale_eps)
    buffers = _Buffers(X, workspace)
    X = _scaled(X, denominator, dtype or G.dtype, overwrite_input, buffers)
    if resolve_algorithm(algorithm, X.shape, len(coefficients), X.dtype, X.device.type) == "gram":
        X = _gram_iteration(X, coefficients, backend, preconditioner, eps, buffers)
    else:
        backend = resolve_backend(backend, X.shape, X.dtype, X.device)
        gram = None
        if preconditioner == "aol":
            X, gram = aol_scaled(X, symmetric_gram(X, backend), eps, in_place=True)
        X = _standard_iteration(X, gram, coefficients, backend, buffers)
    return X.mT if tall else X


def norm_denominator(norm: Tensor, shape: Sequence[int], eps: float, safety_factor: float, scale_eps: bool) -> Tensor:
    """What a matrix of `shape` (as given: (out, in)) with Frobenius norm `norm` is divided by before the first step.
    Clamped (or, under scale_eps, offset): a zero matrix stays exactly zero. Without a safety factor no multiply is
    added, so the rounding is torch.optim.Muon's."""
    if safety_factor != 1.0:
        norm = norm * safety_factor
    if scale_eps:
        return norm + eps * math.sqrt(shape[-1] / shape[-2])
    return norm.clamp(min=overflowed_to_infinity(eps, norm.dtype))


def _scaled(X: Tensor, denominator: Tensor, dtype: torch.dtype, overwrite_input: bool, buffers: _Buffers) -> Tensor:
    """X / denominator in `dtype`, newton_schulz's own tensor, which becomes the buffer "X1" (see `_Buffers`). A CPU
    batch in `dtype`, stored row-major or (a tall batch seen wide) as the transpose of a row-major one, is divided
    in its stored layout into the workspace's block, and its memory, when the caller's, becomes "X0": out of place
    ran twice as fast as in place (7 vs 13 ms on (12, 768, 3072) bf16, 2-core Xeon)."""
    stored = X if X.is_contiguous() else X.mT if X.mT.is_contiguous() else None
    into = buffers.get("X1", stored.shape, dtype) if stored is not None and X.dtype == dtype else None
    if into is not None:
        if overwrite_input:
            buffers.adopt("X0", stored.view(X.shape))  # its values are read once, below: only its memory is reused
        divided = torch.div(stored, denominator, out=into)
        return divided if stored is X else divided.mT
    X = (X.div_(denominator) if overwrite_input else X / denominator).to(dtype)
    buffers.adopt("X1", X)
    return X


def aol_scaled(X: Tensor, gram: Tensor, eps: float, in_place: bool = False) -> tuple[Tensor, Tensor]:
    """AOL preconditioning (Boissin et al., "Turbo-Muon", arXiv 2512.04632): X's rows scaled by
    d = (|X Xᵀ| 1)^(-1/2), which bounds the spectral norm of D X by 1 and starts its singular values closer to 1
    than the Frobenius scaling does; returns D X and its Gram matrix D (X Xᵀ) D, computed from the one given.
    `in_place`: both are the caller's own and are scaled where they lie (no fresh copy of X: on the CPU a new
    GPT-2-sized stack is faulted in page by page)."""
    # Summed in float32 at least, where eps does not round to 0 (float16 took eps=1e-8 as 0: a zero row's rsqrt(0)
    # was inf, and 0 * inf NaN spread through every product); clamped twice so that a zero row stays zero.
    sums = gram.abs().sum(dim=-1, dtype=torch.promote_types(gram.dtype, torch.float32))
    scale = sums.clamp(min=eps).rsqrt().clamp(max=torch.finfo(X.dtype).max)
    rows, columns = scale.unsqueeze(-1), scale.unsqueeze(-2)
    if in_place:
        return X.mul_(rows.to(X.dtype)), gram.mul_(rows).mul_(columns)
    return X * rows.to(X.dtype), gram * rows * columns


# FLOPs a matrix the Gram iteration must save before "auto" picks it: it makes more calls than the standard iteration,
# which cost a small matrix more than their products save (float32 zeropower on a 2-core Xeon, Gram's time over the
# standard one's: 24x256 (2.0M saved) 1.10, 64x128 (2.1M) 1.17, 32x256 (3.4M) 0.88, 16x1024 (4.1M) 0.77; a batch's
# calls count per matrix too: 12 of 32x128, 1.3M each, 1.12).
_GRAM_MIN_SAVED_FLOP = 3e6


# Where "auto" takes the 16-bit (float16) Gram iteration on CUDA GPUs: from this many rows, where it does at most this
# share of the standard iteration's FLOPs. Timed against the standard bf16 iteration (2026-11-26): 2048x8192 (0.67 of
# the FLOPs) 1.21x-1.29x faster on an H100 and an H200; 768x3072 (0.67 too) 0.65x, its 768² products too small to
# run at the tensor cores' rate; a Llama-3-8B layer's step, Gram on all seven matrices, 1.10x-1.11x faster (H100).
_GPU_GRAM_MIN_ROWS = 2048
_GPU_GRAM_MAX_FLOP_SHARE = 0.75


def resolve_algorithm(algorithm: str, shape: Sequence[int], steps: int, dtype: torch.dtype,
                      device_type: str) -> str:
    """"standard" or "gram" for a wide (m, n) matrix (or a batch of them) iterated in `dtype` on a `device_type`
    device. "auto" picks Gram where it saves at least _GRAM_MIN_SAVED_FLOP a matrix and runs in `dtype` itself. In
    16-bit a Gram iteration restarts every three steps and runs its m x m part in float32 on CPUs (see
    `gram_inner_dtype`), where that costs more than the 16-bit products it replaces, so there "auto" keeps the
    standard iteration; on CUDA GPUs it runs in float16, which pays on large matrices (_GPU_GRAM_MIN_ROWS)."""
    if algorithm != "auto":
        return algorithm
    m, n = shape[-2], shape[-1]
    if dtype.itemsize <= 2:
        pays = (device_type == "cuda" and m >= _GPU_GRAM_MIN_ROWS
                and gram_flop(m, n, steps, dtype) <= _GPU_GRAM_MAX_FLOP_SHARE * standard_flop(m, n, steps))
    else:
        pays = standard_flop(m, n, steps) - gram_flop(m, n, steps, dtype) >= _GRAM_MIN_SAVED_FLOP
    return "gram" if pays else "standard"


def standard_flop(m: int, n: int, steps: int) -> float:
    """Full-product FLOPs of the standard iteration on a wide (m, n) matrix: per step X Xᵀ, A², P X."""
    return steps * (4.0 * m * m * n + 2.0 * m ** 3)


def gram_flop(m: int, n: int, steps: int, dtype: torch.dtype) -> float:
    """Full-product FLOPs of the Gram iteration in `dtype`: X Xᵀ and Q X once each, and 4 steps - 3 products of
    m x m (see `_gram_iteration`); each restart adds a Q X and an X Xᵀ, and saves the three m x m products that
    would have joined its step to the one before."""
    restarts = len(_restart_steps(steps, dtype))
    return (1 + restarts) * 4.0 * m * m * n + (4 * steps - 3 - 3 * restarts) * 2.0 * m ** 3


def _restart_steps(steps: int, dtype: torch.dtype) -> tuple[int, ...]:
    """Steps before which the Gram iteration rebuilds X and its Gram matrix from the accumulated Q, so that the
    rounding Q and R gather stays that of a few steps. Every three steps in 16-bit iterations: in float16 (rounded as
    tensor cores round, emulated) that kept the distance to the polar factor at the float32 standard iteration's for
    3 to 10 steps on 512x1536 and 768x3072, where one restart after two of five steps drifted to 1.7x it; and it took
    a bf16 iteration's float32 part on the CPU from 1.7x-1.8x to 0.86x-0.95x the standard bf16 iteration's distance
    from the exact result at condition number 1e6. In float32 and float64, into stretches of at most five steps, as
    even as they come: an eigenvalue of R that rounding has made slightly negative grows by about a² a step, and with
    one restart halfway a rank-1 or ill-conditioned float32 input overflowed to NaN from 16 to 24 steps."""
    if dtype.itemsize <= 2:
        return tuple(range(3, steps, 3))
    stretches = -(-steps // 5)
    return tuple(stretch * steps // stretches for stretch in range(1, stretches))


def gram_inner_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype a Gram iteration in `dtype` runs in on `device`. The iteration maps an eigenvalue λ of R to
    P(λ)² λ, which for λ < 0 grows without bound, and bf16 rounding of R makes eigenvalues of ~4e-3 negative where X's
    singular values are small (polar error 1e2 to 1e11 at condition numbers 1e3 to 1e6, where the standard bf16
    iteration stays below 1.3). So a 16-bit iteration runs wholly in float16 on GPUs (tensor cores multiply it at
    bf16's rate, with 8x finer rounding: Dao-AILab's gram-newton-schulz does the same), and on other devices keeps
    its X Xᵀ and m x m part in float32 (CPUs run float16 products in a reference kernel, hundreds of times slower)."""
    if dtype.itemsize > 2:
        return dtype
    return torch.float16 if device.type == "cuda" else torch.float32


def _gram_iteration(X: Tensor, coefficients: Sequence[Coefficients], backend: str | None,
                    preconditioner: str | None, eps: float, buffers: _Buffers) -> Tensor:
    """Gram Newton-Schulz: the same polynomial iteration, carried out on the (m, m) Gram matrix of a wide X.

    Every step multiplies X on the left by P = a I + Z, Z = b R + c R², with R = X Xᵀ, so X_k = Q_k X_0 with Q_k the
    product of the P's, and R_{k+1} = P R_k P. Because P is a polynomial in R_k the two commute, so R_{k+1} =
    P (P R_k): three m x m products per step besides R² instead of two (m, n) ones, and one Q X_0 at the end. In
    float32 and float64 P is formed (its diagonal keeps `a` to full precision); in float16 `a` stays out of it, each
    product taking a Y + Z Y in one call whose sum is rounded once (as `_scaled_plus_product` does in 16-bit). Nothing
    is inverted, so rank-deficient input stays finite. `backend` (None: chosen) runs the m x m products in the
    iteration's inner dtype (`gram_inner_dtype`).
    """
    dtype = X.dtype
    restarts = _restart_steps(len(coefficients), dtype)
    inner_dtype = gram_inner_dtype(dtype, X.device)
    start = X.to(inner_dtype) if inner_dtype.itemsize <= 2 else X
    backend = resolve_backend(backend, X.shape, inner_dtype, X.device)
    square = (*X.shape[:-1], X.shape[-2])
    R = symmetric_gram(start.to(inner_dtype), backend, out=buffers.get("R", square, inner_dtype))
    if preconditioner == "aol":
        start, R = aol_scaled(start, R, eps, in_place=True)
    Q: Tensor | None = None
    for step, (a, b, c) in enumerate(coefficients):
        if step in restarts:
            start = matmul(Q.to(start.dtype), start)
            R, Q = symmetric_gram(start.to(inner_dtype), backend, out=buffers.get("R", square, inner_dtype)), None
        P = symmetric_polynomial(R, b, c, backend, out=buffers.get("P", square, inner_dtype))  # Z
        shift = a
        if inner_dtype.itemsize > 2:
            P.diagonal(dim1=-2, dim2=-1).add_(a)
            shift = 0.0
        if Q is None:
            Q = P.clone()
            if shift:
                Q.diagonal(dim1=-2, dim2=-1).add_(shift)
        else:
            Q = _shifted_product(P, shift, Q, buffers.get(f"Q{step % 2}", square, inner_dtype))
        if step + 1 < len(coefficients) and step + 1 not in restarts:
            W = _shifted_product(P, shift, R, buffers.get("W", square, inner_dtype))  # P R
            R = _symmetrized(_shifted_product(P, shift, W, buffers.get("R", square, inner_dtype)),  # P R P
                             buffers.get("S", square, inner_dtype))
    return matmul(Q.to(start.dtype), start).to(dtype)


def _symmetrized(R: Tensor, out: Tensor | None) -> Tensor:
    """(R + Rᵀ) / 2, exactly symmetric (a sum's rounding does not depend on the order of its terms), into `out` if
    given. P R P is symmetric but for its products' roundings, and the symmetric kernels read one triangle of R: left
    as computed, the two triangles drifted apart ~10x a step, and a float32 Gram iteration through the CPU op ended
    15-50x farther from its float64 result than through torch's products (1.6e-5 against 8.3e-7 on a 128x256
    Gaussian matrix)."""
    return torch.add(R, R.mT, out=out).mul_(0.5)


def _shifted_product(P: Tensor, shift: float, Y: Tensor, out: Tensor | None) -> Tensor:
    """(shift I + P) @ Y, into `out` if given: P's product alone for a zero shift, else `_scaled_plus_product`, which
    in 16-bit dtypes (the only ones with a shift) leaves P as it is."""
    return _product(P, Y, out) if shift == 0.0 else _scaled_plus_product(Y, P, shift, out)


class _Buffers:
    """The tensors one Newton-Schulz call writes step after step, by name, each taken once from the workspace and
    then reused, for a batch, or a matrix past _LONE_MATRIX_NUMEL entries, on the CPU outside torch.compile (see
    `Workspace`); elsewhere `get` is None and each product allocates. A lone matrix that size otherwise faults its
    fresh products in page by page: zeropower of a 768x768 matrix in bf16 faulted in 1335 pages per call with a new
    tensor per product and 168 with the buffers, and took 18.5 against 20.2 ms; 1024x4096: 62.6 against 65.6 ms
    (paired, 2-core Xeon with AMX)."""

    def __init__(self, X: Tensor, workspace: Workspace | None) -> None:
        self.enabled = (X.ndim == 3 or X.numel() > _LONE_MATRIX_NUMEL) and Workspace.serves(X.device)
        self.workspace = workspace or Workspace()
        self.device = X.device
        self.taken: dict[str, Tensor] = {}

    def get(self, name: str, shape: Sequence[int], dtype: torch.dtype) -> Tensor | None:
        if not self.enabled:
            return None
        taken = self.taken.get(name)
        if taken is None or taken.shape != shape or taken.dtype != dtype:
            taken = self.taken[name] = self.workspace.tensor(name, shape, dtype, self.device)
        return taken

    def standard_step(self, step: int, X: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        """Where step `step` of the standard iteration on X writes A, P and the next X. Without buffers no name nor
        shape is formed: on a lone small matrix those lookups cost the iteration ~2% (bf16, 2-core Xeon, paired)."""
        if not self.enabled:
            return None, None, None
        square = (*X.shape[:-1], X.shape[-2])
        return (self.get("A", square, X.dtype), self.get("P", square, X.dtype),
                self.get(f"X{step % 2}", X.shape, X.dtype))

    def adopt(self, name: str, tensor: Tensor) -> None:
        """Use `tensor` (the caller's to overwrite, contiguous) as the buffer `name`."""
        if self.enabled and tensor.is_contiguous():
            self.taken[name] = tensor


def _standard_iteration(X: Tensor, gram: Tensor | None, coefficients: Sequence[Coefficients],
                        backend: str, buffers: _Buffers) -> Tensor:
    """X <- a X + (b A + c A²) X with A = X Xᵀ, one step per triple; `gram` is the first step's A if computed.
    X is `newton_schulz`'s own (scaled) tensor, on CPU batches the buffer "X1": X alternates between "X0" and "X1"."""
    for step, (a, b, c) in enumerate(coefficients):
        gram_out, polynomial_out, X_out = buffers.standard_step(step, X)
        if gram is None:
            gram = symmetric_gram(X, backend, out=gram_out)
        polynomial = symmetric_polynomial(gram, b, c, backend, out=polynomial_out)  # b A + c A²
        X = _scaled_plus_product(X, polynomial, a, out=X_out)
        gram = None
    return X


def _scaled_plus_product(X: Tensor, P: Tensor, a: float, out: Tensor | None = None) -> Tensor:
    """a*X + P @ X for one matrix or a batch, into `out` if given (on CPUs; a batch's P is then overwritten).

    A 2D X takes torch.optim.Muon's operation (so its rounding). Into a batch's `out`, float32 and float64 compute
    (P + a I) X: one product that never reads X elementwise (a transposed X, as a tall matrix's first step has, is
    read only by the BLAS, which takes transposed operands at full speed, where an elementwise pass over it measured
    ~8 ms per 768 x 3072 float32 matrix); 16-bit keeps `baddbmm`'s a X, because P + a I rounded to bf16 (a is up to
    8) made the result 4x farther from the float64 iteration's. `baddbmm` first copies X into `out` (a tenth of
    GPT-2 small's bf16 step on a 2-core Xeon); carrying the factor outside X instead (Y <- (I + P / a) Y, a <- a *
    scale: no copy) made that step 1.09x faster, as near the polar factor, but 2-4% away from torch.optim.Muon's
    results, which a batch matches bit for bit this way."""
    if X.ndim == 2:
        return torch.addmm(X, P, X, beta=a, out=out)
    if out is None:
        if X.mT.is_contiguous() and not X.is_contiguous():
            # A tall batch seen wide, stored as its row-major transpose G: a G + G P (P is symmetric) there, which the
            # next step again sees wide. On X itself baddbmm first copies X into a row-major result by a transposing
            # elementwise pass (GPT-2 small's two tall buckets: 365 us of an H100 step, 6%), and the update then
            # reaches the parameter transposed.
            return torch.baddbmm(X.mT, X.mT, P, beta=a).mT
        return torch.baddbmm(X, P, X, beta=a)
    if X.element_size() <= 2:
        return torch.baddbmm(X, P, X, beta=a, out=out)
    P.diagonal(dim1=-2, dim2=-1).add_(a)
    return _product(P, X, out)


def _product(P: Tensor, X: Tensor, out: Tensor | None) -> Tensor:
    """P @ X, into `out` if given (on CPUs; a matrix: one `mm`; batches: float32 and float64 one `mm` per matrix,
    which measured as fast as `bmm` on a Xeon and 10-25% faster than MKL's batched entry point on an AMD EPYC;
    16-bit one `bmm`, which oneDNN spreads over the threads, 2x a loop's speed on (12, 768, 768) bf16)."""
    if out is None or X.element_size() <= 2 or X.ndim == 2:
        return matmul(P, X, out=out)
    for p, x, result in zip(P.unbind(), X.unbind(), out.unbind()):
        torch.mm(p, x, out=result)
    return out


def _check_matrix(G: Tensor) -> None:
    if not isinstance(G, Tensor) or G.ndim not in (2, 3):
        shape = tuple(G.shape) if isinstance(G, Tensor) else type(G).__name__
        raise ValueError(f"Invalid G: shape {shape} (expected a matrix (m, n) or a batch of matrices (B, m, n))")
    if not G.dtype.is_floating_point:
        raise ValueError(f"Invalid G: dtype {G.dtype} (expected a floating dtype)")
