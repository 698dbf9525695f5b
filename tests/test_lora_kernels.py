"""The segmented LoRA kernels (engine/kernels/lora.py) against the torch reference
(`LoRAHook.delta`, the engine's CPU path), over the tiles engine/lora/tiles.py plans. The
kernel tests need a GPU; `TRITON_INTERPRET=1` runs them on the CPU, as tests/test_lora.py
does. The planner's tests run anywhere."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine.lora.layer import LoRABatch, LoRAHook
from engine.lora.pool import PoolGroup
from engine.lora.tiles import DECODE_BLOCK_M, TilePlan, block_m_for, split_packed, tile_bound
from test_triton_attention import DEVICE



def needs_gpu(test):
    return pytest.mark.gpu(pytest.mark.skipif(
        DEVICE is None, reason="needs a CUDA GPU (or TRITON_INTERPRET=1)")(test))


def test_plan_groups_rows_by_slot():
    """Interleaved adapters come out slot by slot, base rows in no tile, runs cut at
    block_m; packing pads tiles with slot -1."""
    slots, lens = [2, -1, 0, 2, 0, -1, 2], [1, 1, 1, 3, 1, 1, 1]
    plan = TilePlan.of(slots, lens, block_m=4)
    # rows: seg0 0 | seg1 1 | seg2 2 | seg3 3-5 | seg4 6 | seg5 7 | seg6 8
    assert plan.order == [2, 6, 0, 3, 4, 5, 8]
    assert plan.tiles == [(0, 0, 2), (2, 2, 6), (2, 6, 7)]
    order, tiles = split_packed(plan.pack(9, 5), 9)
    assert order.tolist()[:7] == plan.order
    assert tiles[0].tolist() == [0, 2, 2, -1, -1]
    assert len(plan.tiles) <= tile_bound(sum(lens), 4, 3)
    assert TilePlan.of([-1, -1], [1, 5], 16).tiles == []
    assert block_m_for(40, is_decode=True) == DECODE_BLOCK_M
    assert block_m_for(32, is_decode=False) == DECODE_BLOCK_M
    assert block_m_for(33, is_decode=False) > DECODE_BLOCK_M


def test_extend_graph_buckets_tile_as_the_steps_they_replay():
    """An extend graph's kernels are captured with its bucket's tiling: every step it
    replays (its bucket is the smallest that holds the step's tokens and requests) must
    plan tiles of that height."""
    from engine.executor.graph_runner import BS_BUCKETS, TOKEN_BUCKETS

    for tokens in range(1, TOKEN_BUCKETS[-1] + 1):
        for bs in (1, 2, 5, 17, 40, 64):
            if bs > tokens:
                continue
            cap = next(b for b in BS_BUCKETS if b >= bs)
            bucket = next(t for t in TOKEN_BUCKETS if t >= max(tokens, cap))
            assert block_m_for(tokens, False) == block_m_for(bucket, False), (tokens, bs)


def test_batch_stages_steps_into_static_buffers():
    """A step that fits the static buffers is staged there; a graph being captured reads
    them with the grid of its shape's most tiles; an eager forward launches exactly its
    tiles, none without an adapted row; a forward the staged plan is not for (a graph's
    warm-up) sees no adapter."""
    batch = LoRABatch(capacity=80, num_slots=2, device=torch.device("cpu"))
    batch.stage([1, -1, 0, 1], [1, 1, 1, 1], True)
    batch.bind([1, 1, 1, 1], True, capturing=True)
    assert batch.num_tiles == tile_bound(4, DECODE_BLOCK_M, 2)
    assert batch.order.data_ptr() == batch.static.data_ptr()
    assert batch.order[:3].tolist() == [2, 0, 3] and batch.tiles[0, :3].tolist() == [0, 1, -1]
    assert batch.runs == [(1, 0, 1), (0, 2, 3), (1, 3, 4)]
    batch.bind([1, 1, 1, 1], True, capturing=False)
    assert batch.num_tiles == 2  # eager: slot 0's tile, slot 1's
    batch.bind([1] * 6, True, capturing=False)  # a warm-up of six rows
    assert batch.tiles[0].tolist() == [-1] * batch.tiles_cap and batch.runs == []
    batch.stage([0, -1], [50, 30], False)  # an extend graph's step: 64-row tiles, static
    batch.bind([50, 30], False, capturing=True)
    assert (batch.num_tiles, batch.block_m) == (tile_bound(80, 64, 2), 64)
    assert batch.order.data_ptr() == batch.static.data_ptr()
    assert batch.tiles[:, 0].tolist() == [0, 0, 50] and batch.tiles[0, 1] == -1
    batch.stage([0, -1], [100, 30], False)
    batch.bind([100, 30], False, capturing=False)
    assert (batch.num_tiles, batch.block_m) == (2, 64)  # 100 rows > capacity: a fresh tensor
    assert batch.order.data_ptr() != batch.static.data_ptr() and batch.order.numel() == 100
    batch.stage([-1, -1], [100, 30], False)
    batch.bind([100, 30], False, capturing=False)
    assert batch.num_tiles == 0
    batch = LoRABatch(capacity=8, num_slots=2, device=torch.device("cpu"))
    batch.stage([-1, -1], [3, 5], False)  # the first of its tiling: one tile (of slot -1)
    batch.bind([3, 5], False, capturing=False)  # compiles it
    assert batch.num_tiles == 1 and batch.tiles[0, 0] == -1
    batch.begin(SimpleNamespace(extend_lens_cpu=[3, 5], is_decode=False))
    assert batch.num_tiles == 0


def _group(a, b, part_sizes) -> LoRAHook:
    group = PoolGroup(0, tuple(f"p{i}" for i in range(len(part_sizes))), part_sizes, None, a, b)
    return LoRAHook(group, SimpleNamespace(rank=b.shape[2], ranks=None), None, None)


def _case(dtype, seg_lens, slots, part_sizes, k, r_pool, ranks, num_slots=3):
    gen = torch.Generator().manual_seed(len(seg_lens) * 7 + k)
    n, parts = sum(part_sizes), len(part_sizes)
    a = torch.randn(num_slots, parts * r_pool, k, generator=gen) * 0.1
    b = torch.randn(num_slots, n, r_pool, generator=gen) * 0.1
    for s, rank in enumerate(ranks):  # the pool keeps what lies past a rank zero
        for p in range(parts):
            a[s, p * r_pool + rank:(p + 1) * r_pool] = 0
        b[s, :, rank:] = 0
    t = sum(seg_lens)
    x = torch.randn(t, k, generator=gen)
    y = torch.randn(t, n, generator=gen)
    return [v.to(dtype).to(DEVICE) for v in (a, b, x, y)]


def _run(dtype, seg_lens, slots, part_sizes, k=80, r_pool=32, ranks=(8, 32, 20),
         graph_grid=False, spare=0):
    """lora_sgmv on one step against the reference; `graph_grid`: the decode graphs' grid
    (the row count's bound, from static buffers `spare` entries larger than needed)."""
    from engine.kernels.lora import column_tile, lora_sgmv

    a, b, x, y = _case(dtype, seg_lens, slots, part_sizes, k, r_pool, ranks)
    ref = _group(a.float().cpu(), b.float().cpu(), part_sizes)
    expected = y.float().cpu().clone()
    at = 0
    for slot, n in zip(slots, seg_lens):
        if slot >= 0:
            expected[at:at + n] += ref.delta(x[at:at + n].float().cpu(), slot)
        at += n
    plan = TilePlan.of(slots, seg_lens, block_m_for(sum(seg_lens), max(seg_lens, default=1) == 1))
    num_tiles = tile_bound(sum(seg_lens), plan.block_m, 3) if graph_grid else len(plan.tiles)
    rows_cap, tiles_cap = max(len(plan.order), 1) + spare, max(num_tiles, 1) + spare
    order, tiles = split_packed(plan.pack(rows_cap, tiles_cap).to(DEVICE), rows_cap)
    ranks_t = torch.tensor(ranks, dtype=torch.int32, device=DEVICE)
    bounds = list(torch.tensor(part_sizes[:-1]).cumsum(0).tolist())
    before = y.clone()
    lora_sgmv(x, y, a, b, ranks_t, order, tiles, num_tiles, plan.block_m, bounds,
              column_tile(bounds + [sum(part_sizes)]))
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(y.float().cpu(), expected, atol=tol, rtol=tol)
    base_rows = [i for i, s in enumerate(r for s, n in zip(slots, seg_lens) for r in [s] * n)
                 if s < 0]
    assert torch.equal(y[base_rows], before[base_rows])  # the base's rows untouched


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seg_lens,slots,part_sizes", [
    ([1] * 9, [2, -1, 0, 1, 2, 0, -1, 1, 2], (64, 32, 32)),  # decode, interleaved: q, k, v
    ([3, 40, 1, 17], [1, 0, -1, 1], (96, 96)),  # mixed extend: gate, up
    ([5, 2], [0, 2], (48,)),  # one part, a width not a multiple of the column tile
])
def test_sgmv_matches_torch(dtype, seg_lens, slots, part_sizes):
    _run(dtype, seg_lens, slots, part_sizes)


@needs_gpu
def test_decode_graph_grid_with_split_k():
    """A decode graph's grid (tiles past the step's are -1, static buffers larger than the
    step), K split over several programs, 17 rows of one adapter (two row tiles)."""
    slots = [0] * 17 + [1, -1, 2, 1]
    _run(torch.float32, [1] * len(slots), slots, (64, 32, 32), k=1100, graph_grid=True,
         spare=5)


@needs_gpu
def test_long_segments_with_split_k():
    """Prefill: long segments tile by 64 rows, K split, rank tiles of 32 (rank 8: one
    of each part's used), a base prompt between two adapted ones."""
    _run(torch.bfloat16, [70, 9, 66], [2, -1, 0], (96, 96), k=1100)


def test_expand_programs_stay_inside_one_part():
    from engine.kernels.lora import DECODE, LONG, columns_per_program

    assert columns_per_program([0, 4096], 256, LONG) == 8  # o_proj: eight tiles a program
    assert columns_per_program([0, 4096, 5120, 6144], 256, LONG) == 4  # q 16 tiles, k and v 4
    assert columns_per_program([0, 2048, 2560], 256, LONG) == 2
    assert columns_per_program([0, 48], 16, LONG) == 1  # three tiles: no power of two divides
    assert columns_per_program([0, 4096], 256, DECODE) == 1  # decode keeps its programs


@needs_gpu
def test_long_segments_walk_several_column_tiles():
    """Prefill's expand programs walk four 256-column tiles of one part each (q 2,048
    wide, k and v 1,024 each), the rows' input summed once for all four."""
    _run(torch.float32, [40, 30], [1, 2], (2048, 1024, 1024), k=64)


@needs_gpu
@pytest.mark.parametrize("graph_grid", [False, True])
def test_empty_steps(graph_grid):
    """No adapted row: no launch (eager) or every program exits (a graph's grid)."""
    _run(torch.float32, [1, 1, 1], [-1, -1, -1], (32,), graph_grid=graph_grid)
    _run(torch.float32, [], [], (32,), graph_grid=graph_grid)
