"""The one Triton launch for AdamW parameters whose moments are stored rounded (`state_dtype` bfloat16 or "int8"),
under the Triton interpreter on the CPU (on a GPU where one runs the tests): against torch's fused AdamW started from
the moments the state held, each stored moment one stochastic rounding from torch's float32 result and rounded as the
per-parameter path rounds it; skipped parameters untouched; tensors the kernel cannot take left to the per-parameter
path."""

from __future__ import annotations

import sys

import pytest
import torch

from kernel_under_test import optimizer, submodule
from triton_under_test import DEVICE, INTERPRETER

functional = sys.modules[f"{optimizer.__name__}.functional"]
state_precision = submodule(optimizer, "state_precision")
pytestmark = pytest.mark.skipif(not functional.TRITON_AVAILABLE or not (INTERPRETER or torch.cuda.is_available()),
                                reason="needs Triton and either its interpreter or a GPU")

SETTINGS = dict(lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
KEYS = ("exp_avg", "exp_avg_sq")
# bfloat16 moments take any shape (a program's block of 2048 entries and a partial one among them); 8-bit codes take
# a last dim of whole 256-entry blocks, and leave the others (the last shape) to the per-parameter path.
SHAPES = {torch.bfloat16: [(768,), (3, 700), (5,), (2, 64)], "int8": [(2, 256), (3, 768), (4, 512), (6, 100)]}
SKIPPED = 2  # the index of the parameter whose gradient holds a NaN


def _items(state_dtype: torch.dtype | str, seed: int = 0, param_dtype: torch.dtype = torch.float32) -> list:
    """AdamW parameters with gradients and moments already stored in `state_dtype` (rounded from random values),
    with step and rounding counts as after a few steps."""
    generator = torch.Generator().manual_seed(seed)
    items = []
    for index, shape in enumerate(SHAPES[state_dtype]):
        param = torch.randn(shape, generator=generator).to(param_dtype)
        grad = torch.randn(shape, generator=generator).to(param_dtype)
        if index == SKIPPED:
            grad.view(-1)[0] = float("nan")
        values = [torch.randn(shape, generator=generator) * 0.1, torch.rand(shape, generator=generator) * 0.01]
        if index == 0:
            # A block whose second moments lie far below its largest: as codes most of them are 0, and so must their
            # first moments be read (see `_torch_adamw`), else they would step by m / eps.
            values[1].view(-1)[:256] = 1e-12
            values[1].view(-1)[0] = 1.0
        quantized = state_dtype == "int8"
        stored = [torch.zeros(shape, dtype=torch.int8 if quantized else torch.bfloat16) for _ in KEYS]
        scales = [torch.zeros(state_precision.scales_shape(shape)) if quantized else None for _ in KEYS]
        count = torch.tensor(7, dtype=torch.int64)
        state_precision.store_(KEYS, stored, scales, values, [count, count], torch.ones(2), [None, None])
        tensors = (param, grad, stored[0], stored[1], torch.tensor(4.0), torch.zeros((), dtype=torch.int64), count,
                   scales[0], scales[1])
        items.append(functional.AdamWTensors(*(None if tensor is None else tensor.to(DEVICE) for tensor in tensors)))
    return items


def _step(items: list, monkeypatch: pytest.MonkeyPatch, *, rounded_launch: bool) -> list[list[int]]:
    """One step of the optimizer's AdamW part as on a GPU, each parameter flagged by its gradient; returns the shapes
    each rounded launch took."""
    launches: list[list[int]] = []
    with monkeypatch.context() as patch:
        patch.setattr(functional, "ONE_LAUNCH_DEVICE_TYPES", (DEVICE,))
        tabulate = functional.tabulate_rounded
        patch.setattr(functional, "tabulate_rounded", lambda rows, *args, **kwargs: (
            launches.append([tuple(row[0].shape) for row in rows]), tabulate(rows, *args, **kwargs))[1])
        if not rounded_launch:
            patch.setattr(functional, "_fits_rounded_launch", lambda item: False)
        functional.adamw_update(items, None, **SETTINGS)
    return launches


def _torch_adamw(item) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """torch's fused AdamW step from the moments `item` stores: the parameter and both moments in float32."""
    param = item.param.clone().requires_grad_()
    param.grad = item.grad.clone()
    opt = torch.optim.AdamW([param], fused=True, **SETTINGS)
    # A second moment stored as 0 makes its first moment 0 (state_precision: in exact arithmetic both are 0 then).
    exp_avg_sq = _decoded(item, 1)
    opt.state[param] = {"step": item.step.clone(), "exp_avg": _decoded(item, 0) * exp_avg_sq.sign(),
                        "exp_avg_sq": exp_avg_sq}
    opt.step()
    return param.detach(), opt.state[param]["exp_avg"], opt.state[param]["exp_avg_sq"]


def _decoded(item, moment: int) -> torch.Tensor:
    key = KEYS[moment]
    return state_precision.working_copy(key, item.exp_avg_sq if moment else item.exp_avg,
                                        item.exp_avg_sq_scales if moment else item.exp_avg_scales)


def _one_rounding(stored: torch.Tensor, exact: torch.Tensor, state_dtype: torch.dtype | str) -> torch.Tensor:
    """Whether each stored value is one of the two neighbours of the exact one in the stored form: within its
    spacing (bfloat16: 2^-7 of the value; e4m3: 2^-3 of it, or 2^-9 of its block's scale below the smallest normal)."""
    if state_dtype == torch.bfloat16:
        return (stored - exact).abs() <= exact.abs() * 2.0 ** -7
    blocks = state_precision._blocks(exact.abs())
    floor = state_precision._unblocked(blocks.amax(-1, keepdim=True).expand_as(blocks), exact.shape) / 448 * 2.0 ** -9
    return (stored - exact).abs() <= torch.maximum(exact.abs() * 2.0 ** -3, floor) * (1 + 1e-6)


@pytest.mark.parametrize("state_dtype", [torch.bfloat16, "int8"], ids=["bfloat16", "int8"])
def test_one_launch_steps_rounded_moments_as_torch_then_one_rounding(state_dtype, monkeypatch) -> None:
    ours, before = _items(state_dtype), _items(state_dtype)
    launches = _step(ours, monkeypatch, rounded_launch=True)
    shapes = SHAPES[state_dtype]
    takes = [shape for shape in shapes if state_dtype == torch.bfloat16 or shape[-1] % 256 == 0]
    assert launches == [takes]
    for index, (item, start) in enumerate(zip(ours, before)):
        if index == SKIPPED:
            for name, value in vars(start).items():
                if value is not None and name not in ("step", "nonfinite_skips"):
                    torch.testing.assert_close(getattr(item, name), value, rtol=0, atol=0, equal_nan=True, msg=name)
            assert int(item.nonfinite_skips) == 1
            continue
        param, exp_avg, exp_avg_sq = _torch_adamw(start)
        torch.testing.assert_close(item.param, param, rtol=4e-6, atol=1e-7)
        assert _one_rounding(_decoded(item, 0), exp_avg, state_dtype).all()
        # The second moment's codes hold its square root: that is what was rounded.
        roots = exp_avg_sq.sqrt() if state_dtype == "int8" else exp_avg_sq
        stored_roots = _decoded(item, 1).sqrt() if state_dtype == "int8" else _decoded(item, 1)
        assert _one_rounding(stored_roots, roots, state_dtype).all()
        assert int(item.rounding_count) == int(start.rounding_count) + 1 and float(item.step) == float(start.step) + 1


@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("state_dtype", [torch.bfloat16, "int8"], ids=["bfloat16", "int8"])
def test_one_launch_rounds_as_the_per_parameter_path(state_dtype, param_dtype, monkeypatch) -> None:
    """The same random bits per entry (its index and the count): where the two paths' float32 moments agree, the
    stored bits agree; they differ in the last float32 bits of a few entries (different arithmetic orders), which
    round apart only where such a difference straddles a rounding threshold. bfloat16 parameters too, each rounded
    to nearest once from its float32 step, as torch's fused kernel rounds it."""
    ours, theirs = _items(state_dtype, param_dtype=param_dtype), _items(state_dtype, param_dtype=param_dtype)
    _step(ours, monkeypatch, rounded_launch=True)
    _step(theirs, monkeypatch, rounded_launch=False)
    for item, reference in zip(ours, theirs):
        for stored, expected in ((item.exp_avg, reference.exp_avg), (item.exp_avg_sq, reference.exp_avg_sq)):
            assert (stored.view(torch.int8 if state_dtype == "int8" else torch.int16)
                    == expected.view(torch.int8 if state_dtype == "int8" else torch.int16)).float().mean() >= 0.99
        if state_dtype == "int8":
            torch.testing.assert_close(item.exp_avg_scales, reference.exp_avg_scales, rtol=1e-5, atol=0)
            torch.testing.assert_close(item.exp_avg_sq_scales, reference.exp_avg_sq_scales, rtol=1e-5, atol=0)
        torch.testing.assert_close(item.param, reference.param, rtol=4e-6 if param_dtype == torch.float32 else 8e-3,
                                   atol=1e-7, equal_nan=True)
        assert torch.equal(item.rounding_count, reference.rounding_count)
        assert torch.equal(item.step, reference.step)


def test_counts_move_by_torch_ops_where_their_launch_fails_after_the_update(monkeypatch) -> None:
    ours, reference = _items(torch.bfloat16), _items(torch.bfloat16)
    _step(reference, monkeypatch, rounded_launch=True)
    monkeypatch.setattr(functional, "_one_launch_failed", set())

    def failing_launch(*args, **kwargs) -> None:
        raise RuntimeError("out of resources")

    with monkeypatch.context() as patch:
        patch.setattr(functional, "launch_counts_", failing_launch)
        with pytest.warns(RuntimeWarning, match="one-launch Triton kernel of the step failed.*out of resources"):
            _step(ours, monkeypatch, rounded_launch=True)
    # The update as the launch wrote it, and every count (step, skips, rounded writes) moved once by its flag.
    for item, expected in zip(ours, reference):
        for name, value in vars(expected).items():
            if value is not None:
                torch.testing.assert_close(getattr(item, name), value, rtol=0, atol=0, equal_nan=True, msg=name)
    assert functional._one_launch_failed == {torch.device(DEVICE).type}


def test_one_launch_keeps_a_block_finite_when_a_square_overflows(monkeypatch) -> None:
    # A finite gradient entry of 1e20 squares past float32: that second moment is infinite (as in torch's float32
    # AdamW), and its block's scale, taken from it, made every other entry of the block 0 * inf = NaN.
    items = _items("int8")
    items[1].grad[0, 3] = 1e20
    _step(items, monkeypatch, rounded_launch=True)
    assert torch.isfinite(items[1].exp_avg_sq_scales).all()
    assert not torch.isnan(items[1].param).any()
    assert not torch.isnan(state_precision.working_copy("exp_avg_sq", items[1].exp_avg_sq.cpu(),
                                                        items[1].exp_avg_sq_scales.cpu())).any()


@pytest.mark.parametrize("state_dtype, index, box", [
    (torch.bfloat16, 1, (slice(1, 3), slice(100, 650))),  # rows shorter than a block of the kernel
    ("int8", 1, (slice(1, 3), slice(None))),  # 8-bit codes: their blocks lie along whole rows
], ids=["bfloat16", "int8"])
def test_a_shard_with_its_positions_rounds_in_the_launch_as_the_whole_tensor(
        state_dtype, index: int, box: tuple, monkeypatch) -> None:
    # A distributed parameter's shard (an FSDP2 or TP DTensor's local tensor) stored rounded: its entries' random bits
    # come from where they lie in the whole tensor, so it stores what the whole tensor stores there, bit for bit.
    whole = _items(state_dtype)
    item = whole[index]
    rows, columns = range(item.param.shape[0])[box[0]], range(item.param.shape[1])[box[1]]
    positions = state_precision.EntryPositions(torch.tensor(rows, device=DEVICE) * item.param.shape[1],
                                               torch.tensor(columns, device=DEVICE))
    scales_box = (box[0], slice(None))

    def part(name: str, value: torch.Tensor | None) -> torch.Tensor | None:
        """The shard's own copy of one of the item's tensors (its counts whole)."""
        if value is None or not value.dim():
            return None if value is None else value.clone()
        return value[scales_box if name.endswith("scales") else box].clone(memory_format=torch.contiguous_format)

    shard = functional.AdamWTensors(**{name: part(name, value) for name, value in vars(item).items()}
                                    | {"rounding_positions": positions})
    launches = _step(whole, monkeypatch, rounded_launch=True)
    assert launches[0].count(tuple(item.param.shape)) == 1
    assert _step([shard], monkeypatch, rounded_launch=True) == [[tuple(shard.param.shape)]]
    for name in ("param", "exp_avg", "exp_avg_sq"):
        assert torch.equal(getattr(shard, name), getattr(item, name)[box]), name
    for name in ("exp_avg_scales", "exp_avg_sq_scales"):
        assert getattr(item, name) is None or torch.equal(getattr(shard, name), getattr(item, name)[scales_box]), name
