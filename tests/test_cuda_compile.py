"""The CUDA sources compile, even on machines with no GPU: the .cu files for every capability in build.toml, and the
C++ side against the installed torch's headers (syntax only: a CPU torch has no CUDA libraries to link against).

The command lines come from tools/build.py, so this checks what `make build` would run on a CUDA machine. Beyond
compiling, three things can be checked without a GPU: the PTX of the Gram kernels uses the instructions their design
rests on, the sm_75 PTX uses none that a T4 lacks, and the Gram kernels' tile walk (host-callable) visits exactly the
lower triangle.
"""

from __future__ import annotations

import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest

CUDA_KERNEL_SOURCES = ["muon_momentum.cu", "muon_momentum_rounded.cu", "moment_codes.cu", "symmetric_gram.cu"]
CUDA_CPP_SOURCES = ["muon_momentum_cuda.cpp", "muon_momentum_rounded_cuda.cpp", "moment_codes_cuda.cpp",
                    "finite_flags_cuda.cpp", "symmetric_gram_cuda.cpp", "torch_binding.cpp"]

# Extra commands, keyed apart from the source names.
GRAM_PTX = "symmetric_gram.cu -> ptx"
GRAM_PTX_SM75 = "symmetric_gram.cu -> ptx for sm_75"
TILE_WALK = "tile walk program"

# A host program around the Gram kernels' lower_tile_coords (the .cu is included, so the function under test is the
# one the kernels call). Its truth is plain enumeration: the lower triangle row by row. Rows near 2^16 and past 2^31
# are where a float square root, or 32-bit indices, would go wrong; 3037000498 is the last row whose (row + 1) *
# (row + 2) fits in int64.
TILE_WALK_SOURCE = r"""
#include "symmetric_gram.cu"
#include <cstdio>

int main() {
  using muon_cuda::lower_tile_coords;
  long long mismatches = 0;
  auto check = [&](long long index, long long row, long long col) {
    const auto tile = lower_tile_coords(index);
    if (tile.row != row || tile.col != col) {
      std::printf("index %lld: got (%lld, %lld), expected (%lld, %lld)\n", index, (long long)tile.row,
                  (long long)tile.col, row, col);
      ++mismatches;
    }
  };
  long long index = 0;
  for (long long row = 0; row < 2048; ++row) {
    for (long long col = 0; col <= row; ++col) {
      check(index++, row, col);
    }
  }
  for (long long row : {65535LL, 65536LL, 92681LL, 1LL << 20, 2147483647LL, 3037000498LL}) {
    const long long first = row * (row + 1) / 2;
    for (long long col : {0LL, 1LL, row / 2, row - 1, row}) {
      check(first + col, row, col);
    }
  }
  return mismatches == 0 ? 0 : 1;
}
"""

# A host program around the momentum op's finite check (muon_momentum.cu included): for batches of gradient sizes
# (empty ones, one past a pass of its blocks, a full batch of 64), every block maps to a tensor that has blocks, and
# the blocks' threads, striding as the kernel does, reach each entry of each tensor exactly once.
CHECK_COVER_SOURCE = r"""
#include "muon_momentum.cu"
#include <cstdio>
#include <vector>

int main() {
  using namespace muon_cuda;
  std::vector<std::vector<int64_t>> cases = {{1}, {0}, {5, 0, 7}, {0, 0, 3}, {3, 0, 0}, {1048577, 1, 0, 300, 256}};
  std::vector<int64_t> full;
  for (int t = 0; t < kCheckBatch; ++t) full.push_back((t * 7919) % 3001);
  cases.push_back(full);
  long long failures = 0;
  for (const auto& numels : cases) {
    const int count = static_cast<int>(numels.size());
    std::vector<const void*> grads(count, nullptr);
    const CheckBatch batch = check_batch(grads.data(), numels.data(), count);
    std::vector<std::vector<int>> reads(count);
    for (int t = 0; t < count; ++t) reads[t].assign(numels[t], 0);
    for (unsigned int block = 0; block < batch.first_block[count]; ++block) {
      const int t = check_tensor(batch, count, block);
      const int64_t blocks = batch.first_block[t + 1] - batch.first_block[t];
      if (blocks == 0 || block < batch.first_block[t]) {
        std::printf("block %u maps to tensor %d, whose blocks are [%u, %u)\n", block, t, batch.first_block[t],
                    batch.first_block[t + 1]);
        ++failures;
        continue;
      }
      for (int thread = 0; thread < kThreads; ++thread) {
        for (int64_t j = (block - batch.first_block[t]) * int64_t{kThreads} + thread; j < numels[t];
             j += blocks * kThreads) {
          ++reads[t][j];
        }
      }
    }
    for (int t = 0; t < count; ++t) {
      for (int64_t j = 0; j < numels[t]; ++j) {
        if (reads[t][j] != 1) {
          std::printf("tensor %d entry %lld read %d times\n", t, static_cast<long long>(j), reads[t][j]);
          ++failures;
          break;
        }
      }
    }
  }
  return failures == 0 ? 0 : 1;
}
"""
CHECK_COVER = "finite check cover program"


@dataclass(frozen=True)
class Compiled:
    commands: dict[str, list[str]]  # by source file name, or one of the extra keys above
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
    # Both extras target PTX only (no ptxas run), which keeps them to a few seconds.
    gram_source = build_tool.REPO_ROOT / "kernels-src" / "cuda" / "symmetric_gram.cu"
    commands[GRAM_PTX] = [build_tool.nvcc_path(), "-std=c++17", "-O3", "-arch=compute_80", "-ptx", str(gram_source),
                          "-o", str(objects / "symmetric_gram.ptx")]
    commands[GRAM_PTX_SM75] = [build_tool.nvcc_path(), "-std=c++17", "-O3", "-arch=compute_75", "-ptx",
                               str(gram_source), "-o", str(objects / "symmetric_gram_sm75.ptx")]
    (objects / "tile_walk.cu").write_text(TILE_WALK_SOURCE)
    commands[TILE_WALK] = [build_tool.nvcc_path(), "-std=c++17", "-O2", "-arch=compute_80",
                           f"-I{gram_source.parent}", str(objects / "tile_walk.cu"), "-o", str(objects / "tile_walk")]
    (objects / "check_cover.cu").write_text(CHECK_COVER_SOURCE)
    commands[CHECK_COVER] = [build_tool.nvcc_path(), "-std=c++17", "-O2", "-arch=compute_80",
                             f"-I{gram_source.parent}", str(objects / "check_cover.cu"), "-o",
                             str(objects / "check_cover")]

    def run(command: list[str]) -> subprocess.CompletedProcess[str]:
        return subprocess.run(command, cwd=build_tool.REPO_ROOT, capture_output=True, text=True)

    with ThreadPoolExecutor() as pool:
        return Compiled(commands, dict(zip(commands, pool.map(run, commands.values()))), objects)


def result_of(compiled: Compiled, source: str) -> subprocess.CompletedProcess[str]:
    assert source in compiled.results, f"{source} is not among build.toml's CUDA sources"
    return compiled.results[source]


@pytest.mark.parametrize("source", CUDA_KERNEL_SOURCES)
def test_kernels_compile_for_every_capability(compiled: Compiled, build_tool: ModuleType, source: str) -> None:
    # One nvcc run builds a cubin per capability and fails if any of them does not compile.
    result = result_of(compiled, source)
    for capability in build_tool.buildable_capabilities(build_tool.read_config()):
        assert f"code=sm_{capability.replace('.', '')}" in " ".join(compiled.commands[source])
    assert result.returncode == 0, result.stderr
    assert (compiled.objects / f"{source}.o").stat().st_size > 0


@pytest.mark.parametrize("source", CUDA_CPP_SOURCES)
def test_cuda_cpp_side_compiles_against_torch_headers(compiled: Compiled, source: str) -> None:
    result = result_of(compiled, source)
    assert result.returncode == 0, result.stderr


def test_gram_kernels_use_tensor_cores_and_async_copies(compiled: Compiled) -> None:
    result = compiled.results[GRAM_PTX]
    assert result.returncode == 0, result.stderr
    ptx = (compiled.objects / "symmetric_gram.ptx").read_text()
    # PTX spells out the operand types: bf16 inputs with fp32 accumulators, and fp16 inputs (implicit in this form)
    # with fp32 accumulators and results.
    assert "wmma.mma.sync.aligned.row.col.m16n16k16.f32.bf16.bf16.f32" in ptx
    assert "wmma.mma.sync.aligned.row.col.m16n16k16.f32.f32" in ptx
    assert "cp.async.cg.shared.global" in ptx and "cp.async.wait_group 1" in ptx
    # The fp32 path stays IEEE fp32: TF32 would show as cvt.rna.tf32 conversions or tf32 mma operands.
    assert "fma.rn.f32" in ptx and "tf32" not in ptx


def test_gram_kernels_for_a_t4_use_only_what_sm75_has(compiled: Compiled) -> None:
    # sm_75 (T4: Colab, Kaggle) has fp16 tensor cores but neither bf16 WMMA fragments nor cp.async: its code must
    # not contain them, and the bf16 / async kernels there are stubs that trap (the host never launches them).
    result = compiled.results[GRAM_PTX_SM75]
    assert result.returncode == 0, result.stderr
    ptx = (compiled.objects / "symmetric_gram_sm75.ptx").read_text()
    assert "wmma.mma.sync.aligned.row.col.m16n16k16.f32.f32" in ptx
    assert ".bf16" not in ptx and "cp.async" not in ptx
    assert "trap;" in ptx


def test_declared_capabilities_cover_the_gpus_users_have(build_tool: ModuleType) -> None:
    # T4 (7.5), A100 (8.0), RTX 30/A10 (8.6), L4/RTX 40 (8.9), H100 (9.0), B200 (10.0), RTX 50 (12.0). The loader
    # accepts a variant only for capabilities its metadata lists (kernels.archs), so each must be declared.
    declared = set(build_tool.read_config().cuda_capabilities)
    assert {"7.5", "8.0", "8.6", "8.9", "9.0", "10.0", "12.0"} <= declared


def test_gram_tile_walk_visits_exactly_the_lower_triangle(compiled: Compiled) -> None:
    build = compiled.results[TILE_WALK]
    assert build.returncode == 0, build.stderr
    walk = subprocess.run([str(compiled.objects / "tile_walk")], capture_output=True, text=True, timeout=60)
    assert walk.returncode == 0, walk.stdout + walk.stderr


def test_momentum_finite_check_reads_every_entry_of_every_gradient_once(compiled: Compiled) -> None:
    build = compiled.results[CHECK_COVER]
    assert build.returncode == 0, build.stderr
    cover = subprocess.run([str(compiled.objects / "check_cover")], capture_output=True, text=True, timeout=60)
    assert cover.returncode == 0, cover.stdout + cover.stderr
