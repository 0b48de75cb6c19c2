"""What every conformance test shares: the routings a property runs on, and the truth each is checked against.

A routing is a parameter group as users write it (shapes plus group options) with the route README.md promises for
each parameter. The truth is PyTorch's own optimizers, never ours: `torch.optim.AdamW` for AdamW-routed parameters,
and `torch.optim.Muon` (2D only) on each matrix a Muon-routed parameter is made of, following README's "param_layout"
and "conv_mode": an expert bank is one matrix per expert, a flattened conv weight is (out, in * k), a batched one is
one (out, in) matrix per kernel position.
"""

from __future__ import annotations

import copy
import inspect
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from kernel_under_test import optimizer
from test_muon import seeded_grads

Muon = optimizer.Muon
# The product's class module, for the mutants (mutants.py) that break it on purpose.
muon_module = sys.modules[Muon.__module__]

FLOAT_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
# torch.optim.Muon's Newton-Schulz coefficients, read from its signature so that a change there is seen here too.
TORCH_MUON_COEFFICIENTS: tuple[float, float, float] = inspect.signature(torch.optim.Muon).parameters[
    "ns_coefficients"].default


# --- routings ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Routing:
    """One parameter group: its shapes, its group options, and how README says each parameter becomes matrices.

    `layouts[i]` is "adamw" (AdamW), "matrix", "experts" (one matrix per leading index), "flatten" ((out, rest)),
    "batched" (one (out, in) matrix per kernel position) or "transposed" (one matrix per leading index, each the
    transpose of the last two dims)."""

    name: str
    shapes: tuple[tuple[int, ...], ...]
    layouts: tuple[str, ...]
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def has_muon(self) -> bool:
        return any(layout != "adamw" for layout in self.layouts)

    @property
    def has_adamw(self) -> bool:
        return "adamw" in self.layouts


ROUTINGS: tuple[Routing, ...] = (
    Routing("matrix", ((8, 6),), ("matrix",)),
    Routing("vector", ((6,),), ("adamw",)),
    Routing("scalar", ((),), ("adamw",)),
    Routing("matrix_use_muon_false", ((8, 6),), ("adamw",), {"use_muon": False}),
    # Routed by shape inside one group: two matrices (a tall and a wide one), a vector and a scalar.
    Routing("mixed", ((8, 6), (6,), (), (6, 8)), ("matrix", "adamw", "adamw", "matrix")),
    Routing("experts", ((3, 8, 6),), ("experts",)),
    Routing("conv_flatten", ((4, 2, 3, 3),), ("flatten",), {"conv_mode": "flatten"}),
    Routing("conv_batched", ((4, 3, 2, 2),), ("batched",), {"conv_mode": "batched"}),
    Routing("conv1d", ((6, 4, 3),), ("flatten",), {"param_layout": "conv"}),
    # Stored (in, out), as transformers' Conv1D keeps them: torch's "original" lr scale reads out = 8, in = 6.
    Routing("transposed", ((6, 8), (2, 6, 8)), ("transposed", "transposed"), {"param_layout": "transposed"}),
)
ROUTING_BY_NAME = {routing.name: routing for routing in ROUTINGS}


def make_params(shapes: Sequence[tuple[int, ...]], seed: int = 0, dtype: torch.dtype = torch.float32,
                scale: float = 1.0) -> list[Tensor]:
    generator = torch.Generator().manual_seed(1000 + seed)
    return [(torch.randn(shape, generator=generator, dtype=torch.float64) * scale).to(dtype) for shape in shapes]


def clones(tensors: Sequence[Tensor]) -> list[Tensor]:
    return [tensor.detach().clone() for tensor in tensors]


# --- settings and the torch reference -------------------------------------------------------------------------

@dataclass(frozen=True)
class Settings:
    """Hyperparameters under which our step must equal torch's: Muon with Keller Jordan's coefficients, bf16
    Newton-Schulz and his lr scaling (what torch.optim.Muon does), AdamW with our default betas and eps."""

    lr: float = 0.02
    weight_decay: float = 0.1
    momentum: float = 0.9
    nesterov: bool = True
    adamw_lr: float | None = None
    adamw_betas: tuple[float, float] = (0.9, 0.95)
    adamw_eps: float = 1e-8

    def ours(self) -> dict[str, Any]:
        return dict(lr=self.lr, weight_decay=self.weight_decay, momentum=self.momentum, nesterov=self.nesterov,
                    ns_steps=5, ns_coefficients="original", ns_dtype=torch.bfloat16, adjust_lr_fn="original",
                    adamw_lr=self.adamw_lr, adamw_betas=self.adamw_betas, adamw_eps=self.adamw_eps)

    def torch_muon(self) -> dict[str, Any]:
        return dict(lr=self.lr, weight_decay=self.weight_decay, momentum=self.momentum, nesterov=self.nesterov,
                    ns_steps=5, ns_coefficients=TORCH_MUON_COEFFICIENTS, adjust_lr_fn="original", eps=1e-7)

    def torch_adamw(self) -> dict[str, Any]:
        lr = self.lr if self.adamw_lr is None else self.adamw_lr
        return dict(lr=lr, betas=self.adamw_betas, eps=self.adamw_eps, weight_decay=self.weight_decay,
                    foreach=False)


def as_matrices(tensor: Tensor, layout: str) -> list[Tensor]:
    """The 2D matrices README says Muon orthogonalizes for a parameter of this layout (copies)."""
    if layout == "matrix":
        pieces = [tensor]
    elif layout == "experts":
        pieces = list(tensor.unbind(0))
    elif layout == "flatten":
        pieces = [tensor.reshape(tensor.shape[0], -1)]
    elif layout == "batched":
        pieces = list(tensor.flatten(2).unbind(-1))
    elif layout == "transposed":
        pieces = list(tensor.reshape(-1, *tensor.shape[-2:]).mT.unbind(0))
    else:
        raise AssertionError(f"not a Muon layout: {layout}")
    return [piece.detach().clone().contiguous() for piece in pieces]


def from_matrices(pieces: Sequence[Tensor], layout: str, shape: torch.Size) -> Tensor:
    if layout == "matrix":
        return pieces[0]
    if layout == "experts":
        return torch.stack(list(pieces), 0)
    if layout == "flatten":
        return pieces[0].reshape(shape)
    if layout == "transposed":
        return torch.stack(list(pieces), 0).mT.reshape(shape)
    return torch.stack(list(pieces), -1).reshape(shape)


class Reference:
    """torch.optim.Muon on every matrix of the Muon-routed parameters, torch.optim.AdamW on the rest.

    It works on float32 copies (float64 for float64 parameters): torch.optim.Muon runs Newton-Schulz in bfloat16
    whatever the parameter's dtype, so a wider reference is no more exact, and a 16-bit one would only add its own
    rounding."""

    def __init__(self, params: Sequence[Tensor], layouts: Sequence[str], settings: Settings) -> None:
        self.layouts = list(layouts)
        self.shapes = [param.shape for param in params]
        dtype = torch.float64 if params and params[0].dtype == torch.float64 else torch.float32
        self.pieces: list[list[Tensor]] = []
        for param, layout in zip(params, layouts):
            wide = param.detach().to(dtype)
            self.pieces.append([wide.clone()] if layout == "adamw" else as_matrices(wide, layout))
        muon = [p for pieces, layout in zip(self.pieces, layouts) if layout != "adamw" for p in pieces]
        adamw = [pieces[0] for pieces, layout in zip(self.pieces, layouts) if layout == "adamw"]
        self.muon = torch.optim.Muon(muon, **settings.torch_muon()) if muon else None
        self.adamw = torch.optim.AdamW(adamw, **settings.torch_adamw()) if adamw else None
        self.optimizers: list[torch.optim.Optimizer] = [opt for opt in (self.muon, self.adamw) if opt is not None]

    def set_grads(self, grads: Sequence[Tensor | None]) -> None:
        for pieces, layout, grad in zip(self.pieces, self.layouts, grads):
            if grad is None:
                for piece in pieces:
                    piece.grad = None
                continue
            wide = grad.to(pieces[0].dtype)
            split = [wide] if layout == "adamw" else as_matrices(wide, layout)
            for piece, piece_grad in zip(pieces, split):
                piece.grad = piece_grad

    def step(self, grads: Sequence[Tensor | None]) -> None:
        self.set_grads(grads)
        for opt in self.optimizers:
            opt.step()

    def params(self) -> list[Tensor]:
        return [pieces[0] if layout == "adamw" else from_matrices(pieces, layout, shape)
                for pieces, layout, shape in zip(self.pieces, self.layouts, self.shapes)]


def muon_update_size(shape: torch.Size, layout: str, lr: float) -> float:
    """The size of one entry of one Muon update for this parameter: lr * sqrt(max(1, out/in)) / sqrt(min side)."""
    rows, cols = as_matrices(torch.empty(shape), layout)[0].shape
    return lr * math.sqrt(max(1.0, rows / cols)) / math.sqrt(min(rows, cols))


def assert_matches_reference(ours: Sequence[Tensor], reference: Reference, settings: Settings, steps: int) -> None:
    """Ours against torch's, parameter by parameter, with a tolerance each route justifies.

    Muon: both run the same bf16 Newton-Schulz, and differ only by reductions done in another order (our batched
    norms), so an entry may differ by about 1% of one update per step taken (test_muon.py's tolerance). AdamW: fused
    against single-tensor AdamW is the same float arithmetic in another order, a few ulps (test_muon.py's 1e-6).
    A 16-bit parameter rounds by up to half a unit of its largest entry at every step, and its 16-bit state (the
    momentum that Newton-Schulz then reads) adds as much again: measured up to 0.8 unit per step, allow 2. A float64
    parameter's momentum is divided by its norm in float64 and then rounded to bfloat16 once, where torch rounds it
    first (a float64 entry beyond float32's range became inf there, and the update NaN): the iterations start a
    rounding apart, which moved an entry by up to 5% of one update per step (the bf16 result nearer the float64 SVD
    polar factor, if anything); allow 10%."""
    for index, (param, expected, layout) in enumerate(zip(ours, reference.params(), reference.layouts)):
        if layout == "adamw":
            atol = 1e-6
        else:
            share = 0.1 if param.dtype == torch.float64 else 0.01
            atol = share * muon_update_size(param.shape, layout, settings.lr) * steps
        if param.dtype in (torch.bfloat16, torch.float16):
            largest = float(expected.abs().max()) if expected.numel() else 0.0
            atol += 2 * torch.finfo(param.dtype).eps * largest * steps
        torch.testing.assert_close(param.to(expected.dtype), expected, rtol=0, atol=atol,
                                   msg=lambda text: f"parameter {index} ({layout}, {tuple(param.shape)}): {text}")


# --- snapshots: "nothing changed" is checked on values, not identities ----------------------------------------

def state_snapshot(opt: torch.optim.Optimizer) -> dict[int, dict[str, Any]]:
    """The optimizer's state keyed by parameter position, every tensor cloned."""
    position = {id(p): i for i, p in enumerate(p for group in opt.param_groups for p in group["params"])}
    return {position.get(id(param), -1): {key: value.clone() if isinstance(value, Tensor) else copy.deepcopy(value)
                                          for key, value in entry.items()}
            for param, entry in opt.state.items()}


def groups_snapshot(opt: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Group values, with parameters as identities (a group must keep the very tensors it was given)."""
    return [{key: [id(p) for p in value] if key == "params" else copy.deepcopy(value) for key, value in group.items()}
            for group in opt.param_groups]


def assert_same_state(actual: dict[int, dict[str, Any]], expected: dict[int, dict[str, Any]]) -> None:
    assert actual.keys() == expected.keys()
    for position, entry in expected.items():
        assert actual[position].keys() == entry.keys(), position
        for key, value in entry.items():
            if isinstance(value, Tensor):
                assert torch.equal(actual[position][key], value), (position, key)
            else:
                assert actual[position][key] == value, (position, key)


def assert_all_equal(actual: Sequence[Tensor], expected: Sequence[Tensor]) -> None:
    assert len(actual) == len(expected)
    for index, (a, b) in enumerate(zip(actual, expected)):
        assert a.dtype == b.dtype and a.shape == b.shape, index
        assert torch.equal(a, b), f"parameter {index} differs (max {float((a - b).abs().max()):.3g})"


# --- building and training ---------------------------------------------------------------------------------

def build(routing: Routing, params: Sequence[Tensor], settings: Settings = Settings()) -> Muon:
    """Ours on the routing's group, with settings under which it must equal the torch reference."""
    return Muon([dict(params=list(params), **routing.options)], **settings.ours())


def train_with_reference(opt: torch.optim.Optimizer, params: Sequence[Tensor], reference: Reference,
                         seeds: range) -> None:
    """One step per seed on both, with test_muon.py's seeded gradients (the reference gets the same ones)."""
    for seed in seeds:
        seeded_grads(list(params), seed)
        opt.step()
        reference.step([p.grad for p in params])
