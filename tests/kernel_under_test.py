"""The package under test, loaded the way users load it: through `kernels`, from this repository's build/.

`make build` (tools/build.py) writes build/ first. `kernels` picks the variant for this machine: the compiled arch
variant (e.g. torch213-cxx11-cpu-x86_64-linux, or the CUDA one with a CUDA torch). Tests import it as
`from kernel_under_test import optimizer`.

With OPTIMIZER_VARIANT_UNDER_TEST=noarch (the release workflow's job for a torch no arch variant serves), build/ holds
only the noarch variants, which users of such a torch load: the package is checked to be one, and the tests of the
compiled ops (`compiled_ops`) skip. Anywhere else a build without them fails those tests.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from types import ModuleType

import pytest
from kernels import get_local_kernel

BUILD_DIR = Path(__file__).resolve().parents[1] / "build"
NOARCH_UNDER_TEST = os.environ.get("OPTIMIZER_VARIANT_UNDER_TEST") == "noarch"
NO_COMPILED_OPS = "pure PyTorch fallback"
compiled_ops = pytest.mark.skipif(NOARCH_UNDER_TEST, reason="tests the compiled ops, which the noarch variant lacks")


def _load(path: Path, backend: str | None = None) -> ModuleType:
    if not path.is_dir():
        raise RuntimeError(f"{path} is missing: run `make build` first")
    return get_local_kernel(path, backend=backend)


def load_cpu_variant() -> ModuleType:
    """The compiled CPU arch variant (the same module as `optimizer` on a machine whose torch has no CUDA); under
    OPTIMIZER_VARIANT_UNDER_TEST=noarch, build/torch-cpu."""
    return _checked(_load(BUILD_DIR, backend="cpu"))


def load_fallback_variant() -> ModuleType:
    """The noarch build/torch-cpu variant: the same package with no compiled ops, so every op falls back."""
    return _load(BUILD_DIR / "torch-cpu")


def submodule(package: ModuleType, name: str) -> ModuleType:
    """A module of a loaded variant, e.g. submodule(optimizer, "native"), whether or not __init__ exports it."""
    return importlib.import_module(f"{package.__name__}.{name}")


def _checked(package: ModuleType) -> ModuleType:
    if NOARCH_UNDER_TEST and not (summary := submodule(package, "native").ops_summary()).startswith(NO_COMPILED_OPS):
        raise RuntimeError(f"OPTIMIZER_VARIANT_UNDER_TEST=noarch, but {package.__name__} has {summary}: build/ "
                           "should hold only the noarch variants (tools/build.py --noarch-only)")
    return package


optimizer = _checked(_load(BUILD_DIR))
