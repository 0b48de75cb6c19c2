"""The torch releases the package runs on: older ones are refused where they would fail, with what to install.

Release variants are compiled for a few torch releases; every other one loads a noarch variant, so the Python code
meets every torch a user has. The floor is the oldest release the test suite ran on (README, "Which torch"),
torch 2.9.1, single-device and distributed alike. Two things torch 2.9 does otherwise than later releases are
answered here, so that the step can refuse or avoid them.
"""

from __future__ import annotations

import re
from functools import lru_cache

import torch

OLDEST_TORCH = (2, 9)
# torch 2.9's DTensor cuts a _StridedShard dim into split_factor x mesh-dim-size runs with one torch.chunk: where the
# runs are uneven, rows land elsewhere than FSDP2 over tensor parallelism put them (chunks of chunks), so full_tensor()
# reassembles another matrix, often from local shards of the very shapes expected. 2.10 splits as FSDP2 does.
UNEVEN_STRIDED_SHARDS_TORCH = (2, 10)
# torch 2.9's compiler fails an assertion on the sizes while making the fake copy of a DTensor parameter that a traced
# step reads (seen on FSDP2's); 2.10's traces them.
COMPILED_DTENSOR_STEPS_TORCH = (2, 10)


@lru_cache(maxsize=64)  # asked of every DTensor parameter at every step
def torch_release(version: str) -> tuple[int, int]:
    """(major, minor) of a torch version string: "2.15.0+cu132", "2.11.0a0+git1234" and "2.9.1" alike."""
    found = re.match(r"(\d+)\.(\d+)", version)
    if found is None:
        raise RuntimeError(f"Unrecognized torch version {version!r} (expected major.minor...)")
    return int(found[1]), int(found[2])


def release_name(release: tuple[int, int]) -> str:
    return ".".join(map(str, release))


def check_torch(version: str = torch.__version__) -> None:
    """Refuses, at import, a torch older than the oldest one the package was tested on."""
    if torch_release(version) < OLDEST_TORCH:
        raise ImportError(f"optimizer needs torch >= {release_name(OLDEST_TORCH)}, but this is torch {version}: "
                          f"upgrade torch (pip install -U torch)")


def places_uneven_strided_shards(version: str = torch.__version__) -> bool:
    """Whether DTensor places an uneven _StridedShard's rows where FSDP2 over tensor parallelism puts them."""
    return torch_release(version) >= UNEVEN_STRIDED_SHARDS_TORCH


def compiles_dtensor_steps(version: str = torch.__version__) -> bool:
    """Whether torch.compile can trace an optimizer step that reads DTensor parameters."""
    return torch_release(version) >= COMPILED_DTENSOR_STEPS_TORCH


check_torch()  # on import, which the package's __init__ does first
