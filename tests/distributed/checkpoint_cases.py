"""Resharding checkpoints: FSDP2 training with Muon saved by torch.distributed.checkpoint on 4 ranks, loaded on 2
ranks (spawned) and on 1 process (no process group), then trained on. Every run is compared with one device
training the same global batches without a restart, so a lost or misplaced momentum buffer, AdamW moment, second
moment (NorMuon's, sharded with its parameter) or step count shows as a parameter mismatch."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from functools import partial

from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from distributed_cases import FP32_ATOL, OPTIONS, TRAINED_BF16_ATOL, Muon, assert_matches
from spawning import shared_dir

STEPS_BEFORE_SAVE = 2
STEPS_AFTER_LOAD = 2
GLOBAL_BATCH = 8  # divides over 1, 2 and 4 ranks: each rank's mean loss averages to the global mean
# Each variant's extra options and its tolerance against the uninterrupted run. bfloat16 and 8-bit state are rounded
# with random bits drawn per entry of the whole tensor, so the sharded, resharded and single-device runs store the
# same moments, but for an entry that straddles a rounding threshold: FSDP's gradients are averaged in another order
# than one device's, so such an entry may round the other way (we measured no such entry here; the tolerance allows
# for one on another machine). The reload itself is checked bit for bit.
VARIANTS: dict[str, tuple[dict, float]] = {
    "": ({}, FP32_ATOL),
    "_neuron_normalization": (dict(normalization="neuron"), FP32_ATOL),
    "_bf16_state": (dict(state_dtype=torch.bfloat16), TRAINED_BF16_ATOL),
    "_int8_state": (dict(state_dtype="int8"), TRAINED_BF16_ATOL),
}
# Each variant's moments as saved, key and dtype: 8-bit codes under keys of their own ("int8" keeps the biases'
# moments in bfloat16).
SAVED_KEYS = ("momentum_buffer", "momentum_buffer_codes", "exp_avg", "exp_avg_codes")
SAVED_FORMS = {"_bf16_state": {("momentum_buffer", torch.bfloat16), ("exp_avg", torch.bfloat16)},
               "_int8_state": {("momentum_buffer_codes", torch.int8), ("exp_avg", torch.bfloat16)}}


def small_mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 10), nn.Tanh(), nn.Linear(10, 3), nn.Tanh(), nn.Linear(3, 8))


def _sharded(model: nn.Module) -> nn.Module:
    """FSDP2 over every rank: (10, 16) over 4 ranks is 3, 3, 3, 1 rows; (3, 10) leaves one rank empty."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model[::2]:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def train_steps(model: nn.Module, optimizer: Muon, steps: range, rank: int, world: int) -> None:
    per_rank = GLOBAL_BATCH // world
    for step in steps:
        batch = torch.randn(GLOBAL_BATCH, 16, generator=torch.Generator().manual_seed(600 + step))
        model(batch[rank * per_rank:(rank + 1) * per_rank]).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def uninterrupted(steps: int, variant: str) -> nn.Module:
    """The truth: one device, the whole batch, no checkpoint."""
    model = small_mlp(seed=0)
    train_steps(model, Muon(model.parameters(), **OPTIONS, **VARIANTS[variant][0]), range(steps), rank=0, world=1)
    return model


def _checkpoint_path(variant: str) -> str:
    return str(shared_dir() / f"muon_checkpoint{variant}")


def muon_for(model: nn.Module, variant: str) -> Muon:
    return Muon(model.parameters(), **OPTIONS, comm_dtype=torch.float32, **VARIANTS[variant][0])


def save_case(variant: str) -> None:
    """Trains on 4 ranks, saves, trains on without a restart (matching the uninterrupted run as a baseline)."""
    model = _sharded(small_mlp(seed=0))
    optimizer = muon_for(model, variant)
    rank, world = dist.get_rank(), dist.get_world_size()
    train_steps(model, optimizer, range(STEPS_BEFORE_SAVE), rank, world)
    model_state, optimizer_state = get_state_dict(model, optimizer)
    states = list(optimizer_state["state"].values())
    momentum = [state[key] for state in states for key in ("momentum_buffer", "momentum_buffer_codes") if key in state]
    assert momentum and all(hasattr(buffer, "placements") for buffer in momentum)  # saved as DTensors
    moments = [state["update_sq"] for state in states if "update_sq" in state]
    assert len(moments) == (len(momentum) if "normalization" in VARIANTS[variant][0] else 0)
    assert all(hasattr(moment, "placements") for moment in moments)
    saved_dtypes = {(key, state[key].dtype) for state in states for key in SAVED_KEYS if key in state}
    assert saved_dtypes == SAVED_FORMS.get(variant, {("momentum_buffer", torch.float32), ("exp_avg", torch.float32)})
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=_checkpoint_path(variant))
    saved = _whole_state(optimizer_state)  # every rank takes part in gathering the shards
    if rank == 0:
        torch.save(saved, f"{_checkpoint_path(variant)}.whole.pt")
    train_steps(model, optimizer, range(STEPS_BEFORE_SAVE, STEPS_BEFORE_SAVE + STEPS_AFTER_LOAD), rank, world)
    _assert_matches_uninterrupted(model, variant)


def _whole_state(optimizer_state: dict) -> dict[str, dict[str, torch.Tensor]]:
    """Each parameter's state tensors, whole (gathered from the shards)."""
    return {name: {key: (value.full_tensor() if isinstance(value, DTensor) else value).clone()
                   for key, value in state.items() if isinstance(value, torch.Tensor)}
            for name, state in optimizer_state["state"].items()}


def _assert_matches_uninterrupted(model: nn.Module, variant: str) -> None:
    truth = uninterrupted(STEPS_BEFORE_SAVE + STEPS_AFTER_LOAD, variant)
    assert_matches(list(model.parameters()), list(truth.parameters()), VARIANTS[variant][1])


def load_and_continue(model: nn.Module, rank: int, world: int, variant: str) -> None:
    """Loads the 4-rank checkpoint into `model` (another seed: only the checkpoint can make it right) and a fresh
    Muon, trains on, and compares with the uninterrupted run."""
    optimizer = muon_for(model, variant)
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=_checkpoint_path(variant))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    # Loaded bit for bit, in the dtypes saved (8-bit codes and their scales, bfloat16 moments, counts).
    loaded = _whole_state(get_state_dict(model, optimizer)[1])
    saved = torch.load(f"{_checkpoint_path(variant)}.whole.pt")
    assert loaded.keys() == saved.keys()
    for name, entries in saved.items():
        assert loaded[name].keys() == entries.keys(), name
        for key, value in entries.items():
            assert loaded[name][key].dtype == value.dtype and torch.equal(loaded[name][key], value), (name, key)
    train_steps(model, optimizer, range(STEPS_BEFORE_SAVE, STEPS_BEFORE_SAVE + STEPS_AFTER_LOAD), rank, world)
    _assert_matches_uninterrupted(model, variant)


def load_case(variant: str) -> None:
    load_and_continue(_sharded(small_mlp(seed=1)), dist.get_rank(), dist.get_world_size(), variant)


def load_on_one_process(variant: str) -> None:
    """No process group at all: plain tensors, single-device Muon."""
    load_and_continue(small_mlp(seed=1), rank=0, world=1, variant=variant)


def cases_for(world: int) -> dict:
    if world == 4:
        return {f"checkpoint_save_on_4_ranks{variant}": partial(save_case, variant) for variant in VARIANTS}
    if world == 2:
        return {f"checkpoint_load_on_2_ranks{variant}": partial(load_case, variant) for variant in VARIANTS}
    return {}
