"""Radix-grouped decode (engine/core/prefix_groups.py + the Triton prefix / suffix kernels).

CPU tests: the groups computed from a real radix tree and scheduler. Kernel tests (marked
`gpu`, like tests/test_triton_attention.py) compare the grouped decode with the plain
decode kernel and the fp32 torch reference on fresh random inputs; on a CPU they run
through Triton's interpreter with TRITON_INTERPRET=1 (small shapes).
"""
from __future__ import annotations

import copy
import math
import random

import pytest
import torch

from engine.config import EngineConfig
from engine.core.slot_allocator import SlotAllocator
from engine.executor.prefix_group_batch import PrefixGroupBatch, packed_len
from engine.core.prefix_groups import Group, PrefixGrouper, build_plan
from engine.core.radix_cache import RadixCache
from engine.core.request import Request
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler
from test_triton_attention import DEVICE, Case, compare, make_case, reference

gpu = [pytest.mark.gpu,
       pytest.mark.skipif(DEVICE is None, reason="needs a CUDA GPU (or TRITON_INTERPRET=1)")]


# ------------------------------------------------------------------ groups from the tree
class _Sim:
    """A scheduler + radix cache driven without a model: prefill chunks are cached as the
    engine does, every sample appends token 7."""

    def __init__(self, slots: int = 4096, chunk: int = 64, **cfg) -> None:
        self.cfg = EngineConfig(chunked_prefill_size=chunk, max_running_requests=64, **cfg)
        self.alloc = SlotAllocator(slots)
        self.cache = RadixCache(self.alloc)
        self.sched = Scheduler(self.cfg, self.alloc, self.cache)
        self.n = 0

    def add(self, prompt: list[int], max_tokens: int = 50) -> Request:
        self.n += 1
        req = Request(f"r{self.n}", list(prompt), SamplingParams(max_tokens=max_tokens))
        self.sched.add(req)
        return req

    def step(self):
        plan = self.sched.schedule()
        for c in plan.chunks:
            if c.num_tokens > 1:
                self.sched.cache_prefix(c.req)
        for c in plan.chunks:
            if c.samples:
                c.req.token_ids.append(7)
        return plan

    def run_until_decode(self, max_steps: int = 200):
        for _ in range(max_steps):
            plan = self.step()
            if plan.is_decode and len(plan.chunks) == len(self.sched.running) and not self.sched.waiting:
                return self.step()
        raise AssertionError("never reached an all-decode step")


def _rand(n: int, seed: int) -> list[int]:
    r = random.Random(seed)
    return [r.randint(10, 30000) for _ in range(n)]


def _plan(grouper, plan, cap=None):
    reqs = [c.req for c in plan.chunks]
    seq = [len(r.kv.slots) for r in reqs]
    return reqs, grouper.plan(reqs, seq, cap or len(reqs), lambda t, m: 2)


def test_groups_from_radix_tree():
    sim = _Sim()
    sys_a, sys_b = _rand(300, 1), _rand(200, 2)
    a = [sim.add(sys_a + _rand(20, 10 + i)) for i in range(5)]
    b = [sim.add(sys_b + _rand(30, 20 + i)) for i in range(3)]
    alone = sim.add(_rand(400, 3))
    short = [sim.add(_rand(40, 4) + _rand(5, 30 + i)) for i in range(2)]  # shared 40 < min
    plan = sim.run_until_decode()
    grouper = PrefixGrouper(min_tokens=100, members_per_tile=4, min_saved_tokens=0)
    reqs, gp = _plan(grouper, plan)
    assert gp is not None
    pos = {r: i for i, r in enumerate(reqs)}
    assert sorted(gp.pfx_len[pos[r]] for r in a) == [300] * 5
    assert sorted(gp.pfx_len[pos[r]] for r in b) == [200] * 3
    assert gp.pfx_len[pos[alone]] == 0 and all(gp.pfx_len[pos[r]] == 0 for r in short)
    assert gp.num_groups == 2
    # group a (5 members, 4 per tile) -> tiles of 3 + 2; group b -> one tile of 3
    sizes = sorted(t.member_count for t in gp.tiles)
    assert sizes == [2, 3, 3]
    for t in gp.tiles:
        idx = gp.members[t.member_start:t.member_start + t.member_count]
        assert {gp.pfx_len[i] for i in idx} == {t.prefix_len}
        # every member holds the tile row's slots for the whole prefix
        ref = next(r for r in reqs if r.kv.row == t.row).kv.slots[:t.prefix_len]
        assert all(reqs[i].kv.slots[:t.prefix_len] == ref for i in idx)
    assert sorted(gp.members) == sorted(pos[r] for r in a + b)
    seq = [len(r.kv.slots) for r in reqs]
    assert gp.kv_tokens_plain == sum(seq)
    assert gp.kv_tokens_read == sum(seq) - 5 * 300 - 3 * 200 + 2 * 300 + 200
    packed = gp.packed()
    assert len(packed) == packed_len(gp.cap) and packed[:2] == [3, 2]
    # the device views read back what the plan holds, field by field
    host = torch.tensor(packed, dtype=torch.int64)
    views = PrefixGroupBatch.from_packed(host, host, seq)
    n = len(gp.tiles)
    assert views.pfx_len[:len(reqs)].tolist() == gp.pfx_len
    assert views.tile_row[:n].tolist() == [t.row for t in gp.tiles]
    assert views.tile_len[:n].tolist() == [t.prefix_len for t in gp.tiles]
    assert views.tile_mstart[:n].tolist() == [t.member_start for t in gp.tiles]
    assert views.tile_mcount[:n].tolist() == [t.member_count for t in gp.tiles]
    assert views.members[:len(gp.members)].tolist() == gp.members
    assert (views.num_tiles, views.num_splits, views.max_suffix) == (3, 2, gp.max_suffix)
    # the cache: a second step reuses the chain (the same object), which ends at the
    # request's locked node and passes through the shared 300-token node
    c1 = grouper.chain(a[0])
    assert grouper.chain(a[0]) is c1
    assert c1.nodes[0] is a[0].kv.node and 300 in c1.depths
    assert c1.depths[0] == a[0].kv.locked_len


def test_split_above_a_chain_node_is_noticed():
    """The first request of a group decodes alone; a later one splits its node: the chain
    is rebuilt and both are grouped."""
    sim = _Sim(chunk=1024)
    system = _rand(256, 5)
    first = sim.add(system + _rand(16, 6))
    plan = sim.run_until_decode()
    grouper = PrefixGrouper(min_tokens=128, members_per_tile=16, min_saved_tokens=0)
    _, gp = _plan(grouper, plan)
    assert gp is None  # alone
    assert grouper.chain(first).depths == (272,)  # one node: the whole prompt
    second = sim.add(system + _rand(16, 7))
    plan = sim.run_until_decode()
    reqs, gp = _plan(grouper, plan)
    assert gp is not None and gp.pfx_len == [256, 256]
    assert grouper.chain(first).depths == (272, 256)
    assert second in reqs


def test_chunked_prefill_nodes():
    """Chunked prefill leaves a chain of nodes; the deepest shared one is used."""
    sim = _Sim(chunk=64)
    system = _rand(256, 5)
    reqs = [sim.add(system + _rand(16, 6 + i)) for i in range(3)]
    plan = sim.run_until_decode()
    grouper = PrefixGrouper(min_tokens=100, members_per_tile=16, min_saved_tokens=0)
    _, gp = _plan(grouper, plan)
    assert gp.pfx_len == [256] * 3
    assert grouper.chain(reqs[0]).depths[0] == 272


def test_no_groups_without_sharing_or_below_threshold():
    sim = _Sim()
    for i in range(4):
        sim.add(_rand(150, 40 + i))
    plan = sim.run_until_decode()
    g = PrefixGrouper(min_tokens=64, members_per_tile=16, min_saved_tokens=0)
    assert _plan(g, plan)[1] is None
    assert g.steps == 1 and g.grouped_steps == 0 and g.kv_tokens_read == g.kv_tokens_plain
    # shared, but not saving enough
    sim = _Sim()
    system = _rand(200, 8)
    for i in range(2):
        sim.add(system + _rand(10, 50 + i))
    plan = sim.run_until_decode()
    assert _plan(PrefixGrouper(64, 16, min_saved_tokens=10_000), plan)[1] is None
    assert _plan(PrefixGrouper(64, 16, min_saved_tokens=0), plan)[1].pfx_len == [200, 200]
    assert _plan(PrefixGrouper(300, 16, min_saved_tokens=0), plan)[1] is None


def test_nested_sharing_picks_deepest_shared_node():
    sim = _Sim()
    base, mid = _rand(150, 9), _rand(150, 10)
    deep = [sim.add(base + mid + _rand(8, 60 + i)) for i in range(2)]
    shallow = [sim.add(base + _rand(8, 70 + i)) for i in range(2)]
    plan = sim.run_until_decode()
    reqs, gp = _plan(PrefixGrouper(100, 16, min_saved_tokens=0), plan)
    pos = {r: i for i, r in enumerate(reqs)}
    assert [gp.pfx_len[pos[r]] for r in deep] == [300, 300]
    assert [gp.pfx_len[pos[r]] for r in shallow] == [150, 150]
    # a lone request whose deepest shared node has nobody else joins a shallower group
    sim = _Sim()
    x = [sim.add(base + mid + _rand(8, 80 + i)) for i in range(2)]
    y = sim.add(base + _rand(8, 90))
    plan = sim.run_until_decode()
    reqs = [c.req for c in plan.chunks if c.req is not x[1]]  # x[1] not in this step
    seq = [len(r.kv.slots) for r in reqs]
    gp = PrefixGrouper(100, 16, min_saved_tokens=0).plan(reqs, seq, 8, lambda t, m: 1)
    assert sorted(gp.pfx_len) == [150, 150] and y in reqs


def test_engine_config_switch():
    assert EngineConfig().enable_prefix_grouped_decode is True
    with pytest.raises(ValueError):
        EngineConfig(prefix_group_min_tokens=0)


# ------------------------------------------------------------------ kernels
def _small() -> bool:
    return DEVICE == "cpu"


def make_grouped_case(groups: list[tuple[int, list[int]]], singles: list[int], hq: int,
                      hkv: int, d: int, dtype, *, seed: int, pad_to: int = 0):
    """groups = [(prefix_len, [seq_len of each member])], singles = [seq_len]. Batch order
    is shuffled; members share the prefix slots of their first member."""
    rng = random.Random(seed)
    entries = [(gi, s) for gi, (_, lens) in enumerate(groups) for s in lens] + \
              [(None, s) for s in singles]
    rng.shuffle(entries)
    case = make_case([(s - 1, 1) for _, s in entries], hq, hkv, d, dtype, DEVICE, seed=seed,
                     pad_to=pad_to)
    b = case.batch
    r2t = b.req_to_token
    idx_of = {}
    for i, (gi, _) in enumerate(entries):
        if gi is not None:
            idx_of.setdefault(gi, []).append(i)
    spec = []
    rows = b.req_rows.tolist()
    for gi, (plen, _) in enumerate(groups):
        idx = idx_of.get(gi, [])
        if idx:
            first = rows[idx[0]]
            for i in idx[1:]:
                r2t[rows[i], :plen] = r2t[first, :plen]
        spec.append(Group(plen, idx))
    return case, spec


def attach_groups(case: Case, spec, members_per_tile: int, splits: int, cap: int | None = None):
    b = case.batch
    cap = cap or b.batch_size
    plan = build_plan(spec, b.req_rows.tolist(), b.seq_lens_cpu, cap, members_per_tile,
                      lambda t, m: splits)
    assert plan is not None
    packed = torch.tensor(plan.packed(), dtype=torch.int64, device=b.seq_lens.device)
    b.prefix_groups = PrefixGroupBatch.from_plan(packed, plan)
    return plan


def run_grouped(case: Case, spec, splits: int, per_tile: int | None = None, **kw):
    from engine.attention.triton_backend import TritonAttentionBackend

    be = TritonAttentionBackend(case.pool, 1.0 / math.sqrt(case.q.shape[-1]), **kw)
    group = case.q.shape[1] // case.k.shape[1]
    per = be.prefix_members_per_tile(group)
    plan = attach_groups(case, spec, min(per, per_tile or per), splits)
    be.prepare(case.batch)
    assert be._grouped is not None
    out = torch.full(case.q.shape, float("nan"), dtype=case.q.dtype, device=case.q.device)
    be.forward(case.q, case.k, case.v, case.layer, case.batch, out=out)
    return out, plan


def check_grouped(groups, singles, hq, hkv, d, dtype, *, seed, splits=2, pad_to=0, **kw):
    case, spec = make_grouped_case(groups, singles, hq, hkv, d, dtype, seed=seed, pad_to=pad_to)
    ref, ref_pool = reference(case)
    # the plain decode kernel on the same inputs (its own pool copy: forward stores K/V)
    from test_triton_attention import run_backend
    plain_case = Case(_clone_pool(case.pool), case.batch, case.q, case.k, case.v, case.layer,
                      case.real)
    plain = run_backend(plain_case)
    out, plan = run_grouped(case, spec, splits, **kw)
    r = compare(case, out, ref, ref_pool)
    n = case.real
    r["rel_vs_plain"] = float((out[:n].float() - plain[:n].float()).norm()
                              / plain[:n].float().norm())
    r["ok"] = r["ok"] and r["rel_vs_plain"] < r["tol"]
    r["tiles"] = len(plan.tiles)
    return r


def _clone_pool(pool):
    p = copy.copy(pool)  # every setting (dtype, fp8 scale, ...) as the original's
    p.k = [t.clone() for t in pool.k]
    p.v = [t.clone() for t in pool.v]
    return p


# (name, groups [(L, [seq_len...])], singles, hq, hkv, d, dtype, prefix splits, kwargs)
def grouped_cases():
    if _small():
        return [
            ("two_groups_ragged", [(70, [75, 90, 71]), (40, [41, 60])], [33, 100], 8, 2, 16,
             torch.float32, 2, {}),
            ("group_of_one_and_big", [(50, [51]), (64, [65 + i for i in range(6)])], [20], 4, 1,
             32, torch.bfloat16, 3, {}),
            ("suffix_splits", [(96, [130, 100, 97])], [150], 8, 4, 16, torch.float32, 1,
             {"force_num_splits": 3}),
            ("graph_mode_padded", [(33, [40, 50])], [10], 8, 2, 16, torch.float16, 4,
             {"graph_mode": True}),
            # 7 members, 3 per tile -> tiles of 3/2/2; 2 persistent programs loop over items
            ("multi_tile_persistent", [(45, [46 + 3 * i for i in range(7)])], [12, 80], 8, 2,
             16, torch.float32, 2, {"per_tile": 3, "num_sms": 1}),
        ]
    return [
        ("w2_like", [(2048, [2048 + 128 + random.Random(i).randint(1, 256) for i in range(16)])
                     for _ in range(4)], [700, 3000], 32, 8, 128, torch.bfloat16, 2, {}),
        ("ragged_many", [(L, [L + 1 + random.Random(L + i).randint(0, 400) for i in range(m)])
                         for L, m in [(300, 2), (1000, 17), (511, 33), (64, 5), (4000, 3)]],
         [1, 50, 2500], 32, 8, 128, torch.bfloat16, 4, {}),
        ("group1_mha_fp32", [(200, [250, 201, 300])], [90], 8, 8, 64, torch.float32, 1, {}),
        ("g8_fp16_d128", [(900, [901, 1000, 1500, 905])], [400], 16, 2, 128, torch.float16, 3, {}),
        ("d256", [(300, [301, 400])], [77], 8, 2, 256, torch.bfloat16, 2, {}),
        ("d80", [(130, [140, 131, 200])], [50], 4, 2, 80, torch.bfloat16, 2, {}),
        ("suffix_splits3", [(1500, [1501, 1700, 3000])], [2000], 32, 8, 128, torch.bfloat16, 2,
         {"force_num_splits": 3}),
        ("graph_mode", [(777, [800 + i for i in range(9)])], [5], 32, 8, 128, torch.bfloat16, 4,
         {"graph_mode": True}),
        ("prefix_ends_mid_block", [(65, [66, 67, 70]), (127, [128, 200])], [], 32, 8, 128,
         torch.bfloat16, 4, {}),
        ("multi_tile_persistent", [(1200, [1201 + 37 * i for i in range(40)])], [3], 32, 8, 128,
         torch.bfloat16, 3, {"per_tile": 7, "num_sms": 3}),
    ]


GROUPED = grouped_cases()


def all_grouped_checks():
    rows = []
    for i, (name, groups, singles, hq, hkv, d, dt, splits, kw) in enumerate(GROUPED):
        rows.append(("grouped/" + name, check_grouped(groups, singles, hq, hkv, d, dt,
                                                      seed=500 + i, splits=splits, **kw)))
    rows.append(("grouped/padded", check_grouped_padded()))
    return rows


def check_grouped_padded():
    groups = [(40, [45, 60, 41])] if _small() else [(1024, [1100, 1300, 1025, 2000])]
    return check_grouped(groups, [30], 8, 2, 64 if not _small() else 16, torch.bfloat16,
                         seed=77, splits=2, pad_to=8, graph_mode=True)


@pytest.mark.parametrize("case", GROUPED, ids=[c[0] for c in GROUPED])
@gpu[0]
@gpu[1]
def test_grouped_decode(case):
    name, groups, singles, hq, hkv, d, dt, splits, kw = case
    i = GROUPED.index(case)
    r = check_grouped(groups, singles, hq, hkv, d, dt, seed=500 + i, splits=splits, **kw)
    assert r["ok"], r


@gpu[0]
@gpu[1]
def test_grouped_decode_padded():
    r = check_grouped_padded()
    assert r["ok"], r
