"""The AdamW part's launch plans: reused while every tensor they were built from stays where it was, rebuilt when any
moves, changes layout or is replaced, and never keeping a tensor alive."""

from __future__ import annotations

import gc
import weakref
from dataclasses import dataclass, replace

import pytest
import torch
from kernel_under_test import optimizer, submodule

launch_plans = submodule(optimizer, "launch_plans")


@dataclass
class _Item:
    param: torch.Tensor
    grad: torch.Tensor
    exp_avg: torch.Tensor
    rounding_positions: torch.Tensor | None = None


def _items(count: int = 3) -> list[_Item]:
    return [_Item(torch.zeros(4, 4), torch.ones(4, 4), torch.zeros(4, 4)) for _ in range(count)]


def _addressed(item: _Item) -> tuple[torch.Tensor | None, ...]:
    return item.param, item.exp_avg, item.rounding_positions


class _Builds:
    """A `build` for launch_plan that counts its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, items: list[_Item]) -> tuple[list[object], list[int]]:
        self.calls += 1
        return [object()], []


def test_a_plan_is_built_once_for_tensors_that_stay() -> None:
    items, build = _items(), _Builds()
    first = launch_plans.launch_plan(items, _addressed, build)
    # New item objects around the same tensors (as a step that gathers its state anew makes them), and the same ones.
    again = launch_plans.launch_plan([replace(item) for item in items], _addressed, build)
    assert again is first and launch_plans.launch_plan(items, _addressed, build) is first and build.calls == 1


@pytest.mark.parametrize("change", [
    "gradient elsewhere", "gradient transposed in place of itself", "moment replaced", "parameter data replaced",
    "moment data replaced", "positions given"])
def test_a_plan_is_rebuilt_when_a_tensor_it_addresses_changes(change: str) -> None:
    items, build = _items(), _Builds()
    launch_plans.launch_plan(items, _addressed, build)
    item = items[1]
    if change == "gradient elsewhere":
        item.grad = item.grad.clone()
    elif change == "gradient transposed in place of itself":
        address = item.grad.data_ptr()
        item.grad = item.grad.t()  # the same address, no longer contiguous
        assert item.grad.data_ptr() == address
    elif change == "moment replaced":  # in a new item, as the optimizer makes one whenever state changes
        items[1] = replace(item, exp_avg=item.exp_avg.clone())
    elif change == "parameter data replaced":
        item.param.data = item.param.data.clone()
    elif change == "moment data replaced":  # the same tensor object, new storage (state moved to the host and back):
        items[1] = replace(item)  # in a new item, as the optimizer makes one when a state tensor moves
        item.exp_avg.data = item.exp_avg.data.clone()
    else:
        items[1] = replace(item, rounding_positions=torch.arange(16))
    launch_plans.launch_plan(items, _addressed, build)
    assert build.calls == 2


def test_a_plan_keeps_no_tensor_alive() -> None:
    items = _items()
    refs = [weakref.ref(tensor) for item in items for tensor in (item.param, item.grad, item.exp_avg)]
    launch_plans.launch_plan(items, _addressed, _Builds())
    del items
    gc.collect()
    assert all(ref() is None for ref in refs)


def test_plans_are_kept_a_bounded_number_at_a_time() -> None:
    sets = [_items(1) for _ in range(launch_plans.MAX_PLANS + 1)]
    builds = [_Builds() for _ in sets]
    for items, build in zip(sets, builds):
        launch_plans.launch_plan(items, _addressed, build)
    for items, build in zip(sets, builds):  # the oldest was dropped, and its rebuild drops the next oldest, ...
        launch_plans.launch_plan(items, _addressed, build)
    assert [build.calls for build in builds] == [2] * len(builds)
    assert len(launch_plans._plans) == launch_plans.MAX_PLANS


def test_views_made_anew_at_the_same_addresses_take_their_plans_place() -> None:
    """An offloaded AdamW parameter's pieces: new views of the same tensors at each step, the last step's still
    alive. Their plans replace each other under the same addresses instead of filling the kept plans."""
    whole = _items(1)[0]
    before = set(launch_plans._plans)
    steps = []
    for _ in range(launch_plans.MAX_PLANS + 1):
        steps.append([_Item(whole.param[:2], whole.grad[:2], whole.exp_avg[:2])])
        launch_plans.launch_plan(steps[-1], _addressed, _Builds())
    assert len(set(launch_plans._plans) - before) == 1
