"""The AdamW part's and the Muon update's Triton kernels compile to machine code (PTX, then ptxas's cubin) for the
GPUs users run: a T4 (sm_75, the free Colab and Kaggle GPU), an A100 (sm_80) and an H100 (sm_90), and the symmetric
products' for sm_90, on a machine without a GPU, where the other tests run them only under the Triton interpreter,
which compiles nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from triton_under_test import triton_kernels

CAPABILITIES = (75, 80, 90)
CHECK = Path(__file__).with_name("triton_compile_check.py")
pytestmark = pytest.mark.skipif(not triton_kernels.TRITON_AVAILABLE, reason="needs Triton")


@pytest.fixture(scope="module")
def compiled() -> dict[str, str]:
    """Every case of triton_compile_check.py compiled for every capability, in one process of its own (Triton reads
    TRITON_INTERPRET when the kernels are defined)."""
    result = subprocess.run([sys.executable, str(CHECK), *map(str, CAPABILITIES)], capture_output=True, text=True,
                            env={**os.environ, "TRITON_INTERPRET": "0"}, timeout=600)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.splitlines()[-1])


@pytest.mark.parametrize("capability", CAPABILITIES)
def test_step_kernels_compile_for_each_gpu_generation(compiled: dict[str, str], capability: int) -> None:
    cases = {name: outcome for name, outcome in compiled.items() if name.endswith(f" sm_{capability}")}
    assert cases and all(outcome == "ok" for outcome in cases.values()), cases
