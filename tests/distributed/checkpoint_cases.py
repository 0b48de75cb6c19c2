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

from distributed_cases import FP32_ATOL, OPTIONS, Muon, assert_matches
from spawning import shared_dir

STEPS_BEFORE_SAVE = 2
STEPS_AFTER_LOAD = 2
GLOBAL_BATCH = 8  # divides over 1, 2 and 4 ranks: each rank's mean loss averages to the global mean
NORMALIZATIONS = (None, "neuron")


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 10), nn.Tanh(), nn.Linear(10, 3), nn.Tanh(), nn.Linear(3, 8))


def _sharded(model: nn.Module) -> nn.Module:
    """FSDP2 over every rank: (10, 16) over 4 ranks is 3, 3, 3, 1 rows; (3, 10) leaves one rank empty."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model[::2]:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _train(model: nn.Module, optimizer: Muon, steps: range, rank: int, world: int) -> None:
    per_rank = GLOBAL_BATCH // world
    for step in steps:
        batch = torch.randn(GLOBAL_BATCH, 16, generator=torch.Generator().manual_seed(600 + step))
        model(batch[rank * per_rank:(rank + 1) * per_rank]).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def _uninterrupted(steps: int, normalization: str | None) -> nn.Module:
    """The truth: one device, the whole batch, no checkpoint."""
    model = _model(seed=0)
    _train(model, Muon(model.parameters(), **OPTIONS, normalization=normalization), range(steps), rank=0, world=1)
    return model


def _checkpoint_path(normalization: str | None) -> str:
    return str(shared_dir() / f"muon_checkpoint_{normalization}")


def save_case(normalization: str | None) -> None:
    """Trains on 4 ranks, saves, trains on without a restart (matching the uninterrupted run as a baseline)."""
    model = _sharded(_model(seed=0))
    optimizer = Muon(model.parameters(), **OPTIONS, comm_dtype=torch.float32, normalization=normalization)
    rank, world = dist.get_rank(), dist.get_world_size()
    _train(model, optimizer, range(STEPS_BEFORE_SAVE), rank, world)
    model_state, optimizer_state = get_state_dict(model, optimizer)
    momentum = [state["momentum_buffer"] for state in optimizer_state["state"].values() if "momentum_buffer" in state]
    assert momentum and all(hasattr(buffer, "placements") for buffer in momentum)  # saved as DTensors
    moments = [state["update_sq"] for state in optimizer_state["state"].values() if "update_sq" in state]
    assert len(moments) == (len(momentum) if normalization else 0)
    assert all(hasattr(moment, "placements") for moment in moments)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=_checkpoint_path(normalization))
    _train(model, optimizer, range(STEPS_BEFORE_SAVE, STEPS_BEFORE_SAVE + STEPS_AFTER_LOAD), rank, world)
    _assert_matches_uninterrupted(model, normalization)


def _assert_matches_uninterrupted(model: nn.Module, normalization: str | None) -> None:
    truth = _uninterrupted(STEPS_BEFORE_SAVE + STEPS_AFTER_LOAD, normalization)
    assert_matches(list(model.parameters()), list(truth.parameters()), FP32_ATOL)


def load_and_continue(model: nn.Module, rank: int, world: int, normalization: str | None) -> None:
    """Loads the 4-rank checkpoint into `model` (another seed: only the checkpoint can make it right) and a fresh
    Muon, trains on, and compares with the uninterrupted run."""
    optimizer = Muon(model.parameters(), **OPTIONS, comm_dtype=torch.float32, normalization=normalization)
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=_checkpoint_path(normalization))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    _train(model, optimizer, range(STEPS_BEFORE_SAVE, STEPS_BEFORE_SAVE + STEPS_AFTER_LOAD), rank, world)
    _assert_matches_uninterrupted(model, normalization)


def load_case(normalization: str | None) -> None:
    load_and_continue(_sharded(_model(seed=1)), dist.get_rank(), dist.get_world_size(), normalization)


def load_on_one_process(normalization: str | None) -> None:
    """No process group at all: plain tensors, single-device Muon."""
    load_and_continue(_model(seed=1), rank=0, world=1, normalization=normalization)


def case_suffix(normalization: str | None) -> str:
    return "" if normalization is None else f"_{normalization}_normalization"


def cases_for(world: int) -> dict:
    if world == 4:
        return {f"checkpoint_save_on_4_ranks{case_suffix(n)}": partial(save_case, n) for n in NORMALIZATIONS}
    if world == 2:
        return {f"checkpoint_load_on_2_ranks{case_suffix(n)}": partial(load_case, n) for n in NORMALIZATIONS}
    return {}
