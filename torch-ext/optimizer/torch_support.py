"""The torch releases the package runs on: older ones are refused where they would fail, with what to install.

Release variants are compiled for a few torch releases; every other one loads a noarch variant, so the Python code
meets every torch a user has. The floors are the oldest releases the test suite passed on (README, "Which torch"):
single-device steps on torch 2.9.1; distributed steps lean on DTensor and DeviceMesh internals that changed up to
torch 2.10 (on 2.9.1, uneven shards and meshes of two or more dims failed the gloo cases; 2.10.0 passed them).
"""

from __future__ import annotations

import re

import torch

OLDEST_TORCH = (2, 9)
OLDEST_DISTRIBUTED_TORCH = (2, 10)


def torch_release(version: str) -> tuple[int, int]:
    """(major, minor) of a torch version string: "2.15.0+cu132", "2.11.0a0+git1234" and "2.9.1" alike."""
    found = re.match(r"(\d+)\.(\d+)", version)
    if found is None:
        raise RuntimeError(f"Unrecognized torch version {version!r} (expected major.minor...)")
    return int(found[1]), int(found[2])


def _named(release: tuple[int, int]) -> str:
    return ".".join(map(str, release))


def check_torch(version: str = torch.__version__) -> None:
    """Refuses, at import, a torch older than the oldest one the package was tested on."""
    if torch_release(version) < OLDEST_TORCH:
        raise ImportError(f"optimizer needs torch >= {_named(OLDEST_TORCH)}, but this is torch {version}: "
                          f"upgrade torch (pip install -U torch)")


def check_distributed_torch(what: str, version: str = torch.__version__) -> None:
    """Refuses distributed use (`what`: DTensor parameters, a process_group) on a torch older than the distributed
    step was tested on, before any state or parameter changes."""
    if torch_release(version) < OLDEST_DISTRIBUTED_TORCH:
        raise RuntimeError(f"Muon: {what}: supported from torch {_named(OLDEST_DISTRIBUTED_TORCH)} on (the "
                           f"distributed step relies on DTensor behaviour of those releases), but this is torch "
                           f"{version}: upgrade torch, or step plain tensors")


check_torch()  # on import, which the package's __init__ does first
