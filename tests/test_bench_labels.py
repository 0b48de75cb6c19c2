"""benchmarks/bench.py's rows run what their labels say: on small stand-ins for its shapes, with the timing replaced by
one call of each function, what each labelled optimizer holds and what each labelled iteration runs, against the
label and against the optimizer's own step. Nothing here times anything."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch

from kernel_under_test import optimizer, submodule

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench  # noqa: E402

newton_schulz = submodule(optimizer, "newton_schulz")
CPU = torch.device("cpu")


def called_once(fns: list[Callable[[], object]], device: torch.device, repeats: int) -> list[float]:
    """`paired_medians_ms` without the timing: each function runs once."""
    for fn in fns:
        fn()
    return [1.0] * len(fns)


def test_bucket_rows_run_the_iteration_the_optimizer_runs_on_those_stacks(monkeypatch: pytest.MonkeyPatch) -> None:
    # In float32 ns_algorithm="auto" runs a wide stack by the Gram iteration; the rows timed the standard one.
    monkeypatch.setattr(bench, "GPT2_BUCKETS", [(2, 64, 256), (2, 64, 64)])
    monkeypatch.setattr(bench, "paired_medians_ms", called_once)
    picked: list[tuple[tuple[int, ...], str]] = []
    resolve = newton_schulz.resolve_algorithm

    def recorded(algorithm: str, shape: Sequence[int], *args: object) -> str:
        chosen = resolve(algorithm, shape, *args)
        if len(shape) == 3:  # an iteration's stack, not a question asked about a shape
            picked.append((tuple(shape), chosen))
        return chosen

    monkeypatch.setattr(newton_schulz, "resolve_algorithm", recorded)
    rows = bench.bench_buckets(optimizer, CPU, torch.float32, repeats=1)
    benched = dict(picked)
    picked.clear()
    for batch, rows_, cols in bench.GPT2_BUCKETS:
        params = [torch.randn(rows_, cols, requires_grad=True) for _ in range(batch)]
        for param in params:
            param.grad = torch.randn(rows_, cols)
        optimizer.Muon(params, lr=0.02, ns_dtype=torch.float32).step()
    stepped = dict(picked)
    assert benched == stepped and set(stepped.values()) == {"gram", "standard"}
    assert all(f"{benched[(batch, m, n)]} iteration" in row.case for row, (batch, m, n) in
               zip(rows[::len(rows) // 2], bench.GPT2_BUCKETS))
