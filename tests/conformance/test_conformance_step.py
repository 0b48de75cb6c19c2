"""One step, on every routing: against torch's optimizers, on every float dtype, on strided, empty and 1x1
parameters, with weight decay, momentum and Nesterov switched off in turn; and nothing beside it changes."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import Tensor

from conformance_support import (FLOAT_DTYPES, ROUTINGS, Muon, Reference, Routing, Settings, assert_all_equal,
                                 assert_matches_reference, build, clones, make_params, seeded_grads,
                                 train_with_reference)

ROUTING_IDS = [routing.name for routing in ROUTINGS]
HYPERPARAMETERS = {
    "defaults": Settings(),
    "weight_decay_0": Settings(weight_decay=0.0),
    "momentum_0": Settings(momentum=0.0),
    "nesterov_off": Settings(nesterov=False),
}


@pytest.mark.parametrize("hyper", HYPERPARAMETERS)
@pytest.mark.parametrize("routing", ROUTINGS, ids=ROUTING_IDS)
def test_step_equals_torch_and_touches_nothing_else(routing: Routing, hyper: str) -> None:
    settings = HYPERPARAMETERS[hyper]
    params = make_params(routing.shapes)
    bystander = torch.randn(8, 6)  # in the same group, never given a gradient
    bystander_before = bystander.clone()
    opt = Muon([dict(params=[*params, bystander], **routing.options)], **settings.ours())
    reference = Reference(params, routing.layouts, settings)
    before = clones(params)
    # Three steps: Nesterov's first step has the same direction as plain momentum's (Newton-Schulz ignores scale).
    for seed in range(3):
        seeded_grads(params, seed)
        grads = clones([p.grad for p in params])
        opt.step()
        assert_all_equal([p.grad for p in params], grads)  # a step reads gradients, never writes them
        reference.step(grads)
    assert_matches_reference(params, reference, settings, steps=3)
    for param, old in zip(params, before):
        assert torch.isfinite(param).all() and not torch.equal(param, old)
    assert torch.equal(bystander, bystander_before) and bystander not in opt.state


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("routing", ROUTINGS, ids=ROUTING_IDS)
def test_step_on_every_float_dtype(routing: Routing, dtype: torch.dtype) -> None:
    # Entries ~0.1: a 16-bit parameter's rounding (~1e-3 in bfloat16) stays well below one update (~1e-2).
    params = make_params(routing.shapes, dtype=dtype, scale=0.1)
    settings = Settings()
    opt = build(routing, params, settings)
    reference = Reference(params, routing.layouts, settings)
    before = clones(params)
    train_with_reference(opt, params, reference, range(2))
    assert_matches_reference(params, reference, settings, steps=2)
    for param, old in zip(params, before):
        assert param.dtype == dtype and torch.isfinite(param).all() and not torch.equal(param, old)
        for key, value in opt.state[param].items():
            if key in ("momentum_buffer", "exp_avg", "exp_avg_sq"):  # per-element state: the parameter's own kind
                assert value.dtype == dtype and value.shape == param.shape, key


# --- strided parameters ------------------------------------------------------------------------------------------

def _column(base: Tensor) -> Tensor:
    return base[..., 1]


def _transposed(base: Tensor) -> Tensor:
    return base.permute(*reversed(range(base.ndim)))


def strided(shape: tuple[int, ...], kind: str, seed: int,
            dtype: torch.dtype) -> tuple[Tensor, Tensor, Callable[[Tensor], Tensor]]:
    """A non-contiguous view of `shape` into a larger (column) or reordered (transposed) base."""
    generator = torch.Generator().manual_seed(seed)
    if kind == "column":
        return (base := torch.randn(*shape, 3, generator=generator).to(dtype)), _column(base), _column
    base = torch.randn(*reversed(shape), generator=generator).to(dtype)
    return base, _transposed(base), _transposed


STRIDED_CASES = [(routing, kind) for routing in ROUTINGS for kind in ("column", "transposed")
                 if kind == "column" or all(len(shape) >= 2 for shape in routing.shapes)]


# bfloat16: the bf16 update of a strided bf16 parameter went through torch's add_, which rounded some entries
# otherwise than the compiled op a contiguous one takes.
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("routing, kind", STRIDED_CASES,
                         ids=[f"{routing.name}-{kind}" for routing, kind in STRIDED_CASES])
def test_strided_parameters_step_as_contiguous_copies_and_nothing_beside_them_changes(routing: Routing, kind: str,
                                                                                      dtype: torch.dtype) -> None:
    made = [strided(shape, kind, seed, dtype) for seed, shape in enumerate(routing.shapes)]
    bases, views, view_of = zip(*made)
    assert all(not view.is_contiguous() or view.ndim == 0 for view in views)
    bases_before = clones(bases)
    copies = clones(views)
    ours, theirs = build(routing, views), build(routing, copies)
    for seed in range(3):
        seeded_grads(list(views), seed)
        seeded_grads(copies, seed)
        ours.step()
        theirs.step()
    assert_all_equal(list(views), copies)  # README: exactly the update a contiguous copy gets
    for base, before, take, result in zip(bases, bases_before, view_of, copies):
        expected = before.clone()
        take(expected).copy_(result)
        assert torch.equal(base, expected)  # the view got the update, every entry beside it kept its value


# --- zero-size and 1x1 parameters ---------------------------------------------------------------------------------

def zero_size(shape: tuple[int, ...]) -> tuple[int, ...]:
    return (0, *shape[1:]) if shape else (0,)


@pytest.mark.parametrize("routing", ROUTINGS, ids=ROUTING_IDS)
def test_zero_size_parameters_are_left_alone_beside_normal_ones(routing: Routing) -> None:
    params = make_params(routing.shapes)
    empties = [torch.randn(zero_size(shape)) for shape in routing.shapes]
    settings = Settings()
    opt = Muon([dict(params=[*params, *empties], **routing.options)], **settings.ours())
    reference = Reference(params, routing.layouts, settings)
    for seed in range(2):
        seeded_grads([*params, *empties], seed)  # the empty ones get (empty) gradients too
        opt.step()
        reference.step([p.grad for p in params])
    assert_matches_reference(params, reference, settings, steps=2)
    assert [tuple(e.shape) for e in empties] == [zero_size(shape) for shape in routing.shapes]


MUON_ROUTINGS = [routing for routing in ROUTINGS if routing.has_muon and routing.name != "mixed"]


@pytest.mark.parametrize("routing", MUON_ROUTINGS, ids=[routing.name for routing in MUON_ROUTINGS])
def test_forcing_a_zero_size_parameter_into_muon_is_refused_and_changes_nothing(routing: Routing) -> None:
    opt = Muon([torch.randn(4, 4)])
    empty = torch.randn(zero_size(routing.shapes[0]))
    with pytest.raises(ValueError, match=str(tuple(empty.shape)).replace("(", r"\(").replace(")", r"\)")):
        opt.add_param_group(dict(params=[empty], **routing.options, use_muon=True))
    assert len(opt.param_groups) == 1


# README: a matrix with a side below 2 goes to AdamW by shape; `use_muon=True` forces Muon on it anyway.
ONE_BY_ONE = [("matrix", (1, 1), {}), ("experts", (1, 1, 1), {}), ("flatten", (1, 1, 1, 1), {"conv_mode": "flatten"}),
              ("batched", (1, 1, 1, 1), {"conv_mode": "batched"}), ("flatten", (1, 1, 1), {"param_layout": "conv"})]


@pytest.mark.parametrize("use_muon", [None, True])
@pytest.mark.parametrize("layout, shape, options", ONE_BY_ONE,
                         ids=["matrix", "experts", "conv_flatten", "conv_batched", "conv1d"])
def test_one_by_one_parameters(layout: str, shape: tuple[int, ...], options: dict, use_muon: bool | None) -> None:
    routing = Routing("1x1", (shape, (1,)), (layout if use_muon else "adamw", "adamw"), options)
    params = make_params(routing.shapes)
    settings = Settings()
    groups = [dict(params=params[:1], **options, use_muon=use_muon), dict(params=params[1:])]
    opt = Muon(groups, **settings.ours())
    reference = Reference(params, routing.layouts, settings)
    before = clones(params)
    train_with_reference(opt, params, reference, range(3))
    assert_matches_reference(params, reference, settings, steps=3)
    assert all(torch.isfinite(p).all() and not torch.equal(p, b) for p, b in zip(params, before))
