"""LR schedulers, those that cycle momentum included: what they write into the groups is what the next step uses.

Each schedule drives ours and the torch reference (torch.optim.Muon + torch.optim.AdamW, conformance_support) side
by side, and the parameters are compared after every step, so a value a scheduler set but the step ignored shows up
in the update. The momentum-cycling schedulers take `momentum` when an optimizer's defaults have it, `betas`
otherwise (torch's rule): on Muon they cycle Muon's momentum, which torch.optim.Muon also has; AdamW-routed
parameters keep `adamw_betas`, so their AdamW reference is scheduled without cycling.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from torch.optim import lr_scheduler

from conformance_support import (ROUTING_BY_NAME, ROUTINGS, Muon, Reference, Routing, Settings,
                                 assert_matches_reference, build, make_params, seeded_grads)

ROUTING_IDS = [routing.name for routing in ROUTINGS]
STEPS = 4


@dataclass(frozen=True)
class Schedule:
    """A scheduler factory: `make(optimizer, lr_scale, cycle_momentum)`; lr_scale multiplies every lr it sets (so
    an AdamW reference can run the same schedule from adamw_lr)."""

    make: Callable[[torch.optim.Optimizer, float, bool], object]
    moves_momentum: bool = False
    on_plateau: bool = False


SCHEDULES: dict[str, Schedule] = {
    "StepLR": Schedule(lambda opt, scale, cycle: lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)),
    "LambdaLR": Schedule(lambda opt, scale, cycle: lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (step + 1))),
    "OneCycleLR": Schedule(lambda opt, scale, cycle: lr_scheduler.OneCycleLR(
        opt, max_lr=0.04 * scale, total_steps=STEPS + 2, cycle_momentum=cycle, base_momentum=0.8,
        max_momentum=0.95), moves_momentum=True),
    "CyclicLR": Schedule(lambda opt, scale, cycle: lr_scheduler.CyclicLR(
        opt, base_lr=0.005 * scale, max_lr=0.04 * scale, step_size_up=2, cycle_momentum=cycle, base_momentum=0.8,
        max_momentum=0.95), moves_momentum=True),
    "ReduceLROnPlateau": Schedule(lambda opt, scale, cycle: lr_scheduler.ReduceLROnPlateau(
        opt, factor=0.5, patience=0), on_plateau=True),
}


def advance(schedulers: list[object], schedule: Schedule) -> None:
    for scheduler in schedulers:
        # A loss that never improves: ReduceLROnPlateau halves lr at every step after the first.
        scheduler.step(1.0) if schedule.on_plateau else scheduler.step()


def scheduled(opt: Muon, reference: Reference, schedule: Schedule, adamw_scale: float) -> list[object]:
    schedulers = [schedule.make(opt, 1.0, True)]
    if reference.muon is not None:
        schedulers.append(schedule.make(reference.muon, 1.0, True))
    if reference.adamw is not None:
        schedulers.append(schedule.make(reference.adamw, adamw_scale, False))
    return schedulers


@pytest.mark.parametrize("routing", ROUTINGS, ids=ROUTING_IDS)
@pytest.mark.parametrize("name", SCHEDULES)
def test_scheduled_values_drive_the_next_update(name: str, routing: Routing) -> None:
    schedule, settings = SCHEDULES[name], Settings()
    params = make_params(routing.shapes)
    opt = build(routing, params, settings)
    reference = Reference(params, routing.layouts, settings)
    schedulers = scheduled(opt, reference, schedule, 1.0)
    group = opt.param_groups[0]
    seen_lr, seen_momentum = {group["lr"]}, {group["momentum"]}
    for seed in range(STEPS):
        seeded_grads(params, seed)
        opt.step()
        reference.step([p.grad for p in params])
        advance(schedulers, schedule)
        seen_lr.add(group["lr"])
        seen_momentum.add(group["momentum"])
        if reference.muon is not None:  # the dict too: both optimizers hold what the same schedule wrote
            assert group["lr"] == reference.muon.param_groups[0]["lr"]
            assert group["momentum"] == reference.muon.param_groups[0]["momentum"]
        assert_matches_reference(params, reference, settings, steps=seed + 1)
    assert len(seen_lr) > 2 and (len(seen_momentum) > 2) == schedule.moves_momentum  # the schedule did move them


def _halve_lr_by_hand(optimizers: list[torch.optim.Optimizer]) -> None:
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"] = group["lr"] * 0.5


@pytest.mark.parametrize("name", [*SCHEDULES, "by_hand"])
def test_adamw_lr_moves_by_the_factor_lr_moves(name: str) -> None:
    # README: adamw_lr is relative to lr; whatever moves lr (a scheduler, ReduceLROnPlateau, a loop that sets
    # group["lr"]) moves AdamW's lr by the same factor. The AdamW reference runs the same schedule scaled to adamw_lr.
    settings = Settings(adamw_lr=0.004)
    routing = ROUTING_BY_NAME["mixed"]
    params = make_params(routing.shapes)
    opt = build(routing, params, settings)
    reference = Reference(params, routing.layouts, settings)
    schedule = SCHEDULES.get(name)
    schedulers = scheduled(opt, reference, schedule, settings.adamw_lr / settings.lr) if schedule else []
    for seed in range(STEPS):
        seeded_grads(params, seed)
        opt.step()
        reference.step([p.grad for p in params])
        if schedule:
            advance(schedulers, schedule)
        else:
            _halve_lr_by_hand([opt, *reference.optimizers])
        assert_matches_reference(params, reference, settings, steps=seed + 1)
