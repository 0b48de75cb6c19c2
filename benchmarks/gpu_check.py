"""GPU correctness, one command: every backend's symmetric products and Newton-Schulz against float64, one
`Muon.step()` against `torch.optim.Muon` and three steps of the AdamW part against fused `torch.optim.AdamW` on the
same GPU. Needs a CUDA device and `make build` (or tools/build.py).

The products' and Newton-Schulz rows compare a result with the same computation in float64 from the same stored
inputs, by ||out - ref|| / ||ref||, and beside it cuBLAS's own error in the same dtype (`torch` backend): a backend
passes when its error is within 2x cuBLAS's (plus one unit roundoff), so the bar is set by a library nobody here
wrote, not by a number picked to pass; a symmetric kernel's output must also be symmetric bit for bit. Three kinds of
row have other references and fixed bounds: the polar factor against the SVD's U Vᵀ (3e-2: ten bf16 steps from a
spectrum in [0.1, 1]), the Muon step against torch.optim.Muon's bf16 step (2e-2: bf16 resolution), and the AdamW
part against torch's fused AdamW (3 unit roundoffs of the dtype).
Writes a markdown table; exits 1 if any row fails.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from kernels import get_kernel, get_local_kernel

REPO_ROOT = Path(__file__).resolve().parents[1]
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Odd sizes straddle every tile edge; tall and wide; 2D and 3D (a batch of matrices, as expert banks give).
GRAM_SHAPES = [(1, 1), (7, 300), (300, 7), (129, 257), (1000, 130), (1030, 2049), (3, 257, 515), (2, 1500, 700),
               (4100, 4100)]
POLY_SIZES = [(1,), (129,), (257,), (1030,), (3, 257), (2, 1500), (4100,)]
NS_SHAPES = [(129, 257), (1030, 515), (515, 1030), (3, 257, 515), (2048, 2048)]


@dataclass
class Check:
    what: str
    case: str
    backend: str
    error: float
    bound: float

    @property
    def ok(self) -> bool:
        return self.error == self.error and self.error <= self.bound  # NaN never passes

    def cells(self) -> list[str]:
        return [self.what, self.case, self.backend, f"{self.error:.2e}", f"{self.bound:.2e}",
                "ok" if self.ok else "FAIL"]


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).norm() / ref.norm().clamp_min(1e-300))


def bar(cublas_error: float, dtype: torch.dtype) -> float:
    """Twice cuBLAS's error, plus one unit roundoff of the output dtype for when cuBLAS happens to be exact."""
    return 2 * cublas_error + torch.finfo(dtype).eps / 2


def symmetric_error(out: torch.Tensor, ref: torch.Tensor, backend: str) -> float:
    """The relative error, or infinity when a symmetric kernel's output is not symmetric bit for bit (cuBLAS's full
    product, the "torch" backend, makes no such promise)."""
    if backend != "torch" and not torch.equal(out, out.mT):
        return float("inf")
    return relative_error(out, ref)


def check_gram(optimizer, dispatch, dtype: torch.dtype, generator: torch.Generator) -> list[Check]:
    checks = []
    for shape in GRAM_SHAPES:
        X = torch.randn(shape, generator=generator, device="cuda").to(dtype)
        ref = X.double() @ X.double().mT
        cublas = relative_error(X @ X.mT, ref)
        for backend in dispatch.available_backends(dtype, "cuda"):
            out = dispatch.symmetric_gram(X, backend)
            checks.append(Check("gram X Xᵀ", f"{shape} {dtype}", backend, symmetric_error(out, ref, backend),
                                bar(cublas, dtype)))
    return checks


def check_polynomial(optimizer, dispatch, dtype: torch.dtype, generator: torch.Generator) -> list[Check]:
    b, c = -4.7750, 2.0315
    checks = []
    for size in POLY_SIZES:
        *batch, m = size
        R = torch.randn((*batch, m, m), generator=generator, device="cuda", dtype=torch.float64) / m ** 0.5
        A = (R + R.mT).to(dtype)
        Ad = A.double()
        ref = b * Ad + c * (Ad @ Ad)
        cublas = relative_error(dispatch.symmetric_polynomial(A, b, c, "torch"), ref)
        for backend in dispatch.available_backends(dtype, "cuda"):
            out = dispatch.symmetric_polynomial(A, b, c, backend)
            checks.append(Check("b·A + c·A²", f"{size} {dtype}", backend, symmetric_error(out, ref, backend),
                                bar(cublas, dtype)))
    return checks


def check_newton_schulz(optimizer, dispatch, dtype: torch.dtype, generator: torch.Generator) -> list[Check]:
    """Five Polar Express steps in `dtype` on every backend against the same five steps in float64; and the Gram
    iteration, which a 16-bit request runs in float16 on a GPU, held to the default (standard bf16) iteration's
    error on cuBLAS."""
    checks = []
    for shape in NS_SHAPES:
        G = torch.randn(shape, generator=generator, device="cuda")
        ref = optimizer.zeropower(G.double(), 5, dtype=torch.float64, backend="torch")
        cublas = relative_error(optimizer.zeropower(G, 5, dtype=dtype, backend="torch"), ref)
        for backend in dispatch.available_backends(dtype, "cuda"):
            out = optimizer.zeropower(G, 5, dtype=dtype, backend=backend)
            checks.append(Check("zeropower 5 steps", f"{shape} {dtype}", backend, relative_error(out, ref),
                                bar(cublas, dtype)))
        if dtype.itemsize == 2:
            default = relative_error(optimizer.zeropower(G, 5, dtype=torch.bfloat16, backend="torch"), ref)
            out = optimizer.zeropower(G, 5, dtype=dtype, algorithm="gram")
            checks.append(Check("zeropower 5 steps, algorithm=gram", f"{shape} {dtype}", "auto",
                                relative_error(out, ref), bar(default, torch.bfloat16)))
    return checks


def check_polar_factor(optimizer, generator: torch.Generator) -> list[Check]:
    """The default step (bf16, auto backend) against the exact polar factor U Vᵀ from a float64 SVD: Muon's truth.

    Ten steps on a matrix whose singular values all lie in [0.1, 1] after scaling: Polar Express converges there,
    and the bound is bf16's resolution of an orthogonal matrix."""
    checks = []
    for m, n in ((1024, 3072), (3072, 1024), (4096, 4096)):
        U, _, Vh = torch.linalg.svd(torch.randn(m, n, generator=generator, device="cuda", dtype=torch.float64),
                                    full_matrices=False)
        S = torch.linspace(0.1, 1.0, min(m, n), device="cuda", dtype=torch.float64)
        G = (U * S) @ Vh
        out = optimizer.zeropower(G.float(), 10, dtype=torch.bfloat16)
        checks.append(Check("polar factor vs SVD", f"({m}, {n}) bf16 auto", optimizer.kernel_choice(
            (m, n), torch.bfloat16, "cuda"), relative_error(out, U @ Vh), 3e-2))
    return checks


def check_step_against_torch(optimizer, generator: torch.Generator) -> list[Check]:
    """One step of ours with torch.optim.Muon's settings against torch.optim.Muon on the same parameters."""
    shapes = [(768, 768), (3072, 768), (768, 3072), (1030, 515)]
    params = [torch.randn(s, generator=generator, device="cuda") * 0.02 for s in shapes]
    grads = [torch.randn(s, generator=generator, device="cuda") for s in shapes]
    theirs = [p.clone().requires_grad_() for p in params]
    ours = [p.clone().requires_grad_() for p in params]
    for group in (theirs, ours):
        for p, g in zip(group, grads):
            p.grad = g.clone()
    torch.optim.Muon(theirs, lr=0.02, weight_decay=0.1, adjust_lr_fn="original").step()
    optimizer.Muon(ours, lr=0.02, weight_decay=0.1, ns_coefficients="original", ns_dtype=torch.bfloat16,
                   adjust_lr_fn="original").step()
    checks = []
    for shape, start, a, b in zip(shapes, params, theirs, ours):
        delta_theirs = (a.detach() - start).double()
        error = relative_error(b.detach() - start, delta_theirs)
        # The same bf16 Newton-Schulz; only the symmetric kernels' summation order may differ: bf16 resolution.
        checks.append(Check("Muon.step vs torch.optim.Muon", f"{shape} fp32 params", optimizer.kernel_choice(
            shape, torch.bfloat16, "cuda"), error, 2e-2))
    return checks


def check_adamw_against_torch(optimizer, generator: torch.Generator) -> list[Check]:
    """Three steps of the AdamW part (GPT-2 small's vector sizes and a 5000x768 embedding, all AdamW-routed) against
    torch.optim.AdamW(fused=True) on the same GPU, fp32 and bf16; at the third step one gradient holds a NaN, and
    that parameter must keep its second step's value bit for bit. Both compute in fp32 and round once per stored
    value, so parameters may differ by an ulp per step: the bar is 3 unit roundoffs of the dtype, relative."""
    functional = sys.modules[f"{optimizer.__name__}.functional"]
    path = "one Triton launch per dtype" if functional.TRITON_AVAILABLE else "torch fused, one call per parameter"
    shapes = [(2304,), (768,), (3072,), (768,), (5000, 768)]
    settings = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    checks = []
    for dtype in (torch.float32, torch.bfloat16):
        params = [(torch.randn(s, generator=generator, device="cuda") * 0.02).to(dtype) for s in shapes]
        theirs = [p.clone().requires_grad_() for p in params]
        ours = [p.clone().requires_grad_() for p in params]
        reference = torch.optim.AdamW(theirs, fused=True, **settings)
        opt = optimizer.Muon([dict(params=ours, use_muon=False)], lr=settings["lr"], adamw_lr=settings["lr"],
                             adamw_betas=settings["betas"], adamw_eps=settings["eps"],
                             adamw_weight_decay=settings["weight_decay"])
        for step in range(3):
            grads = [torch.randn(s, generator=generator, device="cuda").to(dtype) for s in shapes]
            if step == 2:
                before_nan = ours[0].detach().clone()
                grads[0][7] = float("nan")
            for p, q, g in zip(theirs, ours, grads):
                p.grad, q.grad = g.clone(), g.clone()
            reference.step()
            opt.step()
        name = str(dtype).removeprefix("torch.")
        for shape, a, b in zip(shapes[1:], theirs[1:], ours[1:]):
            checks.append(Check("AdamW part vs torch.optim.AdamW(fused=True)", f"{shape} {name}, 3 steps", path,
                                relative_error(b.detach(), a.detach().double()), 3 * torch.finfo(dtype).eps))
        kept = torch.equal(ours[0].detach(), before_nan)
        checks.append(Check("AdamW part, a NaN gradient", f"{shapes[0]} {name}: parameter unchanged", path,
                            0.0 if kept else float("inf"), 0.0))
    return checks


def load_both_ways() -> tuple[object, list[str]]:
    """The CUDA build through get_local_kernel and through get_kernel with LOCAL_KERNELS; both must be compiled."""
    local = get_local_kernel(REPO_ROOT / "build")
    os.environ["LOCAL_KERNELS"] = f"local-org/optimizer={REPO_ROOT}"
    hub = get_kernel("local-org/optimizer", version=1)
    lines = [f"get_local_kernel: {local.__name__}: {local.ops_summary()}",
             f"get_kernel + LOCAL_KERNELS: {hub.__name__}: {hub.ops_summary()}"]
    if local.__name__ != hub.__name__:
        raise SystemExit(f"the two loaders picked different variants: {lines}")
    return local, lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="markdown file for the table")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_check needs a CUDA device")
    optimizer, load_lines = load_both_ways()
    dispatch = sys.modules[f"{optimizer.__name__}.dispatch"]
    generator = torch.Generator(device="cuda").manual_seed(0)
    checks: list[Check] = []
    for dtype in DTYPES:
        checks += check_gram(optimizer, dispatch, dtype, generator)
        checks += check_polynomial(optimizer, dispatch, dtype, generator)
        checks += check_newton_schulz(optimizer, dispatch, dtype, generator)
    checks += check_polar_factor(optimizer, generator)
    checks += check_step_against_torch(optimizer, generator)
    checks += check_adamw_against_torch(optimizer, generator)
    props = torch.cuda.get_device_properties(0)
    header = [f"# GPU correctness: {props.name} (sm_{props.major}{props.minor}), {datetime.date.today()}", "",
              f"torch {torch.__version__}, CUDA {torch.version.cuda}", *(f"- {line}" for line in load_lines), "",
              "| what | case | backend | rel. error vs its reference | bound | |", "| --- | --- | --- | --- | --- | --- |"]
    table = "\n".join(header + ["| " + " | ".join(c.cells()) + " |" for c in checks]) + "\n"
    failed = [c for c in checks if not c.ok]
    table += f"\n{len(checks) - len(failed)} of {len(checks)} checks pass.\n"
    args.out.write_text(table)
    print(table)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
