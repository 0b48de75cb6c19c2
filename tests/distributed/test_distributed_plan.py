"""The distributed step's bookkeeping, in plain Python (no processes): owner balance, shard boxes against
torch.chunk (DTensor's Shard semantics), and all-to-all plans that every pair of ranks agrees on."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from kernel_under_test import optimizer, submodule

assignment = submodule(optimizer, "distributed.assignment")
dtensors = submodule(optimizer, "distributed.dtensors")
layout_module = submodule(optimizer, "distributed.layout")
plan = submodule(optimizer, "distributed.plan")
routing = submodule(optimizer, "routing")
GRID_2X2 = (0, 1, 2, 3)  # group rank at mesh coordinates (0, 0), (0, 1), (1, 0), (1, 1)


def gpt_matrix_shapes(layers: int, width: int) -> list[tuple[int, int]]:
    """A GPT block's Muon matrices (nn.Linear weights are (out, in)): fused qkv, attention output, MLP in/out."""
    return [(3 * width, width), (width, width), (4 * width, width), (width, 4 * width)] * layers


def _works(shapes, world: int, dtype: torch.dtype = torch.bfloat16, device_type: str = "cuda") -> list:
    layouts = [layout_module.sharded_layout(shape, (world,), (Shard(0),), tuple(range(world))) for shape in shapes]
    return [assignment.work_of(routing.matrix_view(torch.Size(shape)), layout, 5, "auto", dtype, device_type)
            for shape, layout in zip(shapes, layouts)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("layers,width", [(12, 768), (24, 1024), (32, 4096)])
def test_whole_matrices_balance_newton_schulz_work_over_8_ranks(layers: int, width: int, dtype: torch.dtype) -> None:
    works = _works(gpt_matrix_shapes(layers, width), 8, dtype)
    shares, _ = assignment.chunked_shares(works, 8, None)
    assert all(len(item_shares) == 1 and item_shares[0].kind is None for item_shares in shares)  # none divided
    loads = assignment.rank_flops(works, shares, 8)
    assert max(loads) / (sum(loads) / 8) <= 1.05, loads


@pytest.mark.parametrize("world", [16, 64])
def test_divided_matrices_go_to_distinct_ranks_and_cover_their_columns(world: int) -> None:
    shapes = gpt_matrix_shapes(2, 768)  # 8 matrices: too few for the ranks, so the owners divide them
    works = _works(shapes, world)
    shares, _ = assignment.chunked_shares(works, world, None)
    assert sum(len(item_shares) > 1 for item_shares in shares) >= len(shapes) // 2
    for shape, item_shares in zip(shapes, shares):
        if len(item_shares) == 1:  # whole, where it fit the room of a rank
            assert item_shares[0].kind is None
            continue
        assert len({share.owner for share in item_shares}) == len(item_shares)
        long_dim = 0 if shape[0] > shape[1] else 1  # the wide orientation's columns
        assert all(share.kind == "columns" and share.dim == long_dim for share in item_shares)
        bounds = [(share.start, share.stop) for share in item_shares]
        assert bounds[0][0] == 0 and bounds[-1][1] == shape[long_dim]
        assert all(stop == start for (_, stop), (start, _) in zip(bounds, bounds[1:]))
        assert min(stop - start for start, stop in bounds) >= assignment.MIN_SHARE_COLUMNS
    loads = assignment.rank_flops(works, shares, world)
    assert max(loads) / (sum(loads) / world) <= 1.05


def test_banks_divide_by_experts_and_gram_iterations_stay_whole() -> None:
    bank = _works([(64, 32, 48)], 4)[0]  # split along its rows: no rank holds whole experts
    assert bank.splitting.kind == "experts" and bank.splitting.length == 64
    shares, _ = assignment.chunked_shares([bank], 4, None)
    assert [(share.start, share.stop) for share in shares[0]] == [(0, 16), (16, 32), (32, 48), (48, 64)]
    assert _works([(64, 1024)], 4, torch.float32)[0].splitting is None  # fp32 "auto" runs the Gram iteration


def test_cpu_meshes_divide_expert_banks_but_no_matrix_by_columns() -> None:
    # gloo's per-step Gram exchanges made divided steps slower than whole ones (assignment.NO_COLUMN_DIVISION_ON).
    shapes = gpt_matrix_shapes(2, 768)
    cpu, gpu = _works(shapes, 16, device_type="cpu"), _works(shapes, 16, device_type="cuda")
    assert all(work.splitting is None for work in cpu)
    assert all(work.splitting is not None and work.splitting.kind == "columns" for work in gpu)
    shares, _ = assignment.chunked_shares(cpu, 16, None)
    assert all(len(item_shares) == 1 and item_shares[0].kind is None for item_shares in shares)
    assert _works([(64, 32, 48)], 4, device_type="cpu")[0].splitting.kind == "experts"
    spread = optimizer.plan_step(shapes, 16, mesh_device_type="cpu")
    assert spread.balance > 1.05 and max(spread.flops_per_rank) == max(work.flops for work in cpu)


def test_cost_is_the_flop_count_of_the_iteration_that_runs() -> None:
    # Standard, per step: X Xᵀ (2 m² n), A² (2 m³), (bA + cA²) X (2 m² n); for a (4, 6) matrix 2*96 + 128 + 2*96 =
    # 512 per step, the same for its transpose and per bank member. Gram, 5 steps: X Xᵀ and Q X once (4 m² n = 384)
    # and 17 products of m x m (2 m³ = 128 each): 2560, the same as standard at this shape; at (4, 64) Gram does fewer,
    # but "auto" takes it only where it saves 3M FLOPs a matrix, as at (32, 512).
    view = routing.matrix_view(torch.Size((4, 6)))
    assert assignment.iteration_flops(view, 5, "standard", torch.float32, "cpu") == 5 * 512
    assert assignment.iteration_flops(routing.matrix_view(torch.Size((6, 4))), 5, "standard", torch.float32,
                                      "cpu") == 5 * 512
    assert assignment.iteration_flops(routing.matrix_view(torch.Size((3, 4, 6))), 5, "standard",
                                      torch.float32, "cpu") == 3 * 5 * 512
    assert assignment.iteration_flops(view, 5, "gram", torch.float32, "cpu") == 384 + 17 * 128
    small = routing.matrix_view(torch.Size((4, 64)))
    small_gram, small_standard = 4 * 16 * 64 + 17 * 128, 5 * (4 * 16 * 64 + 128)
    assert assignment.iteration_flops(small, 5, "gram", torch.float32, "cpu") == small_gram < small_standard
    assert assignment.iteration_flops(small, 5, "auto", torch.float32, "cpu") == small_standard
    wide = routing.matrix_view(torch.Size((32, 512)))
    gram, standard = 4 * 32**2 * 512 + 17 * 2 * 32**3, 5 * (4 * 32**2 * 512 + 2 * 32**3)
    assert assignment.iteration_flops(wide, 5, "auto", torch.float32, "cpu") == gram <= standard - 3e6
    assert assignment.iteration_flops(wide, 5, "auto", torch.bfloat16, "cpu") == standard
    # In 16-bit on GPUs, Gram from 2048 rows where it does at most 3/4 of the FLOPs (newton_schulz.resolve_algorithm).
    large, flop = routing.matrix_view(torch.Size((8192, 2048))), submodule(optimizer, "newton_schulz")
    gram = flop.gram_flop(2048, 8192, 5, torch.bfloat16)
    assert assignment.iteration_flops(large, 5, "auto", torch.bfloat16, "cuda") == gram
    assert assignment.iteration_flops(large, 5, "auto", torch.bfloat16, "cpu") == flop.standard_flop(2048, 8192, 5)


def _chunk_bounds(length: int, parts: int) -> list[tuple[int, int]]:
    """torch.chunk's split of range(length) into `parts` (missing trailing chunks are empty), as DTensor shards."""
    chunks = torch.arange(length).chunk(parts)
    bounds = [(int(c[0]), int(c[-1]) + 1) for c in chunks]
    return bounds + [(length, length)] * (parts - len(bounds))


@pytest.mark.parametrize("length,parts", [(10, 4), (2, 4), (8, 2), (7, 3), (1, 4)])
def test_shard_boxes_follow_torch_chunk(length: int, parts: int) -> None:
    layout = layout_module.sharded_layout((length, 5), (parts,), (Shard(0),), tuple(range(parts)))
    assert [(box[0].start, box[0].stop) for box in layout.boxes] == _chunk_bounds(length, parts)
    assert all((box[1].start, box[1].stop) == (0, 5) for box in layout.boxes)


def test_nested_shards_on_one_dim_and_replicas_on_a_2d_mesh() -> None:
    nested = layout_module.sharded_layout((10, 3), (2, 2), (Shard(0), Shard(0)), GRID_2X2)
    # Shard(0) twice: first 10 -> 5, 5, then each 5 -> 3, 2 (torch.chunk of each half).
    assert [(b[0].start, b[0].stop) for b in nested.boxes] == [(0, 3), (3, 5), (5, 8), (8, 10)]
    replicated_rows = layout_module.sharded_layout((10, 3), (2, 2), (Replicate(), Shard(0)), GRID_2X2)
    assert [(b[0].start, b[0].stop) for b in replicated_rows.boxes] == [(0, 5), (5, 10), (0, 5), (5, 10)]
    assert replicated_rows.sources(owner=3) == [0, 3]  # the owner sends nothing it holds; rank 0 has rows 0-5
    # Sums over ranks (a NorMuon row split between shards, the RMS rule's norm) count each replica once.
    assert [replicated_rows.counts_once(rank) for rank in range(4)] == [True, True, False, False]
    uneven = layout_module.sharded_layout((3, 4), (4,), (Shard(0),), tuple(range(4)))
    assert [uneven.counts_once(rank) for rank in range(4)] == [True, True, True, False]  # rank 3 holds nothing


def _global_indices(layout, rank: int, dim: int) -> list[int]:
    box = layout.boxes[rank][dim]
    order = layout.orders[dim] or range(layout.shape[dim])
    return list(order[box.start:box.stop])


@pytest.mark.parametrize("rows", [8, 9, 3, 12])
def test_strided_shard_holds_fsdp_over_tensor_parallel_rows(rows: int) -> None:
    # FSDP2 over tensor parallelism on a (dp, tp) mesh: TP splits the rows with torch.chunk, then FSDP splits each
    # TP shard again with torch.chunk; DTensor labels this (_StridedShard(0, split_factor=tp), Shard(0)).
    placements = (_StridedShard(0, split_factor=2), Shard(0))
    misplaced = dtensors.misplaced_strided_runs((rows, 4), (2, 2), placements)
    if misplaced is not None:  # torch 2.9 on uneven runs: the layout follows its DTensor, and the step refuses them
        pytest.skip(misplaced)
    layout = layout_module.sharded_layout((rows, 4), (2, 2), placements, GRID_2X2)
    for dp, tp in itertools.product(range(2), range(2)):
        tp_rows = torch.arange(rows).chunk(2)
        tp_part = tp_rows[tp] if tp < len(tp_rows) else torch.arange(0)
        dp_rows = tp_part.chunk(2)
        expected = dp_rows[dp].tolist() if dp < len(dp_rows) else []
        assert _global_indices(layout, 2 * dp + tp, 0) == expected
        assert _global_indices(layout, 2 * dp + tp, 1) == [0, 1, 2, 3]
    whole = torch.randn(rows, 4)
    assert torch.equal(layout.to_global(layout.to_storage(whole)), whole)
    for rank in range(4):  # a rank's local tensor is its box of the storage-order tensor
        assert torch.equal(layout.to_storage(whole)[layout.boxes[rank]], whole[_global_indices(layout, rank, 0)])


@pytest.mark.parametrize("shape, mesh_shape, placements, version, runs", [
    ((9, 4), (2, 2), (_StridedShard(0, split_factor=2), Shard(0)), "2.9.1", 4),
    ((3, 4), (2, 2), (_StridedShard(0, split_factor=2), Shard(0)), "2.9.1", 4),
    ((4, 10), (2, 3), (Shard(0), _StridedShard(1, split_factor=3)), "2.9.1", 9),
    ((9, 4), (2, 3), (_StridedShard(-2, split_factor=3), Shard(0)), "2.9.0+cu128", 6),  # not 9: its own mesh dim's size
    ((8, 4), (2, 2), (_StridedShard(0, split_factor=2), Shard(0)), "2.9.1", None),
    ((12, 5), (2, 3), (_StridedShard(0, split_factor=3), Shard(0)), "2.9.1", None),
    ((9, 4), (2, 2), (_StridedShard(0, split_factor=2), Shard(0)), "2.10.0", None),
    ((9, 4), (2, 2), (Shard(0), Shard(0)), "2.9.1", None),  # torch.chunk's own split, which torch 2.9 keeps too
])
def test_uneven_strided_runs_are_named_only_on_a_torch_that_misplaces_them(
        shape: tuple[int, ...], mesh_shape: tuple[int, ...], placements: tuple, version: str, runs: int | None) -> None:
    misplaced = dtensors.misplaced_strided_runs(shape, mesh_shape, placements, version)
    if runs is None:
        assert misplaced is None
        return
    strided = next(p for p in placements if isinstance(p, _StridedShard))
    dim = strided.dim % len(shape)
    assert f"{strided!r}" in misplaced and f"dim {dim} ({shape[dim]}) into {runs} unequal runs" in misplaced
    assert f"torch {version}'s DTensor" in misplaced and f"divisible by {runs}" in misplaced


def test_a_layout_asked_for_again_is_the_same_object_so_cached_plans_are_found_again() -> None:
    # Plans are cached on layouts, which compare by identity: a DDP step (plain tensors over a process group) made
    # a new replicated layout for every parameter at every step, and planned every step anew.
    assert layout_module.replicated_layout((5, 5), 4) is layout_module.replicated_layout((5, 5), 4)
    assert (layout_module.sharded_layout((9, 4), (2, 2), (Replicate(), Shard(0)), GRID_2X2)
            is layout_module.sharded_layout((9, 4), (2, 2), (Replicate(), Shard(0)), GRID_2X2))
    shares = ((assignment.Share(1),),)
    first = plan.chunk_exchanges((layout_module.replicated_layout((5, 5), 4),), shares, 0)
    assert plan.chunk_exchanges((layout_module.replicated_layout((5, 5), 4),), shares, 0) is first


def _layouts_for_plan_checks() -> list:
    ranks = (0, 1, 2, 3)
    return [
        layout_module.sharded_layout((10, 6), (4,), (Shard(0),), ranks),
        layout_module.sharded_layout((3, 8), (4,), (Shard(0),), ranks),  # an empty shard
        layout_module.sharded_layout((6, 7), (2, 2), (Shard(0), Shard(1)), GRID_2X2),
        layout_module.sharded_layout((9, 4), (2, 2), (Replicate(), Shard(0)), GRID_2X2),
        layout_module.sharded_layout((9, 4), (2, 2), (_StridedShard(0, split_factor=2), Shard(0)), GRID_2X2),
        layout_module.replicated_layout((5, 5), 4),
    ]


def _shares_for_plan_checks(owners: tuple[int, int], layouts: list) -> list[tuple]:
    """Whole matrices on the given owners, and the (10, 6) matrix divided in three column shares."""
    Share = assignment.Share
    whole = [owners[0], owners[1], owners[1], owners[0], (owners[0] + 1) % 4, (owners[1] + 2) % 4]
    shares = [(Share(owner),) for owner in whole]
    shares[0] = tuple(Share((owners[0] + k) % 4, "columns", 1, start, stop)
                      for k, (start, stop) in enumerate([(0, 2), (2, 4), (4, 6)]))
    return shares


@pytest.mark.parametrize("owners", list(itertools.product(range(4), repeat=2))[::3])
def test_all_to_all_plans_agree_between_ranks_and_cover_every_element_once(owners: tuple[int, int]) -> None:
    layouts = _layouts_for_plan_checks()
    shares = _shares_for_plan_checks(owners, layouts)
    exchanges = [plan.chunk_exchanges(tuple(layouts), tuple(shares), rank) for rank in range(4)]
    gathers, scatters = [pair[0] for pair in exchanges], [pair[1] for pair in exchanges]
    for side in (gathers, scatters):
        assert len({exchange.moves_data for exchange in side}) == 1
        for src, dst in itertools.permutations(range(4), 2):  # what src sends dst is what dst expects from src
            sent = [(p.item, p.share, p.box) for p in side[src].sends if p.peer == dst]
            expected = [(p.item, p.share, p.box) for p in side[dst].receives if p.peer == src]
            assert sent == expected
            assert side[src].send_counts[dst] == side[dst].recv_counts[src]
    for item, (layout, item_shares) in enumerate(zip(layouts, shares)):
        for index, share in enumerate(item_shares):  # each share's owner gets each of its elements exactly once
            hits = torch.zeros(layout.shape, dtype=torch.int64)
            arrived = gathers[share.owner].kept + gathers[share.owner].receives
            for piece in arrived:
                if piece.item == item and piece.share == index:
                    hits[piece.box] += 1
            wanted = torch.zeros(layout.shape, dtype=torch.int64)
            wanted[share.box(layout.shape)] = 1
            assert torch.equal(hits, wanted), (item, index, hits)
        for rank in range(4):  # after the scatter every rank has each element of its own box exactly once
            hits = torch.zeros(layout.shape, dtype=torch.int64)
            for piece in scatters[rank].kept + scatters[rank].receives:
                if piece.item == item:
                    hits[piece.box] += 1
            wanted = torch.zeros(layout.shape, dtype=torch.int64)
            wanted[layout.boxes[rank]] = 1
            assert torch.equal(hits, wanted), (item, rank, hits)


@pytest.mark.parametrize("owners", list(itertools.product(range(4), repeat=2)))
def test_rank_local_exchanges_and_counts_of_all_ranks_match_every_ranks_transfers(owners: tuple[int, int]) -> None:
    """chunk_exchanges plans a rank's side from the transfers it sends or receives, and plan_step counts every
    rank's elements without listing the transfers (listing them took seconds at 512 ranks); what every rank's
    transfers give is the truth, moves_data included: each item alone too, so that chunks where nothing moves, or
    only the scatter does, are among them."""
    layouts = [*_layouts_for_plan_checks(), layout_module.sharded_layout((1, 8), (4,), (Shard(0),), (0, 1, 2, 3))]
    shares = [*_shares_for_plan_checks(owners, layouts), (assignment.Share(0),)]  # (1, 8): rank 0 holds it all
    chunks = [[item] for item in range(len(layouts))] + [list(range(len(layouts)))]
    moved = set()
    for chunk in chunks:
        chunk_layouts, chunk_shares = tuple(layouts[i] for i in chunk), tuple(shares[i] for i in chunk)
        every_gather = plan.gather_transfers(chunk_layouts, chunk_shares)
        every_scatter = plan.scatter_transfers(chunk_layouts, chunk_shares)
        assert plan.gather_numels(chunk_layouts, chunk_shares) == plan.transfer_numels(every_gather, 4), chunk
        assert plan.scatter_numels(chunk_layouts, chunk_shares) == plan.transfer_numels(every_scatter, 4), chunk
        for rank in range(4):
            gather, scatter = plan.chunk_exchanges(chunk_layouts, chunk_shares, rank)
            assert gather == plan.exchange(every_gather, 4, rank), (chunk, rank)
            assert scatter == plan.exchange(every_scatter, 4, rank), (chunk, rank)
            moved.add((gather.moves_data, scatter.moves_data))
    assert moved == {(False, False), (False, True), (True, True)}  # each kind of chunk was among them


def test_staggered_chunks_launch_each_gather_before_the_previous_chunk_computes() -> None:
    pipeline = submodule(optimizer, "distributed.pipeline")
    events: list[str] = []

    def chunk(k: int):  # the shape of a chunk pipeline: launch, yield, wait + compute + launch, yield, wait + apply
        events.append(f"launch gather {k}")
        yield
        events.append(f"newton-schulz {k}")
        yield
        events.append(f"apply {k}")

    pipeline.run_staggered(chunk(k) for k in range(3))
    assert events == ["launch gather 0",
                      "launch gather 1", "newton-schulz 0",
                      "launch gather 2", "newton-schulz 1", "apply 0",
                      "newton-schulz 2", "apply 1",
                      "apply 2"]
