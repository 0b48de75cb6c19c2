"""The Muon update's one Triton launch (`functional._apply_update_` on GPUs), under the Triton interpreter on the CPU
(on a GPU where one runs the tests): against torch's `_foreach_mul_` then `add_`, which the other way computes,
for straight and transposed updates, tile edges, every dtype pair, with and without decay; the matrices it cannot
take go the other way; a kernel that fails leaves the update to torch's ops."""

from __future__ import annotations

import sys

import pytest
import torch

from kernel_under_test import optimizer
from triton_under_test import DEVICE, INTERPRETER

functional = sys.modules[f"{optimizer.__name__}.functional"]
pytestmark = pytest.mark.skipif(not functional.TRITON_AVAILABLE or not (INTERPRETER or torch.cuda.is_available()),
                                reason="needs Triton and either its interpreter or a GPU")

# Around the 64-entry tile, in sides of multiples of 8 (what the kernel takes): the smallest, a tile's edges, several
# tiles; tall ones take transposed updates, as a tall matrix's Newton-Schulz result is the transpose of a wide one.
SHAPES = [(8, 8), (56, 72), (64, 64), (72, 136), (136, 72), (8, 200)]
STEP_SIZES = [-0.01, -0.02, -0.005, -0.03, -0.015, -0.025]


def _tensors(param_dtype: torch.dtype, update_dtype: torch.dtype) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    params = [torch.randn(shape, generator=generator).to(param_dtype).to(DEVICE) for shape in SHAPES]
    updates = [(torch.randn(shape, generator=generator) if shape[0] <= shape[1]
                else torch.randn(shape[::-1], generator=generator).t()).to(update_dtype).to(DEVICE)
               for shape in SHAPES]
    return params, updates


def _torch_ops(params: list[torch.Tensor], updates: list[torch.Tensor], decay: torch.Tensor | None) -> None:
    if decay is not None:
        torch._foreach_mul_(params, list(decay.unbind()))
    for param, update, step in zip(params, updates, STEP_SIZES):
        param.add_(update, alpha=step)


def _launched(monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    """Serve this device with the one-launch kernels; returns the indices each launch took, as they come."""
    monkeypatch.setattr(functional, "ONE_LAUNCH_DEVICE_TYPES", (torch.device(DEVICE).type,))
    monkeypatch.setattr(functional, "_one_launch_failed", set())
    launches: list[list[int]] = []
    launch = functional.launch_apply_
    monkeypatch.setattr(functional, "launch_apply_",
                        lambda *args: (launches.append(list(args[4])), launch(*args))[1])
    return launches


@pytest.mark.parametrize("decayed", [True, False], ids=["decay", "no decay"])
@pytest.mark.parametrize(("param_dtype", "update_dtype"), [(torch.float32, torch.bfloat16),
                                                           (torch.float32, torch.float32),
                                                           (torch.bfloat16, torch.bfloat16),
                                                           (torch.float16, torch.float16)], ids=str)
def test_one_launch_writes_what_torch_ops_write(param_dtype: torch.dtype, update_dtype: torch.dtype, decayed: bool,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    ours, updates = _tensors(param_dtype, update_dtype)
    theirs = [param.clone() for param in ours]
    decay = torch.tensor([0.99, 1.0, 0.98, 0.97, 0.995, 0.9]).to(param_dtype).to(DEVICE) if decayed else None
    launches = _launched(monkeypatch)
    functional._apply_update_(ours, updates, decay, STEP_SIZES)
    _torch_ops(theirs, updates, decay)
    # One launch for the straight updates, one for the transposed.
    assert launches == [[0, 1, 2, 3, 5], [4]]
    starts = _tensors(param_dtype, update_dtype)[0]
    for param, before, update, step, expected in zip(ours, starts, updates, STEP_SIZES, theirs):
        # The same float32 arithmetic, each stored value rounded once (the decayed parameter, then the sum); the
        # multiply-add may fuse on one side, and the interpreter truncates 16-bit stores where torch rounds: an ulp
        # of each rounded operand at most.
        bound = 2 * torch.finfo(param_dtype).eps * (before.float().abs() + abs(step) * update.float().abs())
        assert ((param.float() - expected.float()).abs() <= bound).all()
    assert all(not torch.equal(param, before) for param, before in zip(ours, starts))


def test_a_zero_update_with_no_decay_leaves_the_parameter_bit_for_bit(monkeypatch: pytest.MonkeyPatch) -> None:
    """A skipped parameter's update is exactly zero and its decay exactly one: its step writes back what it read."""
    params, updates = _tensors(torch.bfloat16, torch.bfloat16)
    before = [param.clone() for param in params]
    _launched(monkeypatch)
    functional._apply_update_(params, [update.zero_() for update in updates],
                              torch.ones(len(params), dtype=torch.bfloat16, device=DEVICE), STEP_SIZES)
    assert all(torch.equal(param, then) for param, then in zip(params, before))


def test_matrices_the_kernel_cannot_take_go_through_torch_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    generator = torch.Generator().manual_seed(1)
    wide = torch.randn(8, 33, generator=generator).to(DEVICE)
    # A conv weight (4D), a float64 matrix, an update starting 4 bytes into its storage, a side not a multiple of 8,
    # and one matrix it takes.
    ours = [torch.randn(4, 3, 2, 2, generator=generator).to(DEVICE),
            torch.randn(5, 7, generator=generator, dtype=torch.float64).to(DEVICE),
            torch.randn(8, 32, generator=generator).to(DEVICE), torch.randn(6, 16, generator=generator).to(DEVICE),
            torch.randn(16, 24, generator=generator).to(DEVICE)]
    updates = [torch.randn(4, 3, 2, 2, generator=generator).to(DEVICE),
               torch.randn(5, 7, generator=generator, dtype=torch.float64).to(DEVICE), wide[:, 1:],
               torch.randn(6, 16, generator=generator).to(DEVICE), torch.randn(16, 24, generator=generator).to(DEVICE)]
    theirs = [param.clone() for param in ours]
    launches = _launched(monkeypatch)
    steps = STEP_SIZES[:5]
    functional._apply_update_(ours, updates, None, steps)
    for param, update, step in zip(theirs, updates, steps):
        param.add_(update, alpha=step)
    assert launches == [[4]]
    for param, expected in zip(ours, theirs):
        torch.testing.assert_close(param, expected, rtol=2e-7, atol=1e-7)


def test_a_kernel_that_fails_leaves_the_update_to_torch_ops_once_and_for_all(monkeypatch: pytest.MonkeyPatch) -> None:
    ours, updates = _tensors(torch.float32, torch.bfloat16)
    theirs = [param.clone() for param in ours]
    monkeypatch.setattr(functional, "ONE_LAUNCH_DEVICE_TYPES", (torch.device(DEVICE).type,))
    monkeypatch.setattr(functional, "_one_launch_failed", set())
    attempts = []

    def failing_build(*args) -> None:
        attempts.append(1)
        raise RuntimeError("PTX assembly failed")

    monkeypatch.setattr(functional, "launch_apply_", failing_build)
    with pytest.warns(RuntimeWarning, match="one-launch Triton kernel of the step failed.*PTX assembly failed"):
        functional._apply_update_(ours, updates, None, STEP_SIZES)
    functional._apply_update_(ours, updates, None, STEP_SIZES)  # no second attempt, no second warning
    for _ in range(2):
        _torch_ops(theirs, updates, None)
    assert attempts == [1]
    for param, expected in zip(ours, theirs):
        torch.testing.assert_close(param, expected, rtol=0, atol=0)


def test_a_compiled_step_traces_torch_ops_in_place_of_the_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.compile traces the update as torch's ops (a launch reads addresses the tracer does not have), in one
    graph, and writes what they write."""
    ours, updates = _tensors(torch.float32, torch.bfloat16)
    theirs = [param.clone() for param in ours]
    launches = _launched(monkeypatch)
    torch.compile(lambda: functional._apply_update_(ours, updates, None, STEP_SIZES), fullgraph=True)()
    _torch_ops(theirs, updates, None)
    assert launches == []
    for param, expected in zip(ours, theirs):
        torch.testing.assert_close(param, expected, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("options", [dict(normalization="neuron"), dict(normalization="element"),
                                     dict(preconditioner="aol", ns_steps=4), dict(nesterov=False, weight_decay=0.0),
                                     dict(last_group=dict(lr=0.01, weight_decay=0.3))],
                         ids=["NorMuon", "AdaMuon", "AOL", "no decay", "groups by lr and decay"])
def test_optimizer_steps_written_by_the_launch_equal_those_written_by_torch_ops(
        options: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whole steps, the normalizations' rescaled updates and a tall matrix's transposed one among them: the same
    parameters through the launch and through torch's ops, a few float32 roundings apart. With `last_group`, the last
    matrix is in a group of its own whose stack it shares with the first (decay factors per matrix)."""
    generator = torch.Generator().manual_seed(2)
    shapes = [(16, 24), (24, 16), (16, 24)]
    start = [torch.randn(shape, generator=generator).to(DEVICE) for shape in shapes]
    grads = [[torch.randn(shape, generator=generator).to(DEVICE) for shape in shapes] for _ in range(3)]
    options = dict(options)
    last_group = options.pop("last_group", None)
    settings = {"lr": 0.02, "weight_decay": 0.1, "ns_dtype": torch.float32, **options}
    results = []
    for launched in (True, False):
        with monkeypatch.context() as patch:
            launches = _launched(patch) if launched else []
            params = [torch.nn.Parameter(weight.clone()) for weight in start]
            groups = [dict(params=params)] if last_group is None else [dict(params=params[:-1]),
                                                                       dict(params=params[-1:], **last_group)]
            opt = optimizer.Muon(groups, **settings)
            for step_grads in grads:
                for param, grad in zip(params, step_grads):
                    param.grad = grad.clone()
                opt.step()
            assert bool(launches) == launched
        results.append(params)
    for ours, theirs in zip(*results):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
