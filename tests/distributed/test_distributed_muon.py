"""Distributed Muon under gloo, 4 and 2 processes (one spawn per world size, many cases each), against
single-device Muon on the same global gradients; and a 4-rank checkpoint loaded on 2 ranks and on 1 process.
The cases are in distributed_cases.py, parallelism_cases.py and checkpoint_cases.py."""

from __future__ import annotations

from pathlib import Path

import pytest

import all_cases
import checkpoint_cases
from spawning import run_cases

# Spawning and importing cost ~9 s for 2 processes and ~17 s for 4 on 2 cores; the cases take seconds. Past this
# the workers are killed and every unfinished case fails.
DEADLINE_S = {2: 150, 4: 240}
# Larger worlds first: the 4-rank run saves the checkpoint that the 2-rank run and the single process load.
WORLDS = (4, 2)
_outcomes: dict[int, dict[str, str]] = {}


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("shared")


def _outcome(world: int, name: str, tmp_path_factory: pytest.TempPathFactory, shared: Path) -> str:
    for earlier in WORLDS[:WORLDS.index(world) + 1]:  # a selected 2-rank case still needs the 4-rank run before it
        if earlier not in _outcomes:
            names = list(all_cases.cases_for(earlier))
            out_dir = tmp_path_factory.mktemp(f"world{earlier}")
            _outcomes[earlier] = run_cases(earlier, "all_cases", names, out_dir, DEADLINE_S[earlier], shared)
    return _outcomes[world][name]


@pytest.mark.parametrize("world,name", [(world, name) for world in WORLDS for name in all_cases.cases_for(world)])
def test_distributed_case(world: int, name: str, tmp_path_factory: pytest.TempPathFactory, shared: Path) -> None:
    outcome = _outcome(world, name, tmp_path_factory, shared)
    assert outcome == "ok", outcome


@pytest.mark.parametrize("variant", checkpoint_cases.VARIANTS)
def test_checkpoint_of_4_ranks_loads_on_one_process(variant: str, tmp_path_factory: pytest.TempPathFactory,
                                                    shared: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    saved = _outcome(4, f"checkpoint_save_on_4_ranks{variant}", tmp_path_factory, shared)
    assert saved == "ok", "no checkpoint was saved"
    monkeypatch.setenv("DISTRIBUTED_CASES_SHARED_DIR", str(shared))
    checkpoint_cases.load_on_one_process(variant)
