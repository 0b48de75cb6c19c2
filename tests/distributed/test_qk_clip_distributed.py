"""QK-clip on weights spread over 4 gloo ranks (DTensors sharded on rows, on columns, on 2D meshes (FSDP2 over TP's
strided rows too), and DDP-style
replicas) against QK-clip of plain copies on one device. Every rank passes the max logits of its own data; the
truth clips with the elementwise max over all ranks' logits, which is what the global batch would have measured.
This module is also the spawned workers' case module (`cases_for`)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from distributed_cases import LONE_STRIDED_SHARD_ACCEPTED, UNEVEN_STRIDED_SHARDS_PLACED
from spawning import run_cases

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for kernel_under_test in spawned workers
from kernel_under_test import optimizer, submodule  # noqa: E402

WORLD = 4
DEADLINE_S = 150  # spawning 4 workers costs ~17 s on 2 cores; the cases take a few seconds
# 6 query heads of 3 rows: 18 rows over 4 ranks split 5, 5, 5, 3, so heads straddle ranks; 2 KV heads: 6 rows split
# 2, 2, 2, 0 (an empty shard).
HEADS, KV_HEADS, HEAD_DIM, MODEL_DIM = 6, 2, 3, 8
THRESHOLD = 10.0


def _tensors(seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    shapes = [(HEADS * HEAD_DIM, MODEL_DIM), (KV_HEADS * HEAD_DIM, MODEL_DIM), (HEADS * HEAD_DIM,),
              (KV_HEADS * HEAD_DIM,)]
    return [torch.randn(shape, generator=generator) for shape in shapes]


def _logits(rank: int) -> torch.Tensor:
    """Rank-dependent logits around the threshold: which rank holds a head's maximum differs from head to head."""
    return torch.rand(HEADS, generator=torch.Generator().manual_seed(50 + rank)) * 2 * THRESHOLD


def _clip(params: Sequence[torch.Tensor], logits: torch.Tensor, **options) -> None:
    query, key, query_bias, key_bias = params
    layer = optimizer.QKClipLayer(query, key, HEADS, HEAD_DIM, num_kv_heads=KV_HEADS, query_bias=query_bias,
                                  key_bias=key_bias)
    # No gradients: the step only clips.
    optimizer.Muon(params, lr=0.1, qk_clip={"attn": layer}, qk_clip_threshold=THRESHOLD, **options).step(
        qk_logits={"attn": logits})


def _truth() -> list[torch.Tensor]:
    tensors = _tensors(seed=0)
    _clip(tensors, torch.stack([_logits(rank) for rank in range(WORLD)]).amax(dim=0))
    return tensors


def _assert_equal_to_truth(params: Sequence[torch.Tensor]) -> None:
    # The scales come from the same maxima and multiply the same fp32 values: the results are bit-identical.
    for index, (param, truth) in enumerate(zip(params, _truth())):
        mine = param.full_tensor() if isinstance(param, DTensor) else param
        assert torch.equal(mine, truth), f"tensor {index}: max error {(mine - truth).abs().max().item():.3g}"


def dtensor_case(mesh_shape: tuple[int, ...], placements: Sequence[Placement]) -> None:
    mesh = init_device_mesh("cpu", mesh_shape)
    params = []
    for tensor in _tensors(seed=0):  # a 1D bias cannot be Shard(1): it stays replicated on that mesh dim
        tensor_placements = [Replicate() if p == Shard(1) and tensor.ndim == 1 else p for p in placements]
        # Every rank made the same tensors; no scatter (DTensor's scatter needs even strided shards)
        params.append(distribute_tensor(tensor, mesh, tensor_placements, src_data_rank=None))
    _clip(params, _logits(dist.get_rank()))
    _assert_equal_to_truth(params)


def refused_strided_case() -> None:
    """On a torch taken for 2.9, whose DTensor misplaces FSDP2-over-TP rows in unequal strided runs (18 query rows
    in runs of 5, 4, 5, 4), the layer is refused when given, before any weight changes."""
    mesh = init_device_mesh("cpu", (2, 2))
    params = [distribute_tensor(tensor, mesh, [_StridedShard(0, split_factor=2), Shard(0)], src_data_rank=None)
              for tensor in _tensors(seed=0)]
    before = [param.to_local().clone() for param in params]
    qk_clip = submodule(optimizer, "qk_clip")
    on_torch_2_9 = partial(qk_clip.misplaced_strided_runs, version="2.9.1")
    with mock.patch.object(qk_clip, "misplaced_strided_runs", on_torch_2_9), pytest.raises(
            ValueError, match=r"Invalid qk_clip\['attn'\]\.query: shape \(18, 8\): .* into 4 unequal runs"):
        _clip(params, _logits(dist.get_rank()))
    assert all(torch.equal(param.to_local(), old) for param, old in zip(params, before))


def replicated_case() -> None:
    """DDP-style replicas: plain tensors, with the optimizer's process_group to agree on the logits."""
    params = _tensors(seed=0)
    _clip(params, _logits(dist.get_rank()), process_group=dist.group.WORLD)
    _assert_equal_to_truth(params)


def cases_for(world: int) -> dict[str, Callable[[], None]]:
    cases = {
        "shard0_1d": partial(dtensor_case, (world,), [Shard(0)]),
        "shard1_1d": partial(dtensor_case, (world,), [Shard(1)]),
        "mesh2x2_shard0_shard0": partial(dtensor_case, (2, 2), [Shard(0), Shard(0)]),
        "mesh2x2_replicate_shard0": partial(dtensor_case, (2, 2), [Replicate(), Shard(0)]),
        "mesh2x2_shard0_shard1": partial(dtensor_case, (2, 2), [Shard(0), Shard(1)]),
        "replicated_process_group": replicated_case,
        "uneven_strided_rows_on_torch_2_9_are_refused": refused_strided_case,
    }
    if UNEVEN_STRIDED_SHARDS_PLACED:  # torch 2.9 misplaces these rows, and the clip refuses them there
        # FSDP2 over tensor parallelism on the rows: rank (dp, tp) holds part dp of TP's row block tp, so the
        # ranks' rows are not in rank order.
        cases["mesh2x2_strided_shard0_shard0"] = partial(dtensor_case, (2, 2), [_StridedShard(0, split_factor=2),
                                                                                Shard(0)])
    if LONE_STRIDED_SHARD_ACCEPTED:  # each rank's rows are two runs, one in each half: not one slice
        cases["strided_shard0_1d"] = partial(dtensor_case, (world,), [_StridedShard(0, split_factor=2)])
    return cases


_outcomes: dict[str, str] = {}


@pytest.mark.parametrize("name", list(cases_for(WORLD)))
def test_qk_clip_distributed(name: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    if not _outcomes:
        out_dir = tmp_path_factory.mktemp("qk_clip_world4")
        _outcomes.update(run_cases(WORLD, "test_qk_clip_distributed", list(cases_for(WORLD)), out_dir, DEADLINE_S))
    assert _outcomes[name] == "ok", _outcomes[name]
