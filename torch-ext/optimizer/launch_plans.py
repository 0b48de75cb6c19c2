"""The AdamW part's launch plans, kept between steps: which parameters the one-launch Triton kernels take, in which
launch groups, with their address tables. Deciding that anew checks four tensors of every parameter and reads six
addresses (GPT-2 small's 97 AdamW tensors: ~40% of the part's host time on a 2-core Xeon, where the part's host time
is what keeps it at 0.49x of fused AdamW's speed on an H100). A plan is reused while it still describes the step's
tensors: the same parameter and state tensor objects, each still at the address the tables hold (`param.data` or a
state tensor's `.data` may be replaced: moving optimizer state to the host and back does it), and gradients at the
addresses the tables hold, still contiguous (a gradient is a new tensor at each step, but the caching allocator
usually hands its block out again; the gradient setter keeps its shape and dtype those of the parameter). An item
passed again, the very object the plan was built from, is taken to hold the same tensors where they were but its
gradient, whose check it then skips (~1 µs per item): a caller that replaces a state tensor or gives one new storage
makes a new item, as the optimizer's held items are made anew whenever a parameter's state changes or moves
(`held_items.HeldItems`; a state tensor given new storage under the same object, as moving state to the host and back
does, went on being written where it had been).

The plans are kept by the parameters' addresses, a few at a time (one per call site: the AdamW tensors of each
device and param group, each offload group), and hold weak references only: a plan never keeps a tensor alive. By
address, not identity: items made anew over the same memory (an offloaded parameter's pieces, when they are cut
again: `offload.StagedUpdates.pieces`) find the old plan's key, and their plan takes its place instead of pushing the
others out.
"""

from __future__ import annotations

import operator
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from itertools import chain, compress
from typing import Any

from torch import Tensor

# Plans kept at once: one per call site, enough for the AdamW tensors of a model's param groups and devices and its
# offload groups (pieces cut again over the same memory take their old plan's place, as above).
MAX_PLANS = 32


@dataclass
class LaunchPlan:
    """Launch groups (whatever the caller builds for them: indices into the items, tables) and the indices left to
    torch's kernels, with what they were built from."""

    groups: list[Any]
    left: list[int]
    items: list[weakref.ref]  # the items themselves
    held: list[tuple[weakref.ref | None, ...]]  # each item's addressed tensors other than its gradient
    present: tuple[bool, ...]  # which of the items' addressed tensors, in order, are not None
    held_addresses: tuple[int, ...]  # where those tensors lay
    grad_addresses: tuple[int, ...]

    def describes(self, items: Sequence[Any], addressed: Callable[[Any], tuple[Tensor | None, ...]]) -> bool:
        """Whether the plan was built from these tensors, where they lie now (the parameters' addresses are the
        plan's key)."""
        if not all(map(operator.is_, items, map(operator.call, self.items))):
            for item, refs in zip(items, self.held):
                for tensor, ref in zip(addressed(item), refs):
                    if (None if ref is None else ref()) is not tensor:
                        return False
            if tuple(_addresses(items, addressed, self.present)) != self.held_addresses:
                return False
        return (tuple(item.grad.data_ptr() for item in items) == self.grad_addresses
                and all(item.grad.is_contiguous() for item in items))


_plans: OrderedDict[tuple[int, ...], LaunchPlan] = OrderedDict()


def launch_plan(items: Sequence[Any], addressed: Callable[[Any], tuple[Tensor | None, ...]],
                build: Callable[[Sequence[Any]], tuple[list[Any], list[int]]]) -> LaunchPlan:
    """The plan for these items (each with `param` and `grad`; `addressed(item)`: the other tensors its table row
    holds, or None for an absent one): the one kept from an earlier step if it still describes them, else
    `build(items)`'s groups and left indices, kept for the next steps."""
    # An empty tensor's address is 0 (a rank's empty shard): its identity keeps such call sites apart.
    key = tuple(item.param.data_ptr() or id(item.param) for item in items)
    plan = _plans.get(key)
    if plan is not None and plan.describes(items, addressed):
        _plans.move_to_end(key)
        return plan
    groups, left = build(items)
    present = tuple(tensor is not None for tensor in _tensors(items, addressed))
    plan = LaunchPlan(groups, left, [weakref.ref(item) for item in items],
                      [tuple(None if tensor is None else weakref.ref(tensor) for tensor in addressed(item))
                       for item in items],
                      present, tuple(_addresses(items, addressed, present)),
                      tuple(item.grad.data_ptr() for item in items))
    _plans[key] = plan
    _plans.move_to_end(key)
    while len(_plans) > MAX_PLANS:
        _plans.popitem(last=False)
    return plan


def _tensors(items: Sequence[Any], addressed: Callable[[Any], tuple[Tensor | None, ...]]) -> Iterator[Tensor | None]:
    """The items' addressed tensors, item after item (None for an absent one)."""
    return chain.from_iterable(map(addressed, items))


def _addresses(items: Sequence[Any], addressed: Callable[[Any], tuple[Tensor | None, ...]],
               present: tuple[bool, ...]) -> Iterator[int]:
    """The addresses of the items' addressed tensors that `present` marks (iterated in C)."""
    return map(Tensor.data_ptr, compress(_tensors(items, addressed), present))
