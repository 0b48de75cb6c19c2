"""mutants.py patches private names of the product, so a mutant whose target has moved stops applying and proves
nothing; two did, unnoticed, when the step's updates moved into offload.py. Running the mutants takes minutes and is
not part of the suite; applying them all takes a process start."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
APPLY_TIMEOUT_S = 120


def test_every_mutant_still_finds_its_target() -> None:
    code = (f"import sys; sys.path[:0] = [{str(HERE.parent)!r}, {str(HERE)!r}]; import mutants\n"
            "for name in mutants.MUTANTS: mutants.apply(name)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=APPLY_TIMEOUT_S,
                            cwd=HERE.parents[1])
    assert result.returncode == 0, result.stderr[-2000:]
