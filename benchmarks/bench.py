"""`make bench`: our kernels and optimizer against their baselines, measured side by side in one run.

Every row is a median over repeated runs; the ratio is baseline time / our time (above 1: we are faster), measured in
the same run, so machine load affects both alike. FLOP counts are those of the full (non-symmetric) products, so the
GFLOP/s column is "effective": a symmetric kernel can exceed the machine's measured matmul peak, printed in the header.
Writes the table to stdout and to benchmarks/results/<device>-<date>.md.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import importlib
import json
import os
import platform
import socket
import tempfile
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from kernels import get_local_kernel
from torch.optim._muon import _zeropower_via_newtonschulz

import step_memory

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"

# GPT-2 small: per block the attention (in, 3 * in) and output projections and the MLP, stored (out, in).
GPT2_SMALL_BLOCK = [(2304, 768), (768, 768), (3072, 768), (768, 3072)]
GPT2_SMALL_VECTORS = [2304, 768, 3072, 768, 768, 768, 768, 768]  # biases and LayerNorm weights/biases per block
GPT2_BLOCKS = 12
GPT2_EMBEDDING = (50257, 768)  # the token embedding (tied output head), an AdamW tensor
# Stacks of same-shape matrices as its step orthogonalizes them (wide): an MLP matrix per block, and the attention
# output projections.
GPT2_BUCKETS = [(GPT2_BLOCKS, 768, 3072), (GPT2_BLOCKS, 768, 768)]
MNIST_MLP = [(256, 784), (256, 256), (10, 256)]  # the classifier most first tries of an optimizer train
MNIST_MLP_VECTORS = [256, 256, 10]
# GPT-2 small's 145 tensors, every dim divided by 96: its step is the optimizer's own Python and per-call overhead,
# which is what a GPU's step of the full model waits on (the products take a fraction of it there).
GPT2_STRUCTURE_WIDTH = 96
# One Llama-3-8B decoder layer: q, k, v, o (GQA: 8 KV heads of 128) and the SwiGLU MLP, stored (out, in); two norms.
LLAMA3_8B_LAYER = [(4096, 4096), (1024, 4096), (1024, 4096), (4096, 4096), (14336, 4096), (14336, 4096),
                   (4096, 14336)]
LLAMA3_8B_VECTORS = [4096, 4096]
# Gram sizes at which NVIDIA Emerging-Optimizers' Triton SYRK is measured beside ours (its autotuning is long).
EMERGING_SYRK_SIZES = (8192,)
# Dense bf16 tensor-core peaks from the vendors' datasheets (TFLOP/s), printed beside the measured torch.mm rate.
DATASHEET_BF16_TFLOPS = {"H100 80GB HBM3": 989.4, "H100 SXM": 989.4, "H200": 989.4, "A100": 312.0, "T4": 65.0,
                         "L4": 121.0, "A10G": 70.0}
DIST_WORLD = 4
DIST_TIMEOUT_S = 600  # past this the dist workers are killed and the section reports that
# With --emulated-peers: muon-fsdp2's bf16 Newton-Schulz where bf16 products are emulated takes minutes a step.
EMULATED_PEERS_TIMEOUT_S = 3600


@dataclass
class Row:
    section: str
    case: str
    path: str
    ms: float
    flop: float
    baseline_ms: float

    def __post_init__(self) -> None:
        # Each row as soon as it is measured, so a run cut short still shows what it measured.
        print(" | ".join(self.cells()), file=sys.stderr, flush=True)

    def cells(self) -> list[str]:
        ratio = self.baseline_ms / self.ms
        gflops = self.flop / (self.ms * 1e-3) / 1e9 if self.flop else float("nan")
        return [self.section, self.case, self.path, f"{self.ms:.2f}", f"{self.flop / 1e9:.1f}", f"{gflops:.0f}",
                f"{ratio:.2f}x"]


def median_ms(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median wall time of fn in ms: `triton.testing.do_bench` on GPUs, perf_counter around each call on CPUs."""
    if device.type == "cuda":
        from triton.testing import do_bench
        return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))
    fn()  # warm-up: allocator, BLAS thread pool, lazy optimizer state
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def paired_medians_ms(fns: list[Callable[[], object]], device: torch.device, repeats: int) -> list[float]:
    """Median wall times of several functions measured side by side, in rounds that time each once, so that a
    machine that slows down for a while slows every one of them alike: on CPUs a call per round (steps take
    seconds: a drift between two back-to-back medians moved the ratio by 20%), on GPUs a short `do_bench` per round
    (GPU_ROUNDS of them), the median of its medians."""
    if device.type == "cuda":
        return _do_bench_rounds(fns)
    return [statistics.median(measured) for measured in paired_times_ms(fns, repeats)]


# A GPU row is the median of this many short `do_bench` runs, taken in turn with the rows beside it. Timed one after
# the other (a long `do_bench` each), the step rows of one H100 run (2026-11-27) moved together by up to 1.7x from
# the compiled step's row on (AOL 10.08 ms against 5.58-6.30 in the other runs, torch's kernels in place of the
# one-launch ones 13.83 against 7.53-9.01, bf16 state 10.61 against 6.87), as a host-bound step does when its host
# slows down part way.
GPU_ROUNDS = 5


def _do_bench_rounds(fns: list[Callable[[], object]]) -> list[float]:
    from triton.testing import do_bench
    for fn in fns:  # compilation, lazy state and allocations, outside any round
        fn()
    torch.cuda.synchronize()
    rounds = [[do_bench(fn, warmup=5, rep=20, return_mode="median") for fn in fns] for _ in range(GPU_ROUNDS)]
    return [statistics.median(times) for times in zip(*rounds)]


def paired_times_ms(fns: list[Callable[[], object]], repeats: int) -> list[list[float]]:
    """Each function's wall times in ms over `repeats` rounds that run every function once, after one warm-up
    call each (lazy optimizer state, compilation)."""
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, measured in zip(fns, times):
            start = time.perf_counter()
            fn()
            measured.append((time.perf_counter() - start) * 1e3)
    return times


def dtype_name(dtype: torch.dtype) -> str:
    """A dtype as labels print it: "bfloat16", not "torch.bfloat16"."""
    return str(dtype).removeprefix("torch.")


def gram_flop(m: int, k: int) -> float:
    return 2.0 * m * m * k


def newton_schulz_flop(m: int, n: int, steps: int) -> float:
    small, large = sorted((m, n))
    return steps * (4.0 * small * small * large + 2.0 * small ** 3)


def peak_gflops(device: torch.device, dtype: torch.dtype, repeats: int) -> float:
    """The machine's measured matmul rate: torch.mm on a square size big enough to saturate it."""
    size = 2048 if device.type == "cpu" else 8192
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    return gram_flop(size, size) / (median_ms(lambda: torch.mm(a, b), device, repeats) * 1e-3) / 1e9


def side_by_side(section: str, case: str, timed: dict[str, Callable[[], object]], flop: float,
                 device: torch.device, repeats: int) -> list[Row]:
    """A row per labelled function, all timed in the same rounds (`paired_medians_ms`), the first the baseline of
    them all: timed one after the other, a machine that slows down part way would have slowed some of them only."""
    times = paired_medians_ms(list(timed.values()), device, repeats)
    return [Row(section, case, label, ms, flop, times[0]) for label, ms in zip(timed, times)]


def bench_gram(optimizer, device: torch.device, dtype: torch.dtype, shapes: list[tuple[int, int]],
               repeats: int) -> list[Row]:
    rows = []
    for m, k in shapes:
        X = torch.randn(m, k, device=device, dtype=dtype)
        timed: dict[str, Callable[[], object]] = {"torch.mm(X, X.T)": functools.partial(torch.mm, X, X.T)}
        for backend in _dispatch(optimizer).available_backends(dtype, device):
            if backend != "torch":
                timed[f"gram backend={backend}"] = functools.partial(optimizer.gram, X, backend=backend)
        if device.type == "cuda" and dtype == torch.bfloat16 and m == k and m in EMERGING_SYRK_SIZES:
            timed.update(_emerging_syrk(X))
        timed[f"gram auto ({optimizer.kernel_choice((m, m), dtype, device)})"] = functools.partial(optimizer.gram, X)
        rows += side_by_side("gram", f"{m}x{k} {dtype_name(dtype)}", timed, gram_flop(m, k), device,
                             repeats)
    return rows


def _emerging_syrk(X: torch.Tensor) -> dict[str, Callable[[], object]]:
    """NVIDIA Emerging-Optimizers' Triton `tsyrk_ex` (bf16, TMA descriptors), if installed."""
    try:
        from emerging_optimizers.triton_kernels import tsyrk_ex
    except ImportError:
        return {}
    return {"emerging-optimizers tsyrk_ex": functools.partial(tsyrk_ex, X)}


def _dispatch(optimizer):
    return importlib.import_module(f"{optimizer.__name__}.dispatch")


def _precision(optimizer):
    return importlib.import_module(f"{optimizer.__name__}.precision")


def _native(optimizer):
    return importlib.import_module(f"{optimizer.__name__}.native")


@contextlib.contextmanager
def torch_muon_computing_in(dtype: torch.dtype) -> Iterator[None]:
    """torch.optim.Muon's Newton-Schulz (`_zeropower_via_newtonschulz`, whose one cast is `grad.bfloat16()`) run in
    `dtype`: the same operations in the same order, so torch is measured in whichever dtype is faster for it here."""
    if dtype == torch.bfloat16:
        yield
        return
    original = torch.Tensor.bfloat16
    torch.Tensor.bfloat16 = lambda self, *args, **kwargs: self.to(dtype, copy=True)  # a copy, as bfloat16() makes
    try:
        yield
    finally:
        torch.Tensor.bfloat16 = original


def torch_stepping(optimizers: list[torch.optim.Optimizer], torch_dtype: torch.dtype) -> Callable[[], None]:
    """One step of each of torch's optimizers, torch.optim.Muon's Newton-Schulz computing in `torch_dtype`."""
    def step() -> None:
        with torch_muon_computing_in(torch_dtype):
            for opt in optimizers:
                opt.step()
    return step


def faster_torch_dtype(device: torch.device, repeats: int) -> tuple[torch.dtype, dict[torch.dtype, float]]:
    """The dtype torch.mm runs faster in here (fp32 or bf16) and both rates in GFLOP/s, at 512 on CPUs (an
    emulated bf16 product is too slow for more) and 4096 on GPUs. On CPUs each rate is the best of 4x `repeats`
    rounds that time both dtypes: five 0.6 ms products once all ran during a pause of the machine, the median
    read bf16 10x slower than it is, and torch's step was then timed in fp32, at twice its bf16 time."""
    size = 512 if device.type == "cpu" else 4096
    operands = {dtype: torch.randn(size, size, device=device, dtype=dtype) for dtype in (torch.float32, torch.bfloat16)}
    products = [functools.partial(torch.mm, a, a) for a in operands.values()]
    if device.type == "cuda":
        times = [median_ms(product, device, repeats) for product in products]
    else:
        times = [min(measured) for measured in paired_times_ms(products, 4 * repeats)]
    rates = {dtype: gram_flop(size, size) / (ms * 1e-3) / 1e9 for dtype, ms in zip(operands, times)}
    return max(rates, key=rates.get), rates


def bench_zeropower(optimizer, device: torch.device, ns_dtypes: list[torch.dtype], torch_dtype: torch.dtype,
                    shapes: list[tuple[int, int]], repeats: int, compiled_reference: bool) -> list[Row]:
    """Five Newton-Schulz steps: ours (Polar Express) in each of `ns_dtypes`, by every backend and with the Gram
    iteration, vs torch.optim.Muon's routine in `torch_dtype`, and the time of our standard iteration's matrix
    products alone (what the rest of zeropower adds is its overhead), all of a shape side by side (`side_by_side`).
    GFLOP are the standard iteration's."""
    rows = []
    coefficients = (3.4445, -4.7750, 2.0315)
    reference = _zeropower_via_newtonschulz
    if compiled_reference:
        reference = torch.compile(_zeropower_via_newtonschulz)
    torch_name = dtype_name(torch_dtype)
    name = f"torch.compile(torch.optim.Muon NS) {torch_name}" if compiled_reference else \
        f"torch.optim.Muon NS {torch_name}"
    for m, n in shapes:
        G = torch.randn(m, n, device=device)
        timed: dict[str, Callable[[], object]] = {
            name: functools.partial(_computing_in, torch_dtype, reference, G, coefficients, 5, 1e-7)}
        for ns_dtype in ns_dtypes:
            timed.update(_our_zeropowers(optimizer, G, ns_dtype, compiled_reference))
        if not compiled_reference and device.type == "cuda":
            timed.update(_emerging_newton_schulz(G))
        rows += side_by_side("zeropower", f"{m}x{n} 5 steps", timed, newton_schulz_flop(m, n, 5), device, repeats)
    return rows


def _computing_in(torch_dtype: torch.dtype, reference: Callable[..., torch.Tensor], *args: object) -> torch.Tensor:
    """torch.optim.Muon's Newton-Schulz routine called in `torch_dtype` (`torch_muon_computing_in`)."""
    with torch_muon_computing_in(torch_dtype):
        return reference(*args)


def _our_zeropowers(optimizer, G: torch.Tensor, ns_dtype: torch.dtype,
                    compiled_reference: bool) -> dict[str, Callable[[], object]]:
    """Our five steps on G in `ns_dtype`, by label: by every backend and by the automatic choice, and beside the
    eager reference also its products alone, the Gram iteration and AOL with a step fewer."""
    m, n = G.shape
    ns_name = dtype_name(ns_dtype)
    timed: dict[str, Callable[[], object]] = {
        f"zeropower {ns_name} backend={backend}": functools.partial(optimizer.zeropower, G, 5, dtype=ns_dtype,
                                                                    backend=backend)
        for backend in _dispatch(optimizer).available_backends(ns_dtype, G.device)}
    auto = f"zeropower {ns_name} auto ({optimizer.kernel_choice((m, n), ns_dtype, G.device)})"
    timed[auto] = functools.partial(optimizer.zeropower, G, 5, dtype=ns_dtype)
    if compiled_reference:
        return timed
    timed.update(_products_alone(optimizer, G.to(ns_dtype)))
    picks = _ns_algorithm(optimizer, m, n, ns_dtype, G.device)
    timed[f"zeropower {ns_name} algorithm=gram (auto would pick {picks})"] = functools.partial(
        optimizer.zeropower, G, 5, dtype=ns_dtype, algorithm="gram")
    return timed | _aol(optimizer, G, ns_dtype)


def bench_buckets(optimizer, device: torch.device, ns_dtype: torch.dtype, repeats: int) -> list[Row]:
    """Five Newton-Schulz steps on GPT-2 small's stacks of same-shape matrices, as the optimizer runs them (batched,
    its workspace reused from call to call, by the iteration its ns_algorithm="auto" picks: the Gram one for the wide
    stack in float32), by each backend, side by side: what decides the CPU dispatcher's choice for 16-bit products,
    which single matrices do not show. The baseline is the "torch" backend; GFLOP are the standard iteration's."""
    module = importlib.import_module(f"{optimizer.__name__}.newton_schulz")
    coefficients = _polar_express(optimizer)
    workspace = importlib.import_module(f"{optimizer.__name__}.workspace").Workspace()
    backends = _dispatch(optimizer).available_backends(ns_dtype, device)
    rows = []
    for shape in GPT2_BUCKETS:
        G = torch.randn(shape, device=device, dtype=ns_dtype)
        algorithm = _ns_algorithm(optimizer, shape[1], shape[2], ns_dtype, device)
        auto = optimizer.kernel_choice(shape, ns_dtype, device)
        runs = {f"stack backend={backend}" + (" (auto)" if backend == auto else ""):
                lambda backend=backend: module.newton_schulz(G.clone(), coefficients, 1e-7, backend, ns_dtype,
                                                             algorithm, overwrite_input=True, workspace=workspace)
                for backend in backends}
        case = f"GPT-2 bucket {shape} {dtype_name(ns_dtype)} 5 steps, {algorithm} iteration"
        rows += side_by_side("zeropower", case, runs, shape[0] * newton_schulz_flop(shape[1], shape[2], 5), device,
                             repeats)
    return rows


def bench_lone_matrices(optimizer, device: torch.device, ns_dtype: torch.dtype, repeats: int) -> list[Row]:
    """Five Newton-Schulz steps on single small matrices in the device's default dtype (16-bit here) against
    ns_dtype=None, which iterates those below `small_matrix_macs()` multiply-adds a product in float32 (2^23 on CPUs
    with AMX, 2^22 with AVX512-BF16: `matrix_ns_dtype`), side by side: the MNIST MLP's 10x256 classifier and shapes
    on both sides of each line. Each runs the iteration the optimizer's ns_algorithm="auto" picks for its dtype (a
    wide float32 matrix takes the Gram one where float32 is not the default), named in its label."""
    rows = []
    for shape in [(10, 256), (128, 128), (128, 512), (192, 192), (224, 224), (256, 256)]:
        G = torch.randn(shape, device=device)
        chosen = optimizer.matrix_ns_dtype(ns_dtype, device, shape)
        iterations = {dtype: _ns_algorithm(optimizer, *shape, dtype, device) for dtype in (ns_dtype, chosen)}
        runs = {f"dtype={dtype_name(ns_dtype)}, {iterations[ns_dtype]}": functools.partial(
                    optimizer.zeropower, G, dtype=ns_dtype, algorithm="auto"),
                f"dtype=None ({dtype_name(chosen)}, {iterations[chosen]} at this shape)": functools.partial(
                    optimizer.zeropower, G, algorithm="auto")}
        rows += side_by_side("zeropower", f"lone {shape[0]}x{shape[1]}, 5 steps", runs, newton_schulz_flop(*shape, 5),
                             device, 20 * repeats)
    return rows


def _aol(optimizer, G: torch.Tensor, ns_dtype: torch.dtype) -> dict[str, Callable[[], object]]:
    """AOL-preconditioned Newton-Schulz with one step fewer (4), standard algorithm, with both iterations' distance
    from the SVD polar factor (spectral norm) in the label: the issue's target is equal or better at 4 steps."""
    u, _, vh = torch.linalg.svd(G.double().cpu(), full_matrices=False)
    truth = u @ vh

    def polar_error(steps: int, preconditioner: str | None) -> float:
        out = optimizer.zeropower(G, steps, dtype=ns_dtype, algorithm="standard", preconditioner=preconditioner)
        return torch.linalg.matrix_norm(out.double().cpu() - truth, ord=2).item()

    label = (f"zeropower {dtype_name(ns_dtype)} preconditioner=aol, 4 steps (polar error "
             f"{polar_error(4, 'aol'):.3f}; 5 plain steps {polar_error(5, None):.3f})")
    return {label: functools.partial(optimizer.zeropower, G, 4, dtype=ns_dtype, algorithm="standard",
                                     preconditioner="aol")}


def _polar_express(optimizer) -> list[tuple[float, float, float]]:
    """zeropower's default schedule for 5 steps: one (a, b, c) per step."""
    return importlib.import_module(f"{optimizer.__name__}.coefficients").resolve_coefficients("polar_express", 5, None)


def _ns_algorithm(optimizer, m: int, n: int, ns_dtype: torch.dtype, device: torch.device) -> str:
    """What `ns_algorithm="auto"` picks for an (m, n) matrix iterated in `ns_dtype` on `device`."""
    module = importlib.import_module(f"{optimizer.__name__}.newton_schulz")
    return module.resolve_algorithm("auto", sorted((m, n)), 5, ns_dtype, device.type)


def _products_alone(optimizer, G: torch.Tensor) -> dict[str, Callable[[], object]]:
    """zeropower's automatic path's three products per step (X Xᵀ, bA + cA², aX + B X) on G (in the iteration's
    dtype) with its Polar Express coefficients, each step on the last one's result as in the iteration, and
    nothing else: the floor zeropower's own time is compared with (goal: within 1.15x of it). The iteration's own
    matrices are the ones to time: the same products on one fixed matrix ran 3-5% faster (2-core Xeon with AMX)."""
    dispatch = _dispatch(optimizer)
    coefficients = _polar_express(optimizer)
    X = G.mT if G.size(-2) > G.size(-1) else G
    X = (X / X.norm()).contiguous()
    backend = dispatch.kernel_choice(tuple(X.shape), X.dtype, X.device)

    def products() -> None:
        Y = X
        for a, b, c in coefficients:
            gram = dispatch.symmetric_gram(Y, backend)
            polynomial = dispatch.symmetric_polynomial(gram, b, c, backend)
            Y = torch.addmm(Y, polynomial, Y, beta=a)

    return {f"its products alone {dtype_name(G.dtype)} ({backend})": products}


def _emerging_newton_schulz(G: torch.Tensor) -> dict[str, Callable[[], object]]:
    """NVIDIA Emerging-Optimizers' newton_schulz in bf16 (float32 matmul precision "medium", as its docs say), with
    cuBLAS and, where its Triton SYRK runs, with `use_syrk` (2D only). Nothing if the package is not installed."""
    try:
        from emerging_optimizers.orthogonalized_optimizers.muon_utils import newton_schulz
    except ImportError:
        return {}
    timed: dict[str, Callable[[], object]] = {}
    for use_syrk in (False, True):
        if use_syrk and min(G.shape) not in EMERGING_SYRK_SIZES:
            continue  # its autotuner compiles 18 to 180 configs per new size: a few sizes only
        label = "emerging-optimizers newton_schulz bf16" + (" use_syrk" if use_syrk else "")
        timed[label] = functools.partial(_at_medium_precision, newton_schulz, G, 5, coefficient_type="polar_express",
                                         use_syrk=use_syrk)
    return timed


def _at_medium_precision(fn: Callable[..., torch.Tensor], *args: object, **kwargs: object) -> torch.Tensor:
    """fn's call with float32 matmul precision "medium", the previous precision restored after."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("medium")
    try:
        return fn(*args, **kwargs)
    finally:
        torch.set_float32_matmul_precision(previous)


def _step_params(device: torch.device, matrix_shapes: list[tuple[int, int]], vector_sizes: list[int],
                 copies: int, embeddings: list[tuple[int, int]]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The Muon matrices, and the AdamW tensors (vectors, then embeddings), with gradients."""
    generator = torch.Generator(device="cpu").manual_seed(0)

    def leaf(shape) -> torch.Tensor:
        tensor = (torch.randn(shape, generator=generator) * 0.02).to(device).requires_grad_()
        tensor.grad = torch.randn(shape, generator=generator).to(device)
        return tensor

    matrices = [leaf(shape) for _ in range(copies) for shape in matrix_shapes]
    adamw = [leaf((size,)) for _ in range(copies) for size in vector_sizes] + [leaf(shape) for shape in embeddings]
    return matrices, adamw


def bench_step(optimizer, device: torch.device, torch_dtype: torch.dtype, repeats: int) -> tuple[list[Row], list[str]]:
    """One optimizer step, ours (defaults; NorMuon, AdaMuon, bfloat16 and int8 state, AOL with a step fewer; on GPUs
    also offload, alone and with int8 state, the Gram iteration, which runs there in float16, and torch's kernels in
    place of the one-launch Triton ones) vs torch.optim.Muon (its Newton-Schulz in
    `torch_dtype`) + fused AdamW, on GPT-2 small's hidden matrices with its vectors and token embedding going to AdamW
    (as muon_param_groups sends them) and, on GPUs, on one Llama-3-8B layer; then the AdamW-routed parameters alone
    against fused AdamW, and a small model's step. The notes give each optimizer's state bytes per parameter."""
    shape_sets = [("GPT-2 small", GPT2_SMALL_BLOCK, GPT2_SMALL_VECTORS, GPT2_BLOCKS, [GPT2_EMBEDDING])]
    if device.type == "cuda":
        shape_sets.append(("Llama-3-8B layer", LLAMA3_8B_LAYER, LLAMA3_8B_VECTORS, 1, []))
    rows, notes = [], []
    for name, matrix_shapes, vector_sizes, copies, embeddings in shape_sets:
        matrices, vectors = _step_params(device, matrix_shapes, vector_sizes, copies, embeddings)
        flop = sum(newton_schulz_flop(*shape, 5) for shape in matrix_shapes) * copies
        theirs = step_memory._optimizers(optimizer, "torch.optim.Muon + AdamW", matrices, vectors)
        muon = functools.partial(step_memory.ours, optimizer, matrices, vectors)
        ours = muon()
        variants = {"normalization='neuron' (NorMuon)": muon(normalization="neuron"),
                    "normalization='element' (AdaMuon)": muon(normalization="element"),
                    "state_dtype=torch.bfloat16": muon(state_dtype=torch.bfloat16),
                    "state_dtype='int8'": muon(state_dtype="int8"),
                    "preconditioner='aol', ns_steps=4": muon(preconditioner="aol", ns_steps=4)}
        torch_kernels = {}
        if device.type == "cuda":  # on a CPU offload moves nothing, and the 16-bit Gram iteration runs slower
            variants["offload='cpu'"] = muon(offload="cpu")
            # A quarter of the bytes to move: what offload's floor (the host link, see _offload_floor) leaves room for.
            variants["offload='cpu', state_dtype='int8'"] = muon(offload="cpu", state_dtype="int8")
            variants["ns_algorithm='gram' (float16 on the GPU)"] = muon(ns_algorithm="gram")
            # What the one-launch Triton kernels (AdamW part, Muon update) save, side by side.
            torch_kernels = {"optimizer.Muon, torch's kernels where one-launch Triton ones serve":
                             _without_one_launch(optimizer, muon().step)}
        # The compiled step compiles twice: before and after the step that creates the optimizer state.
        steppers, failures = _running({"optimizer.Muon (defaults)": ours.step,
                                       "torch.compile(optimizer.Muon.step)": torch.compile(ours.step),
                                       **{f"optimizer.Muon, {label}": opt.step for label, opt in variants.items()},
                                       **torch_kernels})
        notes += [f"{name}: {failure}" for failure in failures]
        baseline, *ours_ms = paired_medians_ms([torch_stepping(theirs, torch_dtype), *steppers.values()], device,
                                               repeats)
        case = f"{name}, {len(matrices)} matrices + {len(vectors)} AdamW tensors"
        rows += [Row("Muon.step", case, f"torch.optim.Muon ({dtype_name(torch_dtype)} NS) + "
                     "fused AdamW", baseline, flop, baseline)]
        rows += [Row("Muon.step", case, label, ms, flop, baseline) for label, ms in zip(steppers, ours_ms)]
        numel = sum(p.numel() for p in matrices + vectors)
        notes += [f"{name}: optimizer state per parameter: {label} {state_bytes(opt) / numel:.2f} bytes"
                  + (f" ({state_bytes(opt, device) / numel:.4f} on the GPU between steps)" if "offload=" in label
                     else "")
                  for label, opt in {"torch.optim.Muon + AdamW": theirs, "optimizer.Muon (defaults)": [ours],
                                     **{f"optimizer.Muon, {key}": [opt] for key, opt in variants.items()}}.items()]
        notes += [f"{name}, {label}: {_offload_floor(opt, device)}" for label, opt in variants.items()
                  if label.startswith("offload=")]
        rows += _adamw_part_rows(optimizer, device, f"{name}, its {len(vectors)} AdamW tensors alone", vectors,
                                 repeats)
    rows += _small_model_rows(optimizer, device, torch_dtype, repeats)
    rows += _layer_group_rows(optimizer, device, torch_dtype, repeats)
    return rows, notes


def _without_one_launch(optimizer, step: Callable[[], object]) -> Callable[[], None]:
    """The step with the one-launch Triton kernels kept out while it runs, as on a device they do not serve."""
    functional = importlib.import_module(f"{optimizer.__name__}.functional")

    def run() -> None:
        with mock.patch.object(functional, "ONE_LAUNCH_DEVICE_TYPES", ()):
            step()
    return run


def _offload_floor(offloaded: torch.optim.Optimizer, device: torch.device) -> str:
    """The time an offloaded step cannot go below here: its state held in pinned host memory crosses the bus to the
    GPU and back every step, at the rates pinned copies of 256 MiB reach on this machine."""
    moved = state_bytes([offloaded], torch.device("cpu"))
    try:
        host, host_back = (torch.empty(2**28, dtype=torch.uint8, pin_memory=True) for _ in range(2))
        on_device, leaving = (torch.empty_like(host, device=device) for _ in range(2))
        to_device = median_ms(lambda: on_device.copy_(host, non_blocking=True), device, 0)
        to_host = median_ms(lambda: host.copy_(on_device, non_blocking=True), device, 0)
        both_ways = median_ms(_copies_both_ways(host, on_device, leaving, host_back), device, 0)
    except Exception as error:  # noqa: BLE001 - a note, not a failed section
        return f"offload: the copy rates could not be measured ({type(error).__name__}: {error})"
    copies = moved / host.numel()  # how many 256 MiB copies the state makes each way
    return (f"offload moves {moved / 2**20:.0f} MiB of state each way per step; pinned copies of 256 MiB ran at "
            f"{host.numel() / to_device / 1e6:.1f} GB/s to the GPU and {host.numel() / to_host / 1e6:.1f} GB/s back, "
            f"and took {both_ways:.2f} ms for one each way at once on two streams (as offload's side streams run "
            f"them), so at least {copies * both_ways:.2f} ms ({copies * max(to_device, to_host):.2f} were both "
            f"directions at full rate at once), {copies * (to_device + to_host):.2f} ms one after the other")


def _copies_both_ways(host: torch.Tensor, on_device: torch.Tensor, leaving: torch.Tensor, host_back: torch.Tensor
                      ) -> Callable[[], None]:
    """A copy to the GPU and one back, each on a side stream of its own, both after and before the current stream's
    work: whether the host link carries both directions at once at full rate."""
    streams = [torch.cuda.Stream(on_device.device) for _ in range(2)]

    def run() -> None:
        current = torch.cuda.current_stream(on_device.device)
        for stream, (target, source) in zip(streams, ((on_device, host), (host_back, leaving))):
            stream.wait_stream(current)
            with torch.cuda.stream(stream):
                target.copy_(source, non_blocking=True)
        for stream in streams:
            current.wait_stream(stream)
    return run


def _running(steppers: dict[str, Callable[[], object]]) -> tuple[dict[str, Callable[[], object]], list[str]]:
    """The steppers whose first call succeeds, and a line naming each that raised, so that one configuration failing
    on a machine (a GPU session has only minutes) costs its own row, not the whole section."""
    running, failures = {}, []
    for label, step in steppers.items():
        try:
            step()
        except Exception as error:  # noqa: BLE001 - reported in the notes, and the other steppers still run
            message = ": ".join([type(error).__name__, *str(error).strip().splitlines()[:1]])
            failures.append(f"{label} failed and is not timed: {message[:240]}")
        else:
            running[label] = step
    return running, failures


def _narrowed(shape: tuple[int, ...]) -> tuple[int, ...]:
    """A GPT-2-small shape at 1/GPT2_STRUCTURE_WIDTH of its width (every dim divided, at least 1)."""
    return tuple(max(1, size // GPT2_STRUCTURE_WIDTH) for size in shape)


def _small_model_rows(optimizer, device: torch.device, torch_dtype: torch.dtype, repeats: int) -> list[Row]:
    """The step where each call's own overhead weighs as much as its products, ours against torch.optim.Muon + fused
    AdamW, side by side over 20x the rounds (a step takes milliseconds): a small model, the MNIST-sized MLP
    784-256-256-10 (three matrices, each a bucket of one, and three biases), and GPT-2 small's structure at
    1/GPT2_STRUCTURE_WIDTH of its width; then that structure's 97 AdamW tensors alone against fused AdamW: the
    AdamW part's host time, what a GPU's AdamW part of the full model waits on."""
    narrow_vectors = [_narrowed((size,))[0] for size in GPT2_SMALL_VECTORS]
    cases = {"MNIST MLP 784-256-256-10, 3 matrices + 3 biases": (MNIST_MLP, MNIST_MLP_VECTORS, 1, []),
             f"GPT-2 small's 48 matrices + 97 AdamW tensors, every dim / {GPT2_STRUCTURE_WIDTH} (host time)": (
                 [_narrowed(shape) for shape in GPT2_SMALL_BLOCK], narrow_vectors, GPT2_BLOCKS,
                 [_narrowed(GPT2_EMBEDDING)])}
    rows = []
    for case, (matrix_shapes, vector_sizes, copies, embeddings) in cases.items():
        matrices, vectors = _step_params(device, matrix_shapes, vector_sizes, copies, embeddings)
        theirs, (ours,) = (step_memory._optimizers(optimizer, label, matrices, vectors)
                           for label in ("torch.optim.Muon + AdamW", "optimizer.Muon (defaults)"))
        baseline, eager = paired_medians_ms([torch_stepping(theirs, torch_dtype), ours.step], device, 20 * repeats)
        flop = copies * sum(newton_schulz_flop(*shape, 5) for shape in matrix_shapes)
        rows += [Row("Muon.step", case, f"torch.optim.Muon ({dtype_name(torch_dtype)} NS) + fused "
                     "AdamW", baseline, flop, baseline),
                 Row("Muon.step", case, "optimizer.Muon (defaults)", eager, flop, baseline)]
    _, vectors = _step_params(device, [], narrow_vectors, GPT2_BLOCKS, [_narrowed(GPT2_EMBEDDING)])
    fused = torch.optim.AdamW(vectors, lr=0.02, betas=(0.9, 0.95), fused=True)
    ours = optimizer.Muon([dict(params=vectors, use_muon=False)], lr=0.02)
    baseline, eager = paired_medians_ms([fused.step, ours.step], device, 20 * repeats)
    case = f"GPT-2 small's {len(vectors)} AdamW tensors alone, every dim / {GPT2_STRUCTURE_WIDTH} (host time)"
    return rows + [Row("AdamW part", case, "torch.optim.AdamW(fused=True)", baseline, 0.0, baseline),
                   Row("AdamW part", case, "optimizer.Muon (non-finite guard included)", eager, 0.0, baseline)]


def _layer_group_rows(optimizer, device: torch.device, torch_dtype: torch.dtype, repeats: int) -> list[Row]:
    """GPT-2 small's structure at 1/GPT2_STRUCTURE_WIDTH of its width with a param group per block, each at its own
    lr (as layer-wise lr decay makes them: lr * 0.9^depth from the top, the vectors in a group of their own per block),
    ours against torch.optim.Muon + fused AdamW on the same groups, and ours on the same tensors in two groups: the
    Muon groups share buckets (they differ only in lr), so what is left between the two is each group's own Python
    (its options checked, its state gathered) and the AdamW part's calls per group."""
    matrices, vectors = _step_params(device, [_narrowed(shape) for shape in GPT2_SMALL_BLOCK],
                                     [_narrowed((size,))[0] for size in GPT2_SMALL_VECTORS], GPT2_BLOCKS, [])
    per_block = (len(GPT2_SMALL_BLOCK), len(GPT2_SMALL_VECTORS))
    blocks = [(matrices[b * per_block[0]:(b + 1) * per_block[0]], vectors[b * per_block[1]:(b + 1) * per_block[1]],
               0.02 * 0.9 ** (GPT2_BLOCKS - 1 - b)) for b in range(GPT2_BLOCKS)]
    theirs = [torch.optim.Muon([dict(params=block, lr=lr) for block, _, lr in blocks], lr=0.02,
                               adjust_lr_fn="match_rms_adamw"),
              torch.optim.AdamW([dict(params=block, lr=lr) for _, block, lr in blocks], lr=0.02, betas=(0.9, 0.95),
                                fused=True)]
    ours = optimizer.Muon([group for block_matrices, block_vectors, lr in blocks
                           for group in (dict(params=block_matrices, lr=lr),
                                         dict(params=block_vectors, lr=lr, use_muon=False))], lr=0.02)
    (two_groups,) = step_memory._optimizers(optimizer, "optimizer.Muon (defaults)", matrices, vectors)
    baseline, grouped, merged = paired_medians_ms([torch_stepping(theirs, torch_dtype), ours.step, two_groups.step],
                                                  device, 20 * repeats)
    case = (f"GPT-2 small's structure, every dim / {GPT2_STRUCTURE_WIDTH}, a param group per block (layer-wise lr "
            "decay)")
    flop = GPT2_BLOCKS * sum(newton_schulz_flop(*_narrowed(shape), 5) for shape in GPT2_SMALL_BLOCK)
    return [Row("Muon.step", case, f"torch.optim.Muon ({dtype_name(torch_dtype)} NS) + fused AdamW, "
                "the same groups", baseline, flop, baseline),
            Row("Muon.step", case, "optimizer.Muon (defaults), the same groups", grouped, flop, baseline),
            Row("Muon.step", case, "optimizer.Muon (defaults), the same tensors in two groups", merged, flop,
                baseline)]


def _adamw_part_rows(optimizer, device: torch.device, case: str, params: list[torch.Tensor], repeats: int) -> list[Row]:
    """The AdamW-routed parameters alone against fused AdamW: the step (our non-finite guard included), then
    gradient clipping and the step, where our clip's read of each gradient also serves the step's guard. Clipping
    at half the gradients' norm, after doubling them (on both sides alike), scales them at every call; at twice
    their norm it only measures (torch multiplies them by 1 all the same). On a CPU also the floor of a guard that
    reads every gradient before any update: fused AdamW after the compiled check's one read of each gradient."""
    fused = torch.optim.AdamW(params, lr=0.02, betas=(0.9, 0.95), fused=True)
    ours = optimizer.Muon([dict(params=params, use_muon=False)], lr=0.02)
    grads = [param.grad for param in params]
    norm = float(torch.nn.utils.get_total_norm(grads))

    def clipped(clip: Callable[[float], object], step: Callable[[], object], max_norm: float,
                grow: bool) -> Callable[[], None]:
        def run() -> None:
            if grow:
                torch._foreach_mul_(grads, 2.0)
            clip(max_norm)
            step()
        return run

    def torch_clip(max_norm: float) -> None:
        torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)

    clip_cases = {"clipping every step (gradients doubled first)": (0.5 * norm, True),
                  "measuring only (norm below max_norm)": (2.0 * norm, False)}
    fns = [fused.step, ours.step]
    for max_norm, grow in clip_cases.values():
        fns += [clipped(torch_clip, fused.step, max_norm, grow),
                clipped(ours.clip_grad_norm_, ours.step, max_norm, grow)]
    floor = [lambda: (_native(optimizer).finite_flags(grads), fused.step())] if device.type == "cpu" else []
    baseline, eager, *clip_ms = paired_medians_ms(fns + floor, device, 3 * repeats)
    rows = [Row("AdamW part", case, "torch.optim.AdamW(fused=True)", baseline, 0.0, baseline),
            Row("AdamW part", case, "optimizer.Muon (non-finite guard included)", eager, 0.0, baseline)]
    if floor:
        rows.append(Row("AdamW part", case, "the guard's floor: the compiled check's read of every gradient, then "
                        "fused AdamW", clip_ms.pop(), 0.0, baseline))
    for index, label in enumerate(clip_cases):
        theirs, mine = clip_ms[2 * index:2 * index + 2]
        rows += [Row("AdamW part", f"{case}, {label}", "torch clip_grad_norm_ + fused AdamW", theirs, 0.0, theirs),
                 Row("AdamW part", f"{case}, {label}", "Muon.clip_grad_norm_ + Muon.step", mine, 0.0, theirs)]
    return rows


def state_bytes(optimizers: list[torch.optim.Optimizer], device: torch.device | None = None) -> int:
    """Bytes of every tensor the optimizers keep as state (counters included), or only of those on `device`."""
    return sum(value.numel() * value.element_size() for opt in optimizers for state in opt.state.values()
               for value in state.values() if isinstance(value, torch.Tensor)
               and (device is None or value.device.type == device.type))


# ---------------------------------------------------------------------------------------------------------------
# dist: one Muon step on FSDP2-style Shard(0) DTensors over DIST_WORLD gloo ranks, three ways side by side.
# ---------------------------------------------------------------------------------------------------------------


def _dist_matrices(blocks: int, mesh) -> list[torch.Tensor]:
    """The GPT-2 small block matrices as Shard(0) DTensors with Shard(0) gradients, identical on every rank."""
    from torch.distributed.tensor import Shard, distribute_tensor
    generator = torch.Generator().manual_seed(0)
    params = []
    for shape in GPT2_SMALL_BLOCK * blocks:
        param = distribute_tensor(torch.randn(shape, generator=generator) * 0.02, mesh, [Shard(0)])
        param.requires_grad_()
        param.grad = distribute_tensor(torch.randn(shape, generator=generator), mesh, [Shard(0)])
        params.append(param)
    return params


class _NaiveGatherAll:
    """The baseline: every rank gathers every full gradient (`full_tensor()`, an all-gather), keeps full momentum,
    orthogonalizes every matrix with the same Newton-Schulz routine as ours, and updates its own rows."""

    def __init__(self, optimizer, params: list[torch.Tensor]) -> None:
        self.optimizer, self.params = optimizer, params
        self.buffers = [torch.zeros(p.shape) for p in params]
        # The same Newton-Schulz dtype as our optimizer's default on this machine, so only the communication differs.
        self.ns_dtype = optimizer.default_ns_dtype("cpu")

    @torch.no_grad()
    def step(self) -> None:
        for param, buffer in zip(self.params, self.buffers):
            grad = param.grad.full_tensor()
            buffer.lerp_(grad, 0.05)
            update = self.optimizer.zeropower(grad.lerp_(buffer, 0.95), 5, dtype=self.ns_dtype)
            local = param.to_local()
            rows = local.shape[0]
            start = dist.get_rank() * rows  # even shards: GPT-2's dims divide by 4
            scale = 0.02 * 0.2 * max(param.shape) ** 0.5
            local.mul_(1 - 0.02 * 0.1).add_(update[start:start + rows], alpha=-scale)


def _timed_step_ms(step: Callable[[], object], repeats: int, warm_up: bool = True) -> float:
    """Median wall time of a step over all ranks: barriers on both sides, so the slowest rank sets it."""
    if warm_up:  # lazy optimizer state, compilation
        step()
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        step()
        dist.barrier()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _bytes_sent(step: Callable[[], object]) -> int:
    """Bytes this rank sends to other ranks in one step of our pipeline, counted at its all-to-all calls."""
    original = dist.all_to_all_single
    sent = 0

    def counting(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
        nonlocal sent
        own = input_split_sizes[dist.get_rank(group)] if input_split_sizes else 0
        sent += (input.numel() - own) * input.element_size()
        return original(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)

    dist.all_to_all_single = counting
    try:
        step()
    finally:
        dist.all_to_all_single = original
    return sent


def _dist_worker(rank: int, world: int, port: int, blocks: int, repeats: int, emulated_peers: bool,
                 result_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # The ranks share the machine's cores: one rank per core share, as torchrun's OMP_NUM_THREADS=1 would do.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    timeout = EMULATED_PEERS_TIMEOUT_S if emulated_peers else 300
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout))
    from torch.distributed.device_mesh import init_device_mesh
    try:
        optimizer = get_local_kernel(REPO_ROOT / "build")
        mesh = init_device_mesh("cpu", (world,))
        result: dict[str, object] = {}
        ours = optimizer.Muon(_dist_matrices(blocks, mesh), lr=0.02)  # ns_dtype=None: the default here
        result["ours_ms"] = _timed_step_ms(ours.step, repeats)
        sent = torch.tensor([float(_bytes_sent(ours.step))])
        gathered = [torch.zeros(1) for _ in range(world)]
        dist.all_gather(gathered, sent)
        result["ours_bytes"] = [float(t) for t in gathered]
        naive = _NaiveGatherAll(optimizer, _dist_matrices(blocks, mesh))
        result["naive_ms"] = _timed_step_ms(naive.step, repeats, warm_up=False)  # no lazy state; the slowest row
        result["muon_fsdp2"] = _muon_fsdp2_ms(optimizer, blocks, mesh, repeats, emulated_peers)
        result["device_model"] = _measured_device_model(optimizer, world)
        if rank == 0:
            Path(result_path).write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def _measured_device_model(optimizer, world: int) -> dict[str, float]:
    """What plan_step's DeviceModel assumes, measured as a rank of this run sees it, every rank at work at once: the
    sustained FLOP/s of Newton-Schulz itself, `zeropower` in the default dtype on each matrix of one GPT-2 block
    (the products at the sizes an owner runs them, with the scaling and copies around them; the closing barrier's
    cost, one collective's latency, taken off: with more ranks than cores a rank that timed only its own work
    measured the whole machine's rate), gloo all-to-all bytes per second a rank sends (8 MB per rank), and the time
    of an all-to-all of one float per peer (the latency). Medians of 5."""
    def median_s(work: Callable[[], object], until_all_done: bool = False) -> float:
        work()
        times = []
        for _ in range(5):
            dist.barrier()
            start = time.perf_counter()
            work()
            if until_all_done:
                dist.barrier()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    dtype = optimizer.default_ns_dtype("cpu")
    matrices = [torch.randn(shape) for shape in GPT2_SMALL_BLOCK]
    newton_schulz = median_s(lambda: [optimizer.zeropower(matrix, 5, dtype=dtype) for matrix in matrices],
                             until_all_done=True)
    flop = sum(newton_schulz_flop(*shape, 5) for shape in GPT2_SMALL_BLOCK)
    big, tiny = torch.zeros(world * (2 << 20)), torch.zeros(world)
    big_out, tiny_out = torch.empty_like(big), torch.empty_like(tiny)
    latency = median_s(lambda: dist.all_to_all_single(tiny_out, tiny))
    transfer = median_s(lambda: dist.all_to_all_single(big_out, big))
    sent = (world - 1) / world * big.numel() * big.element_size()
    return {"matmul_flops": flop / max(newton_schulz - latency, 1e-9), "link_bytes_per_s":
            sent / max(transfer - latency, 1e-9), "collective_latency_s": latency}


def _muon_fsdp2_ms(optimizer, blocks: int, mesh, repeats: int, emulated_peers: bool) -> float | str:
    """The PyPI package muon-fsdp2 on the same DTensors, or why it could not run (every rank decides alike). Where
    its bf16 products are emulated it runs only with `emulated_peers`, and then one timed step after the warm-up."""
    try:
        from muon_fsdp2 import Muon as MuonFsdp2
    except ImportError as error:
        return f"not installed ({error}); `pip install muon-fsdp2` to include it"
    slow = _precision(optimizer).slow_dtype_reason(torch.bfloat16, "cpu")
    if slow and not emulated_peers:  # its Newton-Schulz is bf16, always
        return f"its Newton-Schulz runs in bf16 only, and {slow} (`--emulated-peers` times one step of it anyway)"
    if slow:
        repeats = 1
    theirs = MuonFsdp2([dict(params=_dist_matrices(blocks, mesh), use_muon=True, lr=0.02, weight_decay=0.1)])
    try:
        return _timed_step_ms(theirs.step, repeats)
    except Exception as error:  # reported in the table's notes instead of failing the other sections
        return f"failed on CPU/gloo: {type(error).__name__}: {str(error).splitlines()[0][:200]}"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def bench_dist(optimizer, blocks: int, repeats: int, emulated_peers: bool) -> tuple[list[Row], list[str]]:
    """Rows for our distributed step, the gather-everything baseline and muon-fsdp2, plus notes on bytes and
    balance. CPU and gloo only: the ranks are processes on this machine."""
    with tempfile.TemporaryDirectory() as folder:
        result_path = Path(folder) / "dist.json"
        context = mp.start_processes(_dist_worker, args=(DIST_WORLD, _free_port(), blocks, repeats, emulated_peers,
                                                         str(result_path)),
                                     nprocs=DIST_WORLD, join=False, start_method="spawn")
        timeout = EMULATED_PEERS_TIMEOUT_S if emulated_peers else DIST_TIMEOUT_S
        deadline = time.monotonic() + timeout
        while not context.join(timeout=max(1.0, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                for process in context.processes:
                    process.kill()
                return [], [f"dist: killed after {timeout} s"]
        result = json.loads(result_path.read_text())
    shapes = GPT2_SMALL_BLOCK * blocks
    flop = sum(newton_schulz_flop(*shape, 5) for shape in shapes)
    case = f"GPT-2 small {blocks} blocks ({len(shapes)} matrices), {DIST_WORLD} gloo ranks, Shard(0)"
    naive = result["naive_ms"]
    rows = [Row("dist", case, "every rank full_tensor() + NS of all", naive, flop, naive),
            Row("dist", case, "optimizer.Muon (all-to-all pipeline)", result["ours_ms"], flop, naive)]
    notes = []
    if isinstance(result["muon_fsdp2"], float):
        emulated = _precision(optimizer).slow_dtype_reason(torch.bfloat16, "cpu") is not None
        label = "muon-fsdp2 0.3 (bf16 NS, compiled" + ("; bf16 emulated here: one timed step)" if emulated else ")")
        rows.append(Row("dist", case, label, result["muon_fsdp2"], flop, naive))
    else:
        notes.append(f"dist: muon-fsdp2 skipped: {result['muon_fsdp2']}")
    numel = sum(rows_ * cols for rows_, cols in shapes)
    # Each non-owner shard travels once to its owner and its update once back: 2 (W-1)/W of every matrix in all,
    # in bf16 (comm_dtype's default), spread over W ranks.
    minimum = 2 * (DIST_WORLD - 1) / DIST_WORLD * numel * 2 / DIST_WORLD
    sent = result["ours_bytes"]
    device_model = optimizer.DeviceModel(**result["device_model"])
    plan_dtype = optimizer.default_ns_dtype("cpu")
    plan = optimizer.plan_step(shapes, DIST_WORLD, ns_dtype=plan_dtype, device=device_model, mesh_device_type="cpu")
    naive_bytes = (DIST_WORLD - 1) / DIST_WORLD * numel * 4  # a ring all-gather of fp32 gradients
    notes += [
        f"dist: bytes sent per rank per step: ours mean {statistics.mean(sent) / 1e6:.2f} MB, max "
        f"{max(sent) / 1e6:.2f} MB; minimum (each shard once each way, bf16) {minimum / 1e6:.2f} MB per rank "
        f"(ours/min: mean {statistics.mean(sent) / minimum:.2f}x, max {max(sent) / minimum:.2f}x); the naive "
        f"baseline's ring all-gather of fp32 gradients sends {naive_bytes / 1e6:.2f} MB per rank",
        f"dist: optimizer.plan_step's bytes sent per rank {plan.bytes_sent_per_rank}: "
        f"{'equal to' if [round(b) for b in sent] == plan.bytes_sent_per_rank else 'NOT equal to'} the measured "
        f"{[round(b) for b in sent]}",
        f"dist: owner Newton-Schulz FLOP balance (max/mean over ranks, plan_step): {plan.balance:.3f}",
        f"dist: step time ours/naive {result['ours_ms'] / naive:.2f}x (ratio column: naive/ours)",
        f"dist: plan_step's predicted step time with a DeviceModel measured in the same run (per rank: "
        f"{dtype_name(plan_dtype)} Newton-Schulz of a GPT-2 block's matrices "
        f"{device_model.matmul_flops / 1e9:.1f} GFLOP/s, gloo all-to-all {device_model.link_bytes_per_s / 1e9:.2f} "
        f"GB/s sent, {device_model.collective_latency_s * 1e6:.0f} us per collective): overlapped "
        f"{plan.time_overlapped_s * 1e3:.0f} ms, serial {plan.time_serial_s * 1e3:.0f} ms; measured "
        f"{result['ours_ms']:.0f} ms, {result['ours_ms'] / 1e3 / plan.time_overlapped_s:.2f}x the overlapped "
        f"prediction (it counts Newton-Schulz and the all-to-alls, not the momentum, the update or Python's own "
        f"time)",
    ]
    return rows, notes


def _software_lines(optimizer, device: torch.device) -> list[str]:
    lines = [f"torch {torch.__version__}; {optimizer.ops_summary()}"]
    if device.type == "cuda":
        import triton
        props = torch.cuda.get_device_properties(device)
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True).stdout.strip() or "unknown"
        lines.append(f"CUDA {torch.version.cuda}, driver {driver}, Triton {triton.__version__}; sm_{props.major}"
                     f"{props.minor}, {props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB")
    return lines


def cpu_model() -> str:
    """The CPU's model name as the kernel reports it (Linux), else what platform knows."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    return platform.processor() or f"{platform.machine()} CPU"


def _onednn_cap_note(optimizer) -> str:
    """Where ONEDNN_MAX_CPU_ISA keeps torch's 16-bit products off some instructions (to measure another machine kind
    on this one's cores), the device name says so."""
    cap = _precision(optimizer).onednn_isa_cap()
    return f", oneDNN capped at {cap}" if cap else ""


def _datasheet_note(device_name: str) -> str:
    for key, tflops in DATASHEET_BF16_TFLOPS.items():
        if key in device_name:
            return f" (datasheet dense bf16 peak: {tflops * 1e3:.0f} GFLOP/s)"
    return ""


def _autotune_notes(optimizer) -> list[str]:
    """Which Triton config the autotuner chose for each shape it met in this run."""
    notes = []
    for module_name, kernel_name in (("xxt", "_xxt_lower_kernel"), ("symmetric_poly", "_ba_plus_caa_lower_kernel")):
        module = sys.modules.get(f"{optimizer.__name__}.triton_kernels.{module_name}")
        cache = getattr(getattr(module, kernel_name, None), "cache", {})
        for key, config in cache.items():
            notes.append(f"triton {module_name} autotuned for {key}: {config}")
    return notes


def render(rows: list[Row], header: list[str], notes: list[str] = ()) -> str:
    columns = ["section", "case", "path", "median ms", "GFLOP", "GFLOP/s", "vs baseline"]
    lines = [*header, "", "| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    lines += ["| " + " | ".join(row.cells()) + " |" for row in rows]
    if notes:
        lines += ["", *(f"- {note}" for note in notes)]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5,
                        help="timed rounds per row on CPU (rows of millisecond steps take 20x as many, the AdamW "
                             "part 3x, the dist rows max(3, repeats // 2)); GPU: do_bench's own, GPU_ROUNDS times "
                             "for paired rows")
    parser.add_argument("--sections", default="gram,zeropower,step,dist", help="comma-separated subset to run")
    parser.add_argument("--dist-blocks", type=int, default=2, help="GPT-2 small blocks in the dist section")
    parser.add_argument("--emulated-peers", action="store_true",
                        help="time muon-fsdp2 in the dist section also where its bf16 products are emulated (one step: "
                             "minutes)")
    parser.add_argument("--no-save", action="store_true", help="print only; do not write the results file")
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR, help="folder for <device>-<date>.md")
    args = parser.parse_args()
    sections = set(args.sections.split(","))

    optimizer = get_local_kernel(REPO_ROOT / "build")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        device_name = torch.cuda.get_device_name()
        dtype = torch.bfloat16
        gram_shapes = [(s, s) for s in (512, 1024, 2048, 4096, 8192, 16384)] + [(1024, 4096), (4096, 16384)]
        # 2048x8192: issue 11's Gram target (>= 2x the standard iteration in bf16 on an H100).
        ns_shapes = [(768, 3072), (2048, 8192)] + [(s, s) for s in (1024, 2048, 4096, 8192)]
    else:
        device_name = f"{cpu_model()}, {torch.get_num_threads()} threads{_onednn_cap_note(optimizer)}"
        dtype, gram_shapes = torch.float32, [(512, 512), (1024, 1024), (2048, 2048), (4096, 4096), (1024, 4096)]
        ns_shapes = [(768, 768), (768, 3072), (1024, 4096), (2048, 2048)]
    peak = peak_gflops(device, dtype, args.repeats)
    torch_dtype, rates = faster_torch_dtype(device, args.repeats)
    choice = optimizer.ns_dtype_choice(device)
    today = datetime.date.today().isoformat()
    header = [f"# Benchmarks: {device_name}, {today}", "", *_software_lines(optimizer, device),
              f"Measured matmul peak (torch.mm, {dtype_name(dtype)}): {peak:.0f} GFLOP/s"
              f"{_datasheet_note(device_name)}. "
              "GFLOP counts are of full products; ratios are baseline / ours, measured side by side in this run.",
              "", f"ns_dtype=None picks {choice.dtype} here: {choice.reason}. torch.mm at "
              f"{f'512 (best of {4 * args.repeats})' if device.type == 'cpu' else 4096}: " + ", ".join(
                  f"{dtype_name(key)} {rate:.0f} GFLOP/s" for key, rate in rates.items()) +
              f"; torch.optim.Muon's Newton-Schulz is timed in {torch_dtype}, the faster of the two for it."]
    if device.type == "cpu":
        units = _precision(optimizer).cpu_matrix_units()
        header[-1] = "CPU matrix units: " + ", ".join(
            f"{unit.upper().replace('_', '-')} {'yes' if unit in units else 'no'}"
            for unit in _precision(optimizer).CPU_MATRIX_UNITS) + ". " + header[-1]
    rows: list[Row] = []
    notes: list[str] = []
    if "gram" in sections:
        rows += bench_gram(optimizer, device, dtype, gram_shapes, args.repeats)
    if "zeropower" in sections:
        ns_dtypes = [choice.dtype] if device.type == "cuda" else [torch.float32, torch.bfloat16]
        slow = {ns: _precision(optimizer).slow_dtype_reason(ns, device) for ns in ns_dtypes}
        notes += [f"zeropower {ns} not timed: {reason}" for ns, reason in slow.items() if reason]
        ns_dtypes = [ns for ns in ns_dtypes if not slow[ns]]
        rows += bench_zeropower(optimizer, device, ns_dtypes, torch_dtype, ns_shapes, args.repeats,
                                compiled_reference=False)
        if device.type == "cuda":
            rows += bench_zeropower(optimizer, device, ns_dtypes, torch_dtype, ns_shapes, args.repeats,
                                    compiled_reference=True)
        else:
            rows += bench_buckets(optimizer, device, choice.dtype, args.repeats)
            if choice.dtype.itemsize == 2:
                rows += bench_lone_matrices(optimizer, device, choice.dtype, args.repeats)
    if "step" in sections:
        step_rows, step_notes = bench_step(optimizer, device, torch_dtype, args.repeats)
        rows += step_rows
        notes += step_notes
        notes += [f"GPT-2 small: peak memory of a step above parameters and gradients (state and temporaries; "
                  f"{step_memory.METHOD[device.type]}): {label} {peak / 2**30:.2f} GiB"
                  for label, peak in step_memory.peak_bytes(device, torch_dtype).items()]
    if "dist" in sections:
        dist_rows, dist_notes = bench_dist(optimizer, args.dist_blocks, max(3, args.repeats // 2), args.emulated_peers)
        rows += dist_rows
        notes += dist_notes
    notes += _autotune_notes(optimizer)
    table = render(rows, header, notes)
    print(table)
    if not args.no_save:
        args.results_dir.mkdir(parents=True, exist_ok=True)
        slug = "".join(ch if ch.isalnum() else "-" for ch in device_name.lower()).strip("-")
        path = args.results_dir / f"{slug}-{today}.md"
        path.write_text(table)
        print(f"written to {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
