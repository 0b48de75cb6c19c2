"""The cases the spawned gloo workers run: distributed Muon against single-device Muon on the same global
gradients. Each case runs on every rank; `cases_for(world)` lists those that fit a world size."""

from __future__ import annotations

import copy
import math
import sys
import traceback
import warnings
from unittest import mock
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard
from torch.torch_version import TorchVersion
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for kernel_under_test
from kernel_under_test import load_fallback_variant, optimizer, submodule  # noqa: E402
from offload_recording import recorded_offload  # noqa: E402

Muon = optimizer.Muon
state_precision = submodule(optimizer, "state_precision")
STEPS = 3
LR = 0.05
# fp32 everywhere, so the only differences from the single-device run are summation orders (batched products of
# other batch compositions, gradients reduced in another order): a few fp32 ulps per product, amplified by five
# Newton-Schulz steps whose coefficients reach ~8; we measured at most 3.3e-7. An update entry is about
# LR * 0.2 * sqrt(max dim) / sqrt(min dim) ~ 0.01-0.1 here, so any real mistake (a wrong slice, a missed shard, a
# wrong lr scale) moves entries by 1e-3 or more: 2e-6 separates the two.
FP32_ATOL = 2e-6
# The standard iteration, whose own fp32 rounding keeps ours within FP32_ATOL of the reference. The Gram iteration
# (which "auto", the default, picks for wide fp32 matrices) builds the Gram matrix, squaring the condition number of
# a trained model's ill-conditioned gradients: on the 10x16 weight its own rounding moved entries by up to 8.5e-6
# (measured), which would hide the mistakes these cases are for. It runs sharded in the "gram" and "auto" cases.
OPTIONS = dict(lr=LR, weight_decay=0.1, momentum=0.9, ns_dtype=torch.float32, ns_algorithm="standard")
# The Gram iteration on these random gradients: an owner holding one (6, 6) matrix runs it as a matrix (its norm
# reduced whole), the reference its stack of three (a norm per matrix), and the Gram matrix amplifies that last-bit
# difference to 2.5e-6 (measured): still far below a mistake's 1e-3.
GRAM_ATOL = 1e-5
# Shapes that exercise uneven shards (10 rows over 4 ranks: 3,3,3,1), empty shards (3 rows or columns over 4
# ranks), same-shape matrices (batched on one owner), an expert bank (3D), a conv weight (4D) and a tall matrix.
SHAPES = [(10, 6), (3, 8), (8, 3), (6, 6), (6, 6), (6, 6), (2, 5, 6), (6, 3, 2, 2), (12, 4)]
# torch 2.9's DTensor misplaces the rows of unequal strided runs, which the step therefore refuses there
# (`refused_dtensor_case`); on it the strided cases take shapes whose every dim splits into 4 equal runs.
UNEVEN_STRIDED_SHARDS_PLACED = TorchVersion(torch.__version__) >= "2.10"
STRIDED_SHAPES = SHAPES if UNEVEN_STRIDED_SHARDS_PLACED else [(8, 4), (4, 8), (8, 8), (4, 4, 8), (8, 4, 4, 4)]


def randn_tensors(shapes: Sequence[tuple[int, ...]], seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator) for shape in shapes]


def _global(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def assert_matches(ours: Sequence[torch.Tensor], reference: Sequence[torch.Tensor], atol: float) -> None:
    for index, (mine, truth) in enumerate(zip(ours, reference)):
        error = (_global(mine) - truth).abs().max().item()
        assert error <= atol, f"tensor {index} of shape {tuple(truth.shape)}: max error {error:.3g} > {atol:.3g}"


def grouped(params: Sequence[torch.Tensor], groups: Sequence[dict]) -> list:
    """The parameters, or with `groups` (each a param group's options) dealt out to those groups in turn."""
    if not groups:
        return list(params)
    return [dict(params=list(params[start::len(groups)]), **group) for start, group in enumerate(groups)]


# Three param groups that differ only in lr and weight decay (layer-wise lr decay): their matrices share the step's
# plan, each updated at its own group's rates.
LR_DECAY_GROUPS = (dict(lr=LR, weight_decay=0.1), dict(lr=LR / 2, weight_decay=0.0), dict(lr=LR * 2, weight_decay=0.3))


def run_pair(params: list[torch.Tensor], make_grad: Callable[[torch.Tensor], torch.Tensor],
              shapes: Sequence[tuple[int, ...]], nan_at: tuple[int, int, tuple[int, ...]] | None = None,
              groups: Sequence[dict] = (), **options) -> tuple[Muon, Muon, list[torch.Tensor]]:
    """STEPS steps of Muon on `params` (distributed) and on plain copies of their global values (the truth),
    with the same global gradients, in `groups` (see `grouped`); `nan_at` = (param index, step, element) puts a NaN
    in one gradient."""
    reference = [_global(p).detach().clone() for p in params]
    ours = Muon(grouped(params, groups), **(OPTIONS | options))
    truth = Muon(grouped(reference, groups), **(OPTIONS | options))  # distribution-only options: nothing on one device
    for step in range(STEPS):
        grads = randn_tensors(shapes, seed=100 + step)
        if nan_at is not None and nan_at[1] == step:
            grads[nan_at[0]][nan_at[2]] = math.nan
        for p, q, g in zip(params, reference, grads):
            p.grad, q.grad = make_grad(g.clone()), g.clone()
        ours.step()
        truth.step()
    return ours, truth, reference


def dtensor_case(mesh_shape: tuple[int, ...], placements: Sequence[Placement], atol: float = FP32_ATOL,
                 nan_at: tuple[int, int, tuple[int, ...]] | None = None,
                 comm_dtype: torch.dtype | None = torch.float32, shapes: Sequence[tuple[int, ...]] = SHAPES,
                 **options) -> None:
    """DTensors made with distribute_tensor; comm_dtype None leaves Muon's default (bfloat16). Every rank made the
    same global tensors, so each splits its own part (src_data_rank=None; DTensor's scatter path also refuses
    uneven strided shards)."""
    mesh = init_device_mesh("cpu", mesh_shape)
    params = [distribute_tensor(t, mesh, placements, src_data_rank=None) for t in randn_tensors(shapes, seed=0)]
    make_grad = partial(distribute_tensor, device_mesh=mesh, placements=placements, src_data_rank=None)
    if comm_dtype is not None:
        options["comm_dtype"] = comm_dtype
    ours, truth, reference = run_pair(params, make_grad, shapes, nan_at=nan_at, **options)
    assert_matches(params, reference, atol)
    buffers = [state_precision.stored_moment(ours.state[p], "momentum_buffer")[0] for p in params]
    for p, buffer in zip(params, buffers):  # momentum stays sharded like its parameter
        assert isinstance(buffer, DTensor) and buffer.placements == p.placements
        assert buffer.to_local().shape == p.to_local().shape
    if options.get("state_dtype") is None:
        assert_matches(buffers, [truth.state[q]["momentum_buffer"] for q in reference], atol)
    else:
        _assert_stored_momentum_matches(ours, truth, params, reference, options["state_dtype"])
    skips = [int(ours.state[p]["nonfinite_skips"]) for p in params]
    assert skips == [int(truth.state[q]["nonfinite_skips"]) for q in reference], skips
    if options.get("normalization") is not None:
        _assert_second_moments_match(ours, truth, params, reference, atol)


def _assert_stored_momentum_matches(ours: Muon, truth: Muon, params: Sequence[torch.Tensor],
                                    reference: Sequence[torch.Tensor], state_dtype: torch.dtype | str) -> None:
    """Momentum stored in fewer bytes, in the form one device uses ("int8" keeps bfloat16 where the last dim is
    split, which one device never does). The random bits of its rounding follow each entry's index in the whole
    tensor, so in the same form it is one device's bit for bit; in another, within a few of the coarser form's
    spacings (2^-3 of the largest entry for e4m3 codes) after rounding at random on each side each step."""
    for p, q in zip(params, reference):
        mine, theirs = (state_precision.stored_moment(state, "momentum_buffer")
                        for state in (ours.state[p], truth.state[q]))
        split_last = any(not placement.is_replicate() and placement.dim % p.ndim == p.ndim - 1
                         for placement in p.placements)
        form = torch.bfloat16 if split_last else theirs[0].dtype
        assert mine[0].dtype == form and (mine[1] is not None) == (form == torch.int8)
        assert int(ours.state[p]["rounding_count"]) == int(truth.state[q]["rounding_count"])
        if form == theirs[0].dtype:
            for stored, truth_stored in zip(mine, theirs):
                assert truth_stored is None or torch.equal(_global(stored), truth_stored)
            continue
        values = [state_precision.working_copy("momentum_buffer", _global(stored),
                                               None if scales is None else _global(scales))
                  for stored, scales in (mine, theirs)]
        assert (values[0] - values[1]).abs().max() <= 2 * STEPS * 2.0 ** -3 * values[1].abs().max()


def _assert_second_moments_match(ours: Muon, truth: Muon, params: Sequence[torch.Tensor],
                                 reference: Sequence[torch.Tensor], atol: float) -> None:
    """A normalization's second moments live with the shards (split like the parameter along the dims they keep)
    and hold what one device's do; their step counts agree."""
    moments = [ours.state[p]["update_sq"] for p in params]
    for p, moment in zip(params, moments):
        if isinstance(p, DTensor):
            assert isinstance(moment, DTensor) and moment.device_mesh == p.device_mesh
            kept = [d for d in range(p.ndim) if moment.shape[d] == p.shape[d]]
            for placement, moment_placement in zip(p.placements, moment.placements):
                split_kept = not placement.is_replicate() and placement.dim % p.ndim in kept
                assert moment_placement == (placement if split_kept else Replicate()), (p.placements, moment)
    assert_matches(moments, [truth.state[q]["update_sq"] for q in reference], atol)
    steps = [float(ours.state[p]["update_step"]) for p in params]
    assert steps == [float(truth.state[q]["update_step"]) for q in reference], steps


# Shapes whose Newton-Schulz work whole matrices cannot balance over 2 or 4 ranks, so the owners divide it: a wide and
# a tall matrix by the columns of their wide orientation (256 >= 2 * MIN_SHARE_COLUMNS), beside two small ones.
DIVIDED_SHAPES = [(40, 256), (256, 24), (8, 8), (6, 10)]
# An expert bank not held whole by any rank (split along its rows) that outweighs the rest: divided by its experts.
EXPERT_SHAPES = [(8, 32, 48), (12, 12)]
# Two banks of 6 experts on dim 0 over 4 ranks hold 4, 4, 4 and 0 experts: in place, 1.33 max/mean; with one bank
# released into the pipeline and divided by experts, every rank gets 3.
RELEASED_BANK_SHAPES = [(6, 16, 24), (6, 16, 24)]


@contextmanager
def columns_divided_on_cpu() -> Iterator[None]:
    """CPU (gloo) meshes divide no matrix by columns (`assignment.NO_COLUMN_DIVISION_ON`: slower there); within this
    they do, as GPU meshes, so that the division is tested here. Plans cached under the other rule are dropped on
    the way in and out."""
    assignment = submodule(optimizer, "distributed.assignment")
    assignment.plan_spread.cache_clear()
    try:
        with mock.patch.object(assignment, "NO_COLUMN_DIVISION_ON", frozenset()):
            yield
    finally:
        assignment.plan_spread.cache_clear()


def divided_case(mesh_shape: tuple[int, ...], placements: Sequence[Placement], shapes: Sequence[tuple[int, ...]],
                 kind: str, released: bool = False, **options) -> None:
    """dtensor_case on shapes whose owners divide them (the single-device result, within its tolerance), checking
    that the step's plan did divide them as `kind` says, and (`released`) sent expert banks that ranks hold whole
    through the pipeline."""
    plans = []
    original = submodule(optimizer, "distributed.assignment").plan_spread

    def recording(*args, **kwargs):
        plans.append(original(*args, **kwargs))
        return plans[-1]

    step = submodule(optimizer, "distributed.step")
    with mock.patch.object(step, "plan_spread", recording), columns_divided_on_cpu():
        dtensor_case(mesh_shape, placements, shapes=shapes, **options)
    kinds = {share.kind for plan in plans for item_shares in plan.shares for share in item_shares}
    assert kind in kinds, kinds
    if released:  # every item is a bank its ranks hold whole: one not updated in place went through the pipeline
        assert all(not all(plan.in_place) for plan in plans), [plan.in_place for plan in plans]


def groups_by_lr_and_decay_case(world: int, placements: Sequence[Placement], **options) -> None:
    """dtensor_case in LR_DECAY_GROUPS, whose matrices go through one plan per step, not one per group."""
    step = submodule(optimizer, "distributed.step")
    planned: list[int] = []

    def recording(views, *args, **kwargs):
        planned.append(len(views))
        return real(views, *args, **kwargs)
    real = step.plan_spread
    with mock.patch.object(step, "plan_spread", recording):
        dtensor_case((world,), placements, groups=LR_DECAY_GROUPS, **options)
    assert planned == [len(SHAPES)] * STEPS, planned


def nonfinite_shard_case(world: int) -> None:
    """A NaN in the last row of (10, 6), which only the last rank holds: every rank skips the whole matrix."""
    dtensor_case((world,), [Shard(0)], nan_at=(0, 1, (9, 2)))


def refused_dtensor_case(world: int, kind: str) -> None:
    """A DTensor the distributed update cannot take, in a later group or last of matrices stepped a chunk each, is
    refused before any parameter or state changes: a Partial placement (refused group by group, after the earlier
    groups had stepped), a local shard other than its placements give (`from_local(run_check=False)`; refused
    chunk by chunk, after earlier chunks had stepped), and FSDP2-over-TP rows in unequal strided runs on a torch
    taken for 2.9 (whose DTensor misplaces them; 4 ranks)."""
    mesh = init_device_mesh("cpu", (world,))
    params = [distribute_tensor(t, mesh, [Shard(0)], src_data_rank=None) for t in randn_tensors(SHAPES[:4], seed=0)]
    rank = dist.get_rank()
    refusal, on_torch_2_9 = {"partial": "Partial", "local": "local shard", "strided": "unequal runs"}[kind], None
    if kind == "partial":
        bad = DTensor.from_local(torch.randn(6, 4), mesh, [Partial()])
    elif kind == "strided":  # 9 rows in runs of 3, 2, 2, 2
        bad = distribute_tensor(torch.randn(9, 6), init_device_mesh("cpu", (2, 2)),
                                [_StridedShard(0, split_factor=2), Shard(0)], src_data_rank=None)
        step_module = submodule(optimizer, "distributed.step")
        on_torch_2_9 = mock.patch.object(step_module, "misplaced_strided_runs",
                                         partial(step_module.misplaced_strided_runs, version="2.9.1"))
    else:  # 12 rows split 4 | 8 or 2 | 4 | 2 | 4 where torch.chunk's even split gives every rank another count
        rows = [4, 8] if world == 2 else [2, 4] * (world // 2)
        bad = DTensor.from_local(torch.randn(rows[rank], 6), mesh, [Shard(0)], run_check=False, shape=(12, 6),
                                 stride=(6, 1))
    everything = [*params, bad]
    opt = Muon([dict(params=params), dict(params=[bad], ns_steps=3)], **OPTIONS, comm_dtype=torch.float32,
               chunk_size=1)
    for param, grad in zip(everything, randn_tensors([tuple(p.shape) for p in everything], seed=1)):
        param.grad = (distribute_tensor(grad, param.device_mesh, param.placements, src_data_rank=None)
                      if param is not bad or kind == "strided" else
                      DTensor.from_local(torch.randn(bad.to_local().shape), mesh, bad.placements, run_check=False,
                                         shape=bad.shape, stride=bad.stride()))
    before = [param.to_local().clone() for param in everything]
    try:
        with on_torch_2_9 or nullcontext():
            opt.step()
    except RuntimeError as error:
        assert refusal in str(error), error
    else:
        raise AssertionError("the step was not refused")
    assert all(torch.equal(param.to_local(), old) for param, old in zip(everything, before))
    assert not opt.state


def misplaced_state_case(world: int, kind: str) -> None:
    """A DTensor parameter's momentum placed otherwise than the parameter (from a run laid out otherwise), or a plain
    tensor of its global shape (from a single-device run), set by hand or loaded through `load_state_dict`: each rank
    would step another block of the momentum than its shard of the parameter (silently where the local shapes agree,
    refused by a kernel part way through the step elsewhere). Both are refused before anything changes."""
    mesh = init_device_mesh("cpu", (world,))
    shapes = [(8, 8), (12, 4)]

    def stepped_once(placements: Sequence[Placement]) -> tuple[list[torch.Tensor], Muon]:
        params = [distribute_tensor(t, mesh, placements, src_data_rank=None) for t in randn_tensors(shapes, seed=0)]
        opt = Muon(params, **OPTIONS)
        for param, grad in zip(params, randn_tensors(shapes, seed=1)):
            param.grad = distribute_tensor(grad, mesh, placements, src_data_rank=None)
        opt.step()
        return params, opt

    params, opt = stepped_once([Shard(0)])
    momentum = opt.state[params[1]]["momentum_buffer"]
    misplaced = momentum.full_tensor() if kind == "plain" else momentum.redistribute(mesh, [Shard(1)])
    before = [(param.to_local().clone(), opt.state[param]["momentum_buffer"].to_local().clone()) for param in params]

    def unchanged() -> bool:
        return all(torch.equal(param.to_local(), old) and torch.equal(opt.state[param]["momentum_buffer"].to_local(),
                                                                      old_momentum)
                   for param, (old, old_momentum) in zip(params, before))

    if kind == "placements":
        saved = stepped_once([Shard(1)])[1].state_dict()
    else:
        saved = opt.state_dict()
        saved = {**saved, "state": {index: {**state, "momentum_buffer": state["momentum_buffer"].full_tensor()}
                                    for index, state in saved["state"].items()}}
    try:
        opt.load_state_dict(saved)
    except ValueError as error:
        assert "Invalid state_dict: state 'momentum_buffer' of parameter 0" in str(error), error
    else:
        raise AssertionError("the state dict was loaded")
    assert unchanged()
    opt.state[params[1]]["momentum_buffer"] = misplaced
    try:
        opt.step()
    except RuntimeError as error:
        assert "Invalid state: 'momentum_buffer' of parameter #1" in str(error), error
    else:
        raise AssertionError("the step was not refused")
    opt.state[params[1]]["momentum_buffer"] = momentum
    assert unchanged()


def float64_beyond_float32_case(world: int) -> None:
    """float64 parameters with gradients beyond float32's range, sent in float64 to owners iterating in float32: the
    owners scale them in float64 first, as one device does (they were cast to float32 first: inf, and NaN
    parameters)."""
    mesh = init_device_mesh("cpu", (world,))
    shapes = SHAPES[:4]
    globals_ = [t.double() for t in randn_tensors(shapes, seed=0)]
    params = [distribute_tensor(t, mesh, [Shard(0)], src_data_rank=None) for t in globals_]
    reference = [t.clone() for t in globals_]
    options = OPTIONS | dict(comm_dtype=torch.float64)
    ours, truth = Muon(params, **options), Muon(reference, **options)
    for step in range(STEPS):
        for p, q, g in zip(params, reference, randn_tensors(shapes, seed=100 + step)):
            g = g.double() * 1e200
            p.grad, q.grad = distribute_tensor(g, mesh, [Shard(0)], src_data_rank=None), g.clone()
        ours.step()
        truth.step()
    assert all(torch.isfinite(q).all() for q in reference)
    assert_matches(params, reference, FP32_ATOL)


def fsdp2_case(world: int, max_norm: float | None = None, groups: Sequence[dict] = (), compiled: bool = False) -> None:
    """fully_shard on a small MLP (uneven shards; empty ones on 4 ranks), biases through AdamW, the batch split
    over ranks; the reference trains an unsharded copy on the whole batch (FSDP2 averages gradients). With
    `max_norm`, Muon.clip_grad_norm_ clips the DTensor gradients (torch's function does it for them) and the
    reference is clipped by torch's function on one device. With `groups`, the parameters dealt out to them (see
    `grouped`): the biases' shards share one AdamW update, each at its group's rates. `compiled`: the step through
    `torch.compile(opt.step)` (dynamo failed at the first step, tracing into the distributed layouts)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 10), nn.Tanh(), nn.Linear(10, 3), nn.Tanh(), nn.Linear(3, 8))
    reference = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    ours = Muon(grouped(list(model.parameters()), groups), **OPTIONS, comm_dtype=torch.float32)
    truth = Muon(grouped(list(reference.parameters()), groups), **OPTIONS)
    rank, per_rank = dist.get_rank(), 4
    step_ours = torch.compile(ours.step) if compiled else ours.step
    uncompiled_updates = 0
    for step in range(STEPS):
        batch = torch.randn(world * per_rank, 16, generator=torch.Generator().manual_seed(200 + step))
        model(batch[rank * per_rank:(rank + 1) * per_rank]).square().mean().backward()
        reference(batch).square().mean().backward()
        if max_norm is not None:
            norm = ours.clip_grad_norm_(max_norm)
            expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm)
            torch.testing.assert_close(norm.full_tensor() if isinstance(norm, DTensor) else norm, expected)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step_ours()
        uncompiled_updates += sum("the update runs uncompiled" in str(warning.message) for warning in caught)
        truth.step()
        ours.zero_grad()
        truth.zero_grad()
    assert_matches(list(model.parameters()), list(reference.parameters()), FP32_ATOL)
    # torch 2.9's compiler fails on DTensor parameters: there the compiled step says so and updates uncompiled.
    assert (uncompiled_updates > 0) == (compiled and TorchVersion(torch.__version__) < "2.10"), uncompiled_updates


def ddp_case(world: int, comm_dtype: torch.dtype = torch.float32, atol: float = FP32_ATOL,
             groups: Sequence[dict] = (), **options) -> None:
    """DistributedDataParallel (plain replicated tensors) with process_group, the parameters in `groups` (see
    `grouped`): each rank orthogonalizes part of the matrices; the replicas must stay bit-identical and match
    single-device Muon."""
    torch.manual_seed(0)
    # A tall matrix among them: its owner's update is a transposed view of its Newton-Schulz buffer, where the other
    # replicas receive a contiguous copy (a normalization reducing the two layouts in different orders let the
    # replicas drift apart).
    model = nn.Sequential(nn.Linear(12, 10), nn.Tanh(), nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 6))
    reference = copy.deepcopy(model)
    wrapped = nn.parallel.DistributedDataParallel(model)
    ours = Muon(grouped(list(model.parameters()), groups), **(OPTIONS | options), comm_dtype=comm_dtype,
                process_group=dist.group.WORLD)
    truth = Muon(grouped(list(reference.parameters()), groups), **(OPTIONS | options))
    rank, per_rank = dist.get_rank(), 8  # 8 * world >= 12 samples: full-rank gradients (see BF16_ATOL)
    for step in range(STEPS):
        batch = torch.randn(world * per_rank, 12, generator=torch.Generator().manual_seed(300 + step))
        wrapped(batch[rank * per_rank:(rank + 1) * per_rank]).square().mean().backward()
        reference(batch).square().mean().backward()
        ours.step()
        truth.step()
        ours.zero_grad()
        truth.zero_grad()
    assert_matches(list(model.parameters()), list(reference.parameters()), atol)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    copies = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(copies, flat)
    assert all(torch.equal(copy_, copies[0]) for copy_ in copies), "replicas diverged"


# bf16 communication rounds the momentum and the update to 8 significant bits (relative error 2^-9); Newton-Schulz
# passes an input perturbation on at about its size for well-conditioned directions, so each step's update is off
# by ~0.5% of its ~0.01-0.1 entries: we measured 3.2e-4 after three steps; 3e-3 still fails real mistakes. (A
# rank-deficient gradient would not do: bf16 noise in its null space is inflated by Newton-Schulz to O(1) entries,
# so the cases' gradients have full rank.)
BF16_ATOL = 3e-3
# A trained model's hidden-layer gradients are badly conditioned (we measured 4.6e-3 on a (10, 10) weight after
# three steps), so with bf16 there the check is only that no step is lost or mis-scaled: one step's update entry
# is ~0.03 and three steps move entries by ~0.1, so a third of an entry, 1e-2, still catches a missing update.
TRAINED_BF16_ATOL = 1e-2
# 8-bit moments (3 mantissa bits) against bfloat16 ones: the 8-bit side's momentum is off by up to 2^-3 of an entry
# at every step, so its update direction by a few percent: on the (10, 6) matrix we measured 2.5e-3 after three
# steps. An update entry is ~0.01-0.1, so 1e-2 still catches a missing or misplaced update.
INT8_ATOL = 1e-2


# torch 2.11 (seen on the GPU machine, 2026-11-23) refuses a _StridedShard with no Shard before it on the same dim
# ("unable to be interpreted into a corresponding shard_order"); the torch this project pins accepts it.
LONE_STRIDED_SHARD_ACCEPTED = TorchVersion(torch.__version__) >= "2.13"


def _traffic_of_one_step(opt: Muon) -> tuple[int, int]:
    """(bytes sent to, bytes received from) other ranks in one step, counted at each all-to-all the pipeline
    launches (a rank's split to itself is always empty)."""
    original = dist.all_to_all_single
    traffic = [0, 0]

    def counting(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
        traffic[0] += input.numel() * input.element_size()
        traffic[1] += output.numel() * output.element_size()
        return original(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)

    dist.all_to_all_single = counting
    try:
        opt.step()
    finally:
        dist.all_to_all_single = original
    return traffic[0], traffic[1]


def plan_step_bytes_case(world: int, placements: Sequence[Placement], shapes: Sequence[tuple[int, ...]] = SHAPES,
                         **options) -> None:
    """optimizer.plan_step's bytes per rank are the bytes the step sends and receives, exactly."""
    mesh = init_device_mesh("cpu", (world,))
    params = [distribute_tensor(t, mesh, placements, src_data_rank=None) for t in randn_tensors(shapes, seed=0)]
    for param, grad in zip(params, randn_tensors(shapes, seed=1)):
        param.grad = distribute_tensor(grad, mesh, placements, src_data_rank=None)
    sent, received = _traffic_of_one_step(Muon(params, lr=LR, **options))
    # Muon's ns_dtype=None is this CPU's fastest dtype; plan_step's default is a GPU's bfloat16.
    plan = optimizer.plan_step(shapes, world, placements=placements, mesh_device_type="cpu",
                               **({"ns_dtype": optimizer.default_ns_dtype(torch.device("cpu"))} | options))
    rank = dist.get_rank()
    assert (sent, received) == (plan.bytes_sent_per_rank[rank], plan.bytes_received_per_rank[rank]), \
        (sent, received, plan)


def divided_plan_step_bytes_case(world: int, placements: Sequence[Placement], shapes: Sequence[tuple[int, ...]],
                                 **options) -> None:
    """plan_step_bytes_case where the owners divide matrices by columns (the Gram exchanges counted too)."""
    with columns_divided_on_cpu():
        plan_step_bytes_case(world, placements, shapes, **options)


def offload_case(world: int, **options) -> None:
    """offload="cpu" through the distributed step, with a recording copier in place of the GPU's side stream: the
    parameters and state are bitwise those of the same run without offload, each pipeline chunk's state is fetched
    before the chunk ahead of it runs Newton-Schulz and written back after its own update, and the expert bank
    (whole experts on each rank) and a vector's AdamW shards stage after them, as one device's do, in the step's one
    schedule. Moved home, a DTensor's state stays a DTensor on its mesh with only its
    local shard moved ("meta" standing in for the host of a GPU mesh)."""
    mesh = init_device_mesh("cpu", (world,))
    state = {"momentum_buffer": distribute_tensor(torch.ones(8, 3), mesh, [Shard(0)])}
    submodule(optimizer, "offload").keep_at_home(state, torch.device("meta"))
    moved = state["momentum_buffer"]
    assert isinstance(moved, DTensor) and moved.device_mesh == mesh and moved.placements == (Shard(0),), moved
    assert moved.to_local().device.type == "meta" and moved.shape == (8, 3)
    runs = []
    log: list[str] = []
    pipeline = submodule(optimizer, "distributed.pipeline")
    orthogonalize = pipeline.orthogonalize
    shapes = [*SHAPES, (7,)]  # the vector to AdamW
    for offload in (None, "cpu"):
        params = [distribute_tensor(t, mesh, [Shard(0)], src_data_rank=None) for t in randn_tensors(shapes, seed=0)]
        opt = Muon(params, **(OPTIONS | options))
        opt.offload = offload  # set after construction: on CPU parameters the constructor only warns
        for step in range(STEPS):
            for param, grad in zip(params, randn_tensors(shapes, seed=100 + step)):
                param.grad = distribute_tensor(grad, mesh, [Shard(0)], src_data_rank=None)
            if offload is None:
                opt.step()
                continue
            with recorded_offload(log), mock.patch.object(
                    pipeline, "orthogonalize", lambda *args, **kwargs: (log.append("orthogonalize"),
                                                                        orthogonalize(*args, **kwargs))[1]):
                opt.step()
        runs.append((params, opt))
    (plain_params, plain), (staged_params, staged) = runs
    for plain_param, staged_param in zip(plain_params, staged_params):
        assert torch.equal(plain_param.to_local(), staged_param.to_local())
        for key, value in plain.state[plain_param].items():
            assert torch.equal(_local(staged.state[staged_param][key]), _local(value)), key
    # The pipeline's four chunks A..D first, each a generator of fetch | ready + momentum | orthogonalize | update +
    # write_back, started one per round and advanced newest first: A fetch; B fetch, A ready; C fetch, B ready,
    # A orth.; D fetch, C ready, B orth., A write; then D ready, C orth., B write; D orth., C write; D write. Then
    # the step's one schedule, as on one device: the expert bank's bucket on the ranks that hold one of its 2
    # experts, and the vector's AdamW shard.
    pipeline_schedule = ["fetch", "fetch", "ready", "fetch", "ready", "orthogonalize", "fetch", "ready",
                         "orthogonalize", "write_back", "ready", "orthogonalize", "write_back", "orthogonalize",
                         "write_back", "write_back", "finish"]
    experts = next(shape[0] for shape in SHAPES if len(shape) == 3)
    step_schedule = (["fetch", "ready", "fetch", "write_back", "ready", "write_back", "finish"]
                     if dist.get_rank() < experts else ["fetch", "ready", "write_back", "finish"])
    assert log == (pipeline_schedule + step_schedule) * STEPS, log


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def shard_positions_case() -> None:
    """Each rank's `shard_positions` against DTensor's own split of the whole tensor's flat indices, on 1D and 2D
    meshes (strided shards too), and two vectors shorter together than a shard with two dims of 3 or more."""
    layout = submodule(optimizer, "distributed.layout")
    layouts = {(4,): [[Shard(0)], [Shard(1)], [Replicate()], [_StridedShard(0, split_factor=2)]],
               (2, 2): [[Shard(0), Shard(1)], [Shard(1), Shard(0)], [Shard(0), Shard(0)], [Replicate(), Shard(1)],
                        [_StridedShard(0, split_factor=2), Shard(0)], [Shard(1), Shard(2)]]}
    for mesh_shape, placement_lists in layouts.items():
        mesh = init_device_mesh("cpu", mesh_shape)
        for placements in placement_lists:
            for shape in [(10, 6), (3, 8), (2, 5, 6), (6, 3, 2, 2), (12, 7)]:
                if any(getattr(placement, "dim", 0) >= len(shape) for placement in placements):
                    continue
                indices = distribute_tensor(torch.arange(math.prod(shape)).view(shape), mesh, placements,
                                            src_data_rank=None)
                positions = layout.shard_positions(indices)
                local = indices.to_local()
                assert torch.equal(positions.of(local.shape), local), (mesh_shape, placements, shape)
                if local.numel() and sum(size >= 3 for size in local.shape) >= 2:
                    assert len(positions.rows) + len(positions.columns) < local.numel(), (placements, shape)


# The ops that read a tensor's value on the host: on a GPU each waits for the stream (`.item()`, `bool()`, `int()`,
# a boolean mask's `nonzero`).
HOST_READS = {"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.is_nonzero.default",
              "aten.equal.default", "aten.masked_select.default"}


class HostReads(TorchDispatchMode):
    """Each host read of a tensor's value while active, with the package's innermost frame that asked for it."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func) in HOST_READS:
            frames = [frame for frame in traceback.extract_stack() if "/build/" in frame.filename]
            where = f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "?"
            self.reads.append(f"{func} at {where}")
        return func(*args, **(kwargs or {}))


def no_host_reads_case() -> None:
    """No distributed step, the first ones included, reads a tensor's value on the host, so on GPUs none waits for
    the stream: the pipeline, the momentum, the normalizations, rounded state, the Gram iteration and the
    preconditioner, on 1D and 2D meshes (strided shards too) and DDP replicas. Run on the package's torch-op paths,
    which GPUs take (the compiled CPU ops read their host-side step sizes as numbers)."""
    muon = load_fallback_variant().Muon
    shapes = [*STRIDED_SHAPES, (7,)]
    mesh, mesh_2d = init_device_mesh("cpu", (4,)), init_device_mesh("cpu", (2, 2))
    runs = [(mesh, [Shard(1)], dict(state_dtype=torch.bfloat16, normalization="neuron")),
            (mesh, [Shard(0)], dict(ns_algorithm="gram", chunk_size=1, preconditioner="aol")),
            (mesh_2d, [_StridedShard(0, split_factor=2), Shard(0)], dict(state_dtype="int8", normalization="element")),
            (mesh_2d, [Shard(0), Shard(1)], dict(adjust_lr_fn="spectral", scale_eps=True)),
            (None, None, dict(state_dtype="int8", process_group=dist.group.WORLD))]
    for run_mesh, placements, options in runs:
        def placed(tensor: torch.Tensor) -> torch.Tensor:
            if run_mesh is None:
                return tensor
            kept = [Replicate() if getattr(p, "dim", 0) >= tensor.ndim else p for p in placements]
            return distribute_tensor(tensor, run_mesh, kept, src_data_rank=None)

        params = [placed(tensor) for tensor in randn_tensors(shapes, seed=0)]
        opt = muon(params, **(OPTIONS | options))
        for step in range(STEPS):
            for param, grad in zip(params, randn_tensors(shapes, seed=100 + step)):
                param.grad = placed(grad)
            with HostReads() as reads:
                opt.step()
        assert not reads.reads, (placements, options, reads.reads)


def cases_for(world: int) -> dict[str, Callable[[], None]]:
    cases: dict[str, Callable[[], None]] = {
        "fsdp2_fully_shard": partial(fsdp2_case, world),
        "fsdp2_fully_shard_clip_grad_norm": partial(fsdp2_case, world, max_norm=0.05),
        "fsdp2_fully_shard_groups_by_lr_and_decay": partial(fsdp2_case, world, groups=LR_DECAY_GROUPS),
        "shard0_1d": partial(dtensor_case, (world,), [Shard(0)]),
        "shard1_1d": partial(dtensor_case, (world,), [Shard(1)]),
        "replicate_1d": partial(dtensor_case, (world,), [Replicate()]),
        "shard0_one_matrix_per_chunk": partial(dtensor_case, (world,), [Shard(0)], chunk_size=1),
        "shard0_gram_newton_schulz": partial(dtensor_case, (world,), [Shard(0)], atol=GRAM_ATOL, ns_algorithm="gram"),
        "shard0_auto_newton_schulz": partial(dtensor_case, (world,), [Shard(0)], ns_algorithm="auto"),
        "shard0_aol_preconditioner": partial(dtensor_case, (world,), [Shard(0)], ns_algorithm="auto",
                                             preconditioner="aol"),
        "shard0_batched_conv_normalize_spatial": partial(dtensor_case, (world,), [Shard(0)], conv_mode="batched",
                                                         normalize_spatial=True),
        "nonfinite_on_one_shard_skips_everywhere": partial(nonfinite_shard_case, world),
        "partial_placement_in_a_later_group_is_refused_first": partial(refused_dtensor_case, world, "partial"),
        "float64_gradients_beyond_float32s_range": partial(float64_beyond_float32_case, world),
        "local_shard_other_than_placements_is_refused_first": partial(refused_dtensor_case, world, "local"),
        "momentum_placed_otherwise_is_refused_first": partial(misplaced_state_case, world, "placements"),
        "plain_momentum_of_a_dtensor_is_refused_first": partial(misplaced_state_case, world, "plain"),
        "ddp_process_group": partial(ddp_case, world),
        "ddp_process_group_groups_by_lr_and_decay": partial(ddp_case, world, groups=LR_DECAY_GROUPS),
        "shard0_groups_by_lr_and_decay": partial(groups_by_lr_and_decay_case, world, [Shard(0)]),
        "shard1_groups_by_lr_and_decay_neuron": partial(groups_by_lr_and_decay_case, world, [Shard(1)],
                                                        normalization="neuron"),
        "ddp_process_group_bf16_comm": partial(ddp_case, world, torch.bfloat16, TRAINED_BF16_ATOL),
        "shard0_bf16_comm_default": partial(dtensor_case, (world,), [Shard(0)], atol=BF16_ATOL, comm_dtype=None),
        # ns_dtype=None: on a CPU with fast bf16 products, stacks iterate in bf16 and lone small matrices in float32
        # (`matrix_ns_dtype`), on the owners as on one device, whose buckets are not the owners' stacks.
        "shard0_default_ns_dtype": partial(dtensor_case, (world,), [Shard(0)], atol=BF16_ATOL, ns_dtype=None),
        # NorMuon and AdaMuon on shards: rows whole on each rank (the expert bank updated in place, except where the
        # RMS rule needs its whole norm), rows split between ranks (their squares summed across), both normalizations
        # with and without the RMS rule, batched conv matrices, and replicated data-parallel tensors.
        "shard0_neuron_normalization": partial(dtensor_case, (world,), [Shard(0)], normalization="neuron"),
        "shard1_neuron_normalization": partial(dtensor_case, (world,), [Shard(1)], normalization="neuron"),
        "shard0_element_normalization_spectral": partial(dtensor_case, (world,), [Shard(0)],
                                                         normalization="element", adjust_lr_fn="spectral"),
        "shard1_element_normalization": partial(dtensor_case, (world,), [Shard(1)], normalization="element"),
        "shard1_neuron_normalization_spectral_batched_conv": partial(
            dtensor_case, (world,), [Shard(1)], normalization="neuron", adjust_lr_fn="spectral",
            conv_mode="batched"),
        "ddp_process_group_neuron_normalization": partial(ddp_case, world, normalization="neuron"),
        # Matrices stored (in, out) (transformers' Conv1D): Shard(0) splits each matrix's columns (its row sums
        # summed across ranks), Shard(1) its rows; the lr scale that reads out and in, and NorMuon's rows.
        "shard0_transposed_layout_neuron_original": partial(dtensor_case, (world,), [Shard(0)],
                                                            groups=[dict(param_layout="transposed")],
                                                            normalization="neuron", adjust_lr_fn="original"),
        "shard1_transposed_layout_neuron_original": partial(dtensor_case, (world,), [Shard(1)],
                                                            groups=[dict(param_layout="transposed")],
                                                            normalization="neuron", adjust_lr_fn="original"),
        # Moments in fewer bytes, rounded with random bits drawn per entry of the whole tensor: one device's result.
        "shard1_bf16_state": partial(dtensor_case, (world,), [Shard(1)], state_dtype=torch.bfloat16),
        # (DDP's gradients are averaged in another order than one device's: an entry that straddles a rounding
        # threshold may round the other way, hence the trained bfloat16 tolerance.)
        "ddp_process_group_bf16_state": partial(ddp_case, world, atol=TRAINED_BF16_ATOL, state_dtype=torch.bfloat16),
        "shard0_int8_state": partial(dtensor_case, (world,), [Shard(0)], state_dtype="int8"),
        # Shard(1) splits a matrix's last dim, where "int8" keeps bfloat16 (one device keeps 8-bit codes); the
        # expert bank's Shard(1) splits its rows and keeps codes.
        "shard1_int8_state": partial(dtensor_case, (world,), [Shard(1)], atol=INT8_ATOL, state_dtype="int8"),
        # The cost model's bytes against the step's own traffic: default chunks and bf16, one matrix per chunk in fp32.
        "plan_step_bytes_shard0": partial(plan_step_bytes_case, world, [Shard(0)]),
        "plan_step_bytes_shard1_fp32_one_per_chunk": partial(plan_step_bytes_case, world, [Shard(1)],
                                                              comm_dtype=torch.float32, chunk_size=1),
        # Matrices divided between owners (columns, with the Gram parts exchanged each step) and banks divided by
        # experts; sharded, replicated and 2D meshes, bf16 traffic, the AOL preconditioner, timm's scalings, NaN.
        "divided_columns_shard0": partial(divided_case, (world,), [Shard(0)], DIVIDED_SHAPES, "columns"),
        "divided_columns_shard1_aol": partial(divided_case, (world,), [Shard(1)], DIVIDED_SHAPES, "columns",
                                              preconditioner="aol"),
        "divided_columns_replicated_safety_scale_eps": partial(divided_case, (world,), [Replicate()], DIVIDED_SHAPES,
                                                               "columns", safety_factor=1.05, scale_eps=True),
        "divided_columns_nonfinite": partial(divided_case, (world,), [Shard(0)], DIVIDED_SHAPES, "columns",
                                             nan_at=(0, 1, (3, 200))),
        "divided_columns_bf16_comm": partial(divided_case, (world,), [Shard(0)], DIVIDED_SHAPES, "columns",
                                             atol=TRAINED_BF16_ATOL, comm_dtype=None),
        # bfloat16 Newton-Schulz: the Gram parts travel in bfloat16, from ranks with and without a share.
        "divided_columns_bf16_newton_schulz": partial(divided_case, (world,), [Shard(0)], DIVIDED_SHAPES, "columns",
                                                      atol=TRAINED_BF16_ATOL, ns_dtype=torch.bfloat16),
        "divided_experts_shard1": partial(divided_case, (world,), [Shard(1)], EXPERT_SHAPES, "experts"),
        "plan_step_bytes_divided": partial(divided_plan_step_bytes_case, world, [Shard(0)], shapes=DIVIDED_SHAPES,
                                           ns_dtype=torch.float32, ns_algorithm="standard"),
        # offload="cpu": the pipeline and the in-place expert bank staged through a recording copier.
        "shard0_offloaded_int8_state": partial(offload_case, world, state_dtype="int8", chunk_size=2),
        "shard0_offloaded_neuron_normalization": partial(offload_case, world, normalization="neuron",
                                                       adjust_lr_fn="spectral", chunk_size=2),
    }
    if LONE_STRIDED_SHARD_ACCEPTED:
        cases["strided_shard1_1d"] = partial(dtensor_case, (world,), [_StridedShard(1, split_factor=2)])
        cases["strided_shard1_neuron_normalization"] = partial(dtensor_case, (world,),
                                                               [_StridedShard(1, split_factor=2)],
                                                               normalization="neuron")
    if world == 2:  # compiling takes ~20 s a rank on 2 cores: once
        cases["fsdp2_fully_shard_compiled_step"] = partial(fsdp2_case, world, compiled=True)
    if world == 4:
        cases["mesh2x2_strided_shard0_shard0"] = partial(dtensor_case, (2, 2), [_StridedShard(0, split_factor=2),
                                                                                Shard(0)], shapes=STRIDED_SHAPES)
        cases["uneven_strided_runs_on_torch_2_9_are_refused_first"] = partial(refused_dtensor_case, world, "strided")
        # (3, 8) over 4 ranks: rank 3 holds no row, yet must skip (and count) like the rank with the NaN.
        cases["nonfinite_beside_an_empty_shard"] = partial(dtensor_case, (4,), [Shard(0)], nan_at=(1, 1, (0, 2)))
        cases["mesh2x2_shard0_shard1"] = partial(dtensor_case, (2, 2), [Shard(0), Shard(1)])
        cases["released_banks_shard0"] = partial(divided_case, (4,), [Shard(0)], RELEASED_BANK_SHAPES, "experts",
                                                 released=True)
        cases["plan_step_bytes_released_banks"] = partial(plan_step_bytes_case, 4, [Shard(0)],
                                                          shapes=RELEASED_BANK_SHAPES)
        cases["mesh2x2_shard0_shard1_neuron_normalization"] = partial(dtensor_case, (2, 2), [Shard(0), Shard(1)],
                                                                      normalization="neuron")
        cases["nonfinite_beside_an_empty_shard_neuron_normalization"] = partial(
            dtensor_case, (4,), [Shard(1)], nan_at=(2, 1, (0, 2)), normalization="neuron")
        cases["mesh2x2_replicate_shard0"] = partial(dtensor_case, (2, 2), [Replicate(), Shard(0)])
        cases["shard_positions_follow_dtensor_placements"] = shard_positions_case
        cases["no_host_reads_in_a_distributed_step"] = no_host_reads_case
    return cases
