"""Train a small character-level GPT on Macbeth twice, once with Muon and once with AdamW, and compare.

The `optimizer` package is loaded the way a Hub user loads it, through `kernels`, from the build that
`make build` writes into this repository's `build/`. Both runs start from the same weights and see the same
batches in the same order, so the loss curves differ only by the optimizer.

    python examples/train_gpt.py                 # defaults: about 2 minutes on 2 CPU cores
    python examples/train_gpt.py --steps 2000 --device cuda
    torchrun --standalone --nproc-per-node=4 examples/train_gpt.py --fsdp   # FSDP2 over 4 processes (gloo on CPUs,
                                                                            # NCCL on GPUs); rank 0 reports
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import matplotlib

matplotlib.use("Agg")  # no display on servers and CI; must precede the pyplot import
import matplotlib.pyplot as plt
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from kernels import get_local_kernel
from tqdm import tqdm

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TEXT = REPO_ROOT / "examples" / "data" / "macbeth.txt"
DEFAULT_OUT = REPO_ROOT / "examples" / "out"


# ---------------------------------------------------------------------------------------------------------------
# Data: one character is one token.
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class CharCorpus:
    train: torch.Tensor
    val: torch.Tensor
    vocab_size: int


def load_corpus(path: Path, val_fraction: float) -> CharCorpus:
    # The file's first line describes the file; it is not part of the play.
    _, text = path.read_text(encoding="utf-8").split("\n", 1)
    alphabet = sorted(set(text))
    index = {char: i for i, char in enumerate(alphabet)}
    tokens = torch.tensor([index[char] for char in text], dtype=torch.long)
    # The held-out part is the play's end, so it shares no passage with the training text.
    n_train = int(len(tokens) * (1.0 - val_fraction))
    return CharCorpus(train=tokens[:n_train], val=tokens[n_train:], vocab_size=len(alphabet))


def sample_windows(n_tokens: int, block_size: int, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """Start positions of random windows of block_size + 1 tokens (inputs plus the next-token targets)."""
    if n_tokens <= block_size + 1:
        raise ValueError(f"block_size {block_size} does not fit in a text split of {n_tokens} tokens")
    return torch.randint(0, n_tokens - block_size - 1, shape, generator=generator)


def windows_to_batch(tokens: torch.Tensor, starts: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    window = tokens[starts[:, None] + torch.arange(block_size + 1)]
    return window[:, :-1], window[:, 1:]


# ---------------------------------------------------------------------------------------------------------------
# Model: a pre-norm GPT.
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class GPTConfig:
    vocab_size: int
    block_size: int
    n_layer: int
    n_head: int
    n_embd: int


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        if config.n_embd % config.n_head:
            raise ValueError(f"n_embd {config.n_embd} is not divisible by n_head {config.n_head}")
        self.n_head = config.n_head
        # Separate square projections rather than one fused qkv matrix: Muon orthogonalizes each matrix as a whole,
        # and Q, K and V are different linear maps.
        self.query = nn.Linear(config.n_embd, config.n_embd, bias=False)
        self.key = nn.Linear(config.n_embd, config.n_embd, bias=False)
        self.value = nn.Linear(config.n_embd, config.n_embd, bias=False)
        self.out = nn.Linear(config.n_embd, config.n_embd, bias=False)

    def split_heads(self, x: torch.Tensor) -> torch.Tensor:
        batch, time_, channels = x.shape
        return x.view(batch, time_, self.n_head, channels // self.n_head).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (self.split_heads(projection(x)) for projection in (self.query, self.key, self.value))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(attended.transpose(1, 2).reshape(x.shape))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.up = nn.Linear(config.n_embd, 4 * config.n_embd, bias=False)
        self.down = nn.Linear(4 * config.n_embd, config.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.mlp_norm = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.token_embedding = nn.Embedding(config.vocab_size, config.n_embd)
        self.position_embedding = nn.Embedding(config.block_size, config.n_embd)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.final_norm = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.apply(self.init_weights)

    @staticmethod
    def init_weights(module: nn.Module) -> None:
        # GPT-2's initialization; PyTorch's default Embedding init (std 1) makes the first losses needlessly large.
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.token_embedding(tokens) + self.position_embedding(positions)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.final_norm(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


# ---------------------------------------------------------------------------------------------------------------
# Processes: one, or torchrun's ranks with the model sharded by FSDP2.
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Ranks:
    """This process's place in the run. Under FSDP2 every rank trains on its slice of each batch; FSDP2 averages
    the gradients, so the run follows the same trajectory as one process on the whole batch."""

    rank: int = 0
    world: int = 1
    mesh: DeviceMesh | None = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def say(self, text: str) -> None:
        if self.is_main:
            print(text, flush=True)

    def my_rows(self, rows: torch.Tensor) -> torch.Tensor:
        per_rank = len(rows) // self.world
        return rows[self.rank * per_rank:(self.rank + 1) * per_rank]

    def mean(self, value: torch.Tensor) -> float:
        """The mean over ranks (the whole batch's loss), on every rank."""
        if self.world > 1:
            value = value.detach().clone()
            dist.all_reduce(value)  # SUM: gloo has no AVG
            value /= self.world
        return value.item()

    def shard(self, model: nn.Module) -> nn.Module:
        """FSDP2: each block is one unit (its parameters are gathered for its forward and backward only), and the
        root takes the embeddings, the final norm and the head."""
        if self.mesh is not None:
            for block in model.blocks:
                fully_shard(block, mesh=self.mesh)
            fully_shard(model, mesh=self.mesh)
        return model


def start_ranks(args: argparse.Namespace) -> tuple[Ranks, torch.device]:
    if not args.fsdp:
        return Ranks(), resolve_device(args.device)
    if "LOCAL_RANK" not in os.environ:
        raise SystemExit("--fsdp runs under torchrun: torchrun --standalone --nproc-per-node=N "
                         "examples/train_gpt.py --fsdp")
    local_rank = int(os.environ["LOCAL_RANK"])
    device = resolve_device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    ranks = Ranks(dist.get_rank(), dist.get_world_size(), init_device_mesh(device.type, (dist.get_world_size(),)))
    if args.batch_size % ranks.world:
        raise SystemExit(f"--batch-size {args.batch_size} must be divisible by the {ranks.world} ranks")
    return ranks, device


# ---------------------------------------------------------------------------------------------------------------
# Training: one function runs either optimizer on identical data.
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class RunHistory:
    name: str
    step_losses: list[float] = field(default_factory=list)
    checkpoints: list[int] = field(default_factory=list)
    train_losses: list[float] = field(default_factory=list)
    val_losses: list[float] = field(default_factory=list)
    seconds: float = 0.0


@dataclass
class Batches:
    """Everything random about the data, drawn once so that both runs see exactly the same tokens."""

    train_starts: torch.Tensor  # (steps, batch_size)
    eval_train_starts: torch.Tensor  # (eval_batches, batch_size)
    eval_val_starts: torch.Tensor  # (eval_batches, batch_size)


def draw_batches(corpus: CharCorpus, args: argparse.Namespace) -> Batches:
    generator = torch.Generator().manual_seed(args.seed)
    eval_shape = (args.eval_batches, args.batch_size)
    # Evaluation windows first, so that they stay the same when only --steps changes.
    eval_train_starts = sample_windows(len(corpus.train), args.block_size, eval_shape, generator)
    eval_val_starts = sample_windows(len(corpus.val), args.block_size, eval_shape, generator)
    train_starts = sample_windows(len(corpus.train), args.block_size, (args.steps, args.batch_size), generator)
    return Batches(train_starts, eval_train_starts, eval_val_starts)


@torch.no_grad()
def mean_loss(model: GPT, tokens: torch.Tensor, starts: torch.Tensor, device: torch.device) -> float:
    model.eval()
    losses = [model(*(t.to(device) for t in windows_to_batch(tokens, s, model.config.block_size))) for s in starts]
    model.train()
    return torch.stack(losses).mean().item()


def lr_factor(step: int, total_steps: int, warmup_steps: int, cooldown_steps: int) -> float:
    """Linear warmup, a flat middle, and a linear cooldown towards zero (warmup-stable-decay)."""
    return min(1.0, (step + 1) / max(1, warmup_steps), (total_steps - step) / max(1, cooldown_steps))


def checkpoint_steps(total_steps: int, evals: int) -> set[int]:
    """Steps after which losses are measured; 0 means before any update."""
    return {round(i * total_steps / evals) for i in range(evals + 1)}


def train(
    name: str,
    model: GPT,
    make_optimizer: Callable[[GPT], torch.optim.Optimizer],
    corpus: CharCorpus,
    batches: Batches,
    args: argparse.Namespace,
    device: torch.device,
    ranks: Ranks,
) -> RunHistory:
    history = RunHistory(name)
    optimizer = make_optimizer(model)
    warmup, cooldown = round(args.warmup_fraction * args.steps), round(args.cooldown_fraction * args.steps)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, args.steps, warmup, cooldown))
    checkpoints = checkpoint_steps(args.steps, args.evals)

    def record_checkpoint(step: int) -> None:
        train_loss = mean_loss(model, corpus.train, batches.eval_train_starts, device)
        val_loss = mean_loss(model, corpus.val, batches.eval_val_starts, device)
        history.checkpoints.append(step)
        history.train_losses.append(train_loss)
        history.val_losses.append(val_loss)
        if ranks.is_main:
            tqdm.write(f"[{name:>5}] step {step:>5}/{args.steps}  train loss {train_loss:.4f}  "
                       f"held-out loss {val_loss:.4f}")

    started = time.perf_counter()
    record_checkpoint(0)
    # Written to a log rather than a terminal, each redraw is one more line: there the bar draws when it starts and
    # when it ends, one line per run.
    redraw_interval_s = 0.1 if sys.stderr.isatty() else math.inf
    progress = tqdm(range(args.steps), desc=name, unit="step", dynamic_ncols=True, mininterval=redraw_interval_s,
                    disable=not ranks.is_main)
    for step in progress:
        inputs, targets = windows_to_batch(corpus.train, ranks.my_rows(batches.train_starts[step]), args.block_size)
        loss = model(inputs.to(device), targets.to(device))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        history.step_losses.append(ranks.mean(loss.detach()))
        progress.set_postfix(loss=f"{history.step_losses[-1]:.3f}", refresh=False)  # drawn at the next redraw
        if step + 1 in checkpoints:
            record_checkpoint(step + 1)
    progress.close()
    history.seconds = time.perf_counter() - started
    return history


def adamw_param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    # The usual GPT recipe: decay matrices and embeddings, not the norms' gains and biases.
    matrices = [p for p in model.parameters() if p.ndim >= 2]
    vectors = [p for p in model.parameters() if p.ndim < 2]
    return [{"params": matrices, "weight_decay": weight_decay}, {"params": vectors, "weight_decay": 0.0}]


# ---------------------------------------------------------------------------------------------------------------
# Reporting.
# ---------------------------------------------------------------------------------------------------------------


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing mean, so the per-batch curve shows a trend rather than batch-to-batch noise."""
    cumulative = [0.0]
    for value in values:
        cumulative.append(cumulative[-1] + value)
    return [(cumulative[i + 1] - cumulative[max(0, i + 1 - window)]) / min(i + 1, window) for i in range(len(values))]


def plot_histories(histories: list[RunHistory], path: Path, title: str) -> None:
    figure, (per_batch, held_out) = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    window = max(1, len(histories[0].step_losses) // 25)
    for history in histories:
        steps = range(1, len(history.step_losses) + 1)
        (line,) = per_batch.plot(steps, smooth(history.step_losses, window), label=history.name)
        color = line.get_color()
        held_out.plot(history.checkpoints, history.val_losses, "o-", color=color, label=f"{history.name} held-out")
        held_out.plot(history.checkpoints, history.train_losses, "x--", color=color, alpha=0.6,
                      label=f"{history.name} train")
    per_batch.set(title=f"training batches (trailing mean of {window})", xlabel="step",
                  ylabel="cross-entropy (nats/char)")
    held_out.set(title="fixed evaluation batches", xlabel="step")
    for axes in (per_batch, held_out):
        axes.grid(alpha=0.3)
        axes.legend()
    figure.suptitle(title)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)


def print_summary(histories: list[RunHistory]) -> None:
    print("\nsummary (cross-entropy in nats per character; lower is better)")
    for history in histories:
        print(
            f"  {history.name:<5}  train {history.train_losses[0]:.4f} -> {history.train_losses[-1]:.4f}"
            f"   held-out {history.val_losses[0]:.4f} -> {history.val_losses[-1]:.4f}   {history.seconds:.1f} s"
        )
    best = min(histories, key=lambda history: history.val_losses[-1])
    print(f"  lowest final held-out loss: {best.name}")


def describe_routing(muon: torch.optim.Optimizer) -> str:
    counts = {True: [0, 0], False: [0, 0]}  # use_muon -> [tensors, elements]
    for group in muon.param_groups:
        tally = counts[bool(group.get("use_muon"))]
        tally[0] += len(group["params"])
        tally[1] += sum(p.numel() for p in group["params"])
    return (
        f"Muon orthogonalizes {counts[True][0]} matrices ({counts[True][1]:,} parameters); its AdamW trains the other "
        f"{counts[False][0]} tensors, embeddings, output head and norms ({counts[False][1]:,} parameters)"
    )


def describe_package(package: ModuleType) -> str:
    summary = getattr(package, "ops_summary", None)
    where = f"optimizer package loaded from {Path(package.__file__).parent}"
    return f"{where}\n{summary()}" if callable(summary) else where


# ---------------------------------------------------------------------------------------------------------------
# Entry point.
# ---------------------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps per run")
    parser.add_argument("--device", default="auto", help="'auto' (cuda if available, else cpu), 'cpu', 'cuda', ...")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="folder for loss_curves.png")
    parser.add_argument("--text", type=Path, default=DEFAULT_TEXT, help="plain-text corpus; its first line is skipped")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--block-size", type=int, default=128, help="context length in characters")
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=128)
    # Each lr default is the best of a 2x grid swept with all other defaults as they are (final held-out loss):
    # Muon 0.005 / 0.01 / 0.02 gave 1.825 / 1.782 / 1.809; AdamW 0.001 / 0.002 / 0.004 / 0.008 gave
    # 2.351 / 2.316 / 2.271 / 2.550. With adjust_lr_fn="match_rms_adamw" one Muon lr serves its matrices and its
    # AdamW-routed parameters alike. The warmup is AdamW's need: with 5% its loss spiked to 6 nats after warmup.
    parser.add_argument("--muon-lr", type=float, default=0.01, help="Muon's lr, for its matrices and its AdamW params")
    parser.add_argument("--adamw-lr", type=float, default=0.004, help="the AdamW baseline's lr")
    parser.add_argument("--weight-decay", type=float, default=0.1, help="the same for both runs")
    parser.add_argument("--warmup-fraction", type=float, default=0.15, help="the same schedule for both runs")
    parser.add_argument("--cooldown-fraction", type=float, default=0.3)
    parser.add_argument("--evals", type=int, default=6, help="loss measurements per run, after step 0")
    parser.add_argument("--eval-batches", type=int, default=8)
    parser.add_argument("--val-fraction", type=float, default=0.1)
    parser.add_argument("--fsdp", action="store_true", help="shard the model with FSDP2 over torchrun's processes")
    args = parser.parse_args(argv)
    for name in ("steps", "batch_size", "block_size", "n_layer", "n_head", "n_embd", "evals", "eval_batches"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    for name in ("warmup_fraction", "cooldown_fraction"):
        if not 0.0 <= getattr(args, name) <= 1.0:
            parser.error(f"--{name.replace('_', '-')} must be in [0, 1], got {getattr(args, name)}")
    if not 0.0 < args.val_fraction < 1.0:
        parser.error(f"--val-fraction must be in (0, 1), got {args.val_fraction}")
    return args


def resolve_device(requested: str) -> torch.device:
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(requested)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    ranks, device = start_ranks(args)
    try:
        run(args, ranks, device)
    finally:
        if ranks.mesh is not None:
            dist.destroy_process_group()


def run(args: argparse.Namespace, ranks: Ranks, device: torch.device) -> None:
    optimizer_package = get_local_kernel(REPO_ROOT)
    ranks.say(describe_package(optimizer_package))

    corpus = load_corpus(args.text, args.val_fraction)
    config = GPTConfig(corpus.vocab_size, args.block_size, args.n_layer, args.n_head, args.n_embd)
    torch.manual_seed(args.seed)
    initial_model = GPT(config).to(device)
    batches = draw_batches(corpus, args)
    n_params = sum(p.numel() for p in initial_model.parameters())
    where = f"{device}, FSDP2 over {ranks.world} ranks" if ranks.mesh else f"{device}"
    ranks.say(
        f"device {where}; text {args.text.name}: {len(corpus.train):,} training and {len(corpus.val):,} held-out "
        f"characters, vocabulary {corpus.vocab_size}; model {n_params:,} parameters; "
        f"{args.steps} steps of {args.batch_size}x{args.block_size} characters per run"
    )

    def make_muon(model: GPT) -> torch.optim.Optimizer:
        groups = optimizer_package.muon_param_groups(model)
        muon = optimizer_package.Muon(groups, lr=args.muon_lr, weight_decay=args.weight_decay)
        ranks.say(describe_routing(muon))
        return muon

    def make_adamw(model: GPT) -> torch.optim.Optimizer:
        groups = adamw_param_groups(model, args.weight_decay)
        return torch.optim.AdamW(groups, lr=args.adamw_lr, betas=(0.9, 0.95), eps=1e-8)

    histories = [
        train(name, ranks.shard(copy.deepcopy(initial_model)), make, corpus, batches, args, device, ranks)
        for name, make in (("muon", make_muon), ("adamw", make_adamw))
    ]
    if not ranks.is_main:
        return
    print_summary(histories)
    plot_path = args.out / "loss_curves.png"
    plot_histories(histories, plot_path, f"char-level GPT on {args.text.stem}, {n_params:,} parameters, {where}")
    print(f"loss curves written to {plot_path}")


if __name__ == "__main__":
    main()
