"""The torch.optim.Optimizer surface on every routing: closures, zero_grad, add_param_group mid-run, and the inputs
torch refuses (shared parameters and the rest), refused the way torch.optim.AdamW refuses them."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn

from conformance_support import (ROUTINGS, Muon, Reference, Routing, Settings, assert_all_equal,
                                 assert_matches_reference, assert_same_state, build, clones, groups_snapshot,
                                 make_params, seeded_grads, state_snapshot)

ROUTING_IDS = [routing.name for routing in ROUTINGS]


def quadratic_closure(opt: torch.optim.Optimizer, params: list[Tensor], seed: int,
                      calls: list[bool]) -> Callable[[], Tensor]:
    """A closure as torch documents it: zero the gradients, recompute the loss, backpropagate, return the loss.
    It records whether autograd was on when it ran."""
    generator = torch.Generator().manual_seed(seed)
    targets = [torch.randn(p.shape, generator=generator) for p in params]

    def closure() -> Tensor:
        calls.append(torch.is_grad_enabled())
        opt.zero_grad()
        loss = sum(((p - t) ** 2).sum() * (i + 1) for i, (p, t) in enumerate(zip(params, targets)))
        loss.backward()
        return loss

    return closure


@pytest.mark.parametrize("routing", ROUTINGS, ids=ROUTING_IDS)
def test_closure_recomputes_gradients_with_autograd_on_and_its_loss_is_returned(routing: Routing) -> None:
    params = [nn.Parameter(p) for p in make_params(routing.shapes)]
    twins = [nn.Parameter(p.detach().clone()) for p in params]
    opt, twin = build(routing, params), build(routing, twins)
    for seed in range(3):
        calls: list[bool] = []
        closure = quadratic_closure(opt, params, seed, calls)
        with torch.no_grad():  # as in a training loop that evaluates under no_grad: step must turn autograd on
            loss = opt.step(closure)
        assert calls == [True]
        # The twin runs the same closure by hand, then steps: the returned loss is the one before the update.
        expected = quadratic_closure(twin, twins, seed, [])()
        twin.step()
        assert torch.is_tensor(loss) and torch.equal(loss, expected)
    assert_all_equal([p.detach() for p in params], [p.detach() for p in twins])


@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("routing", ROUTINGS, ids=ROUTING_IDS)
def test_zero_grad(routing: Routing, set_to_none: bool) -> None:
    params = make_params(routing.shapes)
    settings = Settings()
    opt = build(routing, params, settings)
    reference = Reference(params, routing.layouts, settings)
    seeded_grads(params, 0)
    old_grads = [p.grad for p in params]
    opt.step()
    reference.step(old_grads)
    opt.zero_grad(set_to_none=set_to_none)
    if set_to_none:
        assert all(p.grad is None for p in params)
        # torch: a parameter without a gradient is skipped, its value and state untouched.
        before, state = clones(params), state_snapshot(opt)
        opt.step()
        assert_all_equal(params, before)
        assert_same_state(state_snapshot(opt), state)
    else:
        # torch zeroes the gradient tensors in place: the same tensors, now zero.
        assert all(p.grad is g and not g.any() for p, g in zip(params, old_grads))
        opt.step()  # zero gradients are gradients: momentum, AdamW's moments and weight decay still act
        reference.step([torch.zeros_like(p) for p in params])
    assert_matches_reference(params, reference, settings, steps=2)


@pytest.mark.parametrize("routing", ROUTINGS, ids=ROUTING_IDS)
def test_zero_gradients_without_weight_decay_leave_parameters_unchanged(routing: Routing) -> None:
    # torch.optim's battery: the first step on zero gradients moves nothing when nothing decays.
    params = make_params(routing.shapes)
    opt = build(routing, params, Settings(weight_decay=0.0))
    for param in params:
        param.grad = torch.zeros_like(param)
    before = clones(params)
    opt.step()
    assert_all_equal(params, before)


@pytest.mark.parametrize("routing", ROUTINGS, ids=ROUTING_IDS)
def test_add_param_group_mid_run(routing: Routing) -> None:
    settings = Settings()
    old = make_params([(8, 6), (6,)], seed=1)
    alone = clones(old)  # the same old group in an optimizer that never gets the new one
    opt = Muon([dict(params=old)], **settings.ours())
    never_added = Muon([dict(params=alone)], **settings.ours())
    for seed in range(2):
        seeded_grads(old, seed)
        seeded_grads(alone, seed)
        opt.step()
        never_added.step()
    groups_before, state_before = groups_snapshot(opt), state_snapshot(opt)
    new = make_params(routing.shapes, seed=2)
    new_settings = Settings(lr=0.01)
    opt.add_param_group(dict(params=new, lr=new_settings.lr, **routing.options))
    assert groups_snapshot(opt)[:1] == groups_before
    assert_same_state(state_snapshot(opt), state_before)
    added = opt.param_groups[1]
    for key, value in opt.defaults.items():  # every option the new group did not give comes from the defaults
        assert added[key] == {"lr": new_settings.lr, **routing.options}.get(key, value), key
    reference = Reference(new, routing.layouts, new_settings)
    for seed in range(2, 4):
        seeded_grads([*old, *new], seed)
        seeded_grads(alone, seed)
        opt.step()
        never_added.step()
        reference.step([p.grad for p in new])
    assert_all_equal(old, alone)  # the old group steps as if the new one were not there
    assert_matches_reference(new, reference, new_settings, steps=2)


# --- inputs torch refuses ---------------------------------------------------------------------------------------

def _shared_across_groups(factory: Callable, p: Tensor, q: Tensor) -> object:
    return factory([dict(params=[p]), dict(params=[q, p])])


def _shared_by_add_param_group(factory: Callable, p: Tensor, q: Tensor) -> object:
    opt = factory([p])
    try:
        opt.add_param_group(dict(params=[q, p]))
    finally:  # a refused group leaves the optimizer as it was
        assert len(opt.param_groups) == 1 and opt.param_groups[0]["params"] == [p]
    return opt


def _bare_tensor(factory: Callable, p: Tensor, q: Tensor) -> object:
    return factory(p)


def _empty_list(factory: Callable, p: Tensor, q: Tensor) -> object:
    return factory([])


def _non_leaf(factory: Callable, p: Tensor, q: Tensor) -> object:
    return factory([p.detach().requires_grad_() * 2])


def _duplicate_in_a_group(factory: Callable, p: Tensor, q: Tensor) -> object:
    return factory([p, q, p])


REFUSALS = {"shared_across_groups": _shared_across_groups, "shared_by_add_param_group": _shared_by_add_param_group,
            "bare_tensor": _bare_tensor, "empty_list": _empty_list, "non_leaf": _non_leaf,
            "duplicate_in_a_group": _duplicate_in_a_group}


def outcome(factory: Callable, case: Callable) -> tuple[type | None, list[type]]:
    """The exception type (or None) and the warning categories the case gets from this optimizer class."""
    p, q = torch.randn(8, 6), torch.randn(6)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            case(factory, p, q)
        except Exception as error:  # noqa: BLE001 - the type is what we compare
            return type(error), [w.category for w in caught]
    return None, [w.category for w in caught]


@pytest.mark.parametrize("case", REFUSALS)
def test_inputs_torch_refuses_are_refused_as_adamw_refuses_them(case: str) -> None:
    theirs = outcome(torch.optim.AdamW, REFUSALS[case])
    assert theirs != (None, []), "the case must be one torch refuses or warns about"
    assert outcome(Muon, REFUSALS[case]) == theirs
