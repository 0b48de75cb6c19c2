"""Peak memory of one optimizer step on GPT-2 small's parameters (its 48 hidden matrices to Muon, its vectors and token
embedding to AdamW), per optimizer configuration: everything the step holds above the parameters and gradients, that
is the optimizer state and the step's largest set of live temporaries.

On a GPU: torch.cuda.max_memory_allocated over the second step (the first creates the state). On a CPU, where torch
keeps no allocator statistics: each configuration runs in a fresh process whose glibc malloc returns every block of
64 KiB or more to the system when freed (MALLOC_MMAP_THRESHOLD_), so its resident set follows the live tensors, and
the kernel's high-water mark of that set (VmHWM, reset through /proc/self/clear_refs) is the step's peak.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import torch

BENCHMARKS = Path(__file__).resolve().parent
# label -> optimizer.Muon keyword arguments; None: torch.optim.Muon + torch.optim.AdamW(fused=True).
CONFIGS: dict[str, dict | None] = {
    "torch.optim.Muon + AdamW": None,
    "optimizer.Muon (defaults)": {},
    "optimizer.Muon, state_dtype=torch.bfloat16": {"state_dtype": torch.bfloat16},
    "optimizer.Muon, state_dtype='int8'": {"state_dtype": "int8"},
}
# Measured on GPUs only: offload moves nothing on a CPU, and NorMuon's step there is the compiled ops' (its GPU
# composition of torch ops took 2.6x the default step's time on an H100, host-bound: step_profile.py profiles these).
GPU_CONFIGS = {"optimizer.Muon, offload='cpu'": {"offload": "cpu"},
               "optimizer.Muon, offload='cpu', state_dtype='int8'": {"offload": "cpu", "state_dtype": "int8"},
               "optimizer.Muon, normalization='neuron' (NorMuon)": {"normalization": "neuron"}}

# How the peak is measured, per device type, for the report.
METHOD = {"cuda": "torch.cuda.max_memory_allocated", "cpu": "peak resident set of a fresh process, VmHWM"}


def _optimizers(optimizer, label: str, matrices: list[torch.Tensor],
                vectors: list[torch.Tensor]) -> list[torch.optim.Optimizer]:
    options = {**CONFIGS, **GPU_CONFIGS}[label]
    if options is None:
        return [torch.optim.Muon(matrices, lr=0.02, adjust_lr_fn="match_rms_adamw"),
                torch.optim.AdamW(vectors, lr=0.02, betas=(0.9, 0.95), fused=True)]
    return [ours(optimizer, matrices, vectors, **options)]


def ours(optimizer, matrices: list[torch.Tensor], vectors: list[torch.Tensor], **options) -> torch.optim.Optimizer:
    """optimizer.Muon over the step's matrices and, routed to AdamW, its vectors, in group dicts of its own: an
    optimizer makes the very dict it is given its group and writes its defaults into it, as torch's do, so optimizers
    built from one list of dicts would all take the first one's options."""
    return optimizer.Muon([dict(params=matrices), dict(params=vectors, use_muon=False)], lr=0.02, **options)


def _resident_bytes(field: str) -> int:
    """A /proc/self/status memory field (VmRSS, VmHWM) in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def measure(optimizer, label: str, device: torch.device, torch_dtype: torch.dtype) -> int:
    """Bytes above the parameters and gradients at the peak of the second step of configuration `label`, with
    torch.optim.Muon's Newton-Schulz in `torch_dtype` (as the step benchmark times it)."""
    import bench  # noqa: PLC0415 (the shapes and parameters the step benchmark uses)

    matrices, vectors = bench._step_params(device, bench.GPT2_SMALL_BLOCK, bench.GPT2_SMALL_VECTORS,
                                           bench.GPT2_BLOCKS, [bench.GPT2_EMBEDDING])
    optimizers = _optimizers(optimizer, label, matrices, vectors)
    if device.type == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
    else:
        before = _resident_bytes("VmRSS")
    with bench.torch_muon_computing_in(torch_dtype):
        for opt in optimizers:
            opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        else:
            Path("/proc/self/clear_refs").write_text("5")  # the high-water mark restarts from the current set
        for opt in optimizers:
            opt.step()
    if device.type == "cuda":
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    return _resident_bytes("VmHWM") - before


def peak_bytes(device: torch.device, torch_dtype: torch.dtype) -> dict[str, int]:
    """Each configuration's step peak: in this process on a GPU, in a fresh process each on a CPU."""
    if device.type == "cuda":
        from kernels import get_local_kernel  # noqa: PLC0415

        optimizer = get_local_kernel(BENCHMARKS.parent / "build")
        return {label: measure(optimizer, label, device, torch_dtype) for label in {**CONFIGS, **GPU_CONFIGS}}
    environment = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(64 * 1024)}
    peaks = {}
    for label in CONFIGS:
        result = subprocess.run([sys.executable, __file__, "--config", label, "--torch-dtype",
                                 str(torch_dtype).removeprefix("torch.")], env=environment, capture_output=True,
                                text=True, check=True)
        peaks[label] = int(result.stdout.split()[-1])
    return peaks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=list(CONFIGS), help="measure one configuration on the CPU, print bytes")
    parser.add_argument("--torch-dtype", choices=["float32", "bfloat16"], default="float32",
                        help="torch.optim.Muon's Newton-Schulz dtype")
    args = parser.parse_args()
    torch_dtype = getattr(torch, args.torch_dtype)
    if args.config is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        for label, peak in peak_bytes(device, torch_dtype).items():
            print(f"{label}: {peak / 2**30:.2f} GiB")
        return
    from kernels import get_local_kernel  # noqa: PLC0415

    print(measure(get_local_kernel(BENCHMARKS.parent / "build"), args.config, torch.device("cpu"), torch_dtype))


if __name__ == "__main__":
    sys.path.insert(0, str(BENCHMARKS))
    main()
