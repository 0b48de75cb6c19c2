"""`offload="cpu"`: optimizer state kept in pinned host memory and brought to the compute device one group of
parameters at a time, the next group's copy in flight while the current one computes.

A step's Muon buckets and AdamW parameter groups go through one schedule per device (`StagedUpdates`, which the
optimizer keeps from step to step), written against a `Copier` so that it runs, and is tested, without a GPU:
    fetch(0); fetch(1); update(0); write back(0); fetch(2); update(1); write back(1); ...
so that the AdamW part's first fetch overlaps the Muon part's last update and the host waits for the write-backs once.
Group k's device copies are cut from buffer k % SLOTS of a few kept between steps (`_Lane`), and each group's layout,
copies and the items holding them are kept too while its items are the same objects (a parameter cut into pieces keeps
its pieces, `StagedUpdates.pieces`): a later step repeats only the copies and the update, whose AdamW launch plans
(`launch_plans`) then find the same items again. A fetch into a buffer waits for the write-back of the group that used
it before. The distributed pipeline stages its chunks with `start_fetch` / `staged` / `Copier.write_back` on memory of
their own, a chunk's fetch issued while the chunks before it compute. The CUDA copier issues fetches on one side stream
and write-backs on another, so that the host link carries both directions at once: an update waits for its fetch's
event, a write-back for the update's event, and a fetch for nothing on the compute stream (the host memory it reads was
last written back by the previous step, which waited for its write-backs). The AdamW part's groups update and write back
on a third stream, which starts after the compute stream's work issued before the schedule, so that they do not wait
behind the Muon part's Newton-Schulz. The device holds about SLOTS groups' state at once (four chunks' in the
distributed pipeline), and between steps the kept buffers.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Generic, Protocol, TypeVar

import torch
from torch import Tensor

from .functional import (AdamWTensors, MuonTensors, Rates, adamw_update, buckets, by_device, muon_update,
                         nonfinite_flags, picked)
from .state_precision import CODES_KEYS, MOMENT_KEYS, scale_key

OFFLOAD_TARGETS: tuple[str | None, ...] = (None, "cpu")
# The state the option moves: the moments and their block scales, and NorMuon/AdaMuon's second moment. Counters stay
# with the parameter (a few bytes, read by every step's bookkeeping).
OFFLOADED_STATE = (*MOMENT_KEYS, *CODES_KEYS, *(scale_key(key) for key in MOMENT_KEYS), "update_sq")
# Bytes of state a group fetches to the device at most, where it can: AdamW parameters go in groups of up to this
# much (a larger one cut into pieces where it can be, `_pieces`), and a group of up to this much takes its copies from
# a buffer kept between steps (a larger one, a bucket of large matrices or moments stored rounded, which stay whole,
# takes memory of its own for the step).
GROUP_BYTES = 32 << 20
# The buffers kept. Three, not two: with two, a fetch would wait for the write-back of the group before the one
# updating, which starts only once that group's update is done, so that where updates take about as long as copies
# the host link would carry one direction at a time (a schedule worked out on paper, not measured).
SLOTS = 3
# The same tensors as fields of functional's items, by the item's type.
OFFLOADED_FIELDS = {MuonTensors: ("momentum_buffer", "momentum_scales", "second_moment"),
                    AdamWTensors: ("exp_avg", "exp_avg_sq", "exp_avg_scales", "exp_avg_sq_scales")}

Item = TypeVar("Item")


def home_device(param: Tensor, offload: str | None) -> torch.device:
    """Where a parameter's offloadable state lives: the host with `offload="cpu"` and a parameter elsewhere."""
    return torch.device("cpu") if offload == "cpu" and param.device.type != "cpu" else param.device


def keep_at_home(state: dict[str, Any], home: torch.device) -> None:
    """Moves a parameter's offloadable state where it lives (after its creation on the parameter's device, or a
    checkpoint load, which torch places there); host copies are pinned, so the transfers run asynchronously.

    `empty_like` + `copy_` rather than `.to(home).pin_memory()`: one copy, and a DTensor stays a DTensor on its mesh
    with its local shard at home (as FSDP2's CPU offload keeps its parameters), which checkpoints reshard as usual."""
    pin = home.type == "cpu" and torch.cuda.is_available()
    for key in OFFLOADED_STATE:
        if key in state and state[key].device != home:
            state[key] = torch.empty_like(state[key], device=home, pin_memory=pin).copy_(state[key])


def any_offloaded(items: Sequence[MuonTensors | AdamWTensors]) -> bool:
    """Whether some item's state lives away from its parameter (`offloaded`); for items on one device, told by the
    set of their first moments' devices (asked of every parameter every step: a call per item took twice as long)."""
    homes = {item.param.device for item in items}
    if len(homes) != 1:
        return any(offloaded(item) for item in items)
    return {_first_moment(item).device for item in items} != homes


def offloaded(item: MuonTensors | AdamWTensors) -> bool:
    """Whether an item's state lives away from its parameter. `keep_at_home` moves all of it together, so the first
    moment tells (asked of every parameter every step: one device comparison, not one per field)."""
    return _first_moment(item).device != item.param.device


def _first_moment(item: MuonTensors | AdamWTensors) -> Tensor:
    return item.momentum_buffer if isinstance(item, MuonTensors) else item.exp_avg


@dataclass
class Transfer:
    """What crosses the host link for a group of items, in each direction: each device-side tensor from and into its
    host-side one, and the device allocation under the device side (for the copier to mark in use on its streams)."""

    device_side: list[Tensor]
    host_side: list[Tensor]
    memory: Tensor


class Copier(Protocol):
    """Moves groups' state between host and device around their updates. A group's update runs on the compute stream,
    or staged `aside` (the AdamW part's groups, whose updates are short) on a side stream, where its write-back
    follows it: it then neither waits behind the Muon part's Newton-Schulz on the compute stream nor holds back a
    Muon bucket's write-back."""

    def allocate(self, nbytes: int, device: torch.device) -> Tensor:
        """Uninitialized memory on `device` (uint8) for a group's copies, safe to fill by a fetch."""

    def begin(self) -> None:
        """Orders the side stream after the compute stream's work so far (the step's gradients and checks)."""

    def fetch(self, transfer: Transfer, after: Any = None) -> Any:
        """Starts copying the host side into the device side once the write-back `after` (a handle `write_back`
        returned, or None) is done reading that memory; returns a handle for `ready`."""

    def ready(self, handle: Any, aside: bool = False) -> None:
        """Orders the next work of the stream that updates the group (with `aside`, the side stream) after the
        fetch."""

    def updating(self, aside: bool = False) -> AbstractContextManager:
        """Where the group's update runs: on the compute stream, or with `aside` on the side stream."""

    def write_back(self, transfer: Transfer, aside: bool = False) -> Any:
        """Starts copying the device side, updated, back into the host side once the group's update is done;
        returns a handle for a later fetch into the same memory."""

    def finish(self) -> None:
        """Returns once every write-back is in host memory."""


# Where each of a group's copies starts in their one allocation: the caching allocator's own alignment, so the
# one-launch kernels, which need 16 bytes, take them as they take tensors of their own.
_COPY_ALIGNMENT = 512


@dataclass
class _Fetched:
    memory: Tensor
    event: torch.cuda.Event


class CudaCopier:
    """Copies on side streams of the parameters' GPU, fetches on one, write-backs on another, and the updates staged
    aside with their write-backs on a third, ordered with the compute stream by events. One side stream ran the two
    directions one after the other: GPT-2 small's offloaded step on an H100 (2026-11-26) spent 12.1 ms fetching and
    12.5 ms writing back, in a 30.7 ms step. A group's device copies are views of one allocation, filled and emptied
    by one call each (a `to` call per tensor took 7 ms of that step's host time for its 242 state tensors), and by one
    copy each where its homes are packed too (`repack_homes`: a copy per tensor was 629 `cudaMemcpyAsync` calls of an
    int8-state step, host-bound at 29.7 ms against 12.8 ms of device work, H100, 2026-11-27)."""

    def __init__(self, device: torch.device) -> None:
        self.fetch_stream = torch.cuda.Stream(device)
        self.write_stream = torch.cuda.Stream(device)
        self.side_stream = torch.cuda.Stream(device)

    def allocate(self, nbytes: int, device: torch.device) -> Tensor:
        with torch.cuda.stream(self.fetch_stream):  # the stream that writes it first
            return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def begin(self) -> None:
        self.side_stream.wait_event(self._compute().record_event())

    def fetch(self, transfer: Transfer, after: torch.cuda.Event | None = None) -> _Fetched:
        if after is not None:
            self.fetch_stream.wait_event(after)
        with torch.cuda.stream(self.fetch_stream):
            copy_all(transfer.device_side, transfer.host_side)
            return _Fetched(transfer.memory, self.fetch_stream.record_event())

    def ready(self, handle: _Fetched, aside: bool = False) -> None:
        stream = self.side_stream if aside else self._compute()
        stream.wait_event(handle.event)
        handle.memory.record_stream(stream)  # allocated on the fetch stream, used on this one

    def updating(self, aside: bool = False) -> AbstractContextManager:
        return torch.cuda.stream(self.side_stream) if aside else nullcontext()

    def write_back(self, transfer: Transfer, aside: bool = False) -> torch.cuda.Event:
        if aside:  # after the update, on its stream
            stream = self.side_stream
        else:
            stream = self.write_stream
            stream.wait_event(self._compute().record_event())
            transfer.memory.record_stream(stream)
        with torch.cuda.stream(stream):
            copy_all(transfer.host_side, transfer.device_side)
            return stream.record_event()

    def finish(self) -> None:
        # The host may read the state as soon as step() returns, and the next step's work may touch what the
        # updates staged aside wrote.
        self.write_stream.synchronize()
        self.side_stream.synchronize()

    def _compute(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.fetch_stream.device)


def _layout(tensors: Sequence[Tensor]) -> tuple[list[int], int]:
    """Where each of `tensors` starts in one allocation that holds them all in order, in bytes, and its size."""
    starts, total = [], 0
    for tensor in tensors:
        starts.append(total)
        total += _padded(tensor.nbytes)
    return starts, total


def _padded(nbytes: int) -> int:
    return -(-nbytes // _COPY_ALIGNMENT) * _COPY_ALIGNMENT


def _cut(tensors: Sequence[Tensor], memory: Tensor) -> list[Tensor]:
    """Uninitialized contiguous tensors of `tensors`' shapes and dtypes, views of `memory` (uint8, at least
    `_layout`'s total bytes) where `_layout` places them. Each run of tensors of one dtype and shape (a bucket's
    momentum buffers, an AdamW parameter's two moments) is cut from one view of its span, a row per tensor: three view
    calls per tensor took ~5 µs each on the host, more than the rest of a fetch's work for a bucket of small
    matrices."""
    views: list[Tensor] = []
    start = index = 0
    while index < len(tensors):
        first = tensors[index]
        end = index + 1
        while end < len(tensors) and tensors[end].dtype == first.dtype and tensors[end].shape == first.shape:
            end += 1
        count, padded = end - index, _padded(first.nbytes)
        if count > 1 and padded:
            rows = memory[start:start + count * padded].view(count, padded)[:, :first.nbytes]
            views += rows.view(first.dtype).view(count, *first.shape).unbind(0)
        else:  # one tensor, or tensors without bytes (a rank's empty shards)
            views += [memory[start:start + first.nbytes].view(first.dtype).view(first.shape) for _ in range(count)]
        start += count * padded
        index = end
    return views


def _is_packed(tensors: Sequence[Tensor]) -> bool:
    """Whether `tensors` fill one allocation as `_layout` places them, with nothing else in it (homes
    `repack_homes` packed); tensors that hold no bytes are not."""
    starts, total = _layout(tensors)
    sized = [(tensor, start) for tensor, start in zip(tensors, starts) if tensor.nbytes]
    if not sized:
        return False
    # A tensor that starts inside the first one's allocation lies in it (live allocations do not overlap): one
    # address per tensor, where its storage's address, offset and element size took three calls.
    storage = sized[0][0].untyped_storage()
    base = storage.data_ptr()
    return storage.nbytes() == total and all(
        tensor.data_ptr() == base + start and tensor.is_contiguous() for tensor, start in sized)


def _allocation(tensors: Sequence[Tensor]) -> Tensor:
    """The whole allocation under `tensors` (each in the same one, some with bytes), as one uint8 tensor."""
    storage = next(tensor for tensor in tensors if tensor.nbytes).untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=tensors[0].device).set_(storage, 0, (storage.nbytes(),))


@torch.no_grad()  # `set_` under autograd would make each tensor a view
def repack_homes(homes: Sequence[Tensor]) -> None:
    """Moves a group's homes, the optimizer's own state tensors (no views of them), into one pinned allocation laid
    out by `_layout`, each tensor keeping its identity (`set_`), so that the group crosses the host link in one copy
    each way (`LaidOut.bind`). Nothing where they lie so already (`_is_packed`: for the optimizer's own state tensors
    in an allocation this function made, or a checkpoint's copy of one). A group that changes (a parameter without a
    gradient this step) is packed anew, its old allocation freed once no state tensor is left in it."""
    if _is_packed(homes):
        return
    memory = torch.empty(_layout(homes)[1], dtype=torch.uint8, device="cpu", pin_memory=torch.cuda.is_available())
    for home, packed in zip(homes, _cut(homes, memory)):
        home.set_(packed.copy_(home).untyped_storage(), packed.storage_offset(), packed.shape, packed.stride())


def copy_all(destinations: list[Tensor], sources: list[Tensor]) -> None:
    """Each source into its destination in one call, asynchronously where one side is pinned host memory (the
    foreach op refuses empty lists)."""
    if sources:
        torch._foreach_copy_(destinations, sources, non_blocking=True)


@dataclass(frozen=True)
class Stage(Generic[Item]):
    items: list[Item]
    update: Callable[[list[Item]], None]
    repack: bool  # whether the items hold the optimizer's own state tensors, so that `repack_homes` may move them
    aside: bool  # whether the update runs on the copier's side stream (`Copier`)


class StagedUpdates:
    """The offloaded updates of an optimizer's steps, Muon's buckets and AdamW's parameter groups, gathered as a step
    issues them and run as one schedule per device (`run`), each device's with what it keeps between steps (`_Lane`).
    Each part ran a schedule of its own and waited for its write-backs, so the AdamW part's first fetch (GPT-2 small's
    embedding: 309 MB of float32 moments, ~5.6 ms at the 55 GB/s an H100's host link gave) waited behind the Muon
    part's last write-back and a host sync."""

    def __init__(self) -> None:
        self._stages: dict[torch.device, list[Stage]] = {}
        self._lanes: dict[torch.device, _Lane] = {}
        self._cuts: dict[int, _Cut] = {}  # the AdamW items the last step cut into pieces, by id
        self._cuts_now: dict[int, _Cut] = {}  # and those this step has cut so far

    def add(self, device: torch.device, group: list[Item], update: Callable[[list[Item]], None], repack: bool,
            aside: bool = False) -> None:
        self._stages.setdefault(device, []).append(Stage(group, update, repack, aside))

    def pieces(self, item: AdamWTensors, budget: int) -> list[AdamWTensors]:
        """`_pieces(item, budget)`, and the same pieces as at the step before while the item is the same object (held
        from step to step: `held_items.HeldItems`) over the same memory, each with its slice of the gradient now: new
        pieces at each step were laid out, bound and given a launch plan anew (GPT-2 small's embedding: ten pieces,
        ~0.7 ms of the offloaded step's host time, 2-core AMD EPYC)."""
        cut = self._cuts.get(id(item))
        if cut is not None and cut.holds(item, budget):
            cut.refresh()
        else:
            pieces = _pieces(item, budget)
            if pieces[0] is item:  # it stays whole
                return pieces
            cut = _Cut(item, _addresses(item), budget, pieces)
        self._cuts_now[id(item)] = cut
        return cut.pieces

    def run(self) -> None:
        """Each device's stages in the order added, the next one's state fetched while one updates; returns once
        every write-back is in host memory."""
        stages, self._stages = self._stages, {}
        self._cuts, self._cuts_now = self._cuts_now, {}
        for device, device_stages in stages.items():
            lane = self._lanes.get(device)
            if lane is None:
                lane = self._lanes[device] = _Lane(CudaCopier(device), device)
            lane.run(device_stages)
        for cut in self._cuts.values():  # views of the step's gradients, which `zero_grad` may free before the next
            cut.release_gradients()


class _Lane:
    """One device's offloaded updates from step to step: its copier, the SLOTS buffers that groups of up to
    GROUP_BYTES of state take their copies from (group k's from buffer k % SLOTS; a larger group takes memory of its
    own for the step), and each group's layout with its copies (`LaidOut`), kept while the group's items are the same
    objects and its buffer the same. Laying out, cutting the copies and handing them to new items at each step took
    about half of what offload added to the step's host time, and the AdamW part's launch plans, rebuilt for the new
    items, most of the rest: kept, the added time went from 2.1 to 0.6 ms with float32 state and from 2.6 to 0.65 ms
    with int8 (GPT-2 small's structure at 1/96 width with the GPU path's kernels stubbed, 2-core AMD EPYC)."""

    def __init__(self, copier: Copier, device: torch.device) -> None:
        self.copier = copier
        self.device = device
        self.buffers: list[Tensor | None] = [None] * SLOTS
        self.groups: list[LaidOut] = []

    def run(self, stages: Sequence[Stage]) -> None:
        """The stages' updates, each group's state fetched before the group before it updates, and written back
        after its own update."""
        groups = [self._laid_out(position, stage) for position, stage in enumerate(stages)]
        self._bind_kept(groups)
        self.groups = groups
        freed: list[Any] = [None] * SLOTS  # each buffer's last write-back in this step
        self.copier.begin()
        handle = self._fetch(0, groups[0], freed)
        for position, (stage, group) in enumerate(zip(stages, groups)):
            self.copier.ready(handle, stage.aside)
            group.refresh()
            if position + 1 < len(groups):
                handle = self._fetch(position + 1, groups[position + 1], freed)
            with self.copier.updating(stage.aside):
                stage.update(group.staged)
            written = self.copier.write_back(group.transfer, stage.aside)
            slot = self._slot(position, group)
            if slot is not None:
                freed[slot] = written
            # Memory of the group's own goes back to the allocator now, to be reused once the write-back is done
            # (the copier marked it in use on its streams): held to the step's end, every such group's would be live.
            group.release(unbind=slot is None)
        self.copier.finish()

    def _laid_out(self, position: int, stage: Stage) -> LaidOut:
        kept = self.groups[position] if position < len(self.groups) else None
        return kept if kept is not None and kept.holds(stage.items) else lay_out(stage.items, stage.repack)

    @staticmethod
    def _slot(position: int, group: LaidOut) -> int | None:
        return position % SLOTS if group.nbytes <= GROUP_BYTES else None

    def _bind_kept(self, groups: Sequence[LaidOut]) -> None:
        """Grows each buffer to the largest group it serves (the groups cut from it before are cut again), and binds
        each group it serves that is not bound to it."""
        served = [(group, slot) for position, group in enumerate(groups)
                  if (slot := self._slot(position, group)) is not None]
        for slot in {served_by for _, served_by in served}:  # a group of zero-size items binds a buffer too
            nbytes = max(group.nbytes for group, served_by in served if served_by == slot)
            buffer = self.buffers[slot]
            if buffer is None or buffer.numel() < nbytes:
                self.buffers[slot] = self.copier.allocate(nbytes, self.device)
        for group, slot in served:
            if group.memory is not self.buffers[slot]:
                group.bind(self.buffers[slot])

    def _fetch(self, position: int, group: LaidOut, freed: Sequence[Any]) -> Any:
        """Starts the group's fetch: into its kept buffer once the group that used the buffer before is written back,
        or into memory of its own, taken now (taken for all groups at once, it would all be live at once)."""
        slot = self._slot(position, group)
        if slot is None:
            group.bind(self.copier.allocate(group.nbytes, self.device))
        return self.copier.fetch(group.transfer, None if slot is None else freed[slot])


@dataclass
class LaidOut(Generic[Item]):
    """A group of items with their offloaded state as one fetch moves it: the homes in order (`lay_out`), each one's
    item (its index) and field, and once bound to device memory (`bind`), what crosses the host link and the items
    holding the copies. An item the optimizer holds from step to step changes only its gradient
    (`held_items.HeldItems`): any other change makes a new item, which a kept layout does not hold."""

    items: list[Item]
    places: list[tuple[int, str]]
    homes: list[Tensor]
    packed: bool  # the homes fill one allocation of their own (`repack_homes`): one copy each way
    nbytes: int  # of the copies' allocation
    memory: Tensor | None = None
    transfer: Transfer | None = None
    staged: list[Item] = field(default_factory=list)

    def holds(self, items: Sequence[Item]) -> bool:
        return len(items) == len(self.items) and all(map(operator.is_, items, self.items))

    def bind(self, memory: Tensor) -> None:
        """Cuts the copies from `memory` and makes the items that hold them."""
        copies = _cut(self.homes, memory)
        fields: list[dict[str, Tensor]] = [{} for _ in self.items]
        for (index, name), copy in zip(self.places, copies):
            fields[index][name] = copy
        self.staged = [_holding(item, moved) for item, moved in zip(self.items, fields)]
        self.memory = memory
        self.transfer = (Transfer([memory[:self.nbytes]], [_allocation(self.homes)], memory) if self.packed
                         else Transfer(copies, self.homes, memory))

    def refresh(self) -> None:
        """The staged items with their items' gradients now."""
        for moved, item in zip(self.staged, self.items):
            moved.grad = item.grad

    def release(self, unbind: bool = False) -> None:
        """Lets go of the step's gradients, once the update is issued (and with `unbind`, of the memory and copies,
        which the next step binds anew)."""
        for moved in self.staged:
            moved.grad = None
        if unbind:
            self.memory, self.transfer, self.staged = None, None, []


def lay_out(group: Sequence[Item], repack: bool) -> LaidOut[Item]:
    """A group's offloaded state (plain tensors: a DTensor's local shards) laid out for its fetches; with `repack`
    (the items hold the optimizer's own state tensors), packed where it lives (`repack_homes`). The homes go field by
    field (every item's first moment, then every item's second, ...; the items of a group are of one type), and
    within a field by dtype and shape in the order first met, so that tensors of one shape and dtype lie in runs,
    which `_cut` cuts at once: item by item, the int8 codes and their scales alternated, and the AdamW part's vectors
    (a block's biases and norms, each of another shape than the last) took three view calls a tensor, ~0.5 ms of the
    offloaded step of GPT-2 small's structure at 1/96 width on the host (2-core AMD EPYC)."""
    runs: dict[tuple[str, torch.dtype, torch.Size], list[tuple[int, str]]] = {}
    for name in OFFLOADED_FIELDS[type(group[0])]:
        for index, item in enumerate(group):
            home = getattr(item, name)
            if home is not None:
                runs.setdefault((name, home.dtype, home.shape), []).append((index, name))
    places = [place for run in runs.values() for place in run]
    homes = [getattr(group[index], name) for index, name in places]
    if repack:
        repack_homes(homes)
    nbytes = _layout(homes)[1]
    return LaidOut(list(group), places, homes, packed=repack and nbytes > 0, nbytes=nbytes)


@dataclass
class Staging(Generic[Item]):
    """A group of items whose offloaded state is on its way to their device."""

    group: LaidOut[Item]
    handle: Any


def start_fetch(items: Sequence[Item], copier: Copier) -> Staging[Item]:
    """Starts copying the items' offloaded state (`lay_out`, not repacked) to their device, into memory of its own."""
    group = lay_out(items, repack=False)
    group.bind(copier.allocate(group.nbytes, items[0].param.device))
    return Staging(group, copier.fetch(group.transfer))


def staged(staging: Staging[Item], copier: Copier) -> list[Item]:
    """The group's items holding the device copies of their state, once the copies are ready; their write-back is
    `copier.write_back(staging.group.transfer)`."""
    copier.ready(staging.handle)
    return staging.group.staged


def staged_muon_update(items: list[MuonTensors], *, schedule: StagedUpdates | None = None, **settings: Any) -> None:
    """`muon_update`, or where the optimizer offloads state (`schedule`: its step's schedule) and these items' state is
    offloaded, one bucket at a time added to `schedule`, its state to be streamed to the parameters' GPU a bucket
    ahead. Without offload nothing is asked of the items (see `staged_adamw_update`)."""
    if schedule is None or not any_offloaded(items):
        muon_update(items, **settings)
        return
    rates = Rates(items, settings["lr"], settings["weight_decay"])
    for device, device_items in by_device(items).items():
        for bucket in buckets(device_items):
            # Each bucket's lrs and weight decays, found by its items before their state is staged (in new items).
            schedule.add(device, bucket, partial(muon_update, **rates.settings_for(bucket, settings)), repack=True)


def staged_adamw_update(items: list[AdamWTensors], found_inf: Tensor | None, *,
                        schedule: StagedUpdates | None = None, **settings: Any) -> None:
    """`adamw_update` of one device's items (found_inf None: their gradients not checked yet), or where the optimizer
    offloads state and theirs is offloaded, a group of parameters at a time (`adamw_groups`) added to `schedule`, as
    `staged_muon_update` adds buckets, to update aside (`Copier`): on the compute stream, behind the Muon part's
    Newton-Schulz, the groups' updates, and so their write-backs, came after all of it, alone on the host link at the
    step's end (`benchmarks/offload_model.py`, a model of the streams at an H100's copy rates: GPT-2 small's
    offloaded step 8.1 -> 6.9 ms of device time with int8 state, 19.5 -> 16.4 with float32; not measured). Without
    offload nothing is asked of the items: GPT-2 small's 97 AdamW tensors at 1/96 width took 1.28x fused AdamW's step
    time while each step asked where their state lived, 1.19x since (with `moment_form` answering the default first;
    2-core AMD EPYC, three runs of each alternated)."""
    if schedule is None or not any_offloaded(items):
        adamw_update(items, found_inf, **settings)
        return
    if found_inf is None:
        found_inf = nonfinite_flags([item.grad for item in items])
    rates = Rates(items, settings["lr"], settings["weight_decay"])
    for group in adamw_groups(items, GROUP_BYTES, schedule.pieces):
        parameters = [index for index, _ in group]
        # Each group's lrs and weight decays, found by its parameters' items before their state is staged.
        update = partial(adamw_update, found_inf=picked(found_inf, parameters),
                         **rates.settings_for([items[index] for index in parameters], settings))
        pieces = [piece for _, piece in group]
        whole = all(piece is items[index] for index, piece in group)  # a piece's state tensors are views
        schedule.add(items[0].param.device, pieces, update, repack=whole, aside=True)


def adamw_groups(items: Sequence[AdamWTensors], budget: int,
                 cut: Callable[[AdamWTensors, int], list[AdamWTensors]] | None = None
                 ) -> list[list[tuple[int, AdamWTensors]]]:
    """Consecutive parameters whose offloaded state adds up to at most `budget` bytes per group, a parameter with
    more cut into pieces that fit (`cut`: `_pieces` or a schedule's `StagedUpdates.pieces`), or where it cannot be
    cut, alone; each item (a parameter or a piece) with its parameter's index in `items`. The device holds up to
    SLOTS groups' state at once, and each group costs its copies' and its update's launches (GPT-2 small's 97 AdamW
    tensors one at a time: ~2000 operator calls, 5.2x the on-GPU step on an H200)."""
    cut = cut or _pieces
    groups: list[list[tuple[int, AdamWTensors]]] = []
    total = 0
    for index, item in enumerate(items):
        whole = _state_bytes(item)
        for piece in [item] if whole <= budget else cut(item, budget):
            size = whole if piece is item else _state_bytes(piece)
            if not groups or total + size > budget:
                groups.append([])
                total = 0
            groups[-1].append((index, piece))
            total += size
    return groups


# A piece's first entry is a multiple of this many from its parameter's, so that it starts on a 16-byte boundary
# where the parameter does, as the one-launch AdamW kernel needs.
PIECE_ALIGNMENT = 256


def _pieces(item: AdamWTensors, budget: int) -> list[AdamWTensors]:
    """A parameter whose state takes more than `budget` bytes: whole where it cannot be cut, else in pieces of
    consecutive entries whose moments take at most `budget` bytes (PIECE_ALIGNMENT entries at least,
    `_piece_entries`): AdamW's update is elementwise. The pieces but the last hold copies of the step and skip counts,
    which their updates move and the step drops, so that every piece reads the counts as they were before the step
    and they move once. GPT-2 small's token embedding: 309 MB of float32 moments, alone they made the step's largest
    fetch and its write-back, with nothing to overlap them, and most of its peak GPU memory."""
    entries = _piece_entries(item, budget)
    if entries is None:
        return [item]
    flat = [tensor.view(-1) for tensor in (item.param, item.grad, item.exp_avg, item.exp_avg_sq)]
    numel = item.param.numel()
    pieces = []
    for start in range(0, numel, entries):
        last = start + entries >= numel
        counts = (item.step, item.nonfinite_skips) if last else (item.step.clone(), item.nonfinite_skips.clone())
        pieces.append(AdamWTensors(*(tensor[start:start + entries] for tensor in flat), *counts))
    return pieces


def _piece_entries(item: AdamWTensors, budget: int) -> int | None:
    """The entries of each of a parameter's pieces (`_pieces`), or None where it stays whole: moments stored rounded
    (each entry's random bits depend on its index in the whole tensor), and tensors that are not contiguous."""
    tensors = (item.param, item.grad, item.exp_avg, item.exp_avg_sq)
    if item.rounding_count is not None or not all(tensor.is_contiguous() for tensor in tensors):
        return None
    entry_bytes = item.exp_avg.element_size() + item.exp_avg_sq.element_size()
    return max(budget // entry_bytes // PIECE_ALIGNMENT, 1) * PIECE_ALIGNMENT


def _addresses(item: AdamWTensors) -> tuple[int, int, int]:
    """Where the memory a parameter's pieces are views of lies (`param.data` may be replaced)."""
    return item.param.data_ptr(), item.exp_avg.data_ptr(), item.exp_avg_sq.data_ptr()


@dataclass
class _Cut:
    """An AdamW item cut into pieces (`_pieces`), with what they were cut from: the item, its memory's addresses and
    the budget."""

    item: AdamWTensors
    addresses: tuple[int, int, int]
    budget: int
    pieces: list[AdamWTensors]

    def holds(self, item: AdamWTensors, budget: int) -> bool:
        """Whether the pieces are still views of this item's memory as `_pieces` would cut it, its new gradient too."""
        return (item is self.item and budget == self.budget and item.grad.is_contiguous()
                and _addresses(item) == self.addresses)

    def refresh(self) -> None:
        """The pieces with their slices of the item's gradient now, and the copies of the counts that all but the
        last hold with the counts' values now (a caller may have changed them in place), in one call."""
        entries = self.pieces[0].param.numel()
        flat = self.item.grad.view(-1)
        for index, piece in enumerate(self.pieces):
            piece.grad = flat[index * entries:(index + 1) * entries]
        copies = self.pieces[:-1]
        if copies:  # the foreach op refuses empty lists
            torch._foreach_copy_([count for piece in copies for count in (piece.step, piece.nonfinite_skips)],
                                 [self.item.step, self.item.nonfinite_skips] * len(copies))

    def release_gradients(self) -> None:
        """Let go of the step's gradient: held between steps, it would stay alive through the next backward pass."""
        for piece in self.pieces:
            piece.grad = None  # type: ignore[assignment]


def _state_bytes(item: AdamWTensors) -> int:
    """The bytes of an AdamW parameter's offloaded state, asked of every one at every step: 0.43 µs an item, against
    0.79 asking for the fields by name (2-core AMD EPYC)."""
    moments = (item.exp_avg, item.exp_avg_sq, item.exp_avg_scales, item.exp_avg_sq_scales)
    return sum(tensor.nbytes for tensor in moments if tensor is not None)


def _holding(item: Item, fields: Mapping[str, Tensor]) -> Item:
    """A copy of the item (a plain dataclass) with `fields` set: `dataclasses.replace` runs `__init__` again over
    every field, 2.1 µs an item against 0.65 (2-core AMD EPYC), for each of a step's ~150 items."""
    moved = object.__new__(type(item))
    moved.__dict__.update(item.__dict__)
    moved.__dict__.update(fields)
    return moved
