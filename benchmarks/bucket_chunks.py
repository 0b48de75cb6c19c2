"""The bucket chunks' trade, side by side: one Muon step's time and peak memory with same-shape matrices stacked in
chunks of at most 2^22, 2^24 or 2^25 elements, or whole buckets, on GPT-2 small's and (on a GPU) one Llama-3-8B
layer's parameters. `functional._chunks` splits a bucket past the cap of its device type; the caps in
functional.py (2^24 on a CPU, 2^25 elsewhere) come from runs of this script.

    python benchmarks/bucket_chunks.py [--device cuda] [--out FILE]
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import torch

BENCHMARKS = Path(__file__).resolve().parent
CAPS: dict[str, int | None] = {"2^22": 2**22, "2^24": 2**24, "2^25": 2**25, "whole buckets": None}


def _capped(functional, cap: int | None, device: torch.device, step: Callable[[], None]) -> Callable[[], None]:
    """The step with `cap` as its device type's chunk size (None: no chunks) while it runs."""
    size = cap if cap is not None else 2**62

    def run() -> None:
        with (mock.patch.dict(functional._BUCKET_NUMEL, cpu=size) if device.type == "cpu"
              else mock.patch.object(functional, "_GPU_BUCKET_NUMEL", size)):
            step()
    return run


def _peak_bytes(step: Callable[[], None], device: torch.device) -> int | None:
    """Bytes allocated above those before the step at the step's peak (GPUs; None on CPUs, whose peak resident set
    needs a process of its own: benchmarks/step_memory.py)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=9, help="rounds on a CPU (a GPU takes do_bench's)")
    parser.add_argument("--out", type=Path, help="markdown file for the table")
    args = parser.parse_args()
    import bench  # noqa: PLC0415 (the shapes, parameters and paired timing of the step benchmark)
    from kernels import get_local_kernel  # noqa: PLC0415

    optimizer = get_local_kernel(BENCHMARKS.parent / "build")
    functional = importlib.import_module(f"{optimizer.__name__}.functional")
    device = torch.device(args.device)
    models = {"GPT-2 small": (bench.GPT2_SMALL_BLOCK, bench.GPT2_SMALL_VECTORS, bench.GPT2_BLOCKS,
                              [bench.GPT2_EMBEDDING])}
    if device.type == "cuda":
        models["Llama-3-8B layer"] = (bench.LLAMA3_8B_LAYER, bench.LLAMA3_8B_VECTORS, 1, [])
    name = (torch.cuda.get_device_name(device) if device.type == "cuda"
            else f"{bench.cpu_model()}, {torch.get_num_threads()} threads")
    lines = [f"# Bucket chunks: {name}, torch {torch.__version__}", "",
             "| model | chunks of at most | median ms | peak above parameters and gradients |",
             "| --- | --- | --- | --- |"]
    for model, shapes in models.items():
        steps = []
        for cap in CAPS.values():
            matrices, vectors = bench._step_params(device, *shapes)
            muon = optimizer.Muon([dict(params=matrices), dict(params=vectors, use_muon=False)], lr=0.02)
            steps.append(_capped(functional, cap, device, muon.step))
            steps[-1]()  # the state, made before the peak is read
        peaks = [_peak_bytes(step, device) for step in steps]
        times = bench.paired_medians_ms(steps, device, args.repeats)
        for name, ms, peak in zip(CAPS, times, peaks):
            memory = "" if peak is None else f"{peak / 2**30:.2f} GiB"
            lines.append(f"| {model} | {name} | {ms:.2f} | {memory} |")
        del steps  # this model's parameters and state, before the next model's
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    sys.path.insert(0, str(BENCHMARKS))
    main()
