"""The package's layers import downward only: the single-device math never reaches into `distributed/`, which is
built on it (its owners call the same Newton-Schulz and decay code). Read from the sources, nothing imported."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "torch-ext" / "optimizer"
# The modules that do the math on plain tensors; muon.py (the orchestration) and qk_clip.py (which clips DTensor
# weights too) may use the distributed layer.
SINGLE_DEVICE = ("coefficients.py", "dispatch.py", "functional.py", "native.py", "newton_schulz.py", "normalization.py",
                 "offload.py", "precision.py", "routing.py", "state_precision.py", "triton_ops.py")


def imported_packages(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            names |= {node.module} if node.module else {alias.name for alias in node.names}
    return names


@pytest.mark.parametrize("module", SINGLE_DEVICE)
def test_single_device_math_does_not_import_the_distributed_layer(module: str) -> None:
    distributed = {name for name in imported_packages(PACKAGE / module) if name.split(".")[0] == "distributed"}
    assert not distributed, f"{module} imports {sorted(distributed)}"
