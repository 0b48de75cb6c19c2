"""Where we follow torch.optim.Muon and where we deliberately do not, pinned on both sides: torch's defaults are read
from its signature, so a change in either library fails here and has to be looked at. With matching settings our
step equals torch's."""

from __future__ import annotations

import inspect
import math
from typing import Any

import pytest
import torch

from conformance_support import (FLOAT_DTYPES, TORCH_MUON_COEFFICIENTS, Muon, Reference, Settings, assert_all_equal,
                                 assert_matches_reference, make_params, seeded_grads, train_with_reference)

TORCH_MUON_OPTIONS = {name: p.default for name, p in inspect.signature(torch.optim.Muon).parameters.items()
                      if name != "params"}
OUR_OPTIONS = {name: p.default for name, p in inspect.signature(Muon).parameters.items() if name != "params"}

# option: (our default, torch.optim.Muon's default), as of torch 2.13.
PINNED_DEFAULTS: dict[str, tuple[Any, Any]] = {
    "lr": (1e-3, 1e-3),
    "weight_decay": (0.1, 0.1),
    "momentum": (0.95, 0.95),
    "nesterov": (True, True),
    "eps": (1e-7, 1e-7),
    "ns_steps": (5, 5),
    # Deliberate: Polar Express coefficients (computed for ns_steps) instead of Keller Jordan's one triple.
    "ns_coefficients": ("polar_express", (3.4445, -4.775, 2.0315)),
    # Deliberate: Moonshot's scaling, so AdamW's lr and weight decay carry over. torch's None means "original".
    "adjust_lr_fn": ("match_rms_adamw", None),
}


def test_every_torch_muon_option_is_pinned_and_accepted_by_ours() -> None:
    assert set(PINNED_DEFAULTS) == set(TORCH_MUON_OPTIONS)  # a new torch option must be looked at here
    assert set(TORCH_MUON_OPTIONS) <= set(OUR_OPTIONS)  # drop-in: every torch.optim.Muon keyword works on ours


@pytest.mark.parametrize("option", PINNED_DEFAULTS)
def test_default_pinned_against_torch(option: str) -> None:
    ours, theirs = PINNED_DEFAULTS[option]
    assert TORCH_MUON_OPTIONS[option] == theirs
    assert OUR_OPTIONS[option] == ours
    assert Muon([torch.randn(4, 4)]).param_groups[0][option] == ours  # the signature's default is what groups get


def test_original_coefficients_are_torchs_default_and_ours_differ() -> None:
    def trained(**options: Any) -> list[torch.Tensor]:
        params = make_params([(8, 6), (6, 8)])
        opt = Muon(params, lr=0.02, ns_dtype=torch.float32, **options)
        for seed in range(2):
            seeded_grads(params, seed)
            opt.step()
        return params

    original = trained(ns_coefficients="original")
    assert_all_equal(trained(ns_coefficients=TORCH_MUON_COEFFICIENTS), original)
    assert not torch.equal(trained()[0], original[0])


def one_update(opt: torch.optim.Optimizer, param: torch.Tensor) -> torch.Tensor:
    before = param.detach().clone()
    seeded_grads([param], 0)
    opt.step()
    return param.detach() - before


TALL = (12, 4)  # out/in = 3: "original" scales by sqrt(3), match_rms_adamw by 0.2 * sqrt(12)


@pytest.mark.parametrize("our_fn, torch_fn, torch_over_ours", [
    ("original", "original", 1.0), ("match_rms_adamw", "match_rms_adamw", 1.0),
    ("original", None, 1.0),  # torch's None is Keller Jordan's scaling...
    (None, None, math.sqrt(3.0)),  # ...ours is no scaling at all
])
def test_adjust_lr_fn_against_torch(our_fn: str | None, torch_fn: str | None, torch_over_ours: float) -> None:
    param = make_params([TALL])[0]
    twin = param.clone()
    settings = dict(lr=0.02, weight_decay=0.0, momentum=0.9, nesterov=True, ns_steps=5)
    ours = one_update(Muon([param], **settings, ns_coefficients="original", ns_dtype=torch.bfloat16,
                           adjust_lr_fn=our_fn), param)
    theirs = one_update(torch.optim.Muon([twin], **settings, ns_coefficients=TORCH_MUON_COEFFICIENTS,
                                         adjust_lr_fn=torch_fn), twin)
    # bf16 Newton-Schulz on both sides, reductions in another order: 1% of an update (test_muon.py's tolerance).
    torch.testing.assert_close(ours * torch_over_ours, theirs, rtol=0, atol=0.01 * float(theirs.abs().max()))


def test_spectral_scaling_is_ours_only() -> None:
    with pytest.raises(ValueError):
        torch.optim.Muon([torch.randn(4, 4)], adjust_lr_fn="spectral")
    Muon([torch.randn(4, 4)], adjust_lr_fn="spectral")


def test_momentum_of_one_is_refused_by_ours_only() -> None:
    # torch only asks momentum >= 0; ours asks [0, 1): with 1 the buffer would never see a gradient.
    torch.optim.Muon([torch.randn(4, 4)], momentum=1.0)
    with pytest.raises(ValueError, match="momentum"):
        Muon([torch.randn(4, 4)], momentum=1.0)


@pytest.mark.parametrize("shape", [(6,), (), (3, 8, 6), (4, 2, 3, 3), (6, 4, 3)], ids=str)
def test_non_2d_parameters_are_refused_by_torch_and_trained_by_ours(shape: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match="2D"):
        torch.optim.Muon([torch.randn(shape)])
    param = torch.randn(shape)
    before = param.clone()
    opt = Muon([param])
    seeded_grads([param], 0)
    opt.step()
    assert torch.isfinite(param).all() and not torch.equal(param, before)


@pytest.mark.parametrize("nesterov", [True, False])
def test_matching_settings_equal_torch_muon_on_matrices(nesterov: bool) -> None:
    # Tall, wide, square, thin and a repeated shape (ours orthogonalizes those two in one batched call).
    shapes = [(8, 6), (6, 8), (6, 6), (2, 16), (8, 6)]
    settings = Settings(nesterov=nesterov)
    params = make_params(shapes)
    opt = Muon(params, **settings.ours())
    reference = Reference(params, ["matrix"] * len(shapes), settings)
    train_with_reference(opt, params, reference, range(3))
    assert_matches_reference(params, reference, settings, steps=3)
    for param, matrix in zip(params, reference.pieces):
        theirs = reference.muon.state[matrix[0]]["momentum_buffer"]
        torch.testing.assert_close(opt.state[param]["momentum_buffer"], theirs, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("lr, weight_decay", [(0.02, 0.1), (0.005, 0.1), (0.5, 0.5)])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_weight_decay_alone_equals_torch_muon_on_every_float_dtype(dtype: torch.dtype, lr: float,
                                                                    weight_decay: float) -> None:
    # Zero gradients, so that only the decay moves the matrices: each step multiplies by 1 - lr * weight_decay as
    # a float32 number (float64 for float64 matrices) and rounds once to the matrix's dtype, as torch's mul_ by that
    # Python number does. A factor rounded to bfloat16 first (1 - 0.002 -> 1 - 0.0039) doubled the decay there.
    params = [param.to(dtype) for param in make_params([(8, 6), (6, 8), (16, 16)])]
    twins = [param.clone() for param in params]
    ours = Muon(params, lr=lr, weight_decay=weight_decay, adjust_lr_fn="original")
    theirs = torch.optim.Muon(twins, lr=lr, weight_decay=weight_decay)
    for _ in range(20):
        for param in (*params, *twins):
            param.grad = torch.zeros_like(param)
        ours.step()
        theirs.step()
    assert_all_equal(params, twins)
