"""build.toml and `make build`'s output, checked with the `kernels` library's own parsers and variant resolver."""

from __future__ import annotations

import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from kernels._rust import Backend, Build, Metadata
from kernels.variants import get_variants_local, resolve_variant
from kernel_under_test import BUILD_DIR, load_cpu_variant, load_fallback_variant, optimizer, submodule

REPO_ROOT = BUILD_DIR.parent
VARIANT_DIRS = sorted(path for path in BUILD_DIR.iterdir() if path.is_dir() and not path.name.startswith("."))
HAS_CUDA_BUILD = torch.version.cuda is not None and shutil.which("nvcc") is not None  # tools/build.py's condition


def test_build_toml_is_valid_for_kernel_builder() -> None:
    # Build.open is kernel-builder's own parser (shared through kernels-data); it rejects unknown or missing fields.
    build = Build.open(REPO_ROOT)
    assert set(build.general.backends) == {Backend.CPU, Backend.CUDA}


def test_build_toml_sources_exist(build_tool) -> None:
    config = build_tool.read_config()
    sources = [*config.torch_sources, *(path for paths in config.kernel_sources.values() for path in paths)]
    missing = [str(path) for path in sources if not path.is_file()]
    assert not missing, f"build.toml lists missing sources: {missing}"
    assert set(config.kernel_sources) == set(config.backends)


def test_noarch_and_arch_variants_are_written() -> None:
    names = {path.name for path in VARIANT_DIRS}
    major, minor = torch.__version__.split(".")[:2]
    machine = platform.machine()
    assert {"torch-cpu", "torch-cuda", f"torch{major}{minor}-cxx11-cpu-{machine}-linux"} <= names
    if HAS_CUDA_BUILD:
        cuda = "".join(torch.version.cuda.split(".")[:2])
        assert f"torch{major}{minor}-cxx11-cu{cuda}-{machine}-linux" in names


@pytest.mark.parametrize("variant_dir", VARIANT_DIRS, ids=lambda path: path.name)
def test_variant_has_valid_metadata_and_package(variant_dir: Path) -> None:
    metadata = Metadata.read_from_file(variant_dir / "metadata.json")  # kernels' own reader: rejects bad fields
    assert str(metadata.name) == "optimizer"
    assert metadata.version == 1
    assert metadata.license == "Apache-2.0"
    assert metadata.python_depends == []
    expected_backend = Backend.CPU if "cpu" in variant_dir.name else Backend.CUDA
    assert metadata.backend.backend_type == expected_backend
    for name in ("__init__.py", "_ops.py", "native.py"):
        assert (variant_dir / name).is_file(), f"{variant_dir.name} lacks {name}"
    libraries = list(variant_dir.glob("*.so"))
    if variant_dir.name.startswith("torch-"):
        assert libraries == [], "a noarch variant must not carry a compiled library"
    else:
        assert len(libraries) == 1 and libraries[0].name.endswith(".abi3.so")
        extension = libraries[0].name.removesuffix(".abi3.so")
        assert f"from . import {extension}" in (variant_dir / "_ops.py").read_text()


def test_variant_ids_are_unique() -> None:
    # The id becomes the package's sys.modules name: two variants sharing one would clobber each other.
    ids = [Metadata.read_from_file(path / "metadata.json").id for path in VARIANT_DIRS]
    assert len(set(ids)) == len(ids)


def test_kernels_resolver_prefers_the_compiled_variant() -> None:
    variant, _ = resolve_variant(get_variants_local(BUILD_DIR))
    assert variant is not None and not variant.variant_str.startswith("torch-")
    assert optimizer.__name__ == Metadata.read_from_file(BUILD_DIR / variant.variant_str / "metadata.json").id


def test_arch_variant_has_live_compiled_ops() -> None:
    expected_device = "cuda" if HAS_CUDA_BUILD else "cpu"
    assert optimizer.ops_summary().startswith(f"compiled ops ({expected_device})")
    assert load_cpu_variant().ops_summary().startswith("compiled ops (cpu)")


def test_noarch_variant_falls_back() -> None:
    assert load_fallback_variant().ops_summary() == "pure PyTorch fallback: this build has no compiled ops"


def test_both_variants_live_in_one_process() -> None:
    compiled, fallback = load_cpu_variant(), load_fallback_variant()
    assert compiled.__name__ != fallback.__name__
    assert sys.modules[compiled.__name__] is compiled and sys.modules[fallback.__name__] is fallback
    # Each package's native module is bound to its own _ops, whichever was imported first.
    assert submodule(compiled, "native").ops_summary().startswith("compiled ops")
    assert submodule(fallback, "native").ops_summary().startswith("pure PyTorch fallback")


def test_op_schema_marks_mutated_arguments() -> None:
    ops = submodule(load_cpu_variant(), "_ops").ops
    arguments = {arg.name: arg for arg in ops.muon_momentum_.default._schema.arguments}
    written = {name for name, arg in arguments.items() if arg.alias_info is not None and arg.alias_info.is_write}
    assert written == {"momentum_buffers", "updates", "finite"}


def test_unchanged_rebuild_reuses_everything(tmp_path: Path) -> None:
    # A copy of the sources with the warm library cache: the rebuild must compile nothing and take seconds.
    for name in ("build.toml", "tools", "torch-ext", "kernels-src"):
        source = REPO_ROOT / name
        (shutil.copytree if source.is_dir() else shutil.copy2)(source, tmp_path / name)
    shutil.copytree(BUILD_DIR / ".cache", tmp_path / "build" / ".cache", ignore=shutil.ignore_patterns("lock"))
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "tools/build.py"], cwd=tmp_path, capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    assert result.returncode == 0, result.stderr
    arch_lines = [line for line in result.stdout.splitlines() if "compiled ops" in line]
    assert arch_lines and all(line.endswith("(cached library)") for line in arch_lines), result.stdout
    # Importing torch dominates (about 3 s here); compiling the CPU op alone takes over 15 s on these 2 cores.
    assert elapsed < 12, f"an unchanged rebuild took {elapsed:.1f} s"
    built = sorted(path.name for path in (tmp_path / "build").iterdir() if not path.name.startswith("."))
    assert built == [path.name for path in VARIANT_DIRS]
