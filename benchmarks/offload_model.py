"""A model of the offloaded step's device timeline, to weigh schedules without a GPU: the optimizer's own schedule
(`offload._Lane`, its groups as a GPU forms them, GPT-2 small's parameters) driven by a copier that keeps a clock
per stream instead of copying. A copy takes its bytes over the host link's rate in each direction (both directions
at once, as measured on the GPU that the figures come from); a Muon bucket's update takes its share of the
Newton-Schulz time by FLOPs; an AdamW group's, its bytes over the memory's rate. Two write-back streams busy at once
would share the link's rate, which this leaves out (it is optimistic where they overlap). What it prints are model
figures, to be checked against a GPU's profile, never quoted as measurements.

    python benchmarks/offload_model.py [--link-gbs 42.6] [--newton-schulz-ms 5.1] [--memory-gbs 3000]
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

import torch

BENCHMARKS = Path(__file__).resolve().parent


@dataclass
class Rates:
    link_bytes_per_ms: float
    memory_bytes_per_ms: float
    newton_schulz_ms_per_flop: float


@dataclass
class ClockCopier:
    """The copier interface (`offload.Copier`) over clocks, in ms: each stream's time when its last work ends."""

    rates: Rates
    clocks: dict[str, float] = field(default_factory=lambda: dict.fromkeys(("fetch", "write", "side", "compute"), 0.0))
    updating_on: str = "compute"

    def allocate(self, nbytes: int, device: torch.device) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device="meta")

    def begin(self) -> None:
        self.clocks["side"] = max(self.clocks["side"], self.clocks["compute"])

    def fetch(self, transfer, after: float | None = None) -> float:
        start = max(self.clocks["fetch"], after or 0.0)
        self.clocks["fetch"] = start + self._copy_ms(transfer)
        return self.clocks["fetch"]

    def ready(self, handle: float, aside: bool = False) -> None:
        stream = "side" if aside else "compute"
        self.clocks[stream] = max(self.clocks[stream], handle)

    @contextmanager
    def updating(self, aside: bool = False) -> Iterator[None]:
        self.updating_on = "side" if aside else "compute"
        yield

    def spend(self, ms: float) -> None:
        """An update's time, on the stream it runs on."""
        self.clocks[self.updating_on] += ms

    def write_back(self, transfer, aside: bool = False) -> float:
        stream = "side" if aside else "write"
        start = self.clocks[stream] if aside else max(self.clocks["write"], self.clocks["compute"])
        self.clocks[stream] = start + self._copy_ms(transfer)
        return self.clocks[stream]

    def finish(self) -> None:
        pass

    def _copy_ms(self, transfer) -> float:
        return sum(tensor.nbytes for tensor in transfer.host_side) / self.rates.link_bytes_per_ms


def step_ms(optimizer, params: tuple[list[torch.Tensor], list[torch.Tensor]], state_dtype: str | None, aside: bool,
            rates: Rates) -> float:
    """The modelled device time of one offloaded step of GPT-2 small's set (`params`: its matrices and its AdamW
    tensors; the step after the one that makes the state), its AdamW groups updated aside or on the compute stream."""
    import bench  # noqa: PLC0415 (the step benchmark's FLOP count)

    offload = sys.modules[f"{optimizer.__name__}.offload"]
    functional = sys.modules[f"{optimizer.__name__}.functional"]
    copier = ClockCopier(rates)

    def muon_update(items, **settings) -> None:
        steps = len(settings["orthogonalizer"].coefficients)
        copier.spend(rates.newton_schulz_ms_per_flop * sum(
            bench.newton_schulz_flop(item.view.rows, item.view.cols, steps) * item.view.batch for item in items))

    def adamw_update(items, found_inf, **settings) -> None:
        # A parameter and each moment read and written, a gradient read.
        moved = sum(2 * (item.param.nbytes + item.exp_avg.nbytes + item.exp_avg_sq.nbytes) + item.grad.nbytes
                    for item in items)
        copier.spend(moved / rates.memory_bytes_per_ms)

    add = offload.StagedUpdates.add
    wanted = aside

    def add_where_wanted(self, device, group, update, repack, aside=False) -> None:
        add(self, device, group, update, repack, aside and wanted)
    matrices, vectors = params
    patches = [mock.patch.object(offload, "offloaded", lambda item: True),
               mock.patch.object(offload, "any_offloaded", lambda items: bool(items)),
               mock.patch.object(offload, "CudaCopier", lambda device: copier),
               mock.patch.object(offload, "copy_all", lambda destinations, sources: None),
               mock.patch.object(offload, "muon_update", muon_update),
               mock.patch.object(offload, "adamw_update", adamw_update),
               mock.patch.object(offload.StagedUpdates, "add", add_where_wanted),
               mock.patch.dict(functional._BUCKET_NUMEL, cpu=functional._GPU_BUCKET_NUMEL)]  # a GPU's buckets
    with warnings.catch_warnings(), ExitStack() as stack:
        for patch in patches:
            stack.enter_context(patch)
        warnings.simplefilter("ignore")  # offload on CPU parameters says it moves nothing
        opt = optimizer.Muon([dict(params=matrices), dict(params=vectors, use_muon=False)], lr=0.02,
                             state_dtype=state_dtype, offload="cpu")
        opt.step()
        copier.clocks = dict.fromkeys(copier.clocks, 0.0)
        opt.step()
    return max(copier.clocks.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--link-gbs", type=float, default=42.6,
                        help="host link GB/s each way with both busy (H100, 2026-11-27: 619 MiB in 15.22 ms)")
    parser.add_argument("--newton-schulz-ms", type=float, default=5.1,
                        help="the Newton-Schulz time of GPT-2 small's step on the device, split by FLOPs")
    parser.add_argument("--memory-gbs", type=float, default=3000.0, help="device memory GB/s (AdamW updates)")
    args = parser.parse_args()
    from kernels import get_local_kernel  # noqa: PLC0415

    optimizer = get_local_kernel(BENCHMARKS.parent / "build")
    import bench  # noqa: PLC0415

    block_flop = sum(bench.newton_schulz_flop(rows, cols, 5) for rows, cols in bench.GPT2_SMALL_BLOCK)
    total_flop = block_flop * bench.GPT2_BLOCKS
    rates = Rates(args.link_gbs * 1e6, args.memory_gbs * 1e6, args.newton_schulz_ms / total_flop)
    # Made once: the optimizers only read them (their updates are the model's).
    params = bench._step_params(torch.device("cpu"), bench.GPT2_SMALL_BLOCK, bench.GPT2_SMALL_VECTORS,
                                bench.GPT2_BLOCKS, [bench.GPT2_EMBEDDING])
    print(f"model: host link {args.link_gbs} GB/s each way, Newton-Schulz {args.newton_schulz_ms} ms, "
          f"memory {args.memory_gbs} GB/s (model figures, not measurements)")
    for state_dtype in (None, "int8"):
        times = {aside: step_ms(optimizer, params, state_dtype, aside, rates) for aside in (False, True)}
        print(f"state_dtype={state_dtype!r}: AdamW groups on the compute stream {times[False]:.2f} ms, "
              f"aside {times[True]:.2f} ms of device time")


if __name__ == "__main__":
    sys.path.insert(0, str(BENCHMARKS))
    main()
