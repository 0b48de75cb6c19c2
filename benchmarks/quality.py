"""`make quality`: a fair comparison of AdamW and the Muon variants on the demo GPT (examples/train_gpt.py).

Every optimizer gets the same learning-rate grid (log-spaced, factor 2; Muon's lr is on AdamW's scale because
"match_rms_adamw" gives its updates AdamW's RMS), the same seeds (weights and batches), the same warmup-stable-decay
schedule and weight decay. Each optimizer's best lr is the one with the lowest final held-out loss averaged over the
seeds; for it we report that loss, the first evaluated step at which its seed-averaged held-out loss reaches AdamW's
best final loss, and the wall time of a run. Writes benchmarks/results/quality-<machine>-<date>.md and .png; every
finished run is appended to a .jsonl beside them first, so an interrupted sweep keeps what it measured and resumes.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import io
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "examples"))
import train_gpt  # noqa: E402  (the demo: its model, data, schedule and training loop)
from bench import cpu_model  # noqa: E402

RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
# name -> Muon options beyond the demo's (None: torch.optim.AdamW, the baseline).
VARIANTS: dict[str, dict | None] = {
    "adamw": None,
    "muon": {},
    "muon-aol": {"preconditioner": "aol", "ns_steps": 4},
    "normuon": {"normalization": "neuron"},
    "adamuon": {"normalization": "element"},
    "muon-bf16-state": {"state_dtype": torch.bfloat16},
    "muon-int8-state": {"state_dtype": "int8"},
}


def make_optimizer(package, variant: str, lr: float, weight_decay: float) -> Callable[[torch.nn.Module], object]:
    options = VARIANTS[variant]
    if options is None:
        return lambda model: torch.optim.AdamW(train_gpt.adamw_param_groups(model, weight_decay), lr=lr,
                                               betas=(0.9, 0.95), eps=1e-8)
    return lambda model: package.Muon(package.muon_param_groups(model), lr=lr, weight_decay=weight_decay, **options)


def run_one(package, args: argparse.Namespace, variant: str, lr: float, seed: int) -> dict:
    demo_args = train_gpt.parse_args(["--steps", str(args.steps), "--evals", str(args.evals), "--seed", str(seed),
                                      "--device", "cpu"])
    corpus = train_gpt.load_corpus(demo_args.text, demo_args.val_fraction)
    config = train_gpt.GPTConfig(corpus.vocab_size, demo_args.block_size, demo_args.n_layer, demo_args.n_head,
                                 demo_args.n_embd)
    torch.manual_seed(seed)
    model = train_gpt.GPT(config)
    batches = train_gpt.draw_batches(corpus, demo_args)
    ranks = train_gpt.Ranks()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        history = train_gpt.train(variant, copy.deepcopy(model), make_optimizer(package, variant, lr,
                                                                                demo_args.weight_decay),
                                  corpus, batches, demo_args, torch.device("cpu"), ranks)
    return dict(variant=variant, lr=lr, seed=seed, steps=args.steps, checkpoints=history.checkpoints,
                val_losses=history.val_losses, seconds=history.seconds)


def mean_curve(runs: list[dict]) -> list[float]:
    return [statistics.mean(values) for values in zip(*(run["val_losses"] for run in runs))]


def best_lr(runs: list[dict], variant: str) -> float:
    by_lr: dict[float, list[dict]] = {}
    for run in runs:
        if run["variant"] == variant:
            by_lr.setdefault(run["lr"], []).append(run)
    return min(by_lr, key=lambda lr: mean_curve(by_lr[lr])[-1])


def summarize(runs: list[dict], grid: list[float], seeds: list[int]) -> tuple[list[str], dict[str, list[dict]]]:
    variants = [name for name in VARIANTS if any(run["variant"] == name for run in runs)]
    best_runs = {}
    for variant in variants:
        lr = best_lr(runs, variant)
        best_runs[variant] = [run for run in runs if run["variant"] == variant and run["lr"] == lr]
    target = mean_curve(best_runs["adamw"])[-1] if "adamw" in best_runs else None
    lines = ["| optimizer | best lr | final held-out loss (mean of seeds) | per-lr final held-out | "
             "first step at AdamW's best final loss | wall time per run |",
             "| --- | --- | --- | --- | --- | --- |"]
    for variant in variants:
        chosen = best_runs[variant]
        curve = mean_curve(chosen)
        per_lr = []
        for lr in grid:
            at_lr = [run for run in runs if run["variant"] == variant and run["lr"] == lr]
            per_lr.append(f"{lr:g}: {mean_curve(at_lr)[-1]:.3f}" if at_lr else f"{lr:g}: -")
        reached = "-"
        if target is not None:
            hits = [step for step, loss in zip(chosen[0]["checkpoints"], curve) if loss <= target]
            steps = chosen[0]["steps"]
            reached = f"{hits[0]} ({hits[0] / steps:.0%} of {steps})" if hits else f"not within {steps}"
        seconds = statistics.mean(run["seconds"] for run in chosen)
        lines.append(f"| {variant} | {chosen[0]['lr']:g} | {curve[-1]:.4f} (seeds {len(chosen)}/{len(seeds)}) | "
                     f"{'; '.join(per_lr)} | {reached} | {seconds:.1f} s |")
    return lines, best_runs


def plot(best_runs: dict[str, list[dict]], path: Path, title: str) -> None:
    figure, axes = plt.subplots(figsize=(7, 4.2))
    for variant, chosen in best_runs.items():
        axes.plot(chosen[0]["checkpoints"], mean_curve(chosen), "o-", label=f"{variant} (lr {chosen[0]['lr']:g})")
    axes.set(title=title, xlabel="step", ylabel="held-out cross-entropy (nats/char), mean of seeds")
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {list(VARIANTS)}")
    # 1.25e-3 to 4e-2: AdamW's best on this demo lies near the low end and Muon's in the middle, each with a point on
    # either side (a grid starting at 2.5e-3 left AdamW's best at its edge).
    parser.add_argument("--lr-min", type=float, default=1.25e-3, help="the grid's smallest lr")
    parser.add_argument("--points", type=int, default=6, help="lr grid points, each 2x the previous")
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps per run (the demo's)")
    parser.add_argument("--evals", type=int, default=10, help="held-out evaluations per run")
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    package = train_gpt.get_local_kernel(REPO_ROOT / "build")
    grid = [args.lr_min * 2 ** k for k in range(args.points)]
    seeds = list(range(args.seeds))
    machine = f"{cpu_model()}, {torch.get_num_threads()} threads"
    slug = "".join(ch if ch.isalnum() else "-" for ch in machine.lower()).strip("-")
    stem = f"quality-{slug}-{args.steps}steps-{datetime.date.today().isoformat()}"
    args.results_dir.mkdir(parents=True, exist_ok=True)
    log = args.results_dir / f"{stem}.jsonl"
    runs = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    done = {(run["variant"], run["lr"], run["seed"]) for run in runs}
    for variant in args.variants.split(","):
        if variant not in VARIANTS:
            raise ValueError(f"Invalid variant: {variant!r} (expected one of {list(VARIANTS)})")
        for lr in grid:
            for seed in seeds:
                if (variant, lr, seed) in done:
                    continue
                run = run_one(package, args, variant, lr, seed)
                runs.append(run)
                with log.open("a") as file:
                    file.write(json.dumps(run) + "\n")
                print(f"{variant:>9} lr {lr:<8g} seed {seed}: final held-out {run['val_losses'][-1]:.4f} "
                      f"({run['seconds']:.0f} s)", flush=True)
    lines, best_runs = summarize(runs, grid, seeds)
    title = f"demo GPT, {args.steps} steps, best lr of {len(grid)} per optimizer"
    plot(best_runs, args.results_dir / f"{stem}.png", title)
    header = (f"# Quality: {title}\n\n{machine}, torch {torch.__version__}, {datetime.date.today().isoformat()}; "
              f"lr grid {', '.join(f'{lr:g}' for lr in grid)}; seeds {seeds}.\n\n")
    (args.results_dir / f"{stem}.md").write_text(header + "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
