#!/usr/bin/env bash
# Everything a GPU machine should run, one command: build the CUDA variant against the machine's own torch, run the
# whole test suite with the CUDA cases and compiled Triton, the GPU correctness checks, the demo on the GPU and the
# benchmarks, and `kernels benchmark` on the checkout. OUTDIR/summary.txt gets the machine's description and one line
# per stage, OUTDIR/<stage>.log each stage's output; the correctness table, the benchmark table and the profiles of
# single steps (ours and torch's: operators, kernel launches, host and kernel time per operator) land in OUTDIR too.
# Stages run in the order listed below; the tests of the files with GPU cases come right after the build, the rest of
# the suite last. The test stage includes the notebook (tests/test_notebook.py: nbclient,
# nbformat, ipykernel) and the get_kernel + LOCAL_KERNELS load, so those must be installed too: wheels found in .whl/
# (kernels, the Jupyter packages, the peers measured beside us, the workflow linters, downloaded where an index can be
# reached: the GPU machine cannot reach one) are installed beside the machine's own torch first.
#   benchmarks/gpu_first_light.sh OUTDIR [stage,...]
#   (stages: build,gpu-tests,bench,check,ncu,chunks,profile,demo,hub,test)
# BENCH_SECTIONS=step (say) narrows the bench stage to bench.py's sections named, where the others were measured. Two
# more stages run only when named: ncu (benchmarks/gram_kernel_profile.py under Nsight Compute) and chunks
# (benchmarks/bucket_chunks.py: the step's time and peak memory at each chunk size of the Muon buckets).
set -uo pipefail
out=$(realpath -m "${1:?usage: benchmarks/gpu_first_light.sh OUTDIR [stage,stage,...]}")
stages=",${2:-build,gpu-tests,bench,check,profile,demo,hub,test},"
cd "$(dirname "$0")/.."
mkdir -p "$out"
PY=${PYTHON:-python3}
# Compiled Triton, not the interpreter the CPU test runs use; the local build only, never the Hub.
export TRITON_INTERPRET=0 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
status=0

stage() {
  local name=$1 limit=$2
  shift 2
  [[ $stages == *",$name,"* ]] || return 0
  local start=$SECONDS
  timeout "$limit" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  echo "$name: exit $rc after $((SECONDS - start)) s" | tee -a "$out/summary.txt"
  tail -n 4 "$out/$name.log"
  [[ $rc == 0 ]] || status=1
}

environment() {
  nvidia-smi
  "$PY" -c 'import torch, triton, kernels; print("torch", torch.__version__, "cuda", torch.version.cuda, "triton",
triton.__version__, "kernels", kernels.__version__, torch.cuda.get_device_name(),
torch.cuda.get_device_capability())'
  command -v nvcc && nvcc --version | tail -n 2
}

# The carried wheels first, so that what they bring (pytest-xdist among them, if carried) is found below.
if compgen -G ".whl/*.whl" >/dev/null; then
  site=${TMPDIR:-/tmp}/optimizer-site
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl \
    >>"$out/summary.txt" 2>&1
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" PATH="$site/bin:$PATH"
fi

# pytest-xdist, where installed, compiles the Triton kernels of several test files at once; one file per worker
# keeps each distributed file's spawned ranks together; half the cores, since those ranks need cores of their own.
workers=$(( $(nproc) / 2 > 1 ? $(nproc) / 2 : 1 ))
xdist=$("$PY" -c 'import xdist' 2>/dev/null && echo "-n $workers --dist loadfile")
# No file with GPU cases spawns ranks, so their tests are spread one by one: by file, test_compile.py alone (its CPU
# inductor builds) held one worker for about 170 of that stage's 256 s on the H200.
spread=${xdist/loadfile/load}
# Each test's name and outcome as it ends (-v), so a run cut off by the machine's time limit still names its failures.
# The files with GPU cases run first, as a stage of their own, so they finish inside such a limit.
# Each worker its share of the cores: torch's default of one thread per core in each of 8 workers (and in the ranks
# they spawn) oversubscribes the CPU eightfold (the CPU-only files took ~390 s on the H200 that way).
pytest=(env OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( $(nproc) / workers ))}" "$PY" -m pytest -v -rfE -p no:cacheprovider
  --durations=15)
# (test_native_ops' `path` fixture gives a file CUDA cases without naming CUDA itself.)
gpu_files=$(grep -l -E "cuda\.is_available|HAS_CUDA|triton_under_test|from test_native_ops import path" tests/test_*.py)

environment >>"$out/summary.txt" 2>&1
stage build 400 "$PY" tools/build.py
stage gpu-tests 300 "${pytest[@]}" $spread $gpu_files
stage bench 400 "$PY" benchmarks/bench.py --sections "${BENCH_SECTIONS:-gram,zeropower,step}" --results-dir "$out"
stage check 200 "$PY" benchmarks/gpu_check.py --out "$out/gpu_check.md"
# Only when asked for (Nsight Compute's `ncu`): the hardware counters of our Gram kernel (its programs row by row and
# in bands) and tsyrk_ex at 4096 and 8192 rows.
stage ncu 200 "${NCU:-ncu}" --nvtx --nvtx-include "measure/" --section SpeedOfLight --section MemoryWorkloadAnalysis \
  --section MemoryWorkloadAnalysis_Tables --section WarpStateStats --section SchedulerStats --section Occupancy \
  --section LaunchStats "$PY" benchmarks/gram_kernel_profile.py
stage chunks 200 "$PY" benchmarks/bucket_chunks.py --out "$out/bucket_chunks.md"
stage profile 240 "$PY" benchmarks/step_profile.py --out "$out/step_profile.md"
stage demo 120 "$PY" examples/train_gpt.py --device cuda --out "${TMPDIR:-/tmp}/optimizer-demo"
stage hub 300 "$PY" -c 'import sys; from kernels.cli import main; sys.argv = ["kernels", "benchmark", "."]; main()'
stage test 500 "${pytest[@]}" $xdist tests $(printf -- "--ignore=%s " $gpu_files)
exit $status
