"""The conformance battery loads the package as the other tests do (tests/conftest.py puts tests/ on sys.path and
sets the environment), and can run against a deliberately broken product: CONFORMANCE_MUTANT=<name> applies one of
mutants.py's breakages for the whole session, so that each kind of property is shown able to fail."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

TESTS_DIR = Path(__file__).resolve().parents[1]
if str(TESTS_DIR) not in sys.path:  # running this folder alone still finds kernel_under_test and test_muon
    sys.path.insert(0, str(TESTS_DIR))

if os.environ.get("CONFORMANCE_MUTANT"):
    import mutants

    mutants.apply(os.environ["CONFORMANCE_MUTANT"])


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Every tensor here has a few dozen entries: a second intra-op thread has nothing to share, and on a busy 2-core
    machine each handoff to it can wait out a scheduler slice (torch.optim.Muon's bf16 step on a 4x3 matrix measured
    40 ms with 2 threads under load, 0.1 ms with one). Scoped to this folder's tests, and restored after each."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
