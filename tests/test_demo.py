"""The demo (`make demo`) runs end to end: loads the built package through `kernels`, trains with Muon and AdamW,
reports both losses and writes a PNG. A tiny model and a few steps keep it to seconds."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import matplotlib.image
import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
DEMO = REPO_ROOT / "examples" / "train_gpt.py"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"  # the fixed first eight bytes of every PNG file (PNG spec, section 5.2)
SUMMARY_LINE = re.compile(
    r"^\s*(?P<name>muon|adamw)\s+train (?P<train_start>[\d.]+) -> (?P<train_end>[\d.]+)"
    r"\s+held-out (?P<val_start>[\d.]+) -> (?P<val_end>[\d.]+)",
    re.MULTILINE,
)
TINY_RUN = [
    "--steps", "8", "--n-layer", "1", "--n-head", "2", "--n-embd", "32", "--block-size", "32",
    "--batch-size", "8", "--evals", "2", "--eval-batches", "2", "--device", "cpu",
]


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], Path]:
    assert (REPO_ROOT / "build").is_dir(), "no build/ folder: run `make build` (or `make test`, which builds first)"
    out_dir = tmp_path_factory.mktemp("demo_out")
    environment = {**os.environ, "HF_HUB_OFFLINE": "1"}
    completed = subprocess.run(
        [sys.executable, str(DEMO), *TINY_RUN, "--out", str(out_dir)],
        capture_output=True, text=True, timeout=120, env=environment, cwd=REPO_ROOT,
    )
    return completed, out_dir


def test_demo_exits_cleanly(demo_run: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    completed, _ = demo_run
    assert completed.returncode == 0, completed.stderr[-4000:]


def test_demo_reports_both_optimizers_and_muon_learns(
    demo_run: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    completed, _ = demo_run
    summary = {match["name"]: match for match in SUMMARY_LINE.finditer(completed.stdout)}
    assert set(summary) == {"muon", "adamw"}, completed.stdout
    # Same initial weights and same evaluation batches, so both runs must start from the same measured loss.
    assert summary["muon"]["train_start"] == summary["adamw"]["train_start"]
    # An untrained model predicts close to uniformly over the characters, about ln(64) = 4.16 nats; 8 Muon steps
    # at the demo's learning rate take well over 0.3 nats off it (about 0.9 measured), so a 0.1 drop is a margin
    # that only a Muon that fails to learn would miss.
    assert float(summary["muon"]["train_end"]) < float(summary["muon"]["train_start"]) - 0.1, completed.stdout


def test_demo_progress_is_one_line_per_run_in_a_log(demo_run: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    # Captured output is not a terminal, as in CI, where a log viewer shows each redraw as a line: each run's bar
    # draws when it starts and when it ends, and around each of its --evals progress messages; never once per step.
    completed, _ = demo_run
    evals = int(TINY_RUN[TINY_RUN.index("--evals") + 1])
    for name in ("muon", "adamw"):
        draws = re.findall(rf"^{name}:", completed.stderr, re.MULTILINE)  # text mode turned each \r into a \n
        assert 1 <= len(draws) <= 2 + 2 * evals, completed.stderr[-2000:]


def test_demo_writes_a_png(demo_run: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    completed, out_dir = demo_run
    png = out_dir / "loss_curves.png"
    assert str(png) in completed.stdout
    assert png.read_bytes()[:8] == PNG_SIGNATURE
    # A signature alone could front a truncated file; a full decode proves the image is whole.
    height, width, _channels = matplotlib.image.imread(png).shape
    assert height > 100 and width > 100


def test_demo_under_fsdp2_follows_the_single_process_run(
    demo_run: tuple[subprocess.CompletedProcess[str], Path], tmp_path: Path,
) -> None:
    """`torchrun ... --fsdp` over 2 gloo ranks: each rank trains on half of every batch and FSDP2 averages the
    gradients, so the losses rank 0 reports follow the single-process run on the same batches."""
    out_dir = tmp_path / "fsdp_out"
    environment = {**os.environ, "HF_HUB_OFFLINE": "1"}
    completed = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(DEMO), "--fsdp",
         *TINY_RUN, "--out", str(out_dir)],
        capture_output=True, text=True, timeout=120, env=environment, cwd=REPO_ROOT,
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    assert "FSDP2 over 2 ranks" in completed.stdout
    assert (out_dir / "loss_curves.png").read_bytes()[:8] == PNG_SIGNATURE
    sharded = {match["name"]: match for match in SUMMARY_LINE.finditer(completed.stdout)}
    single = {match["name"]: match for match in SUMMARY_LINE.finditer(demo_run[0].stdout)}
    assert set(sharded) == {"muon", "adamw"}, completed.stdout
    for name in ("muon", "adamw"):
        # Same start: the same weights evaluated on the same batches (only summation order differs).
        assert abs(float(sharded[name]["train_start"]) - float(single[name]["train_start"])) < 1e-3
        # Muon's distributed step sends momentum and updates in bfloat16 (relative rounding 2^-9, ~0.2%), and the
        # halves' gradients are summed in another order; after 8 steps that moves the loss by far less than the
        # ~0.9 nats the run learns (we measured 1e-4 after 3 steps). A run that dropped a rank's gradients or
        # skipped updates would end tenths of a nat away: 0.05 separates the two.
        assert abs(float(sharded[name]["train_end"]) - float(single[name]["train_end"])) < 0.05, (
            completed.stdout, demo_run[0].stdout)
