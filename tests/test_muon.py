"""The Muon optimizer class against torch's own optimizers, the SVD polar factor, and itself across a restart."""

from __future__ import annotations

import contextlib
import copy
import gc
import math
import os
import pickle
import re
import subprocess
import sys
import textwrap
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from kernel_under_test import optimizer, submodule

Muon = optimizer.Muon
functional = sys.modules[f"{optimizer.__name__}.functional"]
native = sys.modules[f"{optimizer.__name__}.native"]
muon_view = sys.modules[f"{optimizer.__name__}.routing"].muon_view
TRITON_INTERPRETED = functional.TRITON_AVAILABLE and os.environ.get("TRITON_INTERPRET") == "1"


def polar_factor(matrix: torch.Tensor) -> torch.Tensor:
    """U V^T of the reduced SVD, in float64: the exact answer Newton-Schulz approximates."""
    u, _, vh = torch.linalg.svd(matrix.double(), full_matrices=False)
    return u @ vh


def seeded_grads(params: list[torch.Tensor], seed: int, in_place: bool = False) -> None:
    """Fresh gradients, or with `in_place` the same values written into the gradients the parameters hold."""
    generator = torch.Generator().manual_seed(seed)
    for p in params:
        grad = torch.randn(p.shape, generator=generator, dtype=p.dtype)
        if in_place and p.grad is not None:
            p.grad.copy_(grad)
        else:
            p.grad = grad


# --- against torch.optim.Muon and torch.optim.AdamW ---------------------------------------------------------

# Three groups of one (64, 96), one (96, 64) and one other matrix each: buckets of matrices from every group.
_LR_DECAY_GROUPS = [dict(lr=0.02, weight_decay=0.1), dict(lr=0.01, weight_decay=0.0), dict(lr=0.03, weight_decay=0.2)]


@pytest.mark.parametrize("groups", ["one", "three differing in lr and weight decay"])
@pytest.mark.parametrize("rounds", ["shared", "one per bucket", "buckets in chunks", "written by one Triton launch"])
@pytest.mark.parametrize("nesterov", [True, False])
def test_matches_torch_muon(nesterov: bool, rounds: str, groups: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if rounds == "written by one Triton launch":  # as a GPU with Triton writes the updates
        if not TRITON_INTERPRETED:
            pytest.skip("CPU tensors in Triton kernels need the interpreter")
        monkeypatch.setattr(functional, "ONE_LAUNCH_DEVICE_TYPES", ("cpu",))
        monkeypatch.setattr(functional, "_one_launch_failed", set())  # filled only by a kernel that fails
    elif rounds != "shared":  # as large buckets run: each alone, its Newton-Schulz buffers from the workspace
        monkeypatch.setattr(functional, "_ROUND_NUMEL", 0)
    if rounds == "buckets in chunks":  # as a deep model's buckets run: the three (96, 64) in chunks of one and two
        monkeypatch.setattr(functional, "_BUCKET_NUMEL", {"cpu": 2 * 96 * 64})
    torch.manual_seed(0)
    # Batches of 2, 3 and 1, in an order whose buffers (reused from bucket to bucket and step to step on a CPU)
    # shrink and grow again.
    shapes = [(64, 96), (96, 64), (48, 48), (96, 64), (64, 96), (96, 64)]
    ours = [torch.randn(s) for s in shapes]
    theirs = [p.clone() for p in ours]
    options = _LR_DECAY_GROUPS if groups != "one" else _LR_DECAY_GROUPS[:1]
    lrs = [options[index % len(options)]["lr"] for index in range(len(shapes))]

    def grouped(params: list[torch.Tensor]) -> list[dict]:
        return [dict(params=params[start::len(options)], **group) for start, group in enumerate(options)]
    settings = dict(momentum=0.9, nesterov=nesterov, eps=1e-7)
    opt = Muon(grouped(ours), ns_coefficients="original", ns_dtype=torch.bfloat16, adjust_lr_fn="original",
               ns_steps=5, **settings)
    ref = torch.optim.Muon(grouped(theirs), ns_coefficients=(3.4445, -4.7750, 2.0315), adjust_lr_fn="original",
                           ns_steps=5, **settings)
    for step in range(4):
        seeded_grads(ours, step)
        seeded_grads(theirs, step)
        opt.step()
        ref.step()
        for p, q, lr in zip(ours, theirs, lrs):
            # Both run the same bf16 Newton-Schulz; the only differences are rounding in reductions done in another
            # order (batched norms). An update entry is ~1/sqrt(n) in size and bf16 keeps ~3 significant digits, so
            # allow 1% of one step's update per step taken.
            update_size = lr * math.sqrt(max(1.0, p.shape[0] / p.shape[1])) / math.sqrt(min(p.shape))
            torch.testing.assert_close(p, q, rtol=0, atol=0.01 * update_size * (step + 1))
        for p, q in zip(ours, theirs):
            torch.testing.assert_close(opt.state[p]["momentum_buffer"], ref.state[q]["momentum_buffer"],
                                       rtol=1e-6, atol=1e-6)
    assert not functional._one_launch_failed


def test_muon_update_refuses_per_parameter_rates_of_another_length() -> None:
    param = torch.randn(8, 8)
    item = functional.MuonTensors(param, torch.randn(8, 8), torch.zeros(8, 8), torch.zeros((), dtype=torch.int64),
                                  muon_view(param.shape, None, "auto", "flatten"))
    orthogonalizer = functional.Orthogonalizer(((3.4445, -4.7750, 2.0315),), 1e-7, torch.float32)
    with pytest.raises(ValueError, match="2 learning rates or weight decays given for 1 parameters"):
        functional.muon_update([item], lr=[0.1, 0.2], weight_decay=0.0, momentum=0.9, nesterov=True,
                               orthogonalizer=orthogonalizer, adjust_lr_fn=None, normalize_spatial=False,
                               normalization=None, normalization_beta=0.95)
    assert torch.equal(item.momentum_buffer, torch.zeros(8, 8))


@pytest.fixture(params=["one compiled call", "fused per dtype", "one Triton launch"])
def adamw_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The CPU's AdamW paths: the compiled `adamw_checked_` (each gradient checked, then its update, all in one
    call), or without it the flags read and then torch's fused kernel once per dtype; or the GPUs' (one Triton launch
    per dtype with a skip flag per tensor), run here by the Triton interpreter."""
    if request.param == "one compiled call" and not native.has_compiled_adamw_checked("cpu"):
        pytest.skip("this build has no compiled adamw_checked_")
    if request.param == "fused per dtype":
        monkeypatch.setattr(native, "has_compiled_adamw_checked", lambda device_type: False)
    if request.param == "one Triton launch":
        if not TRITON_INTERPRETED:
            pytest.skip("CPU tensors in Triton kernels need the interpreter")
        monkeypatch.setattr(functional, "ONE_LAUNCH_DEVICE_TYPES", ("cpu",))
    return request.param


def test_matches_torch_adamw_for_non_matrices(adamw_path: str) -> None:
    torch.manual_seed(0)
    ours = [torch.randn(37), torch.randn(5, 1), torch.randn(())]  # 1D, degenerate matrix, scalar: all AdamW
    theirs = [p.clone() for p in ours]
    opt = Muon(ours, lr=0.01, adamw_lr=3e-3, adamw_betas=(0.8, 0.99), adamw_eps=1e-6, adamw_weight_decay=0.05)
    ref = torch.optim.AdamW(theirs, lr=3e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.05)
    for step in range(5):
        seeded_grads(ours, step)
        seeded_grads(theirs, step)
        opt.step()
        ref.step()
    for p, q in zip(ours, theirs):
        # Fused and foreach AdamW do the same fp32 arithmetic in a different order: a few ulps.
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6)
        assert "momentum_buffer" not in opt.state[p]
        assert float(opt.state[p]["step"]) == 5


def _change_between_steps(change: str, adamw: torch.optim.Optimizer, vector: torch.Tensor, muon: torch.optim.Optimizer,
                          matrix: torch.Tensor, extra: torch.Tensor) -> None:
    """The same change made to our optimizer (both roles) and to torch's AdamW and Muon, whose steps read their state
    afresh each time."""
    if change == "a moment replaced":
        adamw.state[vector]["exp_avg"] = torch.full_like(vector, 0.5)
        muon.state[matrix]["momentum_buffer"] = torch.full_like(matrix, 0.5)
    elif change == "a state dict replaced":
        adamw.state[vector] = {}
    elif change == "a state cleared":
        muon.state[matrix].clear()
    elif change == "a state dropped":
        del adamw.state[vector]
    elif change == "a parameter added to the group's list":
        adamw.param_groups[0]["params"].append(extra)
    elif change == "a gradient dropped":
        vector.grad = None


@pytest.mark.parametrize("change", ["a moment replaced", "a state dict replaced", "a state cleared", "a state dropped",
                                    "a gradient dropped", "a parameter added to the group's list"])
def test_a_change_between_steps_is_seen_as_torchs_optimizers_see_it(adamw_path: str, change: str) -> None:
    """A step takes the items it gathered at the last one while nothing they came from changed; whatever did, the
    step reads as torch's optimizers do, which read their state afresh each time."""
    ours = [torch.randn(7), torch.randn(6, 4), torch.randn(3), torch.ones(5)]
    theirs = [p.clone() for p in ours]
    settings = dict(lr=0.02, momentum=0.9, nesterov=True, weight_decay=0.1, eps=1e-7)
    opt = Muon(ours[:3], ns_coefficients="original", ns_dtype=torch.bfloat16, adjust_lr_fn="original",
               adamw_lr=3e-3, adamw_betas=(0.9, 0.95), adamw_eps=1e-8, **settings)
    ref_muon = torch.optim.Muon([theirs[1]], ns_coefficients=(3.4445, -4.7750, 2.0315), adjust_lr_fn="original",
                                **settings)
    ref_adamw = torch.optim.AdamW([theirs[0], theirs[2]], lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    for step in range(4):
        seeded_grads(ours, step)
        seeded_grads(theirs, step)
        if step == 2:
            _change_between_steps(change, opt, ours[0], opt, ours[1], ours[3])
            _change_between_steps(change, ref_adamw, theirs[0], ref_muon, theirs[1], theirs[3])
        opt.step()
        ref_muon.step()
        ref_adamw.step()
        for index, (p, q) in enumerate(zip(ours, theirs)):
            # The matrix: both run bf16 Newton-Schulz, as in test_matches_torch_muon.
            tolerance = 0.01 * 0.02 * math.sqrt(6 / 4) / 2 * (step + 1) if index == 1 else 1e-6
            torch.testing.assert_close(p, q, rtol=0, atol=tolerance)


def test_a_step_after_one_with_the_same_layout_prepares_no_state_and_keeps_no_gradient_alive(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A scheduler's new lr at every step keeps the items held; a new state_dtype prepares the state again."""
    params = [torch.randn(7), torch.randn(6, 4)]
    opt = Muon(params, lr=0.02)
    prepared = []
    prepare = Muon._prepared_state
    monkeypatch.setattr(Muon, "_prepared_state", lambda self, *args: prepared.append(args) or prepare(self, *args))
    for step in range(3):
        opt.param_groups[0]["lr"] = 0.02 / (step + 1)
        seeded_grads(params, step)
        opt.step()
        assert len(prepared) == 2  # both parameters at the first step only
    opt.param_groups[0]["state_dtype"] = torch.bfloat16
    opt.step()
    assert len(prepared) == 4 and opt.state[params[1]]["momentum_buffer"].dtype == torch.bfloat16
    grads = [weakref.ref(param.grad) for param in params]
    opt.zero_grad()
    gc.collect()
    assert all(grad() is None for grad in grads)


@pytest.mark.parametrize("state_dtype", [None, torch.bfloat16], ids=["moments as they are", "bf16 moments"])
def test_adamw_groups_that_differ_only_in_lr_and_weight_decay_share_one_update_as_torch_adamw_steps_them(
        adamw_path: str, state_dtype: torch.dtype | None, monkeypatch: pytest.MonkeyPatch) -> None:
    # Layer-wise lr decay makes a group per block: one update serves them all, each parameter at its group's rates.
    updates = []
    offload = submodule(optimizer, "offload")
    adamw_update = offload.adamw_update
    monkeypatch.setattr(offload, "adamw_update", lambda items, *args, **kwargs: updates.append(len(items))
                        or adamw_update(items, *args, **kwargs))
    launched_rates = []
    launch = functional.launch_adamw_
    monkeypatch.setattr(functional, "launch_adamw_", lambda *args, **kwargs: launched_rates.append(
        kwargs.get("rates") is not None) or launch(*args, **kwargs))
    rates = [(3e-3, 0.05), (1e-3, 0.0), (5e-3, 0.2)]
    ours = [torch.randn(shape, generator=torch.Generator().manual_seed(i)) for i, shape in enumerate([37, 16, 64])]
    theirs = [param.clone() for param in ours]
    opt = Muon([dict(params=[param], use_muon=False, lr=lr, adamw_lr_scale=1.0, adamw_weight_decay=decay)
                for param, (lr, decay) in zip(ours, rates)], adamw_betas=(0.8, 0.99), adamw_eps=1e-6,
               state_dtype=state_dtype)
    ref = torch.optim.AdamW([dict(params=[param], lr=lr, weight_decay=decay) for param, (lr, decay) in
                             zip(theirs, rates)], betas=(0.8, 0.99), eps=1e-6, fused=True)
    for step in range(3):
        seeded_grads(ours, step)
        seeded_grads(theirs, step)
        opt.step()
        ref.step()
    assert updates == [3] * 3
    assert launched_rates == ([True] * 3 if adamw_path == "one Triton launch" else [])  # a pair per tensor
    for p, q in zip(ours, theirs):
        # bf16 moments: rounded at random each step, a bf16 ulp of the moments at most, well inside 1e-4 of a step.
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6 if state_dtype is None else 1e-4)


@pytest.mark.parametrize("second_group, updates", [
    (dict(lr=0.01, weight_decay=0.0), [2]),
    (dict(lr=torch.tensor(0.01)), [1, 1]),  # a tensor lr stays a tensor to the update
    (dict(adamw_betas=(0.8, 0.99)), [1, 1]),
    (dict(adamw_eps=1e-6), [1, 1]),
])
def test_which_adamw_groups_share_an_update(second_group: dict, updates: list[int],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    seen = []
    offload = submodule(optimizer, "offload")
    adamw_update = offload.adamw_update
    monkeypatch.setattr(offload, "adamw_update", lambda items, *args, **kwargs: seen.append(len(items))
                        or adamw_update(items, *args, **kwargs))
    params = [torch.nn.Parameter(torch.randn(16)) for _ in range(2)]
    opt = Muon([dict(params=params[:1], use_muon=False), dict(params=params[1:], use_muon=False, **second_group)])
    seeded_grads(params, 0)
    opt.step()
    assert seen == updates


ADAMW_SETTINGS = dict(lr=3e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.05)


def stepped_beside_fused_adamw(ours: list[torch.Tensor], steps: int, in_place_grads: bool = False
                               ) -> list[torch.Tensor]:
    """Steps `ours` as a Muon's AdamW-routed group (ADAMW_SETTINGS) and contiguous clones of them by fused
    torch.optim.AdamW, one optimizer per dtype (its kernel takes one); returns the clones."""
    theirs = [p.clone(memory_format=torch.contiguous_format) for p in ours]  # torch's CPU fused misreads views
    opt = Muon([dict(params=ours, use_muon=False)], lr=0.01, adamw_lr=ADAMW_SETTINGS["lr"],
               adamw_betas=ADAMW_SETTINGS["betas"], adamw_eps=ADAMW_SETTINGS["eps"],
               adamw_weight_decay=ADAMW_SETTINGS["weight_decay"])
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for param in theirs:
        by_dtype.setdefault(param.dtype, []).append(param)
    references = [torch.optim.AdamW(group, fused=True, **ADAMW_SETTINGS) for group in by_dtype.values()]
    for step in range(steps):
        seeded_grads(ours, step, in_place_grads)
        seeded_grads(theirs, step)
        opt.step()
        for reference in references:
            reference.step()
    return theirs


@pytest.mark.skipif(not TRITON_INTERPRETED, reason="CPU tensors in Triton kernels need the interpreter")
def test_one_launch_path_takes_contiguous_parameters_per_dtype_and_leaves_the_rest(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(functional, "ONE_LAUNCH_DEVICE_TYPES", ("cpu",))
    launches = []
    launch = functional.launch_adamw_
    monkeypatch.setattr(functional, "launch_adamw_", lambda tabulated, *args, **kwargs: launches.append(
        [tabulated.like.dtype] * (tabulated.table.numel() // tabulated.columns)) or launch(tabulated, *args, **kwargs))
    torch.manual_seed(0)
    wide, longer = torch.randn(9, 7), torch.randn(17)
    # The last two: a transposed view, and a contiguous view starting 4 bytes into its storage.
    ours = [torch.randn(37), torch.randn(5, 1), torch.randn(16).bfloat16(), wide.T, longer[1:]]
    theirs = stepped_beside_fused_adamw(ours, steps=3)
    # One launch per dtype for the contiguous, aligned ones; the two views went through torch's fused kernel.
    assert launches == [[torch.float32, torch.float32], [torch.bfloat16]] * 3
    for i in (0, 1, 3, 4):
        torch.testing.assert_close(ours[i], theirs[i], rtol=1e-6, atol=1e-6)
    # bf16: the same fp32 arithmetic, rounded once per stored value, an ulp apart at most per step (the interpreter
    # truncates its stores); an ulp is at most eps * |value|.
    bound = 3 * torch.finfo(torch.bfloat16).eps * theirs[2].float().abs()
    assert ((ours[2].float() - theirs[2].float()).abs() <= bound).all()


@pytest.mark.skipif(not TRITON_INTERPRETED, reason="CPU tensors in Triton kernels need the interpreter")
def test_one_launch_groups_kept_between_steps_step_as_fused_adamw(monkeypatch: pytest.MonkeyPatch) -> None:
    """Gradients written in place keep every tensor where it was: the launch groups and tables are built at the
    first step only (`launch_plans`), and the later steps through them still match torch's fused AdamW."""
    monkeypatch.setattr(functional, "ONE_LAUNCH_DEVICE_TYPES", ("cpu",))
    tables = []
    tabulate = functional.tabulate
    monkeypatch.setattr(functional, "tabulate", lambda tensors, *args, **kwargs: tables.append(len(tensors))
                        or tabulate(tensors, *args, **kwargs))
    torch.manual_seed(0)
    ours = [torch.randn(37), torch.randn(5, 3), torch.randn(16)]
    theirs = stepped_beside_fused_adamw(ours, steps=4, in_place_grads=True)
    assert tables == [3]
    for mine, reference in zip(ours, theirs):
        torch.testing.assert_close(mine, reference, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("count", [torch.tensor(0), torch.tensor(0.0, dtype=torch.float64)])
def test_a_step_count_set_by_hand_in_another_dtype_steps_as_torch_adamw_steps_it(count: torch.Tensor) -> None:
    """`state[p]["step"] = torch.tensor(0)` (int64) restarts AdamW's bias correction in torch's AdamW; ours failed it
    in the AdamW part, after the Muon part had updated every matrix."""
    torch.manual_seed(0)
    ours = [torch.randn(6, 5), torch.randn(5)]
    theirs = [ours[1].clone()]
    opt = Muon([dict(params=ours[:1]), dict(params=ours[1:], use_muon=False)], lr=0.01, adamw_lr=ADAMW_SETTINGS["lr"],
               adamw_betas=ADAMW_SETTINGS["betas"], adamw_eps=ADAMW_SETTINGS["eps"],
               adamw_weight_decay=ADAMW_SETTINGS["weight_decay"])
    reference = torch.optim.AdamW(theirs, fused=True, **ADAMW_SETTINGS)
    for step in range(3):
        seeded_grads(ours, step)
        theirs[0].grad = ours[1].grad.clone()
        if step == 2:
            opt.state[ours[1]]["step"] = count.clone()
            reference.state[theirs[0]]["step"] = torch.tensor(0.0)
        opt.step()
        reference.step()
    torch.testing.assert_close(ours[1], theirs[0], rtol=1e-6, atol=1e-6)
    assert opt.state[ours[1]]["step"].dtype == torch.float32 and opt.state[ours[1]]["step"].item() == 1


def test_a_bfloat16_parameters_count_loaded_past_256_counts_on_as_torch_adamws() -> None:
    """bfloat16 holds whole numbers exactly only up to 256 (301 + 1 rounds back to 300): AdamW's count is float32,
    as torch's, whatever the parameter's dtype, also where a checkpoint brings it."""
    ours = [torch.randn(40, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)]
    theirs = [ours[0].clone()]
    opt = Muon([dict(params=ours, use_muon=False)], lr=0.01, adamw_lr=ADAMW_SETTINGS["lr"],
               adamw_betas=ADAMW_SETTINGS["betas"], adamw_eps=ADAMW_SETTINGS["eps"],
               adamw_weight_decay=ADAMW_SETTINGS["weight_decay"])
    reference = torch.optim.AdamW(theirs, fused=True, **ADAMW_SETTINGS)
    for step in range(4):
        seeded_grads(ours, step)
        seeded_grads(theirs, step)
        if step == 1:
            for optimizer_ in (opt, reference):
                saved = optimizer_.state_dict()
                saved["state"][0]["step"] = torch.tensor(301.0)
                optimizer_.load_state_dict(saved)
        opt.step()
        reference.step()
    assert opt.state[ours[0]]["step"].dtype == torch.float32 and opt.state[ours[0]]["step"].item() == 304
    torch.testing.assert_close(ours[0], theirs[0], rtol=0, atol=0)


def test_adamw_update_refuses_flags_of_another_length_and_changes_nothing() -> None:
    """The functional AdamW (the offload and distributed steps call it with their own flags) takes one skip flag
    per parameter: two flags for one parameter would skip or step it by the wrong one."""
    tensors = [torch.randn(8), torch.randn(8), torch.randn(8), torch.rand(8), torch.tensor(3.0),
               torch.zeros((), dtype=torch.int64)]
    item = functional.AdamWTensors(*(tensor.clone() for tensor in tensors))
    with pytest.raises(ValueError, match=r"found_inf has shape \(2,\) for 1 parameters"):
        functional.adamw_update([item], torch.zeros(2), lr=0.1, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    for value, start in zip(vars(item).values(), tensors):
        assert torch.equal(value, start)


def test_momentum_set_by_hand_in_its_parameters_layout_steps_as_contiguous_momentum() -> None:
    """`state[w]["momentum_buffer"] = torch.zeros_like(w)` for a channels_last conv weight is channels_last: the
    momentum op refused it, after the groups before it had been updated."""
    def trained(momentum_like: Any) -> list[torch.Tensor]:
        torch.manual_seed(0)
        params = [torch.randn(8, 6), torch.randn(8, 4, 3, 3).to(memory_format=torch.channels_last)]
        opt = Muon([dict(params=params[:1], momentum=0.9), dict(params=params[1:])], lr=0.02)
        for step in range(3):
            seeded_grads(params, step)
            if step == 2:
                opt.state[params[1]]["momentum_buffer"] = momentum_like(params[1])
            opt.step()
        return params

    for mine, fresh in zip(trained(torch.zeros_like), trained(lambda w: torch.zeros(w.shape))):
        assert torch.equal(mine, fresh)


def test_state_cleared_between_steps_is_freed_before_the_next_step_makes_new_state(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`optimizer.state.clear()` to restart the moments (or free them): the step after it made the new state while the
    items it held from the step before still held the old, twice a model's state at that step's peak."""
    params = [torch.nn.Parameter(torch.randn(8, 6)), torch.nn.Parameter(torch.randn(6))]
    opt = Muon(params, lr=0.02)
    seeded_grads(params, 0)
    opt.step()
    old = [weakref.ref(value) for state in opt.state.values() for value in state.values()]
    opt.state.clear()
    alive_when_made = []
    muon_module = submodule(optimizer, "muon")
    real = muon_module.keep_moments

    def keep_moments(*args: Any, **kwargs: Any) -> None:
        alive_when_made.append(sum(ref() is not None for ref in old))
        real(*args, **kwargs)

    monkeypatch.setattr(muon_module, "keep_moments", keep_moments)
    seeded_grads(params, 1)
    opt.step()
    assert alive_when_made == [0, 0]


@pytest.mark.skipif(not TRITON_INTERPRETED, reason="CPU tensors in Triton kernels need the interpreter")
def test_kept_launch_groups_follow_state_given_new_storage(monkeypatch: pytest.MonkeyPatch) -> None:
    """Moving optimizer state to the host and back (`value.data = value.data.to(device)`, a common snippet) gives each
    state tensor new storage under the same object: the tables kept from the step before must address the new
    storage (the old is kept alive here, so that a stale table shows as moments that stop moving, not freed memory
    written)."""
    monkeypatch.setattr(functional, "ONE_LAUNCH_DEVICE_TYPES", ("cpu",))
    torch.manual_seed(0)
    ours = [torch.randn(37), torch.randn(5, 3)]
    theirs = [p.clone() for p in ours]
    opt = Muon([dict(params=ours, use_muon=False)], lr=0.01, adamw_lr=ADAMW_SETTINGS["lr"],
               adamw_betas=ADAMW_SETTINGS["betas"], adamw_eps=ADAMW_SETTINGS["eps"],
               adamw_weight_decay=ADAMW_SETTINGS["weight_decay"])
    reference = torch.optim.AdamW(theirs, fused=True, **ADAMW_SETTINGS)
    old_storage = []
    for step in range(4):
        seeded_grads(ours, step, in_place=True)  # the gradients stay where they were: the tables are kept
        seeded_grads(theirs, step)
        opt.step()
        reference.step()
        for value in (value for state in opt.state.values() for value in state.values()):
            old_storage.append(value.data)
            value.data = value.data.clone()
    for mine, its in zip(ours, theirs):
        torch.testing.assert_close(mine, its, rtol=1e-6, atol=1e-6)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(opt.state[mine][key], reference.state[its][key], rtol=1e-6, atol=1e-6)


@pytest.mark.skipif(not TRITON_INTERPRETED, reason="CPU tensors in Triton kernels need the interpreter")
def test_kept_launch_groups_keep_no_parameter_or_moment_alive(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(functional, "ONE_LAUNCH_DEVICE_TYPES", ("cpu",))
    params = [torch.nn.Parameter(torch.randn(37)), torch.nn.Parameter(torch.randn(16).bfloat16())]
    seeded_grads(params, 0)
    opt = Muon([dict(params=params, use_muon=False)], lr=0.01)
    opt.step()
    refs = [weakref.ref(tensor) for param in params for tensor in (param, *opt.state[param].values())]
    del opt, params
    gc.collect()
    assert all(ref() is None for ref in refs)


@pytest.mark.skipif(not TRITON_INTERPRETED, reason="CPU tensors in Triton kernels need the interpreter")
@pytest.mark.parametrize(("launcher", "error"), [
    # As a Triton that cannot compile the kernel for this GPU raises, before anything is written.
    ("launch_adamw_", "PTX assembly failed"),
    # After the first group's update is written: its counts then move by torch's ops.
    ("launch_counts_", "out of resources"),
])
def test_a_one_launch_kernel_that_fails_hands_adamw_to_torch_once_and_for_all(
        launcher: str, error: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(functional, "ONE_LAUNCH_DEVICE_TYPES", ("cpu",))
    monkeypatch.setattr(functional, "_one_launch_failed", set())
    attempts = []

    def failing_launch(*args, **kwargs) -> None:
        attempts.append(1)
        raise RuntimeError(error)

    monkeypatch.setattr(functional, launcher, failing_launch)
    torch.manual_seed(0)
    # Two launch groups (float32, bfloat16); three steps' bias corrections check every step count.
    ours = [torch.randn(37), torch.randn(16).bfloat16(), torch.randn(5, 3)]
    with pytest.warns(RuntimeWarning, match=f"one-launch Triton kernel of the step failed on cpu.*{error}"):
        theirs = stepped_beside_fused_adamw(ours, steps=3)
    assert attempts == [1]  # tried once; the failure is remembered
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(("triton", "capturing", "expected"), [(True, False, True), (True, True, False),
                                                               (False, False, False)])
def test_one_launch_path_serves_cuda_with_triton_and_never_a_graph_capture(
        monkeypatch: pytest.MonkeyPatch, triton: bool, capturing: bool, expected: bool) -> None:
    monkeypatch.setattr(functional, "TRITON_AVAILABLE", triton)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing)
    assert functional.one_launch_serves("cuda") is expected
    assert functional.one_launch_serves("cpu") is False


@pytest.mark.parametrize("move_lr", ["hand-set", "ReduceLROnPlateau", "OneCycleLR"])
def test_adamw_lr_moves_with_lr_by_the_same_factor(move_lr: str) -> None:
    # adamw_lr=1e-3 at lr=0.02: AdamW runs at lr / 20 whatever moves lr.
    vector = torch.zeros(16)
    opt = Muon([dict(params=[vector], use_muon=False)], lr=0.02, adamw_lr=1e-3, weight_decay=0.0)
    if move_lr == "ReduceLROnPlateau":
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.1, patience=0)
        for _ in range(3):
            plateau.step(1.0)  # no improvement: lr is cut
    elif move_lr == "OneCycleLR":
        cycle = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=10)
        for _ in range(3):
            opt.step()  # no gradient yet, so nothing moves; the scheduler expects a step before each of its own
            cycle.step()
    else:
        opt.param_groups[0]["lr"] = 0.005
    lr = opt.param_groups[0]["lr"]
    assert lr != 0.02
    vector.grad = torch.ones_like(vector)
    before = vector.clone()
    opt.step()
    torch.testing.assert_close((before - vector).mean().item(), lr / 20, rtol=1e-5, atol=0)


def test_an_old_checkpoint_with_an_absolute_adamw_lr_keeps_its_ratio_to_lr() -> None:
    # Before adamw_lr_scale, groups kept adamw_lr and schedulers scaled it from `initial_lr`: 1e-3 at 0.02.
    vector = torch.zeros(16)
    opt = Muon([dict(params=[vector], use_muon=False)], lr=0.02, weight_decay=0.0)
    saved = copy.deepcopy(opt.state_dict())
    group = saved["param_groups"][0]
    del group["adamw_lr_scale"]
    group.update(adamw_lr=1e-3, initial_lr=0.02, lr=0.01)
    opt.load_state_dict(saved)
    assert opt.param_groups[0]["adamw_lr_scale"] == pytest.approx(0.05) and "adamw_lr" not in opt.param_groups[0]
    vector.grad = torch.ones_like(vector)
    opt.step()
    torch.testing.assert_close(-vector.mean().item(), 0.01 * 0.05, rtol=1e-5, atol=0)


def test_adamw_lr_and_adamw_lr_scale_are_one_option() -> None:
    with pytest.raises(ValueError, match="adamw_lr"):
        Muon([torch.randn(4)], lr=0.02, adamw_lr=1e-3, adamw_lr_scale=0.5)
    with pytest.raises(ValueError, match="adamw_lr"):
        Muon([torch.randn(4)], lr=0.0, adamw_lr=1e-3)


def test_strided_adamw_parameters_get_adamws_update_and_nothing_beside_them_changes() -> None:
    # torch's CPU fused AdamW walks a strided view as if it were contiguous: a wrong update, and writes beside it.
    base, weight_base = torch.randn(6, 5), torch.randn(9, 7)
    column = base[:, 1]  # a 1D view with stride 5: AdamW
    transposed = weight_base.T  # (7, 9), routed to AdamW by its group
    opt = Muon([dict(params=[column]), dict(params=[transposed], use_muon=False)], lr=0.01, adamw_betas=(0.8, 0.99))
    reference = [column.clone(), transposed.clone()]
    ref = torch.optim.AdamW(reference, lr=0.01, betas=(0.8, 0.99), weight_decay=0.1, foreach=False)
    base_before, weight_before = base.clone(), weight_base.clone()
    for step in range(3):
        seeded_grads([column, transposed], step)
        for ours, theirs in zip((column, transposed), reference):
            theirs.grad = ours.grad.clone()
        opt.step()
        ref.step()
    for ours, theirs in zip((column, transposed), reference):
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
    untouched = torch.ones_like(base, dtype=torch.bool)
    untouched[:, 1] = False
    assert torch.equal(base[untouched], base_before[untouched])
    assert not torch.equal(weight_base, weight_before) and torch.equal(weight_base.T, transposed)


def test_lr_scheduler_scales_adamw_lr_too() -> None:
    weight, bias = torch.randn(16, 16), torch.randn(16)
    bias_ref = bias.clone()
    opt = Muon([weight, bias], lr=0.02, adamw_lr=1e-3, weight_decay=0.0)
    ref = torch.optim.AdamW([bias_ref], lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    schedules = [torch.optim.lr_scheduler.LambdaLR(o, lambda step: 1.0 / (step + 1)) for o in (opt, ref)]
    for step in range(4):
        seeded_grads([weight, bias], step)
        bias_ref.grad = bias.grad.clone()
        opt.step()
        ref.step()
        for schedule in schedules:
            schedule.step()
    torch.testing.assert_close(bias, bias_ref, rtol=1e-6, atol=1e-6)


# --- against the SVD polar factor: every way a parameter becomes matrices ---------------------------------------

def one_step_update(param: torch.Tensor, grad: torch.Tensor, **options) -> torch.Tensor:
    """The first step from zero momentum without Nesterov orthogonalizes (1 - momentum) * grad exactly."""
    param = param.clone()
    param.grad = grad
    opt = Muon([dict(params=[param], use_muon=True, **options)], lr=1.0, weight_decay=0.0, momentum=0.5, nesterov=False,
               ns_steps=10, ns_dtype=torch.float64, adjust_lr_fn=None)
    before = param.clone()
    opt.step()
    return before - param


# Ten Polar Express steps in float64 take every singular value above l = 1e-3 (relative to the Frobenius norm)
# to 1 within ~1e-2 * safety; random Gaussian matrices of these sizes have sigma_min / ||G||_F well above 1e-3.
POLAR_TOL = dict(rtol=0, atol=2e-2)


def test_2d_update_is_polar_factor() -> None:
    grad = torch.randn(40, 24, dtype=torch.float64)
    torch.testing.assert_close(one_step_update(torch.zeros_like(grad), grad), polar_factor(grad), **POLAR_TOL)


@pytest.mark.parametrize("ns_algorithm", ["gram", "auto"])
@pytest.mark.parametrize("shape", [(40, 120), (120, 40), (3, 40, 120)])
def test_gram_newton_schulz_updates_are_polar_factors_too(ns_algorithm: str, shape: tuple[int, ...]) -> None:
    grad = torch.randn(shape, dtype=torch.float64)
    update = one_step_update(torch.zeros_like(grad), grad, ns_algorithm=ns_algorithm)
    torch.testing.assert_close(update, torch.stack([polar_factor(g) for g in grad.reshape(-1, *shape[-2:])])
                               .reshape(shape), **POLAR_TOL)
    standard = one_step_update(torch.zeros_like(grad), grad, ns_algorithm="standard")
    assert not torch.equal(update, standard)  # the option reached the iteration: its rounding differs


@pytest.mark.parametrize("ns_algorithm", ["standard", "gram"])
def test_aol_preconditioned_updates_are_the_functions_result(ns_algorithm: str) -> None:
    grad = torch.randn(3, 16, 40, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    update = one_step_update(torch.zeros_like(grad), grad, preconditioner="aol", ns_algorithm=ns_algorithm)
    expected = optimizer.zeropower(0.5 * grad, 10, dtype=torch.float64, algorithm=ns_algorithm, preconditioner="aol")
    torch.testing.assert_close(update, expected, rtol=0, atol=1e-12)
    # AOL's result is the polar factor of the matrix with each row scaled by (|X X^T| 1)^(-1/2) (Turbo-Muon's
    # definition), which differs from X's own by up to ~0.03 per entry on such Gaussian matrices; ten float64 steps
    # reach it to rounding.
    row_scales = (grad @ grad.mT).abs().sum(-1, keepdim=True).rsqrt()
    torch.testing.assert_close(update, torch.stack([polar_factor(g) for g in row_scales * grad]), rtol=0, atol=1e-10)
    assert not torch.equal(update, one_step_update(torch.zeros_like(grad), grad, ns_algorithm=ns_algorithm))
    with pytest.raises(ValueError, match=r"Invalid preconditioner: 'jacobi'"):
        Muon([torch.randn(4, 8)], preconditioner="jacobi")


def test_an_unknown_ns_algorithm_is_refused() -> None:
    with pytest.raises(ValueError, match=r"Invalid ns_algorithm: 'newton'.*'standard', 'gram', 'auto'"):
        Muon([torch.randn(4, 8)], ns_algorithm="newton")


def test_normalize_spatial_scales_batched_positions_only() -> None:
    # timm's normalize_spatial: in "batched" mode each kernel position's update is divided by sqrt(positions).
    grad = torch.randn(16, 8, 3, 3, dtype=torch.float64)
    plain = one_step_update(torch.zeros_like(grad), grad, conv_mode="batched")
    torch.testing.assert_close(one_step_update(torch.zeros_like(grad), grad, conv_mode="batched",
                                               normalize_spatial=True), plain / 3, rtol=1e-12, atol=0)
    flat = one_step_update(torch.zeros_like(grad), grad, conv_mode="flatten")
    assert torch.equal(one_step_update(torch.zeros_like(grad), grad, normalize_spatial=True), flat)
    with pytest.raises(ValueError, match="Invalid normalize_spatial: 1"):
        Muon([grad.clone()], normalize_spatial=1)


def test_conv_flatten_and_batched_modes() -> None:
    grad = torch.randn(16, 8, 3, 3, dtype=torch.float64)
    flat = one_step_update(torch.zeros_like(grad), grad, conv_mode="flatten")
    torch.testing.assert_close(flat, polar_factor(grad.reshape(16, 72)).reshape(grad.shape), **POLAR_TOL)
    batched = one_step_update(torch.zeros_like(grad), grad, conv_mode="batched")
    for i in range(3):
        for j in range(3):
            torch.testing.assert_close(batched[:, :, i, j], polar_factor(grad[:, :, i, j]), **POLAR_TOL)


def test_expert_bank_and_conv1d_layouts() -> None:
    grad = torch.randn(4, 20, 12, dtype=torch.float64)
    experts = one_step_update(torch.zeros_like(grad), grad)
    for e in range(4):
        torch.testing.assert_close(experts[e], polar_factor(grad[e]), **POLAR_TOL)
    conv1d = one_step_update(torch.zeros_like(grad), grad, param_layout="conv")
    torch.testing.assert_close(conv1d, polar_factor(grad.reshape(4, 240)).reshape(grad.shape), **POLAR_TOL)


@pytest.mark.parametrize("batch", [(), (3,)], ids=["matrix", "expert bank"])
@pytest.mark.parametrize("options", [dict(adjust_lr_fn="original"), dict(adjust_lr_fn="spectral"),
                                     dict(normalization="neuron"), dict(normalization="neuron", nesterov=False)],
                         ids=["original", "spectral", "NorMuon", "NorMuon-plain"])
def test_a_transposed_layout_steps_each_matrix_as_its_out_in_twin_does(batch: tuple[int, ...],
                                                                       options: dict[str, Any]) -> None:
    """Weights stored (in, out) (transformers' Conv1D) with param_layout="transposed" train as their (out, in)
    transposes do: the shape-dependent lr scales read out = 20, in = 12, and NorMuon's second moment is kept per
    output neuron (the last dim here). Read as (out, in) = (12, 20), both went the other way."""
    torch.manual_seed(0)
    stored = torch.randn(*batch, 12, 20, dtype=torch.float64)  # (..., in, out)
    twin = stored.mT.contiguous()  # (..., out, in), laid out as nn.Linear keeps it
    layout = "experts" if batch else "auto"
    settings = dict(lr=0.02, momentum=0.9, ns_dtype=torch.float64, **options)
    ours = Muon([dict(params=[stored], param_layout="transposed")], **settings)
    theirs = Muon([dict(params=[twin], param_layout=layout)], **settings)
    for _ in range(3):
        grad = torch.randn_like(twin)
        twin.grad, stored.grad = grad, grad.mT.contiguous()
        ours.step()
        theirs.step()
    torch.testing.assert_close(stored.mT, twin, rtol=1e-12, atol=1e-14)
    if "normalization" in options:
        assert ours.state[stored]["update_sq"].shape == tuple(theirs.state[twin]["update_sq"].mT.shape)


def _stacks_orthogonalized(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """The shapes of the stacks the optimizer's Newton-Schulz is called on, as it is called."""
    shapes: list[tuple[int, ...]] = []
    real = functional.Orthogonalizer.__call__

    def recording(self: Any, matrices: torch.Tensor, *args: Any) -> torch.Tensor:
        shapes.append(tuple(matrices.shape))
        return real(self, matrices, *args)
    monkeypatch.setattr(functional.Orthogonalizer, "__call__", recording)
    return shapes


@pytest.mark.parametrize("second_group, shared", [
    (dict(lr=0.01, weight_decay=0.0), True),
    (dict(lr=torch.tensor(0.01)), False),  # a tensor lr stays a tensor to the update
    (dict(momentum=0.8), False),
    (dict(ns_steps=4), False),
    (dict(adjust_lr_fn="original"), False),
])
def test_groups_that_differ_only_in_lr_and_weight_decay_share_buckets(second_group: dict, shared: bool,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    shapes = _stacks_orthogonalized(monkeypatch)
    params = [torch.nn.Parameter(torch.randn(16, 24)) for _ in range(4)]
    opt = Muon([dict(params=params[:2]), dict(params=params[2:], **second_group)], lr=0.02, ns_dtype=torch.float32)
    seeded_grads(params, 0)
    opt.step()
    assert shapes == ([(4, 16, 24)] if shared else [(2, 16, 24), (2, 16, 24)])


def test_same_shape_parameters_share_one_batched_call(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _stacks_orthogonalized(monkeypatch)
    params = [torch.randn(32, 48) for _ in range(5)] + [torch.randn(48, 32) for _ in range(2)]
    seeded_grads(params, 0)
    Muon(params).step()
    assert sorted(calls) == [(2, 48, 32), (5, 32, 48)]


@pytest.mark.parametrize("bucket_numel, layout, batches", [
    (None, "7", [7]), (7 * 1536, "7", [7]), (7 * 1536 - 1, "7", [4, 3]), (3 * 1536, "7", [3, 2, 2]),
    (1536, "7", [1] * 7), (1, "7", [1] * 7), (2 * 1536, "2+bank+1", [2, 4, 1]), (None, "2+bank+1", [7])])
def test_large_buckets_run_in_near_equal_chunks(bucket_numel: int | None, layout: str, batches: list[int],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    # (32, 48) matrices, 1536 entries each, and maybe an expert bank of four between them: the fewest chunks of at
    # most _BUCKET_NUMEL entries, in the parameters' order, near-equal; the bank, larger than a chunk, stays whole.
    if bucket_numel is not None:
        monkeypatch.setattr(functional, "_BUCKET_NUMEL", {"cpu": bucket_numel})
    stacks = _stacks_orthogonalized(monkeypatch)
    shapes = [(32, 48)] * 7 if layout == "7" else [(32, 48), (32, 48), (4, 32, 48), (32, 48)]
    params = [torch.randn(shape) for shape in shapes]
    seeded_grads(params, 0)
    Muon(params).step()
    assert [stack[0] for stack in stacks] == batches


@pytest.mark.parametrize("round_numel, rounds", [(None, 1), (32 * 48 * 3, 2), (0, 3)])
def test_small_buckets_share_the_calls_of_a_round(round_numel: int | None, rounds: int,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    # Three buckets: 3 x (32, 48), (48, 32), (16, 16). A round takes one momentum call and one update call for all
    # of its parameters; buckets join a round while their stacks fit in _ROUND_NUMEL elements in all.
    if round_numel is not None:
        monkeypatch.setattr(functional, "_ROUND_NUMEL", round_numel)
    native = sys.modules[f"{optimizer.__name__}.native"]
    calls: dict[str, list[int]] = {"muon_momentum_": [], "apply_update_": []}
    for name in calls:
        real = getattr(native, name)

        def counting(*args, _real=real, _name=name, **kwargs):
            calls[_name].append(len(args[0]))
            return _real(*args, **kwargs)

        monkeypatch.setattr(native, name, counting)
    shapes = [(32, 48), (48, 32), (32, 48), (16, 16), (32, 48)]
    params = [torch.randn(shape) for shape in shapes]
    seeded_grads(params, 0)
    Muon(params, weight_decay=0.1).step()
    expected = {1: [5], 2: [3, 2], 3: [3, 1, 1]}[rounds]
    assert calls == {"muon_momentum_": expected, "apply_update_": expected}


def test_ns_dtype_none_follows_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    dtypes: list[torch.dtype] = []
    real = functional.Orthogonalizer.__call__

    def recording(self, matrices, workspace=None):
        dtypes.append(self.dtype)
        return real(self, matrices, workspace)

    monkeypatch.setattr(functional.Orthogonalizer, "__call__", recording)
    param = torch.randn(8, 8)
    seeded_grads([param], 0)
    Muon([param]).step()
    # bf16 where the CPU has AMX bf16 tiles or AVX512-BF16 on AMD cores, else fp32: the rule itself is tested with
    # faked CPU flags in test_precision.py.
    precision = submodule(optimizer, "precision")
    if precision.onednn_isa_cap():
        pytest.skip("oneDNN is capped here: the units it may use are not the CPU's")
    amd = precision.cpu_vendor() == "AuthenticAMD"
    bf16_units = torch.cpu._is_amx_tile_supported() or (torch.cpu._is_avx512_bf16_supported() and amd)
    assert dtypes == [torch.bfloat16 if bf16_units else torch.float32]


@pytest.mark.parametrize("spike", [None, 3e5])
def test_float16_newton_schulz_neither_overflows_nor_vanishes(spike: float | None) -> None:
    # float16 tops out at 65504. The first momentum step (momentum 0.5) halves the gradient: every element stays
    # below that, but the Frobenius norm (~7.7e4) does not, and the spike (1.5e5) does not either. Scaled in float32
    # before the cast, the update is float64's within float16 rounding (measured 0.2% relative; bfloat16, with 8x
    # float16's unit roundoff, measured 1.2-1.6%).
    grad = torch.randn(128, 128, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) * 1200
    if spike is not None:
        grad[3, 4] = spike
    reference = one_step_update(torch.zeros_like(grad), grad)
    param = torch.zeros_like(grad)
    param.grad = grad
    opt = Muon([dict(params=[param], use_muon=True)], lr=1.0, weight_decay=0.0, momentum=0.5, nesterov=False,
               ns_steps=10, ns_dtype=torch.float16, adjust_lr_fn=None)
    opt.step()
    assert opt.nonfinite_skips() == 0 and torch.isfinite(param).all()
    assert ((-param - reference).norm() / reference.norm()).item() < 0.01


@pytest.mark.parametrize("ns_dtype, within", [(torch.float32, 1e-3), (torch.bfloat16, 0.03)], ids=str)
def test_a_float64_gradient_beyond_float32s_range_trains_as_its_scaled_copy(ns_dtype: torch.dtype,
                                                                           within: float) -> None:
    # Cast to the iteration's dtype before its norm scaled it, the momentum's entries became inf and the parameter
    # NaN, with no skip counted. The update does not depend on the gradient's scale.
    grad = torch.randn(64, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) * 1e40
    reference = one_step_update(torch.zeros_like(grad), grad)
    param = torch.zeros_like(grad)
    param.grad = grad
    opt = Muon([dict(params=[param], use_muon=True)], lr=1.0, weight_decay=0.0, momentum=0.5, nesterov=False,
               ns_steps=10, ns_dtype=ns_dtype, adjust_lr_fn=None)
    opt.step()
    assert opt.nonfinite_skips() == 0 and torch.isfinite(param).all()
    assert ((-param - reference).norm() / reference.norm()).item() < within


def test_adjust_lr_fns_scale_the_update() -> None:
    grad = torch.randn(12, 48, dtype=torch.float64)
    base = one_step_update(torch.zeros_like(grad), grad)
    scales = {"original": 1.0, "match_rms_adamw": 0.2 * math.sqrt(48), "spectral": math.sqrt(12 / 48),
              "rms_to_rms": math.sqrt(12 / 48), "rsqrt_in": 1 / math.sqrt(48)}  # timm's names: sqrt(out/in), 1/sqrt(in)
    for name, scale in scales.items():
        torch.testing.assert_close(one_step_update(torch.zeros_like(grad), grad, adjust_lr_fn=name), base * scale)


# --- timm's spellings ------------------------------------------------------------------------------------------

def test_a_timm_config_steps_as_the_same_config_in_our_spelling() -> None:
    # timm's Muon: `betas` and `fallback_lr_scale` belong to its AdamW fallback, `use_fallback=True` routes a group
    # there, "rms_to_rms" is sqrt(out/in).
    def trained(fallback: dict, **options) -> tuple[list[torch.Tensor], "optimizer.Muon"]:
        params = [torch.randn(shape, generator=torch.Generator().manual_seed(i))
                  for i, shape in enumerate([(12, 48), (48,), (12, 48)])]
        opt = Muon([dict(params=params[:2]), dict(params=params[2:], **fallback)], lr=0.02, **options)
        for seed in range(3):
            seeded_grads(params, seed)
            opt.step()
        return params, opt

    timm_params, timm_style = trained(dict(use_fallback=True), betas=(0.8, 0.9), fallback_lr_scale=0.5,
                                      adjust_lr_fn="rms_to_rms")
    our_params, ours = trained(dict(use_muon=False), adamw_betas=(0.8, 0.9), adamw_lr_scale=0.5,
                               adjust_lr_fn="spectral")
    assert all(torch.equal(theirs, mine) for theirs, mine in zip(timm_params, our_params))
    assert timm_style.state_dict()["param_groups"] == ours.state_dict()["param_groups"]  # kept in our spelling


def test_timms_use_fallback_false_routes_by_shape_as_no_key_does() -> None:
    # It was read as use_muon=True: a group with a bias was refused, and a 2 x 300 matrix (aspect 150, which shape
    # routing gives AdamW, in timm and here) trained with Muon.
    matrix, bias, thin = torch.randn(12, 48), torch.randn(12), torch.randn(2, 300)
    opt = Muon([dict(params=[matrix, bias], use_fallback=False), dict(params=[thin], use_fallback=False)])
    assert [group["use_muon"] for group in opt.param_groups] == [None, None]
    seeded_grads([matrix, bias, thin], 0)
    opt.step()
    assert [set(opt.state[p]) >= {"momentum_buffer"} for p in (matrix, bias, thin)] == [True, False, False]


def test_a_checkpoint_with_timm_keys_loads_in_our_spelling() -> None:
    param = torch.randn(8, 8)
    opt = Muon([param], lr=0.02)
    saved = opt.state_dict()
    group = saved["param_groups"][0]
    group["betas"], group["fallback_lr_scale"] = group.pop("adamw_betas"), group.pop("adamw_lr_scale")
    group["betas"] = (0.5, 0.6)
    opt.load_state_dict(saved)
    assert opt.param_groups[0]["adamw_betas"] == (0.5, 0.6) and "betas" not in opt.param_groups[0]


@pytest.mark.parametrize("group, message", [
    (dict(betas=(0.9, 0.99), adamw_betas=(0.9, 0.95)), r"Invalid betas: \(0.9, 0.99\) given with adamw_betas"),
    (dict(fallback_lr_scale=0.1, adamw_lr_scale=0.2), r"Invalid fallback_lr_scale: 0.1 given with adamw_lr_scale"),
    (dict(use_fallback=True, use_muon=True), r"Invalid use_fallback: True given with use_muon=True"),
    (dict(use_fallback=True, use_muon=False), r"Invalid use_fallback: True given with use_muon=False"),
    (dict(algo="adamuon", normalization="element"), r"Invalid algo: 'adamuon' given with normalization='element'"),
    (dict(use_fallback="yes"), r"Invalid use_fallback: 'yes'"),
    (dict(use_fallback=0), r"Invalid use_fallback: 0 \(expected True or False\)"),
    (dict(use_fallback=np.True_), r"Invalid use_fallback: np.True_"),
])
def test_timm_and_our_name_for_one_option_are_not_both_given(group: dict, message: str) -> None:
    opt = Muon([torch.randn(4, 4)])
    with pytest.raises(ValueError, match=message):
        opt.add_param_group(dict(params=[torch.randn(4, 4)], **group))
    assert len(opt.param_groups) == 1


def composed_polar_express(singular_values: torch.Tensor, steps: int) -> torch.Tensor:
    for a, b, c in optimizer.polar_express_coefficients(steps):
        singular_values = a * singular_values + b * singular_values**3 + c * singular_values**5
    return singular_values


@pytest.mark.parametrize("shape", [(16, 40), (40, 16)])
@pytest.mark.parametrize("options, tiny", [(dict(safety_factor=1.05), False), (dict(scale_eps=True), True),
                                           (dict(scale_eps=True, safety_factor=1.2), False)])
def test_timms_initial_scalings_follow_their_formulas(shape: tuple[int, int], options: dict, tiny: bool) -> None:
    # timm: X0 = G / (‖G‖ safety_factor), clamped below by eps; with scale_eps, eps sqrt(in / out) is added instead
    # (arXiv 2512.05620). The truth: U p(S / that denominator) Vᵀ from G's SVD in float64, p the composed schedule.
    G = torch.randn(shape, dtype=torch.float64) * (1e-9 if tiny else 1.0)
    eps = 1e-7
    u, singular_values, vh = torch.linalg.svd(G, full_matrices=False)
    norm = singular_values.norm() * options.get("safety_factor", 1.0)
    denominator = norm + eps * math.sqrt(shape[1] / shape[0]) if options.get("scale_eps") else max(norm, eps)
    expected = (u * composed_polar_express(singular_values / denominator, 5)) @ vh
    out = optimizer.zeropower(G, 5, dtype=torch.float64, eps=eps, **options)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-10)
    update = one_step_update(torch.zeros_like(G), G / 0.5, ns_steps=5, **options)  # (1 - momentum) G enters
    torch.testing.assert_close(update, expected, rtol=0, atol=1e-10)


@pytest.mark.parametrize("options, message", [(dict(safety_factor=0.5), r"Invalid safety_factor: 0.5"),
                                              (dict(safety_factor=float("inf")), r"Invalid safety_factor: inf"),
                                              (dict(scale_eps="yes"), r"Invalid scale_eps: 'yes'"),
                                              (dict(capturable=1), r"Invalid capturable: 1"),
                                              (dict(verbose="loud"), r"Invalid verbose: 'loud'")])
def test_bad_timm_options_are_refused(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Muon([torch.randn(4, 8)], **options)


def test_a_capturable_step_does_not_read_tensor_option_values() -> None:
    # Reading a tensor lr's value is a host sync, which a CUDA graph cannot hold: a capturable group's step takes it
    # on trust, as torch's capturable optimizers do; a plain group's step checks it.
    for capturable in (False, True):
        param = torch.randn(8, 12)
        opt = Muon([param], lr=torch.tensor(0.01), capturable=capturable)
        opt.param_groups[0]["lr"].fill_(-1.0)
        param.grad = torch.randn(8, 12)
        if capturable:
            opt.step()
        else:
            with pytest.raises(ValueError, match="Invalid learning rate"):
                opt.step()


def test_verbose_logs_each_parameters_route(caplog: pytest.LogCaptureFixture) -> None:
    model = nn.Sequential(nn.Linear(16, 8), nn.Linear(8, 200))
    with caplog.at_level("INFO"):
        Muon(model.named_parameters(), verbose=True)
    routes = [record.getMessage() for record in caplog.records]
    assert any("0.weight (8, 16) -> Muon: 1 matrix(es) of 8x16" in line for line in routes), routes
    assert any("0.bias (8,) -> AdamW: not a matrix Muon trains" in line for line in routes), routes
    assert len(routes) == 4
    caplog.clear()
    with caplog.at_level("INFO"):
        Muon(model.parameters())
    assert not caplog.records


# --- non-finite and zero gradients ---------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nonfinite_gradient_leaves_parameter_and_state_unchanged(bad: float, adamw_path: str) -> None:
    params = [torch.randn(8, 8), torch.randn(8, 8), torch.randn(8), torch.randn(8)]
    opt = Muon(params, lr=0.1)
    seeded_grads(params, 0)
    opt.step()  # create state
    before = [p.clone() for p in params]
    state_before = [{k: v.clone() for k, v in opt.state[p].items()} for p in params]
    seeded_grads(params, 1)
    params[0].grad[3, 4] = bad
    params[2].grad[5] = bad
    opt.step()
    for i in (0, 2):
        assert torch.equal(params[i], before[i])
        for key, value in state_before[i].items():
            if key != "nonfinite_skips":
                assert torch.equal(opt.state[params[i]][key], value), key
    for i in (1, 3):
        assert not torch.equal(params[i], before[i])
    assert opt.nonfinite_skips() == 2
    assert int(opt.state[params[0]]["nonfinite_skips"]) == 1


@pytest.mark.parametrize("case", ["inf and -inf", "-inf", "nan in float64", "float16 beyond its range in sum",
                                  "float64 beyond float32's range"])
def test_the_guard_flags_exactly_the_nonfinite_adamw_gradients(case: str) -> None:
    # The guard sums each gradient: what it must still catch (a +inf and a -inf make a NaN sum), and finite gradients
    # whose sum leaves the gradient dtype's range, which must step exactly as torch.optim.AdamW steps them.
    dtype = {"float16 beyond its range in sum": torch.float16, "nan in float64": torch.float64,
             "float64 beyond float32's range": torch.float64}.get(case, torch.float32)
    grad = torch.randn(64, generator=torch.Generator().manual_seed(0)).to(dtype)
    if case == "inf and -inf":
        grad[3], grad[9] = float("inf"), -float("inf")
    elif case == "-inf":
        grad[3] = -float("inf")
    elif case == "nan in float64":
        grad[3] = float("nan")
    elif case == "float16 beyond its range in sum":
        grad.fill_(60000.0)  # each element finite in float16; their sum (3.8e6) is not
    else:
        grad[3] = 1e200
    ours = torch.randn(64, generator=torch.Generator().manual_seed(1)).to(dtype)
    reference = ours.clone()
    before = ours.clone()
    ours.grad, reference.grad = grad.clone(), grad.clone()
    opt = Muon([ours], lr=0.1)
    opt.step()
    if "inf" in case or "nan" in case:
        assert torch.equal(ours, before) and opt.nonfinite_skips() == 1
        return
    torch.optim.AdamW([reference], lr=0.1, betas=(0.9, 0.95), weight_decay=0.1, fused=True).step()
    assert opt.nonfinite_skips() == 0
    torch.testing.assert_close(ours, reference, equal_nan=True)


@pytest.mark.parametrize("flags_from", ["the step", "clip_grad_norm_"])
def test_a_group_split_between_the_cpu_op_and_torch_s_kernel_skips_exactly_the_nonfinite(flags_from: str,
                                                                                       adamw_path: str) -> None:
    # float32 and bfloat16 go through the compiled adamw_checked_ (where the build has it), float64 through torch's
    # fused kernel; an Inf in one of each kind: those two keep their values and state, the others step as fused
    # torch.optim.AdamW steps them, whether the step checks the gradients or takes the clip's flags (the clip's
    # total norm is then Inf: it scales every gradient by 0, as torch's does, and the Inf ones become NaN).
    dtypes = [torch.float32, torch.float64, torch.bfloat16, torch.float64, torch.float32]
    ours = [torch.randn(300, generator=torch.Generator().manual_seed(i)).to(dtype) for i, dtype in enumerate(dtypes)]
    theirs = [p.clone() for p in ours[:3]]
    before = [p.clone() for p in ours]
    seeded_grads(ours, 7)
    for param, twin in zip(ours, theirs):
        twin.grad = param.grad.clone() if flags_from == "the step" else torch.zeros_like(param)
    ours[3].grad[17] = float("inf")
    ours[4].grad[299] = -float("inf")
    opt = Muon([dict(params=ours, use_muon=False)], lr=0.01, adamw_lr=ADAMW_SETTINGS["lr"],
               adamw_betas=ADAMW_SETTINGS["betas"], adamw_eps=ADAMW_SETTINGS["eps"],
               adamw_weight_decay=ADAMW_SETTINGS["weight_decay"])
    if flags_from == "clip_grad_norm_":
        opt.clip_grad_norm_(1.0)
    opt.step()
    for twin in theirs:
        torch.optim.AdamW([twin], fused=True, **ADAMW_SETTINGS).step()
    assert opt.nonfinite_skips() == 2
    for i in (3, 4):
        assert torch.equal(ours[i], before[i])
        assert float(opt.state[ours[i]]["step"]) == 0.0 and not opt.state[ours[i]]["exp_avg"].any()
    for param, twin in zip(ours, theirs):
        assert float(opt.state[param]["step"]) == 1.0
        # bf16: an ulp apart at most (the Triton interpreter truncates its stores)
        rtol = torch.finfo(torch.bfloat16).eps if param.dtype == torch.bfloat16 else 1e-6
        torch.testing.assert_close(param, twin, rtol=rtol, atol=1e-6)


def test_zero_gradient_gives_finite_zero_update() -> None:
    param, vector = torch.randn(8, 8), torch.randn(8)
    before = param.clone()
    param.grad, vector.grad = torch.zeros_like(param), torch.zeros_like(vector)
    Muon([param, vector], lr=0.1, weight_decay=0.0).step()
    assert torch.equal(param, before)
    assert torch.isfinite(vector).all()


# --- bad input: a clear error and nothing changed --------------------------------------------------------------

def test_sparse_and_complex_gradients_raise_before_any_update() -> None:
    dense, embedding = torch.randn(8, 8), torch.randn(10, 4)
    opt = Muon([dense, embedding])
    seeded_grads([dense], 0)
    embedding.grad = torch.randn(10, 4).to_sparse()
    before = dense.clone()
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()
    assert torch.equal(dense, before) and not opt.state[dense]
    complex_param = torch.randn(4, 4, dtype=torch.complex64)
    complex_param.grad = torch.randn(4, 4, dtype=torch.complex64)
    with pytest.raises(RuntimeError, match="complex"):
        Muon([complex_param]).step()


@pytest.mark.parametrize("shape", [(8, 8), (8,)], ids=["matrix", "vector"])
def test_a_gradient_on_an_integer_parameter_is_refused_before_any_update(shape: tuple[int, ...]) -> None:
    """Set by hand (autograd makes none): other parameters stepped first, then a kernel refused it part way, and its
    integer moments stayed in a state a fresh optimizer would not load."""
    dense, counts = torch.randn(8, 8), torch.zeros(shape, dtype=torch.int64)
    opt = Muon([dense, counts])
    seeded_grads([dense], 0)
    counts.grad = torch.ones_like(counts)
    before = dense.clone()
    with pytest.raises(RuntimeError, match=rf"a torch.int64 parameter of shape {re.escape(str(shape))} has a gradient"):
        opt.step()
    assert torch.equal(dense, before) and not opt.state


def test_forcing_a_vector_into_muon_names_its_shape() -> None:
    opt = Muon([torch.randn(4, 4)])
    with pytest.raises(ValueError, match=r"\(7,\)"):
        opt.add_param_group({"params": [torch.randn(7)], "use_muon": True})
    assert len(opt.param_groups) == 1


@pytest.mark.parametrize("option, value", [
    ("lr", -1.0), ("momentum", 1.0), ("ns_steps", 0), ("ns_coefficients", "fastest"), ("eps", 0.0),
    ("adjust_lr_fn", "sqrt"), ("conv_mode", "unfold"), ("adamw_betas", (0.9, 1.5)), ("ns_dtype", torch.int32),
    ("weight_decay", float("nan")), ("adamw_lr", -3.0),
])
def test_invalid_options_name_the_option(option: str, value) -> None:
    with pytest.raises(ValueError, match=option):
        Muon([torch.randn(4, 4)], **{option: value})


def trained_pair(**options) -> tuple[list[torch.Tensor], "optimizer.Muon"]:
    """A matrix and a vector after two steps (so both routes have state), with the optimizer."""
    params = [torch.randn(8, 6, generator=torch.Generator().manual_seed(1)), torch.zeros(6)]
    opt = Muon(params, **options)
    for step in range(2):
        seeded_grads(params, step)
        opt.step()
    return params, opt


def test_tensor_and_numpy_hyperparameters_act_as_their_values() -> None:
    # A 0-dim tensor lr is what compiled training loops pass so a schedule does not recompile; numpy scalars come
    # from configuration files.
    expected, _ = trained_pair(lr=0.02, weight_decay=0.1, momentum=0.9)
    ours, _ = trained_pair(lr=torch.tensor(0.02), weight_decay=np.float32(0.1), momentum=np.float64(0.9))
    for p, q in zip(ours, expected):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="lr"):
        Muon([torch.randn(4, 4)], lr=torch.tensor([0.01, 0.02]))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_a_float32_tensor_lr_decays_as_its_value_does(dtype: torch.dtype) -> None:
    # Zero gradients: only the decay acts. Its factor is formed in the parameter's precision from the lr's value
    # (formed in float32 first, it was ~8e-8 off per step for a float64 parameter).
    lr = torch.tensor(0.02)
    params = [torch.randn(6, 6, dtype=dtype) for _ in range(2)]
    opts = [Muon([params[0]], lr=lr, weight_decay=0.1), Muon([params[1]], lr=float(lr), weight_decay=0.1)]
    params[1].copy_(params[0])
    for _ in range(3):
        for param, opt in zip(params, opts):
            param.grad = torch.zeros_like(param)
            opt.step()
    assert torch.equal(params[0], params[1])


def test_a_group_made_invalid_after_construction_changes_nothing() -> None:
    first, second = torch.randn(6, 6), torch.randn(6, 6)
    opt = Muon([dict(params=[first]), dict(params=[second])])
    opt.param_groups[1]["momentum"] = 1.5
    seeded_grads([first, second], 0)
    before = first.clone()
    with pytest.raises(ValueError, match="momentum"):
        opt.step()
    assert torch.equal(first, before) and len(opt.state) == 0


@pytest.mark.parametrize("change", ["a new value", "a list changed in place", "a tensor lr filled in place",
                                    "False replaced by 0"])
def test_a_group_made_invalid_after_a_step_is_refused_at_the_next(change: str) -> None:
    # Steps keep what they checked while a group's options are the very same objects: whatever changes one, or
    # changes it in place, is checked again.
    first, second = torch.randn(6, 6), torch.randn(6, 6)
    lr = torch.tensor(0.02)
    opt = Muon([dict(params=[first]), dict(params=[second], adamw_betas=[0.9, 0.95], lr=lr)])
    seeded_grads([first, second], 0)
    opt.step()
    group = opt.param_groups[1]
    expected = {"a new value": "momentum", "a list changed in place": "beta", "a tensor lr filled in place": "lr",
                "False replaced by 0": "scale_eps"}[change]
    if change == "a new value":
        group["momentum"] = 1.5
    elif change == "a list changed in place":
        group["adamw_betas"][0] = 1.5
    elif change == "a tensor lr filled in place":
        lr.fill_(-1.0)
    else:
        opt.param_groups[0]["scale_eps"] = 0  # False before
    seeded_grads([first, second], 1)
    before = [first.clone(), second.clone()]
    with pytest.raises(ValueError, match=expected):
        opt.step()
    assert torch.equal(first, before[0]) and torch.equal(second, before[1])


def test_options_changed_between_steps_take_effect_as_in_torch_muon() -> None:
    # What a step derives from a group (its Newton-Schulz recipe, momentum, rates) follows each change, as
    # torch.optim.Muon reads its groups afresh at every step.
    ours = [torch.randn(16, 24, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    theirs = [param.clone() for param in ours]
    settings = dict(lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=True, ns_steps=5, eps=1e-7)
    opt = Muon(ours, ns_coefficients="original", ns_dtype=torch.bfloat16, adjust_lr_fn="original", **settings)
    ref = torch.optim.Muon(theirs, ns_coefficients=(3.4445, -4.7750, 2.0315), adjust_lr_fn="original", **settings)
    changes = [{}, dict(lr=0.01), dict(momentum=0.8, nesterov=False), dict(weight_decay=0.3, ns_steps=3), {}]
    update_size = 0.02 / math.sqrt(16)  # the largest lr's, as test_matches_torch_muon bounds bf16's roundings
    for step, change in enumerate(changes):
        for optimizer_ in (opt, ref):
            optimizer_.param_groups[0].update(change)
        seeded_grads(ours, step)
        seeded_grads(theirs, step)
        opt.step()
        ref.step()
        for p, q in zip(ours, theirs):
            torch.testing.assert_close(p, q, rtol=0, atol=0.01 * update_size * (step + 1))


def test_a_refused_complex_gradient_leaves_no_state() -> None:
    real, complex_param = torch.randn(6, 6), torch.randn(6, 6, dtype=torch.complex64)
    opt = Muon([dict(params=[real]), dict(params=[complex_param])])
    seeded_grads([real], 0)
    complex_param.grad = torch.randn_like(complex_param)
    with pytest.raises(RuntimeError, match="complex"):
        opt.step()
    assert len(opt.state) == 0


def test_empty_parameters_beside_a_matrix_change_nothing_else() -> None:
    matrix = torch.randn(8, 6)
    empties = [torch.randn(0, 5), torch.randn(0), torch.randn(0, 3, 4)]
    alone = matrix.clone()
    seeded_grads([matrix, *empties], 0)
    alone.grad = matrix.grad.clone()
    Muon([matrix, *empties]).step()
    Muon([alone]).step()
    assert torch.equal(matrix, alone)


def test_a_checkpoint_without_newer_group_keys_loads_with_their_defaults() -> None:
    params, opt = trained_pair(lr=0.02)
    saved = copy.deepcopy(opt.state_dict())  # as from a file: a state dict shares its tensors with the optimizer
    for group in saved["param_groups"]:
        for key in ("adamw_lr_scale", "adamw_betas", "adamw_weight_decay", "param_layout", "ns_dtype", "conv_mode"):
            del group[key]
    resumed_params = [p.clone() for p in params]
    resumed = Muon(resumed_params, lr=0.02)
    resumed.load_state_dict(saved)
    for step in range(2, 4):
        seeded_grads(params, step)
        seeded_grads(resumed_params, step)
        opt.step()
        resumed.step()
    for p, q in zip(params, resumed_params):
        assert torch.equal(p, q)


def test_a_checkpoint_with_an_invalid_group_value_is_refused_before_loading() -> None:
    params, opt = trained_pair()
    saved = opt.state_dict()
    saved["param_groups"][0]["adamw_betas"] = (0.9, 1.2)
    target = Muon([p.clone() for p in params], lr=0.5)
    with pytest.raises(ValueError, match="adamw_betas"):
        target.load_state_dict(saved)
    assert target.param_groups[0]["lr"] == 0.5 and len(target.state) == 0


@pytest.mark.parametrize("copy_kind", ["deepcopy", "pickle"])
def test_a_copied_optimizer_keeps_qk_clip_and_steps_like_the_original(copy_kind: str) -> None:
    model = nn.ModuleDict({"q": nn.Linear(8, 8, bias=False), "k": nn.Linear(8, 8, bias=False), "v": nn.Linear(8, 8)})
    opt = Muon(model.named_parameters(), lr=0.02, qk_clip={0: optimizer.QKClipLayer("q.weight", "k.weight", 2, 4)},
               qk_clip_threshold=50.0)
    seeded_grads(list(model.parameters()), 0)
    opt.step()
    both = (model, opt)
    twin_model, twin = copy.deepcopy(both) if copy_kind == "deepcopy" else pickle.loads(pickle.dumps(both))
    assert twin.qk_clip_threshold == 50.0 and set(twin.qk_clip) == {0}
    for module in (model, twin_model):
        seeded_grads(list(module.parameters()), 1)
    logits = {0: torch.tensor([400.0, 10.0])}
    opt.step(qk_logits=logits)
    twin.step(qk_logits=logits)
    for ours, theirs in zip(model.parameters(), twin_model.parameters()):
        assert torch.equal(ours, theirs)


@pytest.mark.parametrize("copy_kind", ["deepcopy", "pickle"])
def test_a_copied_optimizer_asks_for_its_process_group_again(copy_kind: str) -> None:
    # Unpickled, the saved marker was a new string that the step's identity check missed: the step went on to
    # torch.distributed with it.
    group = object()  # stands for a process group, which cannot be copied into another process
    opt = Muon([torch.randn(4, 4)], process_group=group)
    twin = copy.deepcopy(opt) if copy_kind == "deepcopy" else pickle.loads(pickle.dumps(opt))
    seeded_grads(twin.param_groups[0]["params"], 0)
    with pytest.raises(RuntimeError, match="copied or unpickled"):
        twin.step()
    twin.process_group = None
    twin.step()
    opt.load_state_dict(twin.state_dict())
    assert opt.process_group is group  # a load keeps the optimizer's own


@pytest.mark.parametrize("index, key, bad", [(0, "momentum_buffer", torch.zeros(6, 8)), (1, "exp_avg", torch.zeros(3)),
                                             (1, "exp_avg_sq", torch.zeros(7)), (1, "step", torch.zeros(2))])
def test_a_checkpoint_with_state_of_the_wrong_shape_is_refused_before_loading(index: int, key: str, bad) -> None:
    # The fused kernels trust the shapes: a wrong one would read and write outside the parameter.
    params, opt = trained_pair()
    saved = copy.deepcopy(opt.state_dict())
    saved["state"][index][key] = bad
    target = Muon([p.clone() for p in params])
    with pytest.raises(ValueError, match=rf"state '{key}' of parameter {index}.*expected a tensor of shape"):
        target.load_state_dict(saved)
    assert len(target.state) == 0


def test_state_is_matched_by_parameter_name() -> None:
    # The same model, its parameters listed in another order: each keeps its own state.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Linear(8, 4))
    opt = Muon(model.named_parameters(), lr=0.02)
    twin = copy.deepcopy(model)
    for step in range(2):
        seeded_grads(list(model.parameters()), step)
        opt.step()
    saved = copy.deepcopy(opt.state_dict())
    twin.load_state_dict(model.state_dict())
    resumed = Muon(list(reversed(list(twin.named_parameters()))), lr=0.02)
    resumed.load_state_dict(saved)
    seeded_grads(list(model.parameters()), 2)
    seeded_grads(list(twin.parameters()), 2)
    opt.step()
    resumed.step()
    for ours, theirs in zip(model.parameters(), twin.parameters()):
        assert torch.equal(ours, theirs)
    renamed = copy.deepcopy(saved)
    renamed["param_groups"][0]["param_names"][0] = "encoder.weight"
    with pytest.raises(ValueError, match="encoder.weight"):
        Muon(model.named_parameters()).load_state_dict(renamed)


def test_float64_parameters_decay_by_the_exact_factor() -> None:
    param = torch.ones(4, 4, dtype=torch.float64)
    param.grad = torch.zeros_like(param)
    Muon([param], lr=0.1, weight_decay=1e-3).step()  # a zero gradient: the update is exactly zero, only decay acts
    assert torch.equal(param, torch.full_like(param, 1 - 0.1 * 1e-3))


# --- torch.optim.Optimizer behaviour and exact resume across a process restart ----------------------------------

def test_closure_zero_grad_and_param_names() -> None:
    model = nn.Sequential(nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 2))
    opt = Muon(optimizer.muon_param_groups(model, lr=0.01))
    data = torch.randn(16, 6)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = model(data).square().mean()
        loss.backward()
        return loss

    first = opt.step(closure)
    assert torch.is_tensor(first) and all(p.grad is not None for p in model.parameters())
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    names = [name for group in opt.state_dict()["param_groups"] for name in group["param_names"]]
    assert sorted(names) == sorted(name for name, _ in model.named_parameters())


RESUME_SCRIPT = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, {tests!r})
    from kernel_under_test import optimizer
    from test_muon import make_training
    model, opt, schedule, batches = make_training(optimizer)
    checkpoint = torch.load({checkpoint!r})
    model.load_state_dict(checkpoint["model"])
    opt.load_state_dict(checkpoint["optimizer"])
    schedule.load_state_dict(checkpoint["schedule"])
    for inputs in batches[3:]:
        opt.zero_grad()
        model(inputs).square().mean().backward()
        opt.step()
        schedule.step()
    torch.save(model.state_dict(), {result!r})
""")


class TinyNet(nn.Module):
    """A conv, an expert bank, a bf16 matrix and an embedding: every state kind the optimizer keeps."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.experts = nn.Parameter(torch.randn(3, 8, 8) / 8)
        self.proj = nn.Linear(8, 8).to(torch.bfloat16)
        self.norm = nn.LayerNorm(8)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        features = self.conv(inputs.view(-1, 2, 2, 2)).flatten(1)[:, :8]
        mixed = torch.einsum("bi,eij->bj", features, self.experts)
        return self.norm(self.proj(mixed.bfloat16()).float())


def make_training(module):
    torch.manual_seed(0)
    model = TinyNet()
    opt = module.Muon(module.muon_param_groups(model, lr=0.02), adamw_lr=1e-3)
    schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    batches = [torch.randn(5, 8) for _ in range(6)]
    batches[1][0, 0] = float("nan")  # one non-finite step: its skip counter must survive the checkpoint
    return model, opt, schedule, batches


def test_checkpoint_resume_in_a_new_process_is_exact(tmp_path: Path) -> None:
    model, opt, schedule, batches = make_training(optimizer)
    for i, inputs in enumerate(batches):
        opt.zero_grad()
        model(inputs).square().mean().backward()
        opt.step()
        schedule.step()
        if i == 2:
            checkpoint = tmp_path / "checkpoint.pt"
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                        "schedule": schedule.state_dict()}, checkpoint)
    assert opt.nonfinite_skips() > 0
    result = tmp_path / "resumed.pt"
    script = RESUME_SCRIPT.format(tests=str(Path(__file__).parent), checkpoint=str(checkpoint), result=str(result))
    subprocess.run([sys.executable, "-c", script], check=True, timeout=300)
    resumed = torch.load(result)
    for name, value in model.state_dict().items():
        assert torch.equal(resumed[name], value), name


def test_a_step_inside_an_autocast_region_is_the_step_outside_it() -> None:
    """Lightning's manual optimization under precision="bf16-mixed" steps inside autocast: there a float32 Gram
    iteration ran in bf16 and diverged (an update of spectral norm ~1e4 for ~0.2); torch.optim.Muon's step does not
    change inside autocast either."""
    def trained(under_autocast: bool) -> list[torch.Tensor]:
        params = [torch.nn.Parameter(torch.randn(64, 256, generator=torch.Generator().manual_seed(0))),
                  torch.nn.Parameter(torch.zeros(64))]
        opt = Muon(params, lr=0.02, ns_dtype=torch.float32, ns_algorithm="gram")
        for step in range(3):
            generator = torch.Generator().manual_seed(step)
            params[0].grad = torch.randn(64, 8, generator=generator) @ torch.randn(8, 256, generator=generator)
            params[1].grad = torch.randn(64, generator=generator)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=under_autocast):
                opt.step()
        return params

    assert all(torch.equal(p, q) for p, q in zip(trained(True), trained(False)))


def test_a_closure_runs_under_the_callers_autocast_region() -> None:
    """Only the step's own products leave autocast: the closure (the user's forward and backward) ran in float32
    inside a bf16 region, where torch's optimizers run it in bf16."""
    param = torch.nn.Parameter(torch.randn(8, 8))
    seen = []

    def closure() -> torch.Tensor:
        seen.append(torch.is_autocast_enabled("cpu"))
        loss = (param @ param).sum()
        loss.backward()
        return loss

    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = Muon([param]).step(closure)
    assert seen == [True] and loss.dtype == torch.bfloat16


@pytest.mark.parametrize("options", [{}, {"normalization": "neuron"}, {"state_dtype": "int8"}],
                         ids=["plain", "neuron", "int8"])
def test_a_default_device_context_does_not_move_the_steps_own_tensors(options: dict) -> None:
    """`with torch.device(...)` / `torch.set_default_device` put the step's host tables and counters on that device
    (meta here): it failed after the momentum had moved, where torch's optimizers step as outside it."""
    def trained(default_device: str | None) -> list[torch.Tensor]:
        params = [torch.randn(16, 24, generator=torch.Generator().manual_seed(i)) for i in range(3)] + [torch.ones(24)]
        opt = Muon([dict(params=params[:2], lr=0.02), dict(params=params[2:], lr=0.01)], **options)
        for step in range(2):
            seeded_grads(params, step)
            with contextlib.nullcontext() if default_device is None else torch.device(default_device):
                opt.step()
        return params

    assert all(torch.equal(p, q) for p, q in zip(trained("meta"), trained(None)))


def test_a_checkpoint_loaded_under_inference_mode_trains_on() -> None:
    """A resume helper under `@torch.inference_mode()`: the state made there were inference tensors, and the next
    step failed after the momentum had moved; torch's optimizers train on."""
    params = [torch.nn.Parameter(torch.randn(8, 8)), torch.nn.Parameter(torch.randn(8))]
    opt = Muon(params, state_dtype=torch.bfloat16)
    seeded_grads(params, 0)
    opt.step()
    copies = [torch.nn.Parameter(param.detach().clone()) for param in params]
    resumed = Muon(copies, state_dtype=torch.bfloat16)
    with torch.inference_mode():
        resumed.load_state_dict(opt.state_dict())
    seeded_grads(params, 1)
    seeded_grads(copies, 1)
    opt.step()
    resumed.step()
    assert all(torch.equal(copy, param) for copy, param in zip(copies, params))
