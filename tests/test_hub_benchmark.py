"""benchmarks/benchmark.py as `kernels benchmark` runs it: through the kernels CLI (`kernels.cli.main`, in this
process), against this checkout and its build/ (`kernels benchmark <path>` loads a local path with
`get_local_kernel`), with small shapes on the device the runner picks (the CPU here). Every workload must pass the
runner's verification, and a kernel with one wrong result must fail it. Nothing here asserts a timing."""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import kernels
import kernels.backends
import kernels.cli
import kernels.cli.benchmark as runner
import pytest
from packaging.version import Version
import tabulate  # noqa: F401  (kernels[benchmark]: without it `kernels benchmark` refuses to start)
import torch
from kernel_under_test import optimizer

REPO_ROOT = Path(__file__).resolve().parents[1]
SCRIPT = REPO_ROOT / "benchmarks" / "benchmark.py"

# Small workloads, per class as in the script, used on every device: a GPU machine runs this test too (in bfloat16).
# On the CPU 520 rows take the compiled kernel (from 512 rows), the others the torch path; the step's blocks are 32
# wide.
SMALL_WORKLOADS = {
    "Gram": {"square": (520, 520), "wide": (96, 1000)},
    "Zeropower": {"square": (520, 520), "wide": (100, 600)},
    "MuonStep": {"gpt": (32, 2)},
}
WORKLOADS = {"Gram.square", "Gram.wide", "MuonStep.gpt", "Zeropower.square", "Zeropower.wide"}


def load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("hub_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def discover_small(discover: Callable[[Path, Path], list[type]]) -> Callable[[Path, Path], list[type]]:
    """The runner's own discovery (it executes the script afresh each run), then small shapes."""
    def discover_then_shrink(script_path: Path, cwd: Path) -> list[type]:
        classes = discover(script_path, cwd)
        for cls in classes:
            cls.workloads = {kind: SMALL_WORKLOADS[cls.__name__] for kind in cls.workloads}
        return classes
    return discover_then_shrink


def run_cli(monkeypatch: pytest.MonkeyPatch, *arguments: str) -> None:
    """`kernels benchmark REPO_ROOT --iterations 1 --warmup 2 ...` through the CLI's entry point. The warm-up calls
    the reference three times, so the step is checked against a reference that has stepped before (MuonStep)."""
    monkeypatch.setattr(runner, "discover_benchmark_classes", discover_small(runner.discover_benchmark_classes))
    monkeypatch.setattr(sys, "argv", ["kernels", "benchmark", str(REPO_ROOT), "--iterations", "1", "--warmup", "2",
                                      *arguments])
    # The runner registers the script as this module; recording it as absent makes teardown remove it again.
    monkeypatch.setitem(sys.modules, "benchmark_module", ModuleType("benchmark_module"))
    with torch.random.fork_rng():  # the runner seeds torch's global generator
        kernels.cli.main()


def benchmark_results(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[dict]:
    """The runner's result per workload, as it writes them with --output."""
    output = tmp_path / "results.json"
    run_cli(monkeypatch, "--output", str(output))
    return json.loads(output.read_text())["results"]


def assert_every_workload_ran_and_verified(results: list[dict]) -> None:
    assert {result["workload"] for result in results} == WORKLOADS
    assert all(result["verified"] is True for result in results)


def test_every_workload_is_discovered_run_and_verified(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert_every_workload_ran_and_verified(benchmark_results(monkeypatch, tmp_path))


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here")
def test_a_cuda_torch_without_a_gpu_runs_the_cpu_workloads(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # The runner takes its device from how torch was built, as under PyPI's CUDA wheels on a machine with no GPU.
    monkeypatch.setattr(runner, "_backend", lambda: kernels.backends.CUDA(version=Version("13.0")))
    assert_every_workload_ran_and_verified(benchmark_results(monkeypatch, tmp_path))


def gram_2_percent_too_large(kernel: ModuleType) -> Callable[..., torch.Tensor]:
    return lambda X, **options: 1.02 * kernel.gram(X, **options)


def gram_without_its_upper_half(kernel: ModuleType) -> Callable[..., torch.Tensor]:
    return lambda X, **options: kernel.gram(X, **options).tril()


def zeropower_20_percent_too_large(kernel: ModuleType) -> Callable[..., torch.Tensor]:
    """Too large for float32's tolerance (1-2% of the RMS entry) and for bfloat16's (25-50%) alike."""
    return lambda G, *args, **options: 1.2 * kernel.zeropower(G, *args, **options)


def muon_update_20_percent_too_large(kernel: ModuleType) -> type:
    """Muon whose orthogonalized updates (and their weight decay) are 1.2x too large; AdamW's are right."""
    class ScaledMuon(kernel.Muon):
        def __init__(self, params, *, lr: float, **options) -> None:
            super().__init__(params, lr=1.2 * lr, adamw_lr=lr, **options)
    return ScaledMuon


@pytest.mark.parametrize(("attribute", "mistake", "failing_class"), [
    ("gram", gram_2_percent_too_large, "Gram"),
    ("gram", gram_without_its_upper_half, "Gram"),
    ("zeropower", zeropower_20_percent_too_large, "Zeropower"),
    ("Muon", muon_update_20_percent_too_large, "MuonStep"),
], ids=lambda value: value.__name__ if callable(value) else None)
def test_a_wrong_kernel_fails_verification(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                                           attribute: str, mistake: Callable[[ModuleType], object],
                                           failing_class: str) -> None:
    kernel = kernels.get_local_kernel(REPO_ROOT)  # what the runner loads for a local path
    broken = ModuleType(kernel.__name__)
    broken.__dict__.update(vars(kernel))
    setattr(broken, attribute, mistake(kernel))
    monkeypatch.setattr(kernels, "get_local_kernel", lambda path, **options: broken)
    with pytest.raises(SystemExit) as exit_info:
        run_cli(monkeypatch)
    assert exit_info.value.code == 1
    log = capsys.readouterr().err
    ran = [line.split()[1] for line in log.splitlines() if line.strip().startswith("Running ") and " on " in line]
    assert ran[-1] == failing_class, log
    assert "Verification failed for " in log, log


def test_reference_newton_schulz_is_torch_optim_muons() -> None:
    """The script's plain-PyTorch iteration is bit for bit torch.optim.Muon's private one, tall and wide."""
    torch_routine = getattr(getattr(torch.optim, "_muon", None), "_zeropower_via_newtonschulz", None)
    if torch_routine is None:
        pytest.skip("this torch has no torch.optim._muon._zeropower_via_newtonschulz")
    script = load_script()
    generator = torch.Generator().manual_seed(0)
    for shape in [(96, 200), (200, 96)]:
        G = torch.randn(shape, generator=generator).bfloat16()
        restated = script.newton_schulz_reference(G, [script.ORIGINAL] * script.NS_STEPS)
        assert torch.equal(restated, torch_routine(G, script.ORIGINAL, script.NS_STEPS, script.NS_EPS))


def test_scaling_the_last_step_scales_the_result_exactly() -> None:
    """Zeropower's premise: a power of two on the last (a, b, c) multiplies the output by it and changes no rounding,
    for the reference and for the package (compiled CPU kernel at 520 rows, torch path below)."""
    script = load_script()
    generator = torch.Generator().manual_seed(0)
    for shape, dtype in [((520, 600), torch.float32), ((64, 100), torch.bfloat16)]:
        G = torch.randn(shape, generator=generator).to(dtype)
        s = script.output_scale(max(shape), dtype)
        plain = [script.ORIGINAL] * script.NS_STEPS
        scaled = plain[:-1] + [tuple(s * coefficient for coefficient in script.ORIGINAL)]
        assert torch.equal(script.newton_schulz_reference(G, scaled), s * script.newton_schulz_reference(G, plain))
        assert torch.equal(optimizer.zeropower(G, script.NS_STEPS, scaled, dtype=dtype),
                           s * optimizer.zeropower(G, script.NS_STEPS, plain, dtype=dtype))
