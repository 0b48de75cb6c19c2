"""`native.muon_momentum_` and `native.finite_flags` on both paths (the compiled op and the pure-PyTorch fallback):
the momentum against float64 torch.lerp, the flags against torch.isfinite.

The truth is torch's own lerp in float64 on the same inputs; each tolerance below says which roundings separate the
op from it.
"""

from __future__ import annotations

from types import ModuleType

import pytest
import torch
from kernel_under_test import compiled_ops, load_cpu_variant, load_fallback_variant, optimizer, submodule

HAS_CUDA = torch.cuda.is_available()
BUFFER_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
UPDATE_DTYPES = (torch.float32, torch.bfloat16)
# Odd sizes catch tail handling; 70001 elements is more than two parallel chunks (grain 32768) on the CPU op.
SHAPES = ((1,), (7,), (3, 5), (33, 17), (70001,), (2, 3, 4))


def _paths() -> list:
    needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")
    return [pytest.param((kind, device), id=f"{kind}-{device}",
                         marks=[mark for mark, applies in ((needs_cuda, device == "cuda"),
                                                           (compiled_ops, kind == "compiled")) if applies])
            for device in ("cpu", "cuda") for kind in ("compiled", "fallback")]


@pytest.fixture(params=_paths())
def path(request: pytest.FixtureRequest) -> tuple[ModuleType, str]:
    """(native module, device), with the path it claims checked: compiled means a compiled kernel for that device."""
    kind, device = request.param
    if kind == "fallback":
        native = submodule(load_fallback_variant(), "native")
        assert native.ops_summary().startswith("pure PyTorch fallback")
    else:
        native = submodule(optimizer if device == "cuda" else load_cpu_variant(), "native")
        devices = native.ops_summary().split("(")[1].split(")")[0].split(", ")
        assert device in devices, f"the {device} build has no compiled {device} kernel: {native.ops_summary()}"
    return native, device


def _unit_roundoff(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps / 2


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, scale: torch.Tensor, relative: float,
                  what: str) -> None:
    error = (actual.double() - expected).abs()
    # Below the smallest normal number the rounding error is absolute: half the subnormal spacing of the stored dtype.
    dtype = actual.dtype
    bound = relative * scale + _unit_roundoff(dtype) * torch.finfo(dtype).smallest_normal
    worst = (error / bound).max().item() if error.numel() else 0.0
    assert worst <= 1.0, f"{what}: error up to {worst:.2f}x the allowed bound"


def _run(native: ModuleType, device: str, buffer_dtype: torch.dtype, update_dtype: torch.dtype, shape: tuple,
         beta: float, nesterov: bool, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    buffer = torch.randn(shape, generator=generator, dtype=torch.float64).to(buffer_dtype).to(device)
    grad = (3 * torch.randn(shape, generator=generator, dtype=torch.float64)).to(buffer_dtype).to(device)
    update = torch.full(shape, 7.0, dtype=update_dtype, device=device)  # garbage the op must overwrite
    buffer_before, grad_before = (t.to(torch.float64, copy=True) for t in (buffer, grad))

    finite = native.muon_momentum_([buffer], [grad], [update], beta, nesterov)

    assert finite.dtype == torch.float32 and finite.shape == (1,) and finite.device.type == device
    assert finite.item() == 1.0
    assert torch.equal(grad.double(), grad_before), "grads must be read-only"
    # The bound is the arithmetic's plus the final store's. The lerp runs in float32 (float64 for float64 buffers):
    # rounding the weight, the difference, the product and the sum costs at most about 4 unit roundoffs of the
    # operands' magnitude (max(|buffer|, |grad|), which bounds every intermediate). Storing in the buffer's dtype
    # rounds once more: at most 1 unit roundoff of that dtype.
    math_dtype = torch.float64 if buffer_dtype == torch.float64 else torch.float32
    scale = torch.maximum(buffer_before.abs(), grad_before.abs())
    expected_buffer = torch.lerp(buffer_before, grad_before, 1 - beta)
    _assert_close(buffer, expected_buffer, scale, 4 * _unit_roundoff(math_dtype) + _unit_roundoff(buffer_dtype),
                  "momentum buffer")
    # The update blends with the buffer as stored, so it is checked from the op's own buffer, with the same
    # reasoning: float32 arithmetic (4 units) plus one rounding to the update's dtype (1 unit).
    stored = buffer.double()
    expected_update = torch.lerp(grad_before, stored, beta) if nesterov else stored
    update_scale = torch.maximum(stored.abs(), grad_before.abs()) if nesterov else stored.abs()
    _assert_close(update, expected_update, update_scale, 4 * _unit_roundoff(math_dtype) + _unit_roundoff(update_dtype),
                  "update")


@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("update_dtype", UPDATE_DTYPES, ids=str)
@pytest.mark.parametrize("buffer_dtype", BUFFER_DTYPES, ids=str)
def test_matches_torch_lerp_in_float64(path, buffer_dtype: torch.dtype, update_dtype: torch.dtype,
                                       nesterov: bool) -> None:
    native, device = path
    for seed, shape in enumerate(SHAPES):
        # 0.95 is Muon's default; 0.3 takes torch.lerp's other branch (weight >= 0.5 for the buffer step).
        for beta in (0.95, 0.3):
            _run(native, device, buffer_dtype, update_dtype, shape, beta, nesterov, seed)


@pytest.mark.parametrize("update_dtype", [torch.bfloat16, torch.float16], ids=str)
def test_update_cast_rounds_like_torch(path, update_dtype: torch.dtype) -> None:
    # With beta = 1 the buffer stays put (lerp weight 0 is exact), so the update is the float32 buffer cast to the
    # update's dtype, which must match torch's own cast bit for bit, ties (round half to even) included.
    native, device = path
    random = torch.randn(4099, generator=torch.Generator().manual_seed(2))
    # float32 bit patterns halfway between two bfloat16 values, with an even and with an odd upper half.
    ties = torch.tensor([0x3F808000, 0x3F818000, -0x40800000 + 0x8000, 0x7F7F8000], dtype=torch.int32).view(
        torch.float32)
    buffer = torch.cat([random, ties, torch.tensor([0.0, 1e-40, 65504.0, 7e4])]).to(device)
    expected = buffer.to(update_dtype)
    update = torch.empty_like(buffer, dtype=update_dtype)
    native.muon_momentum_([buffer], [torch.zeros_like(buffer)], [update], 1.0, False)
    assert torch.equal(update.view(torch.int16), expected.view(torch.int16))


def test_many_tensors_in_one_call_match_one_at_a_time(path) -> None:
    # Each tensor's result must not depend on its neighbours: compare a mixed list with separate single calls.
    native, device = path
    generator = torch.Generator().manual_seed(0)
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.float32]
    shapes = [(5, 3), (17,), (2, 2, 2), (9,), (40000,)]
    buffers = [torch.randn(s, generator=generator).to(d).to(device) for s, d in zip(shapes, dtypes)]
    grads = [torch.randn(s, generator=generator).to(d).to(device) for s, d in zip(shapes, dtypes)]
    together = [b.clone() for b in buffers], [torch.empty(s, device=device) for s in shapes]
    native.muon_momentum_(together[0], grads, together[1], 0.9, True)
    for i in range(len(shapes)):
        alone = buffers[i].clone(), torch.empty(shapes[i], device=device)
        native.muon_momentum_([alone[0]], [grads[i]], [alone[1]], 0.9, True)
        assert torch.equal(together[0][i], alone[0]) and torch.equal(together[1][i], alone[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_nonfinite_grads_skip_their_tensor_only(path, dtype: torch.dtype) -> None:
    native, device = path
    generator = torch.Generator().manual_seed(1)
    shapes = [(6, 5), (70001,), (4, 3), (9,), (11,)]
    buffers = [torch.randn(s, generator=generator).to(dtype).to(device) for s in shapes]
    grads = [torch.randn(s, generator=generator).to(dtype).to(device) for s in shapes]
    grads[1][40000] = float("nan")  # in the second parallel chunk of the CPU op
    grads[2][0, 0] = float("inf")
    grads[3][-1] = float("-inf")
    updates = [torch.full(s, 7.0, device=device) for s in shapes]
    before = [b.clone() for b in buffers]

    finite = native.muon_momentum_(buffers, grads, updates, 0.95, True)

    assert finite.tolist() == [1.0, 0.0, 0.0, 0.0, 1.0]
    for i in (1, 2, 3):
        assert torch.equal(buffers[i].view(torch.int16), before[i].view(torch.int16)), "buffer must be untouched"
        assert torch.equal(updates[i], torch.zeros_like(updates[i]))
    for i in (0, 4):
        assert not torch.equal(buffers[i], before[i]) and not updates[i].eq(7.0).any()


def test_nonfinite_grads_among_many_of_mixed_sizes_skip_their_tensor_only(path) -> None:
    """More gradients than one launch of the GPU's check takes (64), empty ones among them, and one with more entries
    than its blocks cover in one pass (1,048,576 on a GPU), each with a NaN or Inf or none at a random place."""
    native, device = path
    values = (None, float("nan"), None, float("inf"), None, float("-inf"))
    sizes = [0 if seed % 17 == 5 else 1 + (seed * 37) % 300 for seed in range(150)]
    sizes[100] = 1_100_001
    grads = [_with_nonfinite((size,), torch.float32, device, values[seed % 6], seed) for seed, size in enumerate(sizes)]
    grads[100].view(-1)[1_099_999] = float("nan")  # past the first pass of its blocks
    buffers = [torch.ones(size, device=device) for size in sizes]
    updates = [torch.full((size,), 7.0, device=device) for size in sizes]
    expected = [float(torch.isfinite(grad).all()) for grad in grads]
    assert expected.count(0.0) > 40 and expected.count(1.0) > 40
    finite = native.muon_momentum_(buffers, grads, updates, 0.9, False)
    assert finite.tolist() == expected
    for buffer, update, flag in zip(buffers, updates, expected):
        if flag == 0.0:
            assert torch.equal(buffer, torch.ones_like(buffer)) and not update.any()


def test_empty_list(path) -> None:
    native, _ = path
    finite = native.muon_momentum_([], [], [], 0.9, True)
    assert finite.shape == (0,) and finite.dtype == torch.float32


def test_empty_tensor_counts_as_finite(path) -> None:
    native, device = path
    buffers = [torch.zeros(0, device=device), torch.zeros(3, device=device)]
    grads = [torch.zeros(0, device=device), torch.ones(3, device=device)]
    updates = [torch.zeros(0, device=device), torch.zeros(3, device=device)]
    finite = native.muon_momentum_(buffers, grads, updates, 0.5, False)
    assert finite.tolist() == [1.0, 1.0]
    assert torch.equal(updates[1], torch.full((3,), 0.5, device=device))  # lerp(0, 1, 0.5) is exact


def _bad_calls(device: str) -> list[tuple[str, tuple, str]]:
    """(case, arguments of muon_momentum_, text the error must contain)."""
    def t(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, device=device)

    return [
        ("list lengths", ([t(3)], [t(3), t(3)], [t(3)], 0.9, False), "grads has 2 tensors"),
        ("updates length", ([t(3)], [t(3)], [], 0.9, False), "updates has 0 tensors"),
        ("grad shape", ([t(3)], [t(4)], [t(3)], 0.9, False), "grads[0] has shape"),
        ("grad dtype", ([t(3)], [t(3, dtype=torch.bfloat16)], [t(3)], 0.9, False), "grads[0] has dtype"),
        ("update shape", ([t(3)], [t(3)], [t(2)], 0.9, False), "updates[0] has shape"),
        ("unsupported dtype", ([t(3, dtype=torch.int32)], [t(3, dtype=torch.int32)], [t(3)], 0.9, False),
         "momentum_buffers[0] has dtype"),
        ("non-contiguous", ([t(3, 4)], [t(4, 3).t()], [t(3, 4)], 0.9, False), "grads[0] must be contiguous"),
        ("beta above 1", ([t(3)], [t(3)], [t(3)], 1.5, False), "beta must be in [0, 1]"),
        ("beta negative", ([t(3)], [t(3)], [t(3)], -0.1, False), "beta must be in [0, 1]"),
        ("beta NaN", ([t(3)], [t(3)], [t(3)], float("nan"), False), "beta must be in [0, 1]"),
    ]


@pytest.mark.parametrize("case", range(len(_bad_calls("cpu"))), ids=[case for case, _, _ in _bad_calls("cpu")])
def test_bad_arguments_raise_value_error_naming_them(path, case: int) -> None:
    native, device = path
    _, arguments, message = _bad_calls(device)[case]
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        native.muon_momentum_(*arguments)


def test_device_mismatch_raises_value_error(path) -> None:
    native, device = path
    other = "meta" if device == "cpu" else "cpu"
    grads = [torch.zeros(3, device=device)]
    with pytest.raises(ValueError, match=r"momentum_buffers\[0\] is on"):
        native.muon_momentum_([torch.zeros(3, device=other)], grads, [torch.zeros(3, device=device)], 0.9, False)
    with pytest.raises(ValueError, match=r"updates\[0\] is on"):
        native.muon_momentum_([torch.zeros(3, device=device)], grads, [torch.zeros(3, device=other)], 0.9, False)


def test_compiled_op_really_runs(path) -> None:
    # The profiler records every dispatcher call: the op's namespaced name appears exactly when the compiled path ran.
    native, device = path
    tensors = [[torch.zeros(4, device=device)] for _ in range(3)]
    with torch.profiler.profile() as profile:
        native.muon_momentum_(*tensors, 0.9, False)
    ran_compiled = any(event.name.endswith("::muon_momentum_") for event in profile.events())
    assert ran_compiled == native.ops_summary().startswith("compiled ops")


@compiled_ops
def test_compiled_op_checks_its_finite_argument() -> None:
    # Direct callers of the op (not through native.py, which allocates `finite`) get a ValueError from the C++ checks.
    ops = submodule(load_cpu_variant(), "_ops").ops
    buffer, grad, update = torch.zeros(3), torch.zeros(3), torch.zeros(3)
    for finite in (torch.zeros(2), torch.zeros(1, dtype=torch.float64), torch.zeros(1, 1)):
        with pytest.raises(ValueError, match="finite must be a contiguous float32 tensor of shape"):
            ops.muon_momentum_([buffer], [grad], [update], finite, 0.9, False)


@compiled_ops
@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")
def test_compiled_cuda_op_checks_devices_itself() -> None:
    # Mixed CPU and CUDA tensors dispatch to the CUDA kernel, whose checks must name the stray argument.
    ops = submodule(optimizer, "_ops").ops
    cuda = [torch.zeros(3, device="cuda") for _ in range(3)]
    with pytest.raises(ValueError, match=r"grads\[0\] is on cpu"):
        ops.muon_momentum_([cuda[0]], [torch.zeros(3)], [cuda[1]], torch.zeros(1, device="cuda"), 0.9, False)


@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")
@pytest.mark.parametrize("kind", ["compiled", "fallback"])
def test_no_host_sync_on_cuda(kind: str) -> None:
    native = submodule(optimizer if kind == "compiled" else load_fallback_variant(), "native")
    buffers = [torch.zeros(1000, device="cuda"), torch.zeros(10, device="cuda", dtype=torch.bfloat16)]
    grads = [torch.ones(1000, device="cuda"), torch.full((10,), float("nan"), device="cuda", dtype=torch.bfloat16)]
    updates = [torch.empty(1000, device="cuda"), torch.empty(10, device="cuda")]
    native.muon_momentum_(buffers, grads, updates, 0.9, True)  # first call: path choice and lazy init may sync
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        finite = native.muon_momentum_(buffers, grads, updates, 0.9, True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert finite.tolist() == [1.0, 0.0]


def _with_nonfinite(shape: tuple, dtype: torch.dtype, device: str, value: float | None, seed: int) -> torch.Tensor:
    """A random tensor with `value` (NaN, +-Inf, or None for none) at a random position."""
    generator = torch.Generator().manual_seed(seed)
    tensor = torch.randn(shape, generator=generator).to(dtype)
    if value is not None and tensor.numel():
        tensor.view(-1)[torch.randint(tensor.numel(), (), generator=generator)] = value
    return tensor.to(device)


@pytest.mark.parametrize("dtype", BUFFER_DTYPES, ids=str)
def test_finite_flags_match_isfinite(path, dtype: torch.dtype) -> None:
    native, device = path
    values = (None, float("nan"), float("inf"), float("-inf"))
    tensors = [_with_nonfinite(shape, dtype, device, values[(seed + len(shape)) % 4], seed)
               for seed, shape in enumerate(SHAPES * 2)]
    tensors.append(_with_nonfinite((70001,), dtype, device, None, 99))
    tensors[-1][40000] = float("nan")  # in the second parallel chunk of the CPU op
    expected = [float(torch.isfinite(tensor).all()) for tensor in tensors]
    assert 0.0 in expected and 1.0 in expected
    finite = native.finite_flags(tensors)
    assert finite.dtype == torch.float32 and finite.device.type == device
    assert finite.tolist() == expected


def test_finite_flags_of_strided_empty_and_no_tensors(path) -> None:
    native, device = path
    column = torch.zeros(5, 3, device=device)
    column[4, 1] = float("inf")
    transposed = torch.ones(4, 6, device=device).t()
    flags = native.finite_flags([column[:, 1], column[:, 0], transposed, torch.zeros(0, device=device)])
    assert flags.tolist() == [0.0, 1.0, 1.0, 1.0]
    empty = native.finite_flags([])
    assert empty.shape == (0,) and empty.dtype == torch.float32


@pytest.mark.parametrize("dtype", BUFFER_DTYPES, ids=str)
def test_finite_flags_flag_only_nan_and_inf(path, dtype: torch.dtype) -> None:
    # Extremes whose sum or squares overflow stay finite. 1000 elements: full blocks of the CPU op's unrolled loop and
    # a tail after them, for every element size.
    native, device = path
    info = torch.finfo(dtype)
    extremes = torch.tensor([info.max, info.min, info.smallest_normal, -0.0], dtype=dtype)
    finite = extremes.repeat(250)
    finite[1::7] = info.smallest_normal * info.eps  # the smallest subnormal
    tensors, expected = [finite], [1.0]
    for position, value in zip((0, 127, 128, 511, 998, 999), (float("nan"), float("inf"), float("-inf")) * 2):
        flagged = finite.clone()
        flagged[position] = value
        tensors.append(flagged)
        expected.append(0.0)
    assert [float(torch.isfinite(tensor).all()) for tensor in tensors] == expected
    assert native.finite_flags([tensor.to(device) for tensor in tensors]).tolist() == expected


def test_finite_flags_of_mixed_dtypes_take_one_multi_tensor_norm_per_dtype(path) -> None:
    """Where the CPU op does not serve (GPUs, builds without it), the flags come from torch's multi-tensor norm, one
    call per dtype whatever the number of tensors, and land in the order the tensors were given."""
    native, device = path
    values = (None, float("nan"), float("inf"), float("-inf"))
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    tensors = [_with_nonfinite((17 + seed,), dtypes[seed % 3], device, values[seed % 4], seed) for seed in range(12)]
    tensors.insert(5, torch.zeros(0, dtype=torch.bfloat16, device=device))
    expected = [float(torch.isfinite(tensor).all()) for tensor in tensors]
    with torch.profiler.profile() as profile:
        finite = native.finite_flags(tensors)
    assert finite.tolist() == expected
    norms = sum(event.name == "aten::_foreach_norm" for event in profile.events())
    assert norms == (0 if _runs_compiled_finite_flags(native, device) else len(dtypes))


def test_finite_flags_device_mismatch_raises_value_error(path) -> None:
    native, device = path
    other = "meta" if device == "cpu" else "cpu"
    with pytest.raises(ValueError, match=r"tensors\[1\] is on"):
        native.finite_flags([torch.zeros(3, device=device), torch.zeros(3, device=other)])


@compiled_ops
def test_compiled_finite_flags_op_checks_its_arguments() -> None:
    ops = submodule(load_cpu_variant(), "_ops").ops
    for finite in (torch.zeros(2), torch.zeros(1, dtype=torch.float64), torch.zeros(1, 1)):
        with pytest.raises(ValueError, match="finite must be a contiguous float32 tensor of shape"):
            ops.finite_flags_([torch.zeros(3)], finite)
    with pytest.raises(ValueError, match=r"tensors\[0\] has dtype"):
        ops.finite_flags_([torch.zeros(3, dtype=torch.int32)], torch.zeros(1))
    with pytest.raises(ValueError, match=r"tensors\[0\] must be contiguous"):
        ops.finite_flags_([torch.zeros(3, 4).t()], torch.zeros(1))


def _runs_compiled_finite_flags(native: ModuleType, device: str) -> bool:
    """The compiled op checks CPU tensors; on GPUs torch's multi-tensor norm does (fewer launches)."""
    return device == "cpu" and native.ops_summary().startswith("compiled ops")


def test_compiled_finite_flags_op_really_runs(path) -> None:
    native, device = path
    with torch.profiler.profile() as profile:
        native.finite_flags([torch.zeros(4, device=device)])
    ran_compiled = any(event.name.endswith("::finite_flags_") for event in profile.events())
    assert ran_compiled == _runs_compiled_finite_flags(native, device)


@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")
@pytest.mark.parametrize("kind", ["compiled", "fallback"])
def test_finite_flags_without_host_sync_on_cuda(kind: str) -> None:
    native = submodule(optimizer if kind == "compiled" else load_fallback_variant(), "native")
    tensors = [torch.ones(1000, device="cuda"), torch.full((10,), float("nan"), device="cuda", dtype=torch.bfloat16)]
    native.finite_flags(tensors)  # first call: path choice and lazy init may sync
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        finite = native.finite_flags(tensors)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert finite.tolist() == [1.0, 0.0]
