"""Distributed Muon under gloo, 2 and 4 processes (one spawn per world size, many cases each), against
single-device Muon on the same global gradients. The cases are in distributed_cases.py."""

from __future__ import annotations

import pytest

import distributed_cases
from spawning import run_cases

# Spawning and importing cost ~9 s for 2 processes and ~17 s for 4 on 2 cores; the cases take seconds. Past this
# the workers are killed and every unfinished case fails.
DEADLINE_S = {2: 120, 4: 180}
_outcomes: dict[int, dict[str, str]] = {}


def _outcome(world: int, name: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    if world not in _outcomes:
        names = list(distributed_cases.cases_for(world))
        out_dir = tmp_path_factory.mktemp(f"world{world}")
        _outcomes[world] = run_cases(world, "distributed_cases", names, out_dir, DEADLINE_S[world])
    return _outcomes[world][name]


@pytest.mark.parametrize("world,name", [(world, name) for world in (2, 4)
                                        for name in distributed_cases.cases_for(world)])
def test_distributed_case(world: int, name: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    outcome = _outcome(world, name, tmp_path_factory)
    assert outcome == "ok", outcome
