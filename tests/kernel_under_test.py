"""The package under test, loaded the way users load it: through `kernels`, from this repository's build/.

`make build` (tools/build.py) writes build/ first. `kernels` picks the variant for this machine: the compiled arch
variant (e.g. torch213-cxx11-cpu-x86_64-linux, or the CUDA one with a CUDA torch). Tests import it as
`from kernel_under_test import optimizer`.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType

from kernels import get_local_kernel

BUILD_DIR = Path(__file__).resolve().parents[1] / "build"


def _load(path: Path, backend: str | None = None) -> ModuleType:
    if not path.is_dir():
        raise RuntimeError(f"{path} is missing: run `make build` first")
    return get_local_kernel(path, backend=backend)


def load_cpu_variant() -> ModuleType:
    """The compiled CPU arch variant (the same module as `optimizer` on a machine whose torch has no CUDA)."""
    return _load(BUILD_DIR, backend="cpu")


def load_fallback_variant() -> ModuleType:
    """The noarch build/torch-cpu variant: the same package with no compiled ops, so every op falls back."""
    return _load(BUILD_DIR / "torch-cpu")


def submodule(package: ModuleType, name: str) -> ModuleType:
    """A module of a loaded variant, e.g. submodule(optimizer, "native"), whether or not __init__ exports it."""
    return importlib.import_module(f"{package.__name__}.{name}")


optimizer = _load(BUILD_DIR)
