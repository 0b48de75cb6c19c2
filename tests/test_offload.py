"""`offload="cpu"`: the schedule that streams state to the device a group ahead (with a recording copier standing in
for the GPU's side stream, so it runs here), its results against the same optimizer without offload, the CPU-only
no-op, and on a GPU the real thing."""

from __future__ import annotations

import math
import os
import sys
import warnings
import weakref
from collections.abc import Callable

import pytest
import torch
from kernel_under_test import optimizer
from offload_recording import RecordingCopier, offload_module, recorded_offload

Muon = optimizer.Muon
HAS_CUDA = torch.cuda.is_available()


def _model_params(seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    shapes = [(32, 16), (32, 16), (24, 16), (16, 48), (48,), (16,)]
    return [torch.randn(shape, generator=generator).requires_grad_() for shape in shapes]


def _train(params: list[torch.Tensor], steps: int, groups: Callable[[list], list[dict]] | None = None,
           **options) -> Muon:
    opt = Muon(params if groups is None else groups(params), lr=0.02, **options)
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for param in params:
            param.grad = torch.randn(param.shape, generator=generator).to(param.device)
        opt.step()
    return opt


@pytest.mark.parametrize("muon_chunks", [False, True], ids=["whole buckets", "a matrix a chunk"])
@pytest.mark.parametrize("adamw_group_bytes", [None, 1], ids=["default groups", "one AdamW tensor a group"])
@pytest.mark.parametrize("state_dtype", [None, "int8"])
def test_staged_steps_match_unstaged_ones_and_fetch_a_group_ahead_in_one_schedule_per_step(
        monkeypatch, state_dtype, adamw_group_bytes, muon_chunks) -> None:
    log: list[str] = []
    functional = sys.modules[f"{optimizer.__name__}.functional"]
    chunk_numel = {"cpu": 1} if muon_chunks else functional._BUCKET_NUMEL
    monkeypatch.setattr(functional, "_BUCKET_NUMEL", chunk_numel)
    if adamw_group_bytes is not None:
        monkeypatch.setattr(offload_module, "GROUP_BYTES", adamw_group_bytes)
    for name in ("muon_update", "adamw_update"):
        update = getattr(offload_module, name)
        monkeypatch.setattr(offload_module, name, lambda *args, _update=update, **kwargs: (log.append("update"),
                                                                                          _update(*args, **kwargs)))
    staged_params, plain_params = _model_params(0), _model_params(0)
    with warnings.catch_warnings(), recorded_offload(log):
        warnings.simplefilter("ignore")  # the CPU-only notice, tested below
        staged = _train(staged_params, 3, state_dtype=state_dtype, offload="cpu")
    monkeypatch.undo()
    monkeypatch.setattr(functional, "_BUCKET_NUMEL", chunk_numel)  # the same batches, so the same roundings
    plain = _train(plain_params, 3, state_dtype=state_dtype)
    for staged_param, plain_param in zip(staged_params, plain_params):
        assert torch.equal(staged_param, plain_param)
        for key, value in plain.state[plain_param].items():
            assert torch.equal(staged.state[staged_param][key], value), key
    # Per step, one schedule: Muon's three buckets ((32, 16) twice, (24, 16), (16, 48)), or in chunks of one matrix
    # four, then AdamW's two tensors, in one group (a few hundred bytes of state) or, with a budget of one byte, one at
    # a time. Group i + 1's fetch is issued before group i's update, and group i's write-back after it; the host waits
    # for the write-backs once, at the end (so the AdamW part's first fetch goes before the Muon part's last update).
    groups = (4 if muon_chunks else 3) + (1 if adamw_group_bytes is None else 2)
    schedule = ["fetch", "ready"] + ["fetch", "update", "write_back", "ready"] * (groups - 1) + [
        "update", "write_back", "finish"]
    assert log == schedule * 3
    # Each group's homes packed into one allocation (`repack_homes`), but AdamW pieces' (views, left where they are).
    muon_storages = 4 if muon_chunks else 3
    adamw_storages = 1 if adamw_group_bytes is None else 2 if state_dtype == "int8" else 4  # rounded moments: whole
    assert len({value.untyped_storage().data_ptr() for state in staged.state.values()
                for key, value in state.items() if key in offload_module.OFFLOADED_STATE}) == (
        muon_storages + adamw_storages)


def test_staged_groups_that_differ_only_in_lr_and_weight_decay_share_buckets_as_unstaged_ones_do(monkeypatch) -> None:
    log: list[str] = []
    batches: list[int] = []
    update = offload_module.muon_update
    monkeypatch.setattr(offload_module, "muon_update", lambda items, **settings: (batches.append(len(items)),
                                                                                 update(items, **settings)))

    def grouped(params: list[torch.Tensor]) -> list[dict]:
        return [dict(params=params[0::2]), dict(params=params[1::2], lr=0.01, weight_decay=0.3)]
    staged_params, plain_params = _model_params(0), _model_params(0)
    with warnings.catch_warnings(), recorded_offload(log):
        warnings.simplefilter("ignore")  # the CPU-only notice
        _train(staged_params, 3, grouped, offload="cpu")
    monkeypatch.undo()
    _train(plain_params, 3, grouped)
    for staged_param, plain_param in zip(staged_params, plain_params):
        assert torch.equal(staged_param, plain_param)
    # Per step, one staged update a bucket: the two groups' (32, 16) matrices together, then (24, 16) and (16, 48).
    assert batches == [2, 1, 1] * 3


@pytest.mark.parametrize("budget", [None, 3000], ids=["every group in a kept buffer", "two groups too large"])
def test_later_steps_keep_each_groups_layout_copies_and_launch_plan_in_buffers_kept_between_steps(
        monkeypatch, budget) -> None:
    """Four groups a step: Muon's buckets of (32, 16) (4 KiB of float32 momentum), (24, 16) (1.5 KiB) and (16, 48)
    (3 KiB), then the AdamW vectors (512 bytes). Group k's copies are cut from kept buffer k % SLOTS, each buffer as
    large as the largest group it serves, and a fetch into a buffer waits for the write-back of the group that used
    it before in the step; a group over the budget (3000 bytes: the first and the third) takes memory of its own at
    each step, waiting for nothing. From the second step on, nothing is laid out, only the groups without a kept
    buffer are bound to memory (and let go of it right after their write-back), the updates get the same items as
    before, and the AdamW part's one-launch plan (Triton under the interpreter) is the first step's. The AdamW group
    updates and writes back on the copier's side stream. A checkpoint load replaces the state tensors (and the
    schedule): the next step lays every group out anew. Parameters and state stay bitwise those of the same steps
    without offload."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU tensors in Triton kernels need the interpreter")
    functional = sys.modules[f"{optimizer.__name__}.functional"]
    monkeypatch.setattr(functional, "ONE_LAUNCH_DEVICE_TYPES", ("cpu",))
    monkeypatch.setattr(functional, "_one_launch_failed", set())  # filled only by a kernel that fails
    if budget is not None:
        monkeypatch.setattr(offload_module, "GROUP_BYTES", budget)
    calls = {"lay_out": 0, "bind": 0, "plans": 0}
    handed: list[list] = []  # the items themselves (kept alive, so that no id is used twice)

    def counted(name: str, function: Callable) -> Callable:
        return lambda *args, **kwargs: (calls.__setitem__(name, calls[name] + 1), function(*args, **kwargs))[1]

    monkeypatch.setattr(offload_module, "lay_out", counted("lay_out", offload_module.lay_out))
    monkeypatch.setattr(offload_module.LaidOut, "bind", counted("bind", offload_module.LaidOut.bind))
    monkeypatch.setattr(functional, "_launch_groups", counted("plans", functional._launch_groups))
    events: list[str] = []
    for name in ("muon_update", "adamw_update"):
        update = getattr(offload_module, name)
        monkeypatch.setattr(offload_module, name, lambda items, *args, _update=update, **kwargs: (
            handed.append(list(items)), events.append("update"), _update(items, *args, **kwargs))[2])
    release = offload_module.LaidOut.release
    monkeypatch.setattr(offload_module.LaidOut, "release", lambda self, unbind=False: (
        events.append(f"release{' memory' * unbind}"), release(self, unbind))[1])
    allocate = RecordingCopier.allocate
    monkeypatch.setattr(RecordingCopier, "allocate", lambda self, nbytes, device: (
        events.append("allocate"), allocate(self, nbytes, device))[1])

    def run(offload: str | None) -> tuple[list[torch.Tensor], Muon, list[dict[str, int]]]:
        params = _model_params(0)
        opt = Muon(params, lr=0.02)
        opt.offload = offload  # set after construction: on CPU parameters the constructor only warns
        generator = torch.Generator().manual_seed(1)
        counts = []
        for step in range(4):
            if step == 3:
                opt.load_state_dict(opt.state_dict())
            for param in params:  # in place after the first, as the caching allocator would place them
                grad = torch.randn(param.shape, generator=generator)
                param.grad = grad if param.grad is None else param.grad.copy_(grad)
            opt.step()
            counts.append(dict(calls))
            calls.update({name: 0 for name in calls})
        return params, opt, counts

    copiers: list[RecordingCopier] = []
    with recorded_offload([], copiers):
        staged_params, staged, counts = run("cpu")
    staged_handed, staged_events = handed[:], events[:]
    plain_params, plain, _ = run(None)
    for staged_param, plain_param in zip(staged_params, plain_params):
        assert torch.equal(staged_param, plain_param)
        for key, value in plain.state[plain_param].items():
            assert torch.equal(staged.state[staged_param][key], value), key
    unslotted = 0 if budget is None else 2
    assert counts == [{"lay_out": 4, "bind": 4, "plans": 1}, *[{"lay_out": 0, "bind": unslotted, "plans": 0}] * 2,
                      {"lay_out": 4, "bind": 4, "plans": 1}]
    steps = [[list(map(id, items)) for items in staged_handed[4 * step:4 * step + 4]] for step in range(4)]
    kept = [0, 1, 2, 3] if budget is None else [1, 3]
    assert [steps[1][k] for k in kept] == [steps[0][k] for k in kept] == [steps[2][k] for k in kept]
    assert all(set(steps[step][k]).isdisjoint(steps[step - 1][k]) for k in range(4) for step in (1, 2, 3)
               if step == 3 or k not in kept)
    # A group over the budget takes its memory just before its fetch (the group before it updates after that) and
    # lets go of it as soon as its update and write-back are issued, so that no two such groups' memory need be live
    # at once; every group lets go of its gradients then. The first step (and the first after the load) allocates
    # the kept buffers first, one per slot that serves a group.
    if budget is None:
        kept_buffers, per_step = 3, ["update", "release"] * 4
    else:
        kept_buffers, per_step = 2, ["allocate", "update", "release memory", "allocate", "update", "release",
                                     "update", "release memory", "update", "release"]
    first = ["allocate"] * kept_buffers + per_step
    assert staged_events == first + per_step * 2 + first
    waits = [None, None, None, 0] if budget is None else [None] * 4
    # A load makes a new schedule (torch's load_state_dict sets the optimizer's state anew: `__setstate__`).
    assert [copier.waits for copier in copiers] == [waits * 3, waits]
    # The Muon buckets update on the compute stream, the AdamW group on the side stream, which starts each step
    # after the compute stream's work so far.
    sides = [("begin", True)] + [(call, aside) for aside in (False, False, False, True)
                                 for call in ("ready", "updating", "write_back")]
    assert [copier.sides for copier in copiers] == [sides * 3, sides]
    lane = staged._staged_updates._lanes[torch.device("cpu")]
    slots = [position % offload_module.SLOTS for position in range(4)]
    for position, group in enumerate(lane.groups):
        assert (group.memory is not None and group.memory is lane.buffers[slots[position]]) == (position in kept)
    sizes = [group.nbytes for group in lane.groups]
    assert [0 if buffer is None else buffer.numel() for buffer in lane.buffers] == [
        max([size for size, slot, position in zip(sizes, slots, range(4)) if slot == buffer and position in kept],
            default=0) for buffer in range(offload_module.SLOTS)]


def _adamw_item(numel: int, rounded: bool = False, contiguous: bool = True):
    functional = sys.modules[f"{optimizer.__name__}.functional"]
    param = torch.randn(numel) if contiguous else torch.randn(2 * numel)[::2]
    return functional.AdamWTensors(param, torch.randn(numel), torch.randn(numel), torch.rand(numel),
                                   torch.tensor(3.0), torch.tensor(1), torch.tensor(0) if rounded else None)


def test_adamw_groups_fill_the_byte_budget_in_order_and_cut_a_larger_parameter_into_pieces() -> None:
    """Float32 moments take 8 bytes an entry; a budget of 4 KiB holds 512 entries. A larger parameter is cut into
    pieces of 512 (a multiple of PIECE_ALIGNMENT), views of its tensors, the last holding its step and skip counts and
    the others copies of them; one whose moments are stored rounded, or that is not contiguous, goes alone."""
    assert offload_module.PIECE_ALIGNMENT == 256
    sizes = [100, 300, 112, 1300, 40, 0, 600, 700, 10]
    items = [_adamw_item(size, rounded=index == 6, contiguous=index != 7) for index, size in enumerate(sizes)]
    groups = offload_module.adamw_groups(items, budget=4096)
    assert [[(index, piece.param.numel()) for index, piece in group] for group in groups] == [
        [(0, 100), (1, 300), (2, 112)], [(3, 512)], [(3, 512)], [(3, 276), (4, 40), (5, 0)], [(6, 600)], [(7, 700)],
        [(8, 10)]]
    pieces = [piece for group in groups for index, piece in group if index == 3]
    whole = items[3]
    for number, piece in enumerate(pieces):
        for name in ("param", "grad", "exp_avg", "exp_avg_sq"):
            assert getattr(piece, name).data_ptr() == getattr(whole, name).data_ptr() + number * 512 * 4, name
        last = number == len(pieces) - 1
        assert (piece.step is whole.step) == last and (piece.nonfinite_skips is whole.nonfinite_skips) == last
        assert torch.equal(piece.step, whole.step) and torch.equal(piece.nonfinite_skips, whole.nonfinite_skips)


@pytest.mark.parametrize("kernels", ["cpu", "one Triton launch"])
@pytest.mark.parametrize("state_dtype", [None, torch.bfloat16])
def test_an_adamw_parameter_staged_in_pieces_steps_and_counts_as_one_staged_whole(monkeypatch, state_dtype,
                                                                                   kernels) -> None:
    """A vector of 1000 entries with a budget of 2 KiB of moments: four pieces of 256 entries (float32 moments), or
    whole (bfloat16 moments are stored rounded). Five steps, the second's gradient holding a NaN, the step count
    moved in place by the caller before the fourth, and the parameter's memory replaced (`param.data`) before the
    fifth: parameter and state bitwise those of the same steps without offload, the step count moved four times (and
    by the caller) and the skip count once. The pieces are cut once and handed to the updates again at the next
    steps, each with its slice of the new gradient and the counts as they are now, until the memory they view is
    replaced; between steps no piece holds on to the step's gradient (`zero_grad` may free it). On the CPU's compiled
    op, and on the one-launch Triton kernels a GPU runs (here under the interpreter), whose tables then address the
    pieces as views into their parameter's tensors."""
    if kernels == "one Triton launch":
        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("CPU tensors in Triton kernels need the interpreter")
        functional = sys.modules[f"{optimizer.__name__}.functional"]
        monkeypatch.setattr(functional, "ONE_LAUNCH_DEVICE_TYPES", ("cpu",))
        monkeypatch.setattr(functional, "_one_launch_failed", set())  # filled only by a kernel that fails
    log: list[str] = []
    monkeypatch.setattr(offload_module, "GROUP_BYTES", 2048)
    handed: list[list] = []  # each update's items (kept alive, so that no id is used twice)
    update = offload_module.adamw_update
    monkeypatch.setattr(offload_module, "adamw_update", lambda items, *args, **kwargs: (
        handed.append(list(items)), update(items, *args, **kwargs))[1])

    def run(offload: str | None) -> tuple[torch.Tensor, Muon]:
        param = torch.randn(1000, generator=torch.Generator().manual_seed(0)).requires_grad_()
        opt = Muon([param], lr=0.02, weight_decay=0.1, state_dtype=state_dtype)
        opt.offload = offload  # set after construction: on CPU parameters the constructor only warns
        generator = torch.Generator().manual_seed(1)
        for step in range(5):
            param.grad = torch.randn(1000, generator=generator)
            if step == 1:
                param.grad[700] = math.nan
            if step == 3:
                opt.state[param]["step"].add_(5)
            if step == 4:
                param.data = param.data.clone()
            opt.step()
            gradient = weakref.ref(param.grad)
            param.grad = None
            assert gradient() is None, f"step {step}: the gradient outlives zero_grad"
        return param, opt

    with recorded_offload(log):
        staged_param, staged = run("cpu")
    staged_handed = [[id(piece) for piece in items] for items in handed]
    plain_param, plain = run(None)
    assert torch.equal(staged_param, plain_param)
    for key, value in plain.state[plain_param].items():
        assert torch.equal(staged.state[staged_param][key], value), key
    assert staged.state[staged_param]["step"].item() == 9 and staged.nonfinite_skips() == 1
    pieces = 4 if state_dtype is None else 1
    schedule = ["fetch", "ready"] + ["fetch", "write_back", "ready"] * (pieces - 1) + ["write_back", "finish"]
    assert log == schedule * 5
    steps = [sum(staged_handed[step * pieces:(step + 1) * pieces], []) for step in range(5)]
    if state_dtype is None:
        assert steps[0] == steps[1] == steps[2] == steps[3] and set(steps[4]).isdisjoint(steps[3])


@pytest.mark.parametrize("kind", ["muon", "adamw"])
def test_an_item_is_offloaded_when_its_first_moment_lives_away_from_its_parameter(kind: str) -> None:
    """The step's one-pass check against the item-by-item one, with a "meta" tensor standing for state elsewhere:
    parameters on one device and on two, each item at home or away."""
    functional = sys.modules[offload_module.__name__.rsplit(".", 1)[0] + ".functional"]

    def item(param_device: str, moment_device: str):
        param, moment = torch.zeros(2, 2, device=param_device), torch.zeros(2, 2, device=moment_device)
        if kind == "muon":
            return functional.MuonTensors(param, param, moment, param, None)
        return functional.AdamWTensors(param, param, moment, moment, param, param)

    for devices in [[("cpu", "cpu")] * 3, [("cpu", "cpu"), ("cpu", "meta"), ("cpu", "cpu")], [("meta", "meta")],
                    [("cpu", "cpu"), ("meta", "meta")], [("cpu", "meta"), ("meta", "meta")],
                    [("cpu", "cpu"), ("meta", "cpu")], []]:
        items = [item(*pair) for pair in devices]
        expected = any(param_device != moment_device for param_device, moment_device in devices)
        assert offload_module.any_offloaded(items) is expected, devices


def test_a_groups_device_copies_are_aligned_disjoint_views_of_one_allocation() -> None:
    """The CUDA copier's copies (made here on the CPU): each of its state tensor's shape and dtype, contiguous, from a
    16-byte boundary as the one-launch kernels need, none overlapping another, and all in one allocation; runs of one
    dtype and shape (cut from one view of their span) among them, each where `_layout` places it."""
    homes = [torch.zeros(5, 3), torch.zeros(5, 3), torch.zeros(7, dtype=torch.int8), torch.zeros(()),
             torch.zeros(0, 4), torch.zeros(300, dtype=torch.bfloat16), *[torch.zeros(4, 32) for _ in range(3)],
             torch.zeros(0, 4), torch.zeros(0, 4), torch.zeros(8, 32), torch.zeros(256, dtype=torch.bfloat16)]
    starts, total = offload_module._layout(homes)
    copies = offload_module._cut(homes, torch.empty(total, dtype=torch.uint8))
    base = copies[0].data_ptr()
    assert [copy.data_ptr() - base for copy in copies if copy.nbytes] == [
        start for start, home in zip(starts, homes) if home.nbytes]
    assert [(copy.shape, copy.dtype) for copy in copies] == [(home.shape, home.dtype) for home in homes]
    assert all(copy.is_contiguous() and copy.data_ptr() % 16 == 0 for copy in copies)
    assert len({copy.untyped_storage().data_ptr() for copy in copies}) == 1
    spans = sorted((copy.data_ptr(), copy.data_ptr() + copy.nbytes) for copy in copies if copy.nbytes)
    assert all(end <= next_start for (_, end), (next_start, _) in zip(spans, spans[1:]))
    for copy, value in zip(copies, range(1, len(copies) + 1)):
        copy.fill_(value)
    assert [copy.unique().tolist() for copy in copies if copy.numel()] == [[index + 1] for index, home in
                                                                          enumerate(homes) if home.numel()]


def test_a_fetch_lays_a_groups_homes_in_runs_and_hands_each_item_its_own_copies() -> None:
    """`lay_out` (here through `start_fetch`) orders a group's homes field by field and, within a field, in runs of
    one dtype and shape (the vectors of a model's blocks alternate shapes); `staged` hands each item the device copies
    of its own tensors."""
    functional = sys.modules[f"{optimizer.__name__}.functional"]
    generator = torch.Generator().manual_seed(0)
    shapes = [(48,), (16,), (48,), (3, 4), (16,), (48,)]

    def item(shape: tuple[int, ...]) -> functional.AdamWTensors:
        param, exp_avg, exp_avg_sq = (torch.randn(shape, generator=generator) for _ in range(3))
        return functional.AdamWTensors(param, param.clone(), exp_avg, exp_avg_sq, torch.zeros(()), torch.zeros(()))

    group = [item(shape) for shape in shapes]
    copier = RecordingCopier([])
    staging = offload_module.start_fetch(group, copier)
    laid = staging.group
    runs = [(field, laid.homes[index].shape) for index, (_, field) in enumerate(laid.places)]
    starts = [run for index, run in enumerate(runs) if index == 0 or runs[index - 1] != run]
    assert len(starts) == len(set(starts)) == 2 * len(set(shapes)), runs  # each run in one piece
    assert [field for field, _ in starts] == ["exp_avg"] * 3 + ["exp_avg_sq"] * 3
    staged = offload_module.staged(staging, copier)
    assert len(laid.transfer.device_side) == 2 * len(group)
    for original, moved in zip(group, staged):
        assert moved.param is original.param and moved.grad is original.grad
        for field in ("exp_avg", "exp_avg_sq"):
            copy, home = getattr(moved, field), getattr(original, field)
            assert copy is not home and copy.shape == home.shape and torch.equal(copy, home), field


def _bound(homes: list[torch.Tensor], packed: bool, spare: int = 0):
    """A layout of `homes` (of no items) bound to memory of its own, `spare` bytes larger than it needs (a kept
    buffer that a larger group made)."""
    nbytes = offload_module._layout(homes)[1]
    laid = offload_module.LaidOut([], [], homes, packed=packed, nbytes=nbytes)
    laid.bind(torch.empty(nbytes + spare, dtype=torch.uint8))
    return laid


def test_a_groups_homes_are_packed_in_place_and_cross_in_one_copy_each_way() -> None:
    """`repack_homes` moves a group's state tensors into one allocation laid out as their device copies are, each
    tensor the same object with the same values; then a fetch and a write-back are one copy each, of the group's bytes
    (however large the buffer its copies are cut from), a second packing changes nothing, and a group that changes is
    packed anew, leaving the tensor it dropped as it was. Homes not packed (AdamW pieces) are copied one by one."""
    homes = [torch.randn(5, 3), torch.arange(7, dtype=torch.int8), torch.tensor(2.5), torch.zeros(0, 4),
             torch.randn(300).to(torch.bfloat16)]
    dropped = torch.randn(9)
    dropped_value = dropped.clone()
    offload_module.repack_homes([*homes[:2], dropped, *homes[2:]])
    objects, values = list(map(id, homes)), [home.clone() for home in homes]
    offload_module.repack_homes(homes)  # `dropped` has no gradient this step
    assert list(map(id, homes)) == objects and all(map(torch.equal, homes, values))
    assert len({home.untyped_storage().data_ptr() for home in homes if home.nbytes}) == 1
    assert dropped.untyped_storage().data_ptr() != homes[0].untyped_storage().data_ptr()
    assert torch.equal(dropped, dropped_value)
    packed_at = homes[0].data_ptr()
    offload_module.repack_homes(homes)
    assert homes[0].data_ptr() == packed_at

    laid = _bound(homes, packed=True, spare=4096)
    transfer = laid.transfer
    assert [side[0].nbytes for side in (transfer.device_side, transfer.host_side)] == [laid.nbytes] * 2
    assert len(transfer.device_side) == len(transfer.host_side) == 1
    offload_module.copy_all(transfer.device_side, transfer.host_side)
    copies = offload_module._cut(homes, laid.memory)
    assert all(map(torch.equal, copies, values))
    for copy in copies:
        copy.add_(1)
    offload_module.copy_all(transfer.host_side, transfer.device_side)
    assert all(torch.equal(home, value + 1) for home, value in zip(homes, values))
    # Views laid out as a packed group's homes would be (400-byte tensors 512 bytes apart, in 1024 bytes), but with
    # other entries between them: not packed, so copied tensor by tensor, and the entries between stay as they were.
    whole = torch.randn(256)
    before = whole.clone()
    pieces = [whole[:100], whole[128:228]]
    assert offload_module._is_packed(pieces)
    transfer = _bound(pieces, packed=False).transfer
    assert transfer.host_side == pieces and len(transfer.device_side) == 2
    offload_module.copy_all(transfer.device_side, transfer.host_side)
    for copy in transfer.device_side:
        copy.add_(1)
    offload_module.copy_all(transfer.host_side, transfer.device_side)
    assert torch.equal(whole[:100], before[:100] + 1) and torch.equal(whole[128:228], before[128:228] + 1)
    assert torch.equal(whole[100:128], before[100:128]) and torch.equal(whole[228:], before[228:])


def test_a_zero_size_parameter_alone_in_its_staged_group_steps_as_without_offload() -> None:
    # Its group has no bytes to move: no buffer was made for it, and every step failed ('NoneType' object has no
    # attribute 'device_side').
    def params() -> list[torch.Tensor]:
        return [torch.randn(8, 8, generator=torch.Generator().manual_seed(0)), torch.zeros(0)]

    staged_params, plain_params = params(), params()
    with warnings.catch_warnings(), recorded_offload([]):
        warnings.simplefilter("ignore")  # the CPU-only notice
        staged = _train(staged_params, 2, offload="cpu")
    plain = _train(plain_params, 2)
    assert all(torch.equal(p, q) for p, q in zip(staged_params, plain_params))
    assert staged.state[staged_params[1]]["step"] == plain.state[plain_params[1]]["step"] == 2


def test_offload_on_cpu_parameters_is_a_noop_that_says_so_once() -> None:
    with pytest.warns(UserWarning, match="offload='cpu' has no effect here: every parameter is on the CPU") as notes:
        opt = _train(_model_params(0), 2, offload="cpu")
    assert len(notes) == 1
    reference_params = _model_params(0)
    reference = _train(reference_params, 2)
    for param, reference_param in zip(opt.param_groups[0]["params"], reference_params):
        assert torch.equal(param, reference_param)
    assert all(value.device.type == "cpu" for state in opt.state.values() for value in state.values())
    assert reference.state_dict()["state"].keys() == opt.state_dict()["state"].keys()


def test_an_unknown_offload_target_is_refused() -> None:
    with pytest.raises(ValueError, match="offload"):
        Muon(_model_params(0), offload="disk")


@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")
@pytest.mark.parametrize("pieces", [False, True], ids=["whole", "AdamW tensors in pieces"])
@pytest.mark.parametrize("state_dtype", [None, torch.bfloat16, "int8"])
def test_offloaded_state_lives_pinned_on_the_host_and_steps_as_on_the_gpu(monkeypatch, state_dtype, pieces) -> None:
    if pieces:  # the (48,) vector in three pieces of 16 entries (64-byte views, as the one-launch kernel takes them)
        monkeypatch.setattr(offload_module, "PIECE_ALIGNMENT", 16)
        monkeypatch.setattr(offload_module, "GROUP_BYTES", 16 * 8)
    offloaded_params = [param.detach().cuda().requires_grad_() for param in _model_params(0)]
    resident_params = [param.detach().cuda().requires_grad_() for param in _model_params(0)]
    offloaded = _train(offloaded_params, 3, state_dtype=state_dtype, offload="cpu")
    resident = _train(resident_params, 3, state_dtype=state_dtype)
    for param, resident_param in zip(offloaded_params, resident_params):
        torch.testing.assert_close(param, resident_param, rtol=0, atol=0)
        for key in offload_module.OFFLOADED_STATE:
            if key in offloaded.state[param]:
                value = offloaded.state[param][key]
                assert value.device.type == "cpu" and value.is_pinned(), key
                assert torch.equal(value, resident.state[resident_param][key].cpu()), key
    loaded = Muon(offloaded_params, lr=0.02, state_dtype=state_dtype, offload="cpu")
    loaded.load_state_dict(offloaded.state_dict())
    loaded.step()  # a checkpoint loads onto the parameters' device; the step moves the moments home again
    assert all(value.device.type == "cpu" for state in loaded.state.values()
               for key, value in state.items() if key in offload_module.OFFLOADED_STATE)
