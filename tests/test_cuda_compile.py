"""The CUDA sources compile, even on machines with no GPU: the .cu for every capability in build.toml, and the C++
side against the installed torch's headers (syntax only: a CPU torch has no CUDA libraries to link against).

The command lines come from tools/build.py, so this checks what `make build` would run on a CUDA machine.
"""

from __future__ import annotations

import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest


@dataclass(frozen=True)
class Compiled:
    commands: dict[str, list[str]]  # by source file name
    results: dict[str, subprocess.CompletedProcess[str]]
    objects: Path


@pytest.fixture(scope="module")
def compiled(build_tool: ModuleType, tmp_path_factory: pytest.TempPathFactory) -> Compiled:
    """Every compile at once (they are independent); objects land in a temporary folder."""
    if build_tool.nvcc_path() is None:
        pytest.skip("nvcc not found (CUDA_HOME or PATH): nothing to compile the CUDA sources with")
    config = build_tool.read_config()
    extension = build_tool.plan_extension(config, "cuda")
    build_tool.write_registration_header()
    objects = tmp_path_factory.mktemp("cuda_objects")
    commands = {}
    for source in (*config.torch_sources, *config.kernel_sources["cuda"]):
        if source.suffix == ".cu":
            commands[source.name] = build_tool.compile_command(extension, source, objects / f"{source.name}.o")
        elif source.suffix == ".cpp":
            commands[source.name] = ["c++", *build_tool.cxx_flags("cuda"), f"-DTORCH_EXTENSION_NAME={extension.name}",
                                     "-fsyntax-only", str(source)]

    def run(command: list[str]) -> subprocess.CompletedProcess[str]:
        return subprocess.run(command, cwd=build_tool.REPO_ROOT, capture_output=True, text=True)

    with ThreadPoolExecutor() as pool:
        return Compiled(commands, dict(zip(commands, pool.map(run, commands.values()))), objects)


def test_kernels_compile_for_every_capability(compiled: Compiled, build_tool: ModuleType) -> None:
    # One nvcc run builds a cubin per capability and fails if any of them does not compile.
    for capability in build_tool.read_config().cuda_capabilities:
        assert f"code=sm_{capability.replace('.', '')}" in " ".join(compiled.commands["muon_momentum.cu"])
    result = compiled.results["muon_momentum.cu"]
    assert result.returncode == 0, result.stderr
    assert (compiled.objects / "muon_momentum.cu.o").stat().st_size > 0


@pytest.mark.parametrize("source", ["muon_momentum_cuda.cpp", "torch_binding.cpp"])
def test_cuda_cpp_side_compiles_against_torch_headers(compiled: Compiled, source: str) -> None:
    result = compiled.results[source]
    assert result.returncode == 0, result.stderr
