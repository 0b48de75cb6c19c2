"""zeropower against the float64 SVD polar factor, torch.optim.Muon's own routine, and its own symmetries."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.optim._muon import _zeropower_via_newtonschulz as torch_muon_newton_schulz
from torch.overrides import TorchFunctionMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "torch-ext"))

from optimizer.coefficients import polar_express_coefficients, resolve_coefficients  # noqa: E402
import optimizer.newton_schulz as newton_schulz_module  # noqa: E402
from optimizer.newton_schulz import (Orthogonalizer, gram_flop, gram_inner_dtype, newton_schulz,  # noqa: E402
                                     resolve_algorithm, zeropower)
from optimizer.workspace import Workspace  # noqa: E402

KELLER_JORDAN = (3.4445, -4.7750, 2.0315)
DESIGN_LOWER_BOUND = 1e-3  # the smallest normalized singular value the default Polar Express schedule targets
# Past the lone-matrix size, so a matrix newton_schulz iterates in buffers it reuses from step to step.
LARGE = (520, 1024)
assert math.prod(LARGE) > newton_schulz_module._LONE_MATRIX_NUMEL


def matrix_with_spectrum(rows: int, cols: int, smallest: float, largest: float, seed: int = 0):
    """(G, U V^T, singular values) in float64, with singular values log-spaced in [smallest, largest]."""
    generator = torch.Generator().manual_seed(seed)
    k = min(rows, cols)
    u, _ = torch.linalg.qr(torch.randn(rows, k, generator=generator, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(cols, k, generator=generator, dtype=torch.float64))
    s = torch.logspace(math.log10(smallest), math.log10(largest), k, dtype=torch.float64)
    return (u * s) @ v.T, u @ v.T, s


def polar_factor(G: torch.Tensor) -> torch.Tensor:
    u, _, vh = torch.linalg.svd(G.double(), full_matrices=False)
    return u @ vh


def spectral_norm(A: torch.Tensor) -> float:
    return torch.linalg.matrix_norm(A.double(), ord=2).item()


def design_band(steps: int) -> float:
    """1 - l_k: the Polar Express schedule maps [1e-3, 1] into [l_k, 2 - l_k] (checked in test_coefficients)."""
    lower = DESIGN_LOWER_BOUND
    for a, b, c in polar_express_coefficients(steps):
        lower = a * lower + b * lower**3 + c * lower**5
    return 1 - lower


def random_matrix(*shape: int, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


@pytest.mark.parametrize("shape", [(64, 96), (96, 64), (50, 50), (33, 17), (1, 20), (20, 1), LARGE, LARGE[::-1]])
@pytest.mark.parametrize("input_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("steps", [1, 5])
def test_original_preset_in_bf16_matches_torch_muon_bit_for_bit(shape, input_dtype, steps):
    G = random_matrix(*shape, dtype=input_dtype)
    before = G.clone()
    ours = zeropower(G, steps, "original", dtype=torch.bfloat16, eps=1e-7)
    # torch's routine divides its bf16 working copy in place, which is the caller's tensor for bf16 input.
    expected = torch_muon_newton_schulz(G.clone(), KELLER_JORDAN, steps, 1e-7)
    assert ours.dtype == input_dtype and ours.shape == G.shape
    assert torch.equal(ours.to(torch.bfloat16), expected)
    assert torch.equal(G, before)


@pytest.mark.parametrize("shape", [(96, 160), (160, 96), (64, 64)])
@pytest.mark.parametrize("steps", [5, 6, 7, 8])
def test_polar_express_in_fp32_approaches_the_svd_polar_factor(shape, steps):
    G, exact, s = matrix_with_spectrum(*shape, smallest=1e-2, largest=1.0)
    assert (s.min() / s.norm()).item() >= DESIGN_LOWER_BOUND  # the spectrum is inside the design range
    ours = zeropower(G.float(), steps, "polar_express", dtype=torch.float32).double()
    # Every normalized singular value lies in the design interval, so in exact arithmetic the output's singular
    # values lie in [l_k, 2 - l_k] and ||out - U V^T||_2 <= 1 - l_k. Rounding: each of the 3*steps products is
    # backward stable to ~u = 6e-8 relative, and the polar factor amplifies a relative perturbation by at most
    # the condition number (s_max / s_min = 100 here), so allow 3 * steps * u * 100 on top.
    rounding = 3 * steps * 2**-24 * (s.max() / s.min()).item()
    assert spectral_norm(ours - exact) <= design_band(steps) + rounding
    singular_values = torch.linalg.svdvals(ours)
    assert (singular_values - 1).abs().max().item() <= design_band(steps) + rounding


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_polar_express_in_low_precision_stays_near_the_polar_factor(dtype):
    G, exact, _ = matrix_with_spectrum(96, 160, smallest=1e-2, largest=1.0)
    ours = zeropower(G.float(), 8, "polar_express", dtype=dtype).double()
    # The unit of error is what storing the exact answer in `dtype` costs: r = ||round(U V^T) - U V^T||_2.
    # The last steps are flat at 1 (p'(1) = p''(1) = 0), so the singular values carry only the final few
    # roundings (allow 5 r; measured 1.5 r); the singular vectors carry roundoff from all 24 products, amplified
    # by the early steep steps (slope up to ~8): allow 100 r (measured about 25 r).
    r = spectral_norm(exact.to(dtype).double() - exact)
    assert (torch.linalg.svdvals(ours) - 1).abs().max().item() <= design_band(8) + 5 * r
    assert spectral_norm(ours - exact) <= 100 * r


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_original_preset_gives_singular_values_in_its_known_band(dtype):
    # Keller Jordan's coefficients trade accuracy for speed: they give U S' V^T with S' roughly in
    # [0.5, 1.5] (torch.optim.Muon's docstring), not U V^T: a + b + c = 0.70, so 1 is not even a fixed point.
    G, _, _ = matrix_with_spectrum(128, 192, smallest=1e-1, largest=1.0)
    singular_values = torch.linalg.svdvals(zeropower(G.float(), 5, "original", dtype=dtype).double())
    assert singular_values.min().item() >= 0.5 and singular_values.max().item() <= 1.5
    assert (singular_values - 1).abs().max().item() > 0.1


@pytest.mark.parametrize("shape", [(5, 24, 40), (5, 40, 24), (3, 17, 17)])
def test_batched_equals_each_slice(shape):
    G = random_matrix(*shape, dtype=torch.float64)
    G[1] *= 1e3  # each slice is normalized by its own norm
    G[2].zero_()
    batched = zeropower(G, 6, "polar_express", dtype=torch.float64)
    for matrix, result in zip(G, batched):
        # Same arithmetic through batched kernels instead of 2D ones: only float64 rounding (~1e-16 per
        # operation, a few hundred operations deep) may differ.
        torch.testing.assert_close(result, zeropower(matrix, 6, "polar_express", dtype=torch.float64),
                                   rtol=0, atol=1e-12)
    assert torch.equal(batched[2], torch.zeros_like(batched[2]))


class CountMatrixProducts(TorchFunctionMode):
    NAMES = {"matmul", "__matmul__", "mm", "bmm", "addmm", "baddbmm"}

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.count += getattr(func, "__name__", "") in self.NAMES
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("batch", [1, 7])
def test_a_batch_is_one_call_per_product(batch):
    steps = 4
    with CountMatrixProducts() as counter:
        zeropower(random_matrix(batch, 12, 20), steps, "quintic", dtype=torch.float32)
    # X X^T and b A + c A A: one batched call each per step, whatever the batch. a X + B X: one per matrix on CPUs,
    # whose BLAS runs its batched entry point slower than a loop (newton_schulz._scaled_plus_product).
    assert counter.count == 2 * steps + steps * batch


class RecordProductNames(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.names: set[str] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in CountMatrixProducts.NAMES:
            self.names.add(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape, as_a_matrix", [((1, 40, 96), True), ((1, 96, 40), True), ((1, 512, 1024), True),
                                                 ((1, 513, 1024), False), ((2, 40, 96), False)])
def test_a_stack_of_one_small_matrix_runs_as_that_matrix(dtype, shape, as_a_matrix):
    """An optimizer's bucket of one small parameter takes the 2D products (torch.optim.Muon's), bit for bit."""
    G = random_matrix(*shape)
    coefficients = resolve_coefficients("polar_express", 5, None)
    with RecordProductNames() as recorder:
        out = newton_schulz(G.clone(), coefficients, 1e-7, "torch", dtype, overwrite_input=True, workspace=Workspace())
    assert out.shape == G.shape
    assert ("bmm" in recorder.names or "baddbmm" in recorder.names) != as_a_matrix
    if as_a_matrix:
        torch.testing.assert_close(out[0], newton_schulz(G[0], coefficients, 1e-7, "torch", dtype), rtol=0, atol=0)


@pytest.mark.parametrize("shape", [(24, 40), (4, 24, 40)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tall_is_wide_transposed(shape, dtype):
    # A tall input is iterated as its wide transpose, so the results are the same numbers, bit for bit.
    G = random_matrix(*shape, dtype=dtype)
    assert torch.equal(zeropower(G.mT, 5, dtype=dtype), zeropower(G, 5, dtype=dtype).mT)


@pytest.mark.parametrize(("dtype", "tolerance"),
                         [(torch.float64, 1e-12), (torch.float32, 1e-5), (torch.bfloat16, 0.05)])
def test_a_tall_batch_without_buffers_iterates_on_its_row_major_transpose(monkeypatch, dtype, tolerance):
    """Where no workspace serves (GPUs, compiled steps), a tall batch's a X + P X runs as a G + G P on G, the row-major
    tall batch (no transposing copy into a row-major result), so the result lies row-major as the parameter does:
    the numbers of the wide iteration, but for the products' roundings."""
    monkeypatch.setattr(Workspace, "serves", staticmethod(lambda device: False))
    G = random_matrix(4, 40, 24, dtype=dtype)
    with CountMatrixProducts() as counter:
        tall = zeropower(G, 5, dtype=dtype)
    wide = zeropower(G.mT.contiguous(), 5, dtype=dtype)
    assert tall.is_contiguous() and not wide.mT.is_contiguous()
    assert counter.count == 3 * 5  # still one batched call per product
    torch.testing.assert_close(tall.double(), wide.mT.double(), rtol=0, atol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("algorithm", ["standard", "gram"])
def test_stacks_orthogonalized_in_one_workspace_are_zeropowers_results_in_their_layout(dtype, algorithm):
    # The optimizer's path: each stack is its own to overwrite, and every call takes its buffers from one workspace,
    # whose blocks the next stack (another shape, batch or orientation) reuses. A tall stack's result is the
    # transpose of a contiguous batch (it was computed wide), which the update op reads tile by tile.
    orthogonalize = Orthogonalizer(tuple(resolve_coefficients("polar_express", 5, None)), 1e-7, dtype, algorithm)
    workspace = Workspace()
    for seed, shape in enumerate([(3, 40, 24), (2, 24, 40), (4, 40, 24), (1, 17, 17)]):
        G = random_matrix(*shape, dtype=dtype, seed=seed)
        result = orthogonalize(G.clone(), workspace)
        assert (result.mT if shape[-2] > shape[-1] else result).is_contiguous()
        assert torch.equal(result, zeropower(G, 5, dtype=dtype, algorithm=algorithm))


def test_a_recipe_hashes_before_its_fields_are_set():
    # torch 2.11's compiler hashes a callable object built inside a traced step before its __init__ has run (a hash
    # of the fields then raised, and a compiled GPT-2 step died on an H200); identity's hash needs no fields.
    recipe = object.__new__(Orthogonalizer)
    assert hash(recipe) == hash(recipe)


def test_a_workspace_block_is_reused_across_shapes_and_dtypes_and_grows_when_asked_for_more():
    workspace, cpu = Workspace(), torch.device("cpu")
    first = workspace.tensor("X", (4, 8, 16), torch.float32, cpu)
    smaller = workspace.tensor("X", (2, 8, 8), torch.bfloat16, cpu)
    assert smaller.data_ptr() == first.data_ptr() and smaller.shape == (2, 8, 8) and smaller.is_contiguous()
    assert workspace.tensor("other", (4, 8, 16), torch.float32, cpu).data_ptr() != first.data_ptr()
    larger = workspace.tensor("X", (5, 8, 16), torch.float32, cpu)
    assert larger.shape == (5, 8, 16) and larger.data_ptr() != first.data_ptr()
    assert workspace.tensor("X", (5, 8, 16), torch.float32, cpu) is larger  # the same request: the same view again
    again = workspace.tensor("X", (4, 8, 16), torch.float32, cpu)
    assert again.shape == (4, 8, 16) and again.data_ptr() == larger.data_ptr()
    assert workspace.tensor("X", (4, 8, 16), torch.bfloat16, cpu).dtype == torch.bfloat16


@pytest.mark.parametrize("coefficients", ["original", "quintic", "polar_express"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(16, 24), (3, 24, 16)])
def test_zero_in_gives_exact_zero_out(coefficients, dtype, shape):
    G = torch.zeros(shape, dtype=dtype)
    result = zeropower(G, 5, coefficients, dtype=dtype)
    assert torch.equal(result, G)  # X / max(||X||, eps) = 0: no 0/0, as in torch.optim.Muon


@pytest.mark.parametrize("input_dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_any_floating_input_dtype_round_trips(input_dtype):
    G, _, s = matrix_with_spectrum(48, 80, smallest=1e-2, largest=1.0, seed=1)
    G = G.to(input_dtype)
    result = zeropower(G, 8, "polar_express", dtype=torch.float32)
    assert result.dtype == input_dtype and result.shape == G.shape
    # Against the polar factor of the input as given (after its own rounding): the fp32 allowance of the
    # accuracy test (3 * steps * u32 * condition number), plus storing the answer back in the input dtype,
    # which costs about ||round(U V^T) - U V^T||_2 (allow twice that).
    exact = polar_factor(G)
    allowance = 3 * 8 * 2**-24 * (s.max() / s.min()).item() + 2 * spectral_norm(exact.to(input_dtype).double() - exact)
    assert spectral_norm(result.double() - exact) <= design_band(8) + allowance


@pytest.mark.parametrize("shape", [(1, 1), (1, 7), (7, 1), (7, 13), (13, 7), (3, 5, 9), (2, 1, 6), (2, 6, 1)])
def test_odd_sizes(shape):
    G = random_matrix(*shape, dtype=torch.float64, seed=3)
    result = zeropower(G, 8, "polar_express", dtype=torch.float32)
    assert result.shape == G.shape and result.dtype == G.dtype
    # These small random matrices have normalized singular values above 0.17 (well inside the design range),
    # so after 8 steps only float32 rounding is left. The allowance is the accuracy test's for a condition
    # number of 100; theirs are below 4, so it is loose.
    exact = torch.stack([polar_factor(m) for m in G.reshape(-1, *G.shape[-2:])]).reshape(G.shape)
    assert (result.double() - exact).abs().max().item() <= 3 * 8 * 2**-24 * 100


def test_newton_schulz_runs_a_given_schedule_in_the_input_dtype():
    G = random_matrix(2, 10, 30, dtype=torch.float64)
    schedule = polar_express_coefficients(8)
    result = newton_schulz(G, schedule, 1e-7)
    assert result.dtype == torch.float64
    torch.testing.assert_close(result, zeropower(G, 8, schedule, dtype=torch.float64), rtol=0, atol=0)


def test_float16_scales_before_the_cast():
    # One element above float16's 65504: cast first, it becomes inf and the whole result NaN.
    G = random_matrix(48, 80) * 100
    G[1, 2] = 1e5
    ours = zeropower(G, 8, "polar_express", dtype=torch.float16).double()
    reference = zeropower(G.double(), 8, "polar_express", dtype=torch.float64)
    assert torch.isfinite(ours).all()
    assert spectral_norm(ours - reference) <= 100 * spectral_norm(reference.half().double() - reference)


@pytest.mark.parametrize("kwargs, message", [
    ({"G": torch.ones(4)}, r"Invalid G: shape \(4,\)"),
    ({"G": torch.ones(2, 3, 4, 5)}, r"Invalid G: shape \(2, 3, 4, 5\)"),
    ({"G": torch.ones(4, 4, dtype=torch.int32)}, r"Invalid G: dtype torch.int32"),
    ({"G": torch.ones(4, 4, dtype=torch.complex64)}, r"Invalid G: dtype torch.complex64"),
    ({"steps": 0}, r"Invalid steps: 0"),
    ({"steps": 101}, r"Invalid steps: 101 .*three matrix products"),
    ({"steps": 5.0}, r"Invalid steps: 5.0"),
    ({"dtype": torch.int64}, r"Invalid dtype: torch.int64"),
    ({"eps": 0.0}, r"Invalid eps: 0.0"),
    ({"eps": -1e-7}, r"Invalid eps: -1e-07"),
    ({"eps": float("inf")}, r"Invalid eps: inf"),
    ({"coefficients": "cubic"}, r"Invalid coefficients: 'cubic'"),
    ({"coefficients": [(1.0, 2.0)]}, r"Invalid coefficients\[0\]"),
    ({"preconditioner": "jacobi"}, r"Invalid preconditioner: 'jacobi' \(expected one of None, 'aol'\)"),
])
def test_bad_arguments_are_rejected(kwargs, message):
    arguments = {"G": torch.ones(4, 6), **kwargs}
    with pytest.raises(ValueError, match=message):
        zeropower(**arguments)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_float64_matrix_beyond_float32s_range_is_scaled_before_it_is_rounded(dtype: torch.dtype) -> None:
    # Cast to the iteration's dtype first, its entries became inf and the result NaN; the polar factor does not
    # depend on the scale.
    G = random_matrix(12, 20).double()
    expected = zeropower(G, dtype=dtype)
    huge = zeropower(G * 1e40, dtype=dtype)
    assert torch.isfinite(huge).all()
    torch.testing.assert_close(huge, expected, rtol=0, atol=torch.finfo(dtype).eps)


@pytest.mark.parametrize("steps", [np.int64(3), torch.tensor(3)], ids=["numpy", "tensor"])
def test_steps_take_what_the_optimizer_takes(steps):
    """zeropower's steps accept the integers Muon's ns_steps does, and mean the same."""
    G = random_matrix(12, 20)
    assert torch.equal(zeropower(G, steps, dtype=torch.float32), zeropower(G, 3, dtype=torch.float32))


# --- Gram Newton-Schulz -----------------------------------------------------------------------------------------

def composed_polynomial(s: torch.Tensor, steps: int) -> torch.Tensor:
    """What the whole iteration does to each normalized singular value, in float64."""
    for a, b, c in polar_express_coefficients(steps):
        s = a * s + b * s**3 + c * s**5
    return s


def batch_with_spectrum(shape: tuple[int, ...], condition: float, seed: int = 0):
    """(G, U p(S) Vᵀ) in float64 for a matrix or batch with singular values log-spaced over `condition`: the exact
    output of five Polar Express steps (p composed over the steps) is known from G's SVD."""
    generator = torch.Generator().manual_seed(seed)
    *batch, rows, cols = shape
    k = min(rows, cols)
    u, _ = torch.linalg.qr(torch.randn(*batch, rows, k, generator=generator, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(*batch, cols, k, generator=generator, dtype=torch.float64))
    s = torch.logspace(0, -math.log10(condition), k, dtype=torch.float64)
    G = (u * s) @ v.mT
    return G, (u * composed_polynomial(s / s.norm(), 5)) @ v.mT


# Largest spectral-norm distance from U p(S) Vᵀ, measured on these shapes (in brackets) with a margin. The Gram
# iteration maps an eigenvalue λ of R = X Xᵀ to P(λ)² λ, so rounding that makes a tiny λ negative grows with every
# step where X's singular values are small; float32 keeps it near 1e-3 at condition numbers of 1e3 and beyond. In
# bfloat16 both iterations leave the smallest singular values far from p's values (the polynomial is steep there);
# the Gram iteration's float32 part and its restart after three steps keep it a little nearer than the standard one.
GRAM_BOUNDS = {(torch.float32, 10.0): 1e-4,  # standard [7e-6], gram [1e-5]
               (torch.float32, 1e3): 1e-2, (torch.float32, 1e6): 1e-2,  # standard [3e-5], gram [3e-3]
               (torch.bfloat16, 10.0): 0.1,  # standard [6.5e-2], gram [4.3e-2]
               (torch.bfloat16, 1e3): 0.6, (torch.bfloat16, 1e6): 0.75}  # standard [0.38, 0.57], gram [0.35, 0.54]


@pytest.mark.parametrize("algorithm", ["standard", "gram"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("condition", [10.0, 1e3, 1e6])
@pytest.mark.parametrize("shape", [(64, 256), (256, 64), (128, 128), (4, 48, 96), LARGE])
def test_both_algorithms_apply_the_composed_polynomial(algorithm, dtype, condition, shape):
    G, expected = batch_with_spectrum(shape, condition)
    out = zeropower(G.float(), 5, "polar_express", dtype=dtype, algorithm=algorithm).double()
    error = torch.linalg.matrix_norm(out - expected, ord=2).max().item()
    assert error <= GRAM_BOUNDS[dtype, condition], error
    assert torch.linalg.matrix_norm(out, ord=2).max().item() <= 1 + design_band(5) + GRAM_BOUNDS[dtype, condition]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("steps", [5, 8])  # 8 steps restart once
def test_gram_on_rank_deficient_input_is_finite_and_keeps_the_null_space(dtype, steps):
    generator = torch.Generator().manual_seed(0)
    G = torch.randn(48, 3, generator=generator, dtype=torch.float64) @ torch.randn(3, 160, generator=generator,
                                                                                   dtype=torch.float64)
    G[7] = 0.0
    out = zeropower(G.float(), steps, "polar_express", dtype=dtype, algorithm="gram").double()
    assert torch.isfinite(out).all()
    assert out[7].abs().max().item() == 0.0  # a zero row stays zero: nothing is inverted
    if dtype == torch.float32:  # a bf16 copy of G is full rank (rounding), and any iteration amplifies that part
        U, _, _ = torch.linalg.svd(G, full_matrices=False)
        assert spectral_norm(out - U[:, :3] @ U[:, :3].mT @ out) <= 0.05  # nothing outside G's 3D range


def test_gram_with_a_restart_matches_the_standard_iteration():
    G, _ = batch_with_spectrum((96, 288), 100.0)
    standard = zeropower(G.float(), 8, "polar_express", dtype=torch.float32)
    gram = zeropower(G.float(), 8, "polar_express", dtype=torch.float32, algorithm="gram")
    assert spectral_norm(gram - standard) <= 1e-3


@pytest.fixture
def gram_as_on_a_gpu(monkeypatch: pytest.MonkeyPatch) -> list[torch.dtype]:
    """The Gram iteration with the dtypes a GPU gives it (a 16-bit one wholly in float16), on the CPU's float16
    products; returns the list of the dtypes its Gram matrices are formed in, filled as it runs."""
    real_inner_dtype, real_gram = newton_schulz_module.gram_inner_dtype, newton_schulz_module.symmetric_gram
    formed: list[torch.dtype] = []
    monkeypatch.setattr(newton_schulz_module, "gram_inner_dtype",
                        lambda dtype, device: real_inner_dtype(dtype, torch.device("cuda")))
    monkeypatch.setattr(newton_schulz_module, "symmetric_gram",
                        lambda X, backend, out=None: formed.append(X.dtype) or real_gram(X, backend, out=out))
    return formed


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("condition", [10.0, 1e3, 1e6])
@pytest.mark.parametrize("shape", [(64, 256), (256, 64), (4, 48, 96)])
def test_gram_in_float16_applies_the_composed_polynomial(gram_as_on_a_gpu, dtype, condition, shape):
    """As a GPU runs it: nearer U p(S) Vᵀ than the standard bfloat16 iteration for a bf16 request (measured 0.5x to
    1.0x its distance), and within 0.2 for a float16 one (measured up to 0.15, where the standard float16 iteration
    stays within 0.06: the Gram matrix squares the condition number)."""
    G, expected = batch_with_spectrum(shape, condition)
    out = zeropower(G.float(), 5, "polar_express", dtype=dtype, algorithm="gram")
    assert gram_as_on_a_gpu and set(gram_as_on_a_gpu) == {torch.float16}
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    error = torch.linalg.matrix_norm(out.double() - expected, ord=2).max().item()
    if dtype == torch.bfloat16:
        standard = zeropower(G.float(), 5, "polar_express", dtype=dtype, algorithm="standard")
        assert error <= 1.1 * torch.linalg.matrix_norm(standard.double() - expected, ord=2).max().item()
    else:
        assert error <= 0.2, error


def test_gram_in_float16_on_rank_deficient_input_is_finite(gram_as_on_a_gpu):
    generator = torch.Generator().manual_seed(0)
    G = torch.randn(48, 3, generator=generator) @ torch.randn(3, 160, generator=generator)
    G[7] = 0.0
    out = zeropower(G, 8, "polar_express", dtype=torch.bfloat16, algorithm="gram")
    assert torch.isfinite(out).all() and out[7].abs().max().item() == 0.0


def test_gram_runs_16_bit_iterations_in_float16_on_gpus_and_float32_elsewhere():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert [gram_inner_dtype(dtype, cuda) for dtype in (torch.bfloat16, torch.float16, torch.float32)] == [
        torch.float16, torch.float16, torch.float32]
    assert [gram_inner_dtype(dtype, cpu) for dtype in (torch.bfloat16, torch.float16, torch.float64)] == [
        torch.float32, torch.float32, torch.float64]


@pytest.mark.parametrize("dtype, steps", [(torch.float32, 5), (torch.float32, 8), (torch.bfloat16, 5),
                                          (torch.bfloat16, 7), (torch.bfloat16, 3)])
def test_gram_flop_counts_the_products_the_iteration_runs(dtype, steps):
    """The profiler's count of every matrix product's FLOPs in one Gram call (torch's products), restarts included:
    16-bit iterations restart every three steps, float32 ones in stretches of at most five (the elementwise ops, which
    the profiler counts too, left out)."""
    X = random_matrix(40, 120)
    with torch.profiler.profile(with_flops=True) as profile:
        zeropower(X, steps, "polar_express", dtype=dtype, algorithm="gram", backend="torch")
    products = ("aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm")
    counted = sum(event.flops for event in profile.events() if event.flops and event.name in products)
    assert counted == gram_flop(40, 120, steps, dtype)


def test_gram_restarts_split_the_steps_as_documented() -> None:
    """Float32 and float64: stretches of at most five steps (longer ones let a rounded negative eigenvalue of R grow
    to NaN), as few as that allows (each restart costs two (m, n) products), as even as they come. 16-bit: every
    three steps."""
    for steps in range(1, 101):
        for dtype in (torch.float32, torch.float64):
            bounds = (0, *newton_schulz_module._restart_steps(steps, dtype), steps)
            stretches = [stop - start for start, stop in zip(bounds, bounds[1:])]
            assert len(stretches) == math.ceil(steps / 5) and max(stretches) - min(stretches) <= 1, (steps, bounds)
        assert newton_schulz_module._restart_steps(steps, torch.bfloat16) == tuple(range(3, steps, 3))


@pytest.mark.parametrize("shape, expected", [((768, 3072), "gram"), ((3072, 768), "gram"), ((1024, 4096), "gram"),
                                             ((768, 768), "standard"), ((768, 1024), "standard"),
                                             ((32, 256), "gram"), ((24, 256), "standard"), ((10, 256), "standard")])
def test_auto_picks_the_algorithm_with_fewer_flops(shape, expected):
    """Fewer FLOPs by at least 3M a matrix: below that Gram's extra calls cost more than its products save."""
    wide = tuple(sorted(shape))
    assert resolve_algorithm("auto", wide, 5, torch.float32, "cpu") == expected
    # the large shapes at an eighth of their size (the same choice there), the small ones as they are
    G = random_matrix(*(size // 8 for size in shape)) if min(shape) >= 768 else random_matrix(*shape)
    # float32 named: the default dtype is bfloat16 on CPUs with bf16 matrix units, where "auto" keeps "standard".
    torch.testing.assert_close(zeropower(G, 5, dtype=torch.float32, algorithm="auto"),
                               zeropower(G, 5, dtype=torch.float32, algorithm=expected), rtol=0, atol=0)


@pytest.mark.parametrize("shape, dtype, device_type, expected", [
    ((2048, 8192), torch.bfloat16, "cuda", "gram"), ((8192, 2048), torch.float16, "cuda", "gram"),
    ((4096, 14336), torch.bfloat16, "cuda", "gram"), ((768, 3072), torch.bfloat16, "cuda", "standard"),
    ((2048, 4096), torch.bfloat16, "cuda", "standard"), ((4096, 4096), torch.bfloat16, "cuda", "standard"),
    ((2048, 8192), torch.bfloat16, "cpu", "standard"), ((768, 3072), torch.float32, "cuda", "gram")])
def test_auto_in_16_bit_takes_gram_only_on_gpus_and_large_wide_matrices(shape, dtype, device_type, expected):
    """The float16 Gram iteration ran faster than the standard bf16 one on GPUs at 2048x8192 (two thirds of its
    FLOPs) and slower at 768x3072; in 16-bit on CPUs its m x m part runs in float32, slower than the products it saves.
    Where the iteration runs in float32 the FLOP rule holds on every device."""
    assert resolve_algorithm("auto", tuple(sorted(shape)), 5, dtype, device_type) == expected


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_auto_on_a_gpu_runs_gram_on_a_large_wide_bf16_matrix():
    G = torch.randn(2048, 8192, generator=torch.Generator().manual_seed(0)).cuda()
    auto = zeropower(G, 5, dtype=torch.bfloat16, algorithm="auto")
    assert torch.equal(auto, zeropower(G, 5, dtype=torch.bfloat16, algorithm="gram"))
    assert not torch.equal(auto, zeropower(G, 5, dtype=torch.bfloat16, algorithm="standard"))


# --- AOL preconditioning -----------------------------------------------------------------------------------------

def aol_truth(G: torch.Tensor, steps: int) -> torch.Tensor:
    """U' p(S') V'ᵀ in float64 for D X = U' S' V'ᵀ, where X is G (wide) scaled by its Frobenius norm and D scales
    each row by (|X Xᵀ| 1)^(-1/2) (Turbo-Muon's AOL), p the composed AOL schedule: written from the paper, not
    from our code."""
    X = G.double() / G.double().norm()
    scaled = X / (X @ X.mT).abs().sum(dim=-1, keepdim=True).sqrt()
    u, s, vh = torch.linalg.svd(scaled, full_matrices=False)
    for a, b, c in resolve_coefficients("polar_express", steps, "aol"):
        s = a * s + b * s**3 + c * s**5
    return (u * s) @ vh


@pytest.mark.parametrize("algorithm", ["standard", "gram"])
@pytest.mark.parametrize("steps", [4, 5])
@pytest.mark.parametrize("condition", [10.0, 1e3, 1e6])
@pytest.mark.parametrize("shape", [(48, 160), LARGE])
def test_aol_applies_its_schedule_to_the_row_scaled_matrix(algorithm, steps, condition, shape):
    G, _ = batch_with_spectrum(shape, condition)
    out = zeropower(G, steps, "polar_express", dtype=torch.float64, algorithm=algorithm, preconditioner="aol")
    assert spectral_norm(out - aol_truth(G, steps)) <= 1e-8


def test_aol_row_scaling_bounds_the_spectral_norm_by_one():
    # The AOL guarantee: ‖D X‖₂ <= 1 for any X; one step with a = 1, b = c = 0 returns D X itself.
    for seed, shape in enumerate([(16, 64), (40, 40), (3, 200)]):
        G = random_matrix(*shape, dtype=torch.float64, seed=seed) * torch.logspace(0, 3, shape[1], dtype=torch.float64)
        scaled = newton_schulz(G, [(1.0, 0.0, 0.0)], 1e-7, preconditioner="aol")
        assert spectral_norm(scaled) <= 1 + 1e-12


@pytest.mark.parametrize("algorithm", ["standard", "gram"])
def test_aol_clamps_row_sums_below_eps(algorithm):
    # README: the row sums are taken in float32 or float64, "where eps clamps them". A row far smaller than the
    # others has a row sum under eps, and takes eps^(-1/2), not its own sum's far larger inverse root.
    eps = 1e-7
    G = random_matrix(4, 16, dtype=torch.float64, seed=0)
    G[1] *= 1e-9
    scaled = newton_schulz(G, [(1.0, 0.0, 0.0)], eps, algorithm=algorithm, preconditioner="aol")
    X = G / G.norm()
    sums = (X @ X.mT).abs().sum(dim=-1)
    assert sums[1] < eps < sums[[0, 2, 3]].min()
    torch.testing.assert_close(scaled, X * sums.clamp(min=eps).rsqrt().unsqueeze(-1), rtol=1e-12, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(128, 512), (512, 128), (64, 384)])
def test_aol_with_one_step_fewer_is_as_close_to_the_polar_factor(dtype, shape):
    # Rectangular Gaussian matrices (well conditioned): AOL with 4 steps against the Frobenius scaling with 5, both
    # against the SVD. On a square Gaussian one (condition number ~1e3) AOL's 4 steps measured 0.47 against 0.32.
    G = random_matrix(*shape, dtype=torch.float32, seed=3)
    truth = polar_factor(G)
    plain = spectral_norm(zeropower(G, 5, dtype=dtype) - truth)
    aol = spectral_norm(zeropower(G, 4, dtype=dtype, preconditioner="aol") - truth)
    assert aol <= plain * 1.05, (aol, plain)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_aol_keeps_zero_and_rank_deficient_input_finite(dtype):
    assert torch.equal(zeropower(torch.zeros(8, 24), 4, dtype=dtype, preconditioner="aol"), torch.zeros(8, 24))
    G = random_matrix(16, 3) @ random_matrix(3, 40, seed=1)
    out = zeropower(G, 4, dtype=dtype, preconditioner="aol")
    assert torch.isfinite(out).all() and spectral_norm(out) <= 1.3


@pytest.mark.parametrize("algorithm", ["standard", "gram"])
@pytest.mark.parametrize("shape", [(24, 40), (40, 24), (3, 24, 40), (3, 40, 24), LARGE])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_option_leaves_the_input_as_it_was(algorithm, shape, dtype):
    """zeropower's G is the caller's, in any layout and whether or not it is already in the iteration's dtype: AOL
    scales newton_schulz's own copy in place, never the caller's."""
    G = random_matrix(*shape, dtype=dtype)
    kept = G.clone()
    for preconditioner in (None, "aol"):
        zeropower(G, 4, dtype=dtype, algorithm=algorithm, preconditioner=preconditioner)
        zeropower(G.mT, 4, dtype=dtype, algorithm=algorithm, preconditioner=preconditioner)
    assert torch.equal(G, kept)


@pytest.mark.parametrize("algorithm", ["standard", "gram"])
def test_a_surrounding_autocast_region_changes_nothing(algorithm):
    """Its products run in the dtype asked for: under CPU autocast they ran in bf16 (and the float32 Gram
    iteration, without its 16-bit guards, diverged on low-rank inputs)."""
    G = torch.randn(64, 8) @ torch.randn(8, 256)  # rank 8, as a batch of 8 makes a Linear weight's gradient
    outside = zeropower(G, 5, dtype=torch.float32, algorithm=algorithm)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inside = zeropower(G, 5, dtype=torch.float32, algorithm=algorithm)
    assert torch.equal(inside, outside)


@pytest.mark.parametrize("shape", [(3, 16, 24), LARGE], ids=["batch", "large"])
def test_an_input_that_requires_grad_is_orthogonalized_as_its_values_are(shape):
    """The products write into reused buffers, which autograd refuses (a batch, or a matrix past the lone size,
    raised): computed without autograd, whatever the input."""
    G = torch.randn(shape)
    out = zeropower(G.clone().requires_grad_(), 5, dtype=torch.float32)
    assert not out.requires_grad and torch.equal(out, zeropower(G, 5, dtype=torch.float32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("coefficients", ["original", "quintic", "polar_express", "polar_express_safer"])
@pytest.mark.parametrize("steps", [16, 24, 100])
@pytest.mark.parametrize("spectrum", ["rank 1", "condition 1e8"])
def test_many_gram_steps_stay_in_the_standard_iterations_band(spectrum, steps, coefficients, dtype):
    """Between restarts an eigenvalue of R that rounding made slightly negative grows by about a² a step: with one
    restart halfway, rank-deficient and ill-conditioned inputs overflowed to NaN from 16 steps in float32 (the
    accepted ns_steps go to 100). Rounding in the (near-)null space is amplified toward the band as in the standard
    iteration: every singular value stays within the band the schedule's odd polynomials keep [0, 1] in, rounding
    entering at any step."""
    if spectrum == "rank 1":
        G = torch.randn(64, 1, dtype=torch.float64) @ torch.randn(1, 256, dtype=torch.float64)
    else:
        G = matrix_with_spectrum(64, 256, 1e-8, 1.0)[0]
    gram = zeropower(G.to(dtype), steps, coefficients, dtype=dtype, algorithm="gram").double()
    band = 1.0  # the largest singular value after each step, of those started in [0, 1] at that step or before
    for a, b, c in resolve_coefficients(coefficients, steps):
        x = torch.linspace(0, band, 100_001, dtype=torch.float64)
        band = max(1.0, (a * x + b * x**3 + c * x**5).abs().max().item())
    assert torch.isfinite(gram).all()
    assert torch.linalg.matrix_norm(gram, 2) <= band * (1 + 1e-3)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("eps", [1e-7, 1e-8, 1e-12])
@pytest.mark.parametrize("algorithm", ["standard", "gram"])
def test_aol_keeps_a_zero_row_zero_whatever_eps(algorithm, eps, dtype):
    """float16 took eps=1e-8 as 0: the zero row's scale rsqrt(0) was inf and 0 * inf NaN spread everywhere (a
    dead neuron's gradient row; float16 is a T4's ns_dtype). The other rows are those of the matrix without it."""
    G = random_matrix(8, 24)
    G[3] = 0
    out = zeropower(G, 4, dtype=dtype, eps=eps, algorithm=algorithm, preconditioner="aol")
    assert torch.isfinite(out).all() and not out[3].any()
    without = zeropower(G[torch.arange(8) != 3], 4, dtype=dtype, eps=eps, algorithm=algorithm, preconditioner="aol")
    torch.testing.assert_close(out[torch.arange(8) != 3], without, rtol=0, atol=max(4 * torch.finfo(dtype).eps, 1e-5))
