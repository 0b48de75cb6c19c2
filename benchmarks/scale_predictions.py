"""Predicted cost of one distributed Muon step for Llama-3-8B and -70B on 64, 512 and 1024 H100s: `plan_step` (the
planning code the step runs) over a device model of an H100 cluster. Predictions, not measurements.

The device model: Newton-Schulz products at the bf16 `torch.mm` rate measured on one H100 by `make bench`
(benchmarks/results/nvidia-h100-80gb-hbm3-2026-11-23.md); all-to-all bandwidth per GPU from datasheets, never
measured here: 50 GB/s (one 400 Gb/s InfiniBand NIC per GPU) between nodes, 450 GB/s (NVLink 4, one direction)
inside an 8-GPU node. Writes the table to stdout and to benchmarks/results/scale-predictions.md.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from kernels import get_local_kernel

from bench import cpu_model
from model_shapes import LLAMA_3_8B, LLAMA_3_70B

REPO_ROOT = Path(__file__).resolve().parents[1]
H100_BF16_MM_FLOPS = 791.8e12  # measured, torch.mm bf16, 2026-11-23
INTER_NODE_BYTES_PER_S = 50e9
NVLINK_BYTES_PER_S = 450e9
GPUS_PER_NODE = 8
MODELS = {"Llama-3-8B": LLAMA_3_8B, "Llama-3-70B": LLAMA_3_70B}
GPUS = (64, 512, 1024)


def rows(optimizer) -> list[str]:
    """One row per model, cluster size and layout: FSDP2 over every GPU (all-to-alls cross nodes), and HSDP with
    8-GPU shard groups inside a node (each replica group runs the same plan over NVLink)."""
    table = []
    for name, shapes in MODELS.items():
        for gpus in GPUS:
            for layout, world, link in (("FSDP2", gpus, INTER_NODE_BYTES_PER_S),
                                        (f"HSDP {gpus // GPUS_PER_NODE}x{GPUS_PER_NODE}", GPUS_PER_NODE,
                                         NVLINK_BYTES_PER_S)):
                device = optimizer.DeviceModel(matmul_flops=H100_BF16_MM_FLOPS, link_bytes_per_s=link)
                plan = optimizer.plan_step(shapes, world, device=device)
                table.append(f"| {name} | {gpus} | {layout} | {max(plan.flops_per_rank) / 1e12:.2f} | "
                             f"{plan.balance:.3f} | {max(plan.bytes_sent_per_rank) / 2**20:.0f} | {plan.collectives} | "
                             f"{plan.time_overlapped_s * 1e3:.1f} | {plan.time_serial_s * 1e3:.1f} |")
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks" / "results" / "scale-predictions.md",
                        help="where the table is written besides stdout")
    args = parser.parse_args()
    optimizer = get_local_kernel(REPO_ROOT / "build")
    started = time.perf_counter()
    lines = [__doc__.split("\n\n")[0].replace("\n", " "), "",
             "| model | H100s | layout | Newton-Schulz TFLOP, busiest GPU | balance | MiB sent, busiest GPU | "
             "all-to-alls | predicted ms, overlapped | predicted ms, serial |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |", *rows(optimizer), "",
             f"(planned in {time.perf_counter() - started:.0f} s on {cpu_model()})"]
    text = "\n".join(lines)
    print(text)
    args.out.write_text(text + "\n")


if __name__ == "__main__":
    sys.exit(main())
