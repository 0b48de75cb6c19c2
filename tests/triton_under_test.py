"""The Triton kernels' package as the tests take it, from the source tree, with where they run: under the Triton
interpreter on the CPU (conftest.py sets TRITON_INTERPRET=1 unless the environment says otherwise) or on a GPU."""

import importlib
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

TORCH_EXT = Path(__file__).resolve().parents[1] / "torch-ext"
PACKAGE_DIR = TORCH_EXT / "optimizer" / "triton_kernels"


def load_package_by_path(module_name: str) -> ModuleType:
    """The subpackage alone, bypassing `optimizer/__init__.py` (whose other imports may be mid-edit)."""
    spec = importlib.util.spec_from_file_location(
        module_name, PACKAGE_DIR / "__init__.py", submodule_search_locations=[str(PACKAGE_DIR)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module


def import_triton_kernels() -> ModuleType:
    sys.path.insert(0, str(TORCH_EXT))
    try:
        return importlib.import_module("optimizer.triton_kernels")
    except ImportError:
        return load_package_by_path("optimizer_triton_kernels_from_source")
    finally:
        sys.path.remove(str(TORCH_EXT))


triton_kernels = import_triton_kernels()

INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRETER else "cuda"
needs_kernels = pytest.mark.skipif(
    not triton_kernels.TRITON_AVAILABLE or not (INTERPRETER or torch.cuda.is_available()),
    reason="needs Triton and either its interpreter or a GPU",
)
