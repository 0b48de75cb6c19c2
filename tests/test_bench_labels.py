"""benchmarks/bench.py's rows run what their labels say: on small stand-ins for its shapes, with the timing replaced by
one call of each function, what each labelled optimizer holds and what each labelled iteration runs, against the
label and against the optimizer's own step. Nothing here times anything."""

from __future__ import annotations

import re
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


@pytest.fixture
def small_gpt2(monkeypatch: pytest.MonkeyPatch) -> None:
    """GPT-2 small's structure at a few rows a dimension, its step section's timing and compilation left out."""
    monkeypatch.setattr(bench, "GPT2_SMALL_BLOCK", [(24, 8), (8, 8), (32, 8), (8, 32)])
    monkeypatch.setattr(bench, "GPT2_SMALL_VECTORS", [24, 8, 32, 8, 8, 8, 8, 8])
    monkeypatch.setattr(bench, "GPT2_BLOCKS", 2)
    monkeypatch.setattr(bench, "GPT2_EMBEDDING", (40, 8))
    monkeypatch.setattr(bench, "MNIST_MLP", [(16, 24), (16, 16), (10, 16)])
    monkeypatch.setattr(bench, "MNIST_MLP_VECTORS", [16, 16, 10])
    monkeypatch.setattr(bench, "paired_medians_ms", called_once)
    monkeypatch.setattr(torch, "compile", lambda fn: fn)


def test_each_step_variant_holds_the_options_its_label_names(small_gpt2, monkeypatch: pytest.MonkeyPatch) -> None:
    # The variants were built from one list of group dicts, which the first optimizer made its groups and filled with
    # its defaults: every "optimizer.Muon, <option>" row ran the defaults.
    steppers: dict[str, Callable[[], object]] = {}
    running = bench._running

    def recorded(given: dict[str, Callable[[], object]]) -> tuple[dict[str, Callable[[], object]], list[str]]:
        steppers.update(given)
        return running(given)

    monkeypatch.setattr(bench, "_running", recorded)
    bench.bench_step(optimizer, CPU, torch.float32, repeats=1)
    variants = {label.removeprefix("optimizer.Muon, "): step.__self__ for label, step in steppers.items()
                if label.startswith("optimizer.Muon, ")}
    assert {"normalization='neuron' (NorMuon)", "state_dtype='int8'"} <= variants.keys()
    for label, opt in variants.items():
        options = re.sub(r" \(.*\)$", "", label).split(", ")
        for key, value in (option.split("=", 1) for option in options):
            held = [repr(group[key]) if key in group else repr(getattr(opt, key)) for group in opt.param_groups]
            assert held == [value] * len(opt.param_groups), (label, key)


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


def test_the_gram_and_zeropower_rows_of_a_shape_are_timed_side_by_side(monkeypatch: pytest.MonkeyPatch) -> None:
    # Each row was a median of its own, taken after the row before it, where the header says the ratios are measured
    # side by side: a machine that slowed down part way slowed some rows of a shape only.
    rounds: list[int] = []
    alone: list[float] = []

    def paired(fns: list[Callable[[], object]], device: torch.device, repeats: int) -> list[float]:
        called_once(fns, device, repeats)
        rounds.append(len(fns))
        return [float(len(rounds))] * len(fns)  # one time for the whole call: its rows then share it

    def timed_alone(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
        fn()
        alone.append(100.0 + len(alone))  # a time of its own
        return alone[-1]

    monkeypatch.setattr(bench, "paired_medians_ms", paired)
    monkeypatch.setattr(bench, "median_ms", timed_alone)
    rows = bench.bench_gram(optimizer, CPU, torch.float32, [(16, 24), (24, 16)], repeats=1)
    rows += bench.bench_zeropower(optimizer, CPU, [torch.float32], torch.float32, [(16, 24)], repeats=1,
                                  compiled_reference=False)
    shapes: dict[tuple[str, str], list[bench.Row]] = {}
    for row in rows:
        shapes.setdefault((row.section, row.case), []).append(row)
    assert len(shapes) == 3
    for of_shape in shapes.values():
        assert len({(row.ms, row.baseline_ms) for row in of_shape}) == 1, [row.path for row in of_shape]
    assert sorted(map(len, shapes.values())) == sorted(rounds)
