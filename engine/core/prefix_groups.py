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

The packed device layout of a step's groups: engine/executor/prefix_group_batch.py.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass
class Group:
    """Batch entries that share the KV slots of their first `prefix_len` tokens."""

    prefix_len: int
    members: list[int]  # batch indices


@dataclass(frozen=True)
class Tile:
    """Up to `members_per_tile` members of one group: the prefix kernel reads the prefix
    once per tile."""

    row: int  # req_to_token row holding the prefix slots (any member's row)
    prefix_len: int
    member_start: int  # first member of the tile in `GroupPlan.members`
    member_count: int


@dataclass(frozen=True)
class Chain:
    """A request's ancestors ending at a depth >= min_tokens, deepest first (its locked
    node included), with what they looked like when the chain was built."""

    last_node: object  # the request's locked radix node the chain starts from
    nodes: tuple  # radix nodes, deepest first
    depths: tuple[int, ...]  # end depth (prefix length) of each node
    parents: tuple  # each node's parent then: a split since then changed it

    def is_current(self, last_node) -> bool:
        """Still the request's chain: same locked node, and no node on it was split."""
        return self.last_node is last_node and all(
            node.parent is parent for node, parent in zip(self.nodes, self.parents))


@dataclass
class GroupPlan:
    """One decode step's groups, on the host."""

    cap: int
    pfx_len: list[int]  # per batch entry
    tiles: list[Tile]
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
        out += [t.row for t in self.tiles] + pad
        out += [t.prefix_len for t in self.tiles] + pad
        out += [t.member_start for t in self.tiles] + pad
        out += [t.member_count for t in self.tiles] + pad
        out += self.members + [0] * (cap - len(self.members))
        return out


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
        self._chains: dict = {}  # request -> its Chain
        # Counters over all decode steps planned (for benchmarks).
        self.steps = 0
        self.grouped_steps = 0
        self.kv_tokens_plain = 0
        self.kv_tokens_read = 0

    def reset_stats(self) -> None:
        self.steps = self.grouped_steps = self.kv_tokens_plain = self.kv_tokens_read = 0

    # -- chains -------------------------------------------------------------------------
    def chain(self, req) -> Chain:
        """The request's ancestors (its last_node included) ending at a depth >=
        min_tokens, deepest first; cached until its last_node changes or a node is split."""
        cached = self._chains.get(req)
        if cached is not None and cached.is_current(req.kv.node):
            return cached
        nodes, depths = [], []
        node, d = req.kv.node, req.kv.locked_len
        while node is not None and node.parent is not None and d >= self.min_tokens:
            nodes.append(node)
            depths.append(d)
            d -= len(node.key)
            node = node.parent
        chain = Chain(req.kv.node, tuple(nodes), tuple(depths),
                      tuple(n.parent for n in nodes))
        self._chains[req] = chain
        return chain

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
        for chain in chains:
            for node in chain.nodes:
                counts[node] = counts.get(node, 0) + 1
        if not counts or max(counts.values()) < 2:
            return None
        groups: dict = {}  # node -> Group: each request at its deepest node shared with another
        for i, chain in enumerate(chains):
            for node, d in zip(chain.nodes, chain.depths):
                if counts[node] >= 2:
                    groups.setdefault(node, Group(d, [])).members.append(i)
                    break
        # A request left alone at its deepest shared node joins a shallower group.
        for node in [nd for nd, g in groups.items() if len(g.members) == 1]:
            g = groups[node]
            if len(g.members) != 1:
                continue
            i = g.members[0]
            nodes = chains[i].nodes
            for other in nodes[nodes.index(node) + 1:]:
                og = groups.get(other)
                if og is not None and og.members:
                    og.members.append(i)
                    del groups[node]
                    break
        plan = build_plan(list(groups.values()), [r.kv.row for r in reqs], seq_lens, cap,
                          self.members_per_tile, choose_splits)
        if plan is None or plan.kv_tokens_plain - plan.kv_tokens_read < self.min_saved_tokens:
            return None
        return plan


def build_plan(groups: list[Group], rows: list[int], seq_lens: list[int],
               cap: int, members_per_tile: int,
               choose_splits: Callable[[int, int], int]) -> GroupPlan | None:
    """Tiles from groups; groups of fewer than two members are dropped (those requests
    attend alone). `rows[i]` is batch entry i's req_to_token row; members of a group must
    hold the same slots in [0, prefix_len) and prefix_len must be below their seq_len."""
    pfx_len = [0] * len(seq_lens)
    tiles: list[Tile] = []
    members: list[int] = []
    prefix_tokens = 0
    num_groups = 0
    max_prefix = 0
    per = max(1, members_per_tile)
    for group in groups:
        plen = group.prefix_len
        # the new token is always in the suffix
        idx = [i for i in group.members if plen < seq_lens[i]]
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
            tiles.append(Tile(row, plen, len(members) + pos, cnt))
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
