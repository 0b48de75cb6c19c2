"""Where one optimizer step's time goes, ours beside torch's, on GPT-2 small's parameters (its 48 hidden matrices to
Muon, its vectors and token embedding to AdamW), on the MNIST MLP 784-256-256-10's (3 matrices, 3 biases), whose
step is mostly host work on a GPU (an H100, 2026-11-26: 2.23 ms against torch's 1.28 in the morning, 2.09 against
2.13 later), and on one Llama-3-8B layer's
(on a GPU): torch.profiler over the third step of each (the first creates the state, the second warms the caches),
with the count of operators and of kernel launches, and each one's costliest operators by host time and, on a GPU,
by kernel time. torch's Newton-Schulz runs in the dtype torch.mm is faster in here (`bench.faster_torch_dtype`, named
in its label), as `make bench` times it. Ours runs with the defaults, and on GPT-2 small also with moments stored
rounded and offloaded, as they are and as int8 codes (the rows that missed issue 12's targets on the H100: 1.25x,
1.34x and 5.0x the default step's time; int8 offload 3.0x and 3.5x where its copies need 0.5x), on a GPU with
NorMuon too (2.6x the default step's time on an H100, its composition of torch ops host-bound), and on the Llama
layer also compiled (1.15x of torch's speed there, against 1.31x eager). GPT-2 small's AdamW part alone (its 97
vectors and embedding: 0.49x of fused AdamW's speed on the H100, host-bound) is profiled too. Each step, ours and
torch's, also gets its count of Python calls and tables of its Python functions by cumulative and by own time
(cProfile over PYTHON_STEPS steps): the host work to shrink, beside the baseline's,
and on a GPU every step a line on how its device work overlapped (`device_timeline`: copies each way and kernels,
and the host's waits), which tells an offloaded step's serialized copies from its host-bound stretches.

On a GPU a small model's step is bound by the host, not by the products (the H100 run of 2026-11-23: 24 ms for ~2 ms
of Newton-Schulz), so the launch count and the host time per operator are what to shrink.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

BENCHMARKS = Path(__file__).resolve().parent
TOP = 25
PYTHON_STEPS = 20
PROBE_REPEATS = 5  # `make bench`'s default --repeats, for the probe of torch's faster dtype
# The runtime calls that launch a kernel: torch's own kernels, and Triton's (cuLaunchKernelEx).
_LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")


def _steps(optimizer, device: torch.device) -> dict[str, Callable[[], None]]:
    import bench  # noqa: PLC0415 (the shapes and parameters the step benchmark uses)
    import step_memory  # noqa: PLC0415 (the optimizers, configured as the memory benchmark configures them)

    models = {"GPT-2 small": (bench.GPT2_SMALL_BLOCK, bench.GPT2_SMALL_VECTORS, bench.GPT2_BLOCKS,
                              [bench.GPT2_EMBEDDING]),
              "MNIST MLP": (bench.MNIST_MLP, bench.MNIST_MLP_VECTORS, 1, [])}
    if device.type == "cuda":  # a CPU takes most of a minute for one step of it
        models["Llama-3-8B layer"] = (bench.LLAMA3_8B_LAYER, bench.LLAMA3_8B_VECTORS, 1, [])
    ours = "optimizer.Muon (defaults)"
    theirs = "torch.optim.Muon + AdamW"
    labels = {"GPT-2 small": [theirs, ours, "optimizer.Muon, state_dtype=torch.bfloat16",
                              "optimizer.Muon, state_dtype='int8'"]
              + (list(step_memory.GPU_CONFIGS) if device.type == "cuda" else []),
              "MNIST MLP": [theirs, ours],
              "Llama-3-8B layer": [theirs, ours]}
    # torch's Newton-Schulz in the dtype faster for it here, as `make bench` times it (bf16 is emulated on some
    # CPUs: 26 s a GPT-2 step).
    torch_dtype, _ = bench.faster_torch_dtype(device, PROBE_REPEATS)
    torch_label = f"torch.optim.Muon ({bench.dtype_name(torch_dtype)} NS) + AdamW"

    def stepping(optimizers: list[torch.optim.Optimizer]) -> Callable[[], None]:
        def step() -> None:
            for opt in optimizers:
                opt.step()
        return step

    steps = {}
    _, adamw_params = bench._step_params(device, [], bench.GPT2_SMALL_VECTORS, bench.GPT2_BLOCKS,
                                         [bench.GPT2_EMBEDDING])
    steps["GPT-2 small's AdamW part: torch.optim.AdamW(fused=True)"] = torch.optim.AdamW(
        adamw_params, lr=0.02, betas=(0.9, 0.95), fused=True).step
    steps[f"GPT-2 small's AdamW part: {ours}"] = optimizer.Muon([dict(params=adamw_params, use_muon=False)],
                                                                lr=0.02).step
    for model, shapes in models.items():
        matrices, vectors = bench._step_params(device, *shapes)
        for label in labels[model]:
            optimizers = step_memory._optimizers(optimizer, label, matrices, vectors)
            if label == theirs:
                steps[f"{model}: {torch_label}"] = bench.torch_stepping(optimizers, torch_dtype)
            else:
                steps[f"{model}: {label}"] = stepping(optimizers)
        if model == "Llama-3-8B layer":
            (compiled,) = step_memory._optimizers(optimizer, ours, matrices, vectors)
            steps[f"{model}: torch.compile(optimizer.Muon.step)"] = torch.compile(compiled.step)
    return steps


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def profile_step(step: Callable[[], None], device: torch.device) -> list[str]:
    for _ in range(2):
        step()
    _synchronize(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities, record_shapes=True) as trace:
        start = time.perf_counter()
        step()
        _synchronize(device)
        wall_ms = (time.perf_counter() - start) * 1e3
    events = trace.events()
    operators = sum(1 for event in events if _is_operator(event) and not _is_operator(event.cpu_parent))
    launches = sum(1 for event in events if event.name in _LAUNCHES)
    averages = trace.key_averages()
    lines = [f"step {wall_ms:.2f} ms (profiled); operators called from Python: {operators}; "
             f"kernel launches: {launches}",
             "", "```", averages.table(sort_by="self_cpu_time_total", row_limit=TOP, max_name_column_width=60), "```"]
    if device.type == "cuda":
        lines += ["", "By kernel time:", "", "```",
                  averages.table(sort_by="self_cuda_time_total", row_limit=TOP // 2, max_name_column_width=60), "```"]
        # Which calls of an operator hold its kernel time (on the H100, two of the GPT-2-small step's 48 copy_ calls
        # took 365 us of elementwise kernels, most likely baddbmm's transposing copies of the tall buckets).
        by_shape = trace.key_averages(group_by_input_shape=True)
        lines += ["", "Operators by kernel time and input shapes:", "", "```",
                  by_shape.table(sort_by="self_cuda_time_total", row_limit=TOP // 2, max_name_column_width=40,
                                 max_shapes_column_width=100), "```", "", device_timeline(events)]
    return lines


# The device's work by kind, told by the names the profiler gives its activities (copies: "Memcpy HtoD (Pinned ->
# Device)", "Memcpy DtoH (...)"); a copy within the device counts as a kernel.
_DEVICE_KINDS = {"HtoD": "copies to the GPU", "DtoH": "copies to the host"}
# The runtime calls in which the host waits for the device.
_HOST_WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def device_timeline(events) -> str:
    """How the step's device work overlapped (an offloaded step's copies with its kernels, and the two directions of
    copies with each other): each kind's busy time (the union of its intervals), the time both directions of copies
    ran at once and kernels ran beside copies, the span from the first to the last, and the host's time in the
    runtime calls that wait for the device. The step's own range, which the profiler also draws on the device's
    timeline (`Optimizer.step#...`), is no work: counted as kernels, it made their busy time the whole span."""
    busy: dict[str, list[tuple[float, float]]] = {kind: [] for kind in (*_DEVICE_KINDS.values(), "kernels")}
    waits = {name: 0.0 for name in _HOST_WAITS}
    for event in events:
        interval = (event.time_range.start, event.time_range.end)
        if event.name in waits:
            waits[event.name] += interval[1] - interval[0]
        elif event.device_type == torch.autograd.DeviceType.CUDA and not _is_range(event):
            kind = next((kind for key, kind in _DEVICE_KINDS.items() if key in event.name), "kernels")
            busy[kind].append(interval)
    spans = [interval for intervals in busy.values() for interval in intervals]
    if not spans:
        return "Device timeline: no device activity recorded"
    span = max(end for _, end in spans) - min(start for start, _ in spans)
    parts = [f"{kind} {_union_length(intervals) / 1e3:.2f} ms" for kind, intervals in busy.items()]
    to_gpu, to_host, kernels = busy.values()
    both_ways = _overlap_length(to_gpu, to_host)
    beside_copies = _overlap_length(kernels, to_gpu + to_host)
    waited = [f"{name} {total / 1e3:.2f} ms" for name, total in waits.items() if total]
    return (f"Device timeline: busy {', '.join(parts)}, all within {span / 1e3:.2f} ms from the first to the last; "
            f"copies both ways at once {both_ways / 1e3:.2f} ms, kernels beside copies {beside_copies / 1e3:.2f} ms; "
            f"the device busy with anything {_union_length(spans) / 1e3:.2f} ms; the host waiting in "
            f"{', '.join(waited) or 'no runtime call'}")


def _is_range(event) -> bool:
    """Whether a device-side event is a `record_function` range (the step's own), not work."""
    return bool(getattr(event, "is_user_annotation", False)) or event.name.startswith("Optimizer.")


def _overlap_length(first: list[tuple[float, float]], second: list[tuple[float, float]]) -> float:
    """The length both sets of intervals cover at once."""
    return _union_length(first) + _union_length(second) - _union_length(first + second)


def _union_length(intervals: list[tuple[float, float]]) -> float:
    """The length the intervals cover together, overlaps counted once."""
    total, reached = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reached:
            total += end - max(start, reached)
            reached = end
    return total


def python_profile(step: Callable[[], None], device: torch.device) -> list[str]:
    """The step's Python functions over PYTHON_STEPS steps (cProfile, which slows each call), by cumulative time and
    by their own time, and how many calls a step makes (built-in ones included): a count that, unlike a time, is the
    same on every host, so ours and torch's compare across runs."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(PYTHON_STEPS):
        step()
    _synchronize(device)
    profiler.disable()
    stats = pstats.Stats(profiler).strip_dirs()
    lines = [f"Python calls per step: {stats.total_calls / PYTHON_STEPS:.0f}"]
    for order, title in (("cumulative", "cumulative time"), ("tottime", "own time")):
        report = io.StringIO()
        stats.stream = report
        stats.sort_stats(order).print_stats(TOP)
        body = report.getvalue()
        lines += ["", f"Python functions by {title}, {PYTHON_STEPS} steps:", "", "```",
                  body[body.index("ncalls"):].rstrip(), "```"]
    return lines


def _is_operator(event) -> bool:
    """An operator's event (aten's, or one of the package's compiled ops), as opposed to a record_function range."""
    return event is not None and "::" in event.name and not event.name.startswith("Optimizer.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, required=True, help="markdown file for the report")
    args = parser.parse_args()
    from kernels import get_local_kernel  # noqa: PLC0415

    optimizer = get_local_kernel(BENCHMARKS.parent / "build")
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    lines = [f"# One optimizer step profiled: {name}, torch {torch.__version__}", ""]
    for label, step in _steps(optimizer, device).items():
        lines += [f"## {label}", "", *profile_step(step, device), "", *python_profile(step, device), ""]
    args.out.write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    sys.path.insert(0, str(BENCHMARKS))
    main()
