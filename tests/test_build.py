"""build.toml and `make build`'s output, checked with the `kernels` library's own parsers and variant resolver."""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch
from kernels._rust import Backend, Build, Digest, Metadata
from kernels.variants import get_variants_local, resolve_variant
from console_scripts import console_script
from kernel_under_test import BUILD_DIR, load_cpu_variant, load_fallback_variant, optimizer, submodule

REPO_ROOT = BUILD_DIR.parent
VARIANT_DIRS = sorted(BUILD_DIR.iterdir())
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


def test_build_dir_holds_only_variants_kernels_recognizes() -> None:
    # Caches live in .build-cache/: build/ is what the Hub repository gets, nothing else.
    recognized = {variant.variant_str for variant in get_variants_local(BUILD_DIR)}
    assert {path.name for path in VARIANT_DIRS} == recognized


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
    general = tomllib.loads((REPO_ROOT / "build.toml").read_text())["general"]
    assert str(metadata.name) == general["name"]
    assert metadata.version == general["version"]
    assert metadata.license == general["license"]
    assert (metadata.upstream, metadata.source) == (general["upstream"], general["source"])
    assert metadata.kernels_minver is not None
    assert metadata.python_depends == []
    # The digest `kernels verify-signature` checks a variant against: recomputed by kernels' own code, it must match.
    assert metadata.digest is not None
    metadata.digest.validate(Digest.hash_variant(metadata.digest.algorithm, variant_dir))
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
    # As kernel-builder names them: the op namespace is the id.
    assert f"ops = torch.ops.{metadata.id}\n" in (variant_dir / "_ops.py").read_text()


@pytest.mark.parametrize("variant_dir", VARIANT_DIRS, ids=lambda path: path.name)
def test_variant_records_its_git_provenance(variant_dir: Path) -> None:
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True)
    if head.returncode != 0:
        pytest.skip("not a git checkout")
    provenance = Metadata.read_from_file(variant_dir / "metadata.json").provenance
    assert provenance is not None and provenance.kernel is not None
    assert provenance.kernel.commit == head.stdout.strip()
    changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO_ROOT,
                             capture_output=True, text=True, check=True).stdout
    assert provenance.kernel.dirty == bool(changed.strip())


def test_kernels_info_shows_every_field() -> None:
    result = subprocess.run([console_script("kernels"), "info", "--json", str(REPO_ROOT)], capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout)
    missing = [field for field in ("name", "version", "kernels_minver", "license", "upstream", "source")
               if info.get(field) is None]
    assert not missing, f"kernels info shows no {missing}"
    assert info["backends"] == ["cpu", "cuda"]


def test_cpu_kernels_are_compiled_with_openmp(build_tool) -> None:
    # build.toml's cxx-flags reach the compiler: at::parallel_for then calls into libgomp instead of running inline.
    config = build_tool.read_config()
    assert all("-fopenmp" in config.source_cxx_flags[source] for source in config.kernel_sources["cpu"]
               if source.suffix == ".cpp")  # headers take no flags (the shared ones are listed by CUDA kernels too)
    library = next((BUILD_DIR / build_tool.arch_variant_name("cpu")).glob("*.so"))
    undefined = subprocess.run(["nm", "-D", "--undefined-only", str(library)], capture_output=True, text=True,
                               check=True).stdout
    assert "GOMP_parallel" in undefined


def test_get_kernel_loads_the_local_build_through_local_kernels() -> None:
    # What a user's `get_kernel(repo_id, version=1)` does, pointed at this checkout: the Hub path minus the download.
    repo_id = tomllib.loads((REPO_ROOT / "build.toml").read_text())["general"]["hub"]["repo-id"]
    script = ("import kernels, sys; module = kernels.get_kernel(sys.argv[1], version=1, trust_remote_code=[sys.argv[1]]);"
              " print(module.__file__); print(module.ops_summary())")
    environment = {**os.environ, "LOCAL_KERNELS": f"{repo_id}={REPO_ROOT}", "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-c", script, repo_id], capture_output=True, text=True, env=environment)
    assert result.returncode == 0, result.stderr
    path, summary = result.stdout.splitlines()[-2:]
    variant, _ = resolve_variant(get_variants_local(BUILD_DIR))
    assert Path(path).resolve().is_relative_to((BUILD_DIR / variant.variant_str).resolve())
    assert summary.startswith("compiled ops")


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


def test_unchanged_rebuild_reuses_everything(tmp_path: Path, build_tool) -> None:
    # A copy of the sources with the warm library cache: the rebuild must compile nothing and take seconds.
    for name in ("build.toml", "tools", "torch-ext", "kernels-src"):
        source = REPO_ROOT / name
        (shutil.copytree if source.is_dir() else shutil.copy2)(source, tmp_path / name)
    cache = build_tool.CACHE_DIR.name
    shutil.copytree(REPO_ROOT / cache, tmp_path / cache, ignore=shutil.ignore_patterns("lock"))
    result = subprocess.run([sys.executable, "tools/build.py"], cwd=tmp_path, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    arch_lines = [line for line in result.stdout.splitlines() if "compiled ops" in line]
    assert arch_lines and all(line.endswith("(cached library)") for line in arch_lines), result.stdout
    built = sorted(path.name for path in (tmp_path / "build").iterdir())
    assert built == [path.name for path in VARIANT_DIRS]


def test_noarch_only_build_needs_no_compiler(tmp_path: Path) -> None:
    for name in ("build.toml", "tools", "torch-ext"):
        source = REPO_ROOT / name
        (shutil.copytree if source.is_dir() else shutil.copy2)(source, tmp_path / name)
    environment = {**os.environ, "PATH": str(Path(sys.executable).parent)}  # no c++, no nvcc
    result = subprocess.run([sys.executable, "tools/build.py", "--noarch-only"], cwd=tmp_path, capture_output=True,
                            text=True, env=environment)
    assert result.returncode == 0, result.stderr
    assert sorted(path.name for path in (tmp_path / "build").iterdir()) == ["torch-cpu", "torch-cuda"]
