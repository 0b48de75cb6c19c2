"""Our Triton Gram kernel, with and without TMA stores, and NVIDIA Emerging-Optimizers' `tsyrk_ex` at one size, each
launched once inside an NVTX range named "measure" after their autotuning, for Nsight Compute to read their hardware
counters side by side.

Compiled for sm_90 both kernels' 128x256 configs have the same main loop (README), yet `tsyrk_ex` ran 1.91x as fast
as cuBLAS at 8192 rows on an H200 and ours 1.27x: the counters say where our kernel's time goes (stalls, L2 hit
rate, DRAM and shared-memory traffic, the epilogue's stores). Run it under ncu, as gpu_first_light.sh's ncu stage
does:
    ncu --nvtx --nvtx-include "measure/" --section SpeedOfLight ... python3 benchmarks/gram_kernel_profile.py
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=8192, help="rows and columns of X (bf16)")
    args = parser.parse_args()
    from kernels import get_local_kernel  # noqa: PLC0415

    optimizer = get_local_kernel(REPO_ROOT / "build")
    X = torch.randn(args.size, args.size, device="cuda", dtype=torch.bfloat16)
    kernels = {f"ours (Triton, lower tiles, {label})": our_gram(optimizer, X, tma_store)
               for label, tma_store in (("TMA stores", True), ("masked stores", False))}
    try:
        from emerging_optimizers.triton_kernels import tsyrk_ex  # noqa: PLC0415
    except ImportError as error:
        print(f"tsyrk_ex not measured: {error}")
    else:
        kernels["Emerging-Optimizers tsyrk_ex"] = lambda: tsyrk_ex(X)
    reference = (X.float() @ X.float().T).to(torch.bfloat16)
    for name, gram in kernels.items():
        result = gram()  # autotunes outside the range, which ncu then leaves out
        error = (result.float() - reference.float()).norm() / reference.float().norm()
        tuned = getattr(gram, "tuned", {})
        print(f"{name}: relative error against the float32 product {error:.2e}"
              + "".join(f"; config {config}" for config in tuned.values()))
    torch.cuda.synchronize()
    with torch.cuda.nvtx.range("measure"):
        for gram in kernels.values():
            gram()
    torch.cuda.synchronize()


def our_gram(optimizer, X: torch.Tensor, tma_store: bool) -> Callable[[], torch.Tensor]:
    """Our Gram product with the autotuner's choice among the configs that do (or do not) write their tiles through
    TMA, each variant keeping its own tuning."""
    kernel = importlib.import_module(f"{optimizer.__name__}.triton_kernels.xxt")._xxt_lower_kernel
    configs = [config for config in kernel.configs if config.kwargs["TMA_STORE"] == tma_store]
    tuned: dict = {}

    def gram() -> torch.Tensor:
        kernel.configs, kernel.cache = configs, tuned
        return optimizer.gram(X, backend="triton")
    gram.tuned = tuned  # printed beside the variant's error
    return gram


if __name__ == "__main__":
    main()
