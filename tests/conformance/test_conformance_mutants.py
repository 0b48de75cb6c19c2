"""mutants.py patches private names of the product, so a mutant whose target has moved stops applying and proves
nothing; two did, unnoticed, when the step's updates moved into offload.py, and one went on applying to a method the
step no longer called (routing moved out of `Muon._uses_muon`): so every mutant is run here against the tests meant to
catch it (~3 minutes in one process at a time on a 2-core Xeon, as many at once as there are cores)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
APPLY_TIMEOUT_S = 120
RUN_TIMEOUT_S = 900


def test_every_mutant_still_finds_its_target() -> None:
    code = (f"import sys; sys.path[:0] = [{str(HERE.parent)!r}, {str(HERE)!r}]; import mutants\n"
            "for name in mutants.MUTANTS: mutants.apply(name)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=APPLY_TIMEOUT_S,
                            cwd=HERE.parents[1])
    assert result.returncode == 0, result.stderr[-2000:]


def test_every_mutant_is_caught_by_the_tests_meant_for_it() -> None:
    result = subprocess.run([sys.executable, str(HERE / "mutants.py")], capture_output=True, text=True,
                            timeout=RUN_TIMEOUT_S, cwd=HERE.parents[1])
    missed = [line for line in result.stdout.splitlines() if not line.startswith("caught")]
    assert result.returncode == 0 and not missed, "\n".join(missed) or result.stderr[-2000:]
