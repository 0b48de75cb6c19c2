"""Every case the spawned workers run, by world size: one spawn per world size runs them all."""

from __future__ import annotations

from collections.abc import Callable

import checkpoint_cases
import distributed_cases
import parallelism_cases

MODULES = (distributed_cases, parallelism_cases, checkpoint_cases)


def cases_for(world: int) -> dict[str, Callable[[], None]]:
    cases: dict[str, Callable[[], None]] = {}
    for module in MODULES:
        cases.update(module.cases_for(world))
    return cases
