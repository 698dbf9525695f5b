"""Radix-grouped decode: which running requests share a cached prefix, per decode step.

Requests that matched the same radix node hold the same KV slots for the node's whole
path (they took them from the tree), so a decode step can attend over that prefix once
for all of them and merge the partial result with each request's own suffix (the tokens
after the prefix) by log-sum-exp. This module decides the groups on the host; the Triton
backend runs them (`engine/attention/triton_backend.py`).

Per request we keep its *chain*: the nodes on the path from its locked `last_node` up to
the root whose end depth is at least `min_tokens` (deepest first; a short walk, usually
one to three nodes). The chain is cached per request and rebuilt only when its
`last_node` changes or a node on it was split (its parent changed: a split inserts a new
node above). A step then counts, per chain node, how many of the step's requests have it,
and gives each request the deepest node shared with another request. Staleness can only
cost sharing, never correctness: any chain node is a true prefix of the request, with the
tree's slots, for as long as the request holds its lock.

Device metadata (one int64 tensor, laid out for a capacity `cap` >= batch size, so a CUDA
graph captured for a padded batch of `cap` reads it at fixed addresses):

    [0] num_tiles   [1] num_splits (prefix splits P)
    then six arrays of `cap` entries:
    pfx_len[b]      prefix length of batch entry b (0: not grouped, attends alone)
    tile_row[t]     req_to_token row holding the prefix slots (any member's row)
    tile_len[t]     prefix length L of tile t
    tile_mstart[t]  first member of tile t in `members`
    tile_mcount[t]  members of tile t (<= members_per_tile)
    members[i]      batch indices, tile by tile

A tile is up to `members_per_tile` members of one group (a big group gets several tiles,
each reading the prefix once); the prefix kernel loads a KV block once per tile and KV
head and multiplies it by all the tile's members' query heads of that KV head.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

CTRL = 2  # leading control entries of the packed metadata
FIELDS = 6  # arrays of `cap` entries after them


def packed_len(cap: int) -> int:
    return CTRL + FIELDS * cap


@dataclass
class GroupPlan:
    """One decode step's groups, on the host."""

    cap: int
    pfx_len: list[int]  # per batch entry
    tiles: list[tuple[int, int, int, int]]  # (row, prefix_len, member_start, member_count)
    members: list[int]
    num_splits: int
    num_groups: int
    kv_tokens_plain: int  # KV tokens the plain decode kernel would read (per layer)
    kv_tokens_read: int  # ... and the grouped kernels read: each tile's prefix once + suffixes
    max_suffix: int  # longest suffix (eager split heuristic)
    max_prefix: int

    def packed(self) -> list[int]:
        cap = self.cap
        n = len(self.tiles)
        out = [n, self.num_splits]
        out += self.pfx_len + [0] * (cap - len(self.pfx_len))
        pad = [0] * (cap - n)
        for f in range(4):
            out += [t[f] for t in self.tiles] + pad
        out += self.members + [0] * (cap - len(self.members))
        return out


@dataclass
class PrefixGroupBatch:
    """Device views of the packed metadata, plus host-side sizes for launch decisions."""

    packed: torch.Tensor  # [packed_len(cap)] int64
    cap: int
    num_tiles: int  # host copy (eager launches size their grid with it; graphs use cap)
    num_splits: int
    max_suffix: int

    @property
    def ctrl(self) -> torch.Tensor:
        return self.packed[:CTRL]

    def field(self, i: int) -> torch.Tensor:
        start = CTRL + i * self.cap
        return self.packed[start:start + self.cap]

    @property
    def pfx_len(self) -> torch.Tensor:
        return self.field(0)

    @property
    def tile_row(self) -> torch.Tensor:
        return self.field(1)

    @property
    def tile_len(self) -> torch.Tensor:
        return self.field(2)

    @property
    def tile_mstart(self) -> torch.Tensor:
        return self.field(3)

    @property
    def tile_mcount(self) -> torch.Tensor:
        return self.field(4)

    @property
    def members(self) -> torch.Tensor:
        return self.field(5)

    @classmethod
    def from_plan(cls, packed: torch.Tensor, plan: GroupPlan) -> "PrefixGroupBatch":
        return cls(packed=packed, cap=plan.cap, num_tiles=len(plan.tiles),
                   num_splits=plan.num_splits, max_suffix=plan.max_suffix)

    @classmethod
    def from_packed(cls, packed: torch.Tensor, host: torch.Tensor,
                    seq_lens: list[int]) -> "PrefixGroupBatch":
        """From the uploaded metadata and its host copy (`GroupPlan.packed()` as an int64
        CPU tensor): what a tensor-parallel rank that did not plan the step gets."""
        cap = (host.numel() - CTRL) // FIELDS
        head = host[:CTRL + len(seq_lens)].tolist()
        pfx = head[CTRL:]
        return cls(packed=packed, cap=cap, num_tiles=head[0], num_splits=head[1],
                   max_suffix=max((s - p for s, p in zip(seq_lens, pfx)), default=1))


class PrefixGrouper:
    """Computes a `GroupPlan` per decode step from the requests' locked radix nodes.

    Args:
        min_tokens: a shared prefix shorter than this is not grouped.
        members_per_tile: how many requests one prefix-kernel tile serves.
        min_saved_tokens: use the grouped kernels only when they save at least this many
            KV tokens of reading per layer (below it the extra launch costs more).
    """

    def __init__(self, min_tokens: int, members_per_tile: int, min_saved_tokens: int = 4096) -> None:
        self.min_tokens = max(1, int(min_tokens))
        self.members_per_tile = max(1, int(members_per_tile))
        self.min_saved_tokens = int(min_saved_tokens)
        # request -> (last_node, nodes deepest first, their end depths, their parents)
        self._chains: dict = {}
        # Counters over all decode steps planned (for benchmarks).
        self.steps = 0
        self.grouped_steps = 0
        self.kv_tokens_plain = 0
        self.kv_tokens_read = 0

    def reset_stats(self) -> None:
        self.steps = self.grouped_steps = self.kv_tokens_plain = self.kv_tokens_read = 0

    # -- chains -------------------------------------------------------------------------
    def chain(self, req) -> tuple[tuple, tuple]:
        """(nodes, depths): the request's ancestors (its last_node included) ending at a
        depth >= min_tokens, deepest first."""
        node = req.last_node
        ent = self._chains.get(req)
        if ent is not None and ent[0] is node:
            nodes, parents = ent[1], ent[3]
            for i in range(len(nodes)):
                if nodes[i].parent is not parents[i]:
                    break
            else:
                return nodes, ent[2]
        nodes, depths, parents = [], [], []
        d = req.locked_len
        while node is not None and node.parent is not None and d >= self.min_tokens:
            nodes.append(node)
            depths.append(d)
            parents.append(node.parent)
            d -= len(node.key)
            node = node.parent
        ent = (req.last_node, tuple(nodes), tuple(depths), tuple(parents))
        self._chains[req] = ent
        return ent[1], ent[2]

    # -- per step -----------------------------------------------------------------------
    def plan(self, reqs: list, seq_lens: list[int], cap: int,
             choose_splits: Callable[[int, int], int]) -> GroupPlan | None:
        """Groups for one decode step of `reqs` (seq_lens include the new token), or None
        when grouping is not worth it. `choose_splits(num_tiles, max_prefix)` picks the
        prefix split count."""
        n = len(reqs)
        plain = sum(seq_lens)
        self.steps += 1
        self.kv_tokens_plain += plain
        if len(self._chains) > 2 * n + 256:  # forget finished requests
            self._chains = {r: self._chains[r] for r in reqs if r in self._chains}
        plan = self._plan(reqs, seq_lens, cap, choose_splits, plain) if n >= 2 else None
        if plan is None:
            self.kv_tokens_read += plain
        else:
            self.grouped_steps += 1
            self.kv_tokens_read += plan.kv_tokens_read
        return plan

    def note_plain(self, seq_lens: list[int]) -> None:
        """Count a decode step that runs without grouping (e.g. a small plain graph)."""
        total = sum(seq_lens)
        self.steps += 1
        self.kv_tokens_plain += total
        self.kv_tokens_read += total

    def _plan(self, reqs, seq_lens, cap, choose_splits, plain) -> GroupPlan | None:
        chains = [self.chain(r) for r in reqs]
        counts: dict = {}
        for nodes, _ in chains:
            for node in nodes:
                counts[node] = counts.get(node, 0) + 1
        if not counts or max(counts.values()) < 2:
            return None
        groups: dict = {}  # node -> [prefix_len, [batch indices]]
        for i, (nodes, depths) in enumerate(chains):
            for node, d in zip(nodes, depths):
                if counts[node] >= 2:
                    g = groups.get(node)
                    if g is None:
                        groups[node] = g = [d, []]
                    g[1].append(i)
                    break
        # A request left alone at its deepest shared node joins a shallower group.
        for node in [nd for nd, g in groups.items() if len(g[1]) == 1]:
            g = groups[node]
            if len(g[1]) != 1:
                continue
            i = g[1][0]
            nodes = chains[i][0]
            for other in nodes[nodes.index(node) + 1:]:
                og = groups.get(other)
                if og is not None and len(og[1]) >= 1:
                    og[1].append(i)
                    del groups[node]
                    break
        plan = build_plan([(plen, idx) for plen, idx in groups.values()],
                          [r.row for r in reqs], seq_lens, cap, self.members_per_tile,
                          choose_splits)
        if plan is None or plan.kv_tokens_plain - plan.kv_tokens_read < self.min_saved_tokens:
            return None
        return plan


def build_plan(groups: list[tuple[int, list[int]]], rows: list[int], seq_lens: list[int],
               cap: int, members_per_tile: int,
               choose_splits: Callable[[int, int], int]) -> GroupPlan | None:
    """Tiles from groups [(prefix_len, batch indices)]; groups of fewer than two members are
    dropped (those requests attend alone). `rows[i]` is batch entry i's req_to_token row;
    members of a group must hold the same slots in [0, prefix_len) and prefix_len must be
    below their seq_len."""
    pfx_len = [0] * len(seq_lens)
    tiles: list[tuple[int, int, int, int]] = []
    members: list[int] = []
    prefix_tokens = 0
    num_groups = 0
    max_prefix = 0
    per = max(1, members_per_tile)
    for plen, idx in groups:
        idx = [i for i in idx if plen < seq_lens[i]]  # the new token is always in the suffix
        m = len(idx)
        if m < 2 or plen <= 0:
            continue
        num_groups += 1
        max_prefix = max(max_prefix, plen)
        row = rows[idx[0]]
        for i in idx:
            pfx_len[i] = plen
        nt = -(-m // per)
        base, extra = divmod(m, nt)
        pos = 0
        for t in range(nt):
            cnt = base + (1 if t < extra else 0)
            tiles.append((row, plen, len(members) + pos, cnt))
            pos += cnt
        members += idx
        prefix_tokens += nt * plen
    if not tiles:
        return None
    assert len(seq_lens) <= cap
    plain = sum(seq_lens)
    read = plain - sum(pfx_len) + prefix_tokens
    max_suffix = max(s - p for s, p in zip(seq_lens, pfx_len))
    return GroupPlan(cap=cap, pfx_len=pfx_len, tiles=tiles, members=members,
                     num_splits=choose_splits(len(tiles), max_prefix), num_groups=num_groups,
                     kv_tokens_plain=plain, kv_tokens_read=read, max_suffix=max_suffix,
                     max_prefix=max_prefix)
