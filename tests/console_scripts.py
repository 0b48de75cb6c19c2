"""Where the tests find a console script a wheel installed: in the venv's bin/, else on PATH (a GPU machine installs
the carried wheels beside its own torch, elsewhere: benchmarks/gpu_first_light.sh)."""

from __future__ import annotations

import shutil
import sysconfig
from pathlib import Path

SCRIPTS_DIR = Path(sysconfig.get_path("scripts"))  # the venv's bin/


def console_script(name: str) -> str:
    installed = SCRIPTS_DIR / name
    return str(installed) if installed.exists() else shutil.which(name) or str(installed)
