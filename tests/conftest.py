"""Shared test setup. Environment first: both settings are read when the libraries that use them are imported."""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

# Triton kernels run in its interpreter on CPU-only machines; it must be chosen before any @triton.jit runs.
os.environ.setdefault("TRITON_INTERPRET", "1")
# Tests load the local build only; nothing may reach the Hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]


def load_build_tool() -> ModuleType:
    """tools/build.py as a module (it is a script, not a package), for tests that check its command lines."""
    spec = importlib.util.spec_from_file_location("optimizer_build_tool", REPO_ROOT / "tools" / "build.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def build_tool() -> ModuleType:
    return load_build_tool()


@pytest.fixture(autouse=True)
def seeded_global_generators() -> None:
    """Every test draws from torch's and numpy's global generators as if it ran alone: a result then no longer hangs
    on which tests ran before it (a tolerance met by one draw and missed by another showed up only in a reordered
    run)."""
    import numpy as np  # noqa: PLC0415
    import torch  # noqa: PLC0415

    torch.manual_seed(0)
    np.random.seed(0)


@pytest.fixture(autouse=True)
def autograd_left_on() -> Iterator[None]:
    """A test that leaves autograd off errors itself, and the tests after it run with autograd on: a compile that
    failed inside the Triton interpreter of torch 2.9 and 2.10 left it off, and seven later tests failed for it."""
    import torch  # noqa: PLC0415

    yield
    if not torch.is_grad_enabled():
        torch.set_grad_enabled(True)
        pytest.fail("the test left autograd off (torch.is_grad_enabled() was False after it); turned back on")
