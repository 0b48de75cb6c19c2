"""`native.apply_update_`, the last write of a Muon step (decay, then the scaled update), on the compiled op and the
pure-PyTorch fallback: against torch's own `_foreach_mul_` then `add_` (what the op claims to compute, rounding for
rounding) and against the float64 result."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch
from kernel_under_test import compiled_ops, load_cpu_variant, load_fallback_variant, submodule

PARAM_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
# float64: ns_dtype=torch.float64 orthogonalizes in double; torch's add_ adds such an update in double, rounding once.
UPDATE_DTYPES = (torch.float32, torch.bfloat16, torch.float64)
# Odd sizes catch tail handling; 70001 elements is more than two parallel chunks (grain 32768) of the CPU op.
SHAPES = ((7,), (33, 17), (70001,))


@pytest.fixture(params=[pytest.param("compiled", marks=compiled_ops), "fallback"])
def native(request: pytest.FixtureRequest) -> ModuleType:
    module = submodule(load_cpu_variant() if request.param == "compiled" else load_fallback_variant(), "native")
    assert module.ops_summary().startswith("compiled ops" if request.param == "compiled" else "pure PyTorch")
    return module


def _tensors(dtype: torch.dtype, update_dtype: torch.dtype, seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    params = [torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype) for shape in SHAPES]
    updates = [torch.randn(shape, generator=generator, dtype=torch.float64).to(update_dtype) for shape in SHAPES]
    return params, updates


def _torch_composition(params: list[torch.Tensor], updates: list[torch.Tensor], decay: torch.Tensor | None,
                       steps: list[float]) -> None:
    if decay is not None:
        torch._foreach_mul_(params, list(decay.unbind()))
    for param, update, step in zip(params, updates, steps):
        param.add_(update, alpha=step)


# 16-bit parameters are left to the float64 test: torch's own add_ rounds alpha to the parameter's dtype in its
# vectorized body but not in each thread's scalar tail, so it does not compute one function the op could equal.
@pytest.mark.parametrize("with_decay", [True, False], ids=["decay", "no-decay"])
@pytest.mark.parametrize("update_dtype", UPDATE_DTYPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_equals_foreach_mul_then_add(native, dtype: torch.dtype, update_dtype: torch.dtype, with_decay: bool) -> None:
    params, updates = _tensors(dtype, update_dtype, seed=0)
    expected = [param.clone() for param in params]
    decay = torch.tensor([0.999, 1.0, 0.98], dtype=dtype) if with_decay else None
    steps = [-0.02, -0.0371, 0.5]
    _torch_composition(expected, updates, decay, steps)
    native.apply_update_(params, updates, decay, steps)
    for param, reference in zip(params, expected):
        assert torch.equal(param, reference)


@pytest.mark.parametrize("update_dtype", UPDATE_DTYPES, ids=str)
@pytest.mark.parametrize("dtype", PARAM_DTYPES, ids=str)
def test_within_two_roundings_of_float64(native, dtype: torch.dtype, update_dtype: torch.dtype) -> None:
    # Tensor step sizes too (lr schedules, the RMS rule): the fallback multiplies them in with addcmul_.
    if dtype == update_dtype == torch.float64:
        pytest.skip("the float64 reference rounds step * update as the result does: no truth to bound it by")
    params, updates = _tensors(dtype, update_dtype, seed=1)
    originals = [param.to(torch.float64, copy=True) for param in params]
    decay = torch.tensor([0.9, 0.99, 1.0], dtype=torch.promote_types(dtype, torch.float32))  # as decay_factors makes
    steps = [-0.25, torch.tensor(-0.125, dtype=dtype), torch.tensor(0.75, dtype=dtype)]
    native.apply_update_(params, updates, decay, steps)
    unit = torch.finfo(dtype).eps / 2
    for param, original, update, factor, step in zip(params, originals, updates, decay.double(), steps):
        decayed = original * factor
        expected = decayed + float(step) * update.double()
        # One rounding of the decayed value, carried through the add, and one of the sum.
        bound = unit * (decayed.abs() + expected.abs()) + torch.finfo(dtype).smallest_normal * unit
        assert ((param.double() - expected).abs() <= bound).all()


@pytest.mark.parametrize("update_dtype", UPDATE_DTYPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("shape", [(70, 130), (3, 65, 33), (1, 200), (128, 192)], ids=str)
def test_a_transposed_update_equals_the_composition(native, shape: tuple, dtype: torch.dtype,
                                                     update_dtype: torch.dtype) -> None:
    # A tall matrix's Newton-Schulz result is the transpose of a contiguous batch; the op reads it in tiles of 64,
    # transposed in 8 x 8 blocks of float (float32 parameters) or double (float64) values. Sizes here leave partial
    # tiles on both sides, a batch of three matrices, and whole tiles only.
    generator = torch.Generator().manual_seed(2)
    params = [torch.randn(shape, generator=generator, dtype=dtype)]
    updates = [torch.randn((*shape[:-2], shape[-1], shape[-2]), generator=generator).to(update_dtype).mT]
    expected = [params[0].clone()]
    decay = torch.tensor([0.75], dtype=dtype)
    _torch_composition(expected, [updates[0].contiguous()], decay, [-0.3])
    native.apply_update_(params, updates, decay, [-0.3])
    assert torch.equal(params[0], expected[0])


def test_strided_and_mixed_tensors_take_the_torch_ops(native) -> None:
    # A transposed parameter, or an update strided otherwise than by a transpose, cannot take the compiled op: those
    # pairs take the torch ops, the others the op, and all compute the composition.
    params = [torch.randn(5, 3).t(), torch.randn(4), torch.randn(6, 4)]
    updates = [torch.randn(3, 5), torch.randn(4), torch.randn(6, 8)[:, ::2]]
    expected = [param.clone() for param in params]
    decay = torch.tensor([0.5, 0.25, 0.125])
    _torch_composition(expected, updates, decay, [-1.0, 2.0, 4.0])
    native.apply_update_(params, updates, decay, [-1.0, 2.0, 4.0])
    for param, reference in zip(params, expected):
        assert torch.equal(param, reference)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_a_strided_parameter_steps_as_its_contiguous_copy_and_nothing_beside_it_changes(native,
                                                                                     dtype: torch.dtype) -> None:
    # A column of a larger tensor: torch's 16-bit add_ rounds such a parameter's entries otherwise than a contiguous
    # one's (its strided loop and its vector loop round alpha differently), so builds without the compiled op once
    # stepped a strided bf16 parameter to other values than its contiguous copy.
    generator = torch.Generator().manual_seed(3)
    base = torch.randn(33, 17, 3, generator=generator).to(dtype)
    before = base.clone()
    column, copy = base[..., 1], base[..., 1].clone()
    update = torch.randn(33, 17, generator=generator).to(dtype)
    decay = torch.tensor([0.98])
    native.apply_update_([column], [update], decay, [-0.0371])
    native.apply_update_([copy], [update], decay, [-0.0371])
    assert torch.equal(column, copy)
    assert torch.equal(base[..., 0::2], before[..., 0::2])


@compiled_ops
def test_compiled_op_runs_on_cpu_tensors() -> None:
    native = submodule(load_cpu_variant(), "native")
    with torch.profiler.profile() as profile:
        native.apply_update_([torch.zeros(4)], [torch.ones(4, dtype=torch.bfloat16)], None, [1.0])
    assert any(event.name.endswith("::apply_update_") for event in profile.events())


def _bad_calls() -> list[tuple[str, tuple, str]]:
    """(case, arguments of the compiled op, text its error must contain)."""
    def t(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype)

    factors = t(1, dtype=torch.float64)
    shared = t(6)
    return [
        ("list lengths", ([t(3)], [], factors, factors), "updates has 0 tensors"),
        ("decay dtype", ([t(3)], [t(3)], t(1), factors), "decay must be a contiguous float64"),
        ("step sizes count", ([t(3)], [t(3)], factors, t(2, dtype=torch.float64)), "step_sizes must be"),
        ("update shape", ([t(3)], [t(4)], factors, factors), r"updates\[0\] has shape"),
        ("unsupported dtype", ([t(3, dtype=torch.int32)], [t(3)], factors, factors), r"params\[0\] has dtype"),
        ("non-contiguous", ([t(4, 3).t()], [t(3, 4)], factors, factors), r"params\[0\] must be contiguous"),
        ("strided update", ([t(3, 4)], [t(3, 8)[:, ::2]], factors, factors),
         r"updates\[0\] must be contiguous or the transpose"),
        ("aliasing", ([shared[:3]], [shared[2:5]], factors, factors), r"updates\[0\] shares memory"),
    ]


@pytest.mark.parametrize("case", range(len(_bad_calls())), ids=[case for case, _, _ in _bad_calls()])
@compiled_ops
def test_compiled_op_rejects_bad_arguments_naming_them(case: int) -> None:
    ops = submodule(load_cpu_variant(), "_ops").ops
    _, arguments, message = _bad_calls()[case]
    params_before = [param.clone() for param in arguments[0]]
    with pytest.raises(ValueError, match=message):
        ops.apply_update_(*arguments)
    assert all(torch.equal(before, after) for before, after in zip(params_before, arguments[0]))
