"""Per decode step, the radix-grouped decode metadata (engine/core/prefix_groups.py) packed for
the batch size that runs it: a CUDA graph's padded size when a graph runs the step (none
when that size's graph decodes plainly), else the batch's own."""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from engine.core.request import Request

if TYPE_CHECKING:  # (imported by the runner only when grouped decode is on)
    from engine.core.prefix_groups import PrefixGrouper


class GroupedGraphs(Protocol):
    """What this needs of the CUDA graphs (engine/executor/graph_runner.py's GraphRunner,
    built above this module by the runner)."""

    max_bs: int

    def grouped_capacity(self, bs: int) -> int | None: ...


class GroupMetadata:
    def __init__(self, grouper: PrefixGrouper, graphs: GroupedGraphs | None,
                 num_splits: Callable) -> None:
        self.grouper = grouper
        self.graphs = graphs
        self.num_splits = num_splits  # the attention backend's split count for a group

    def packed(self, reqs: list[Request], seq_lens: list[int]) -> list[int]:
        """The step's metadata as ints; [] for plain decode."""
        n = len(reqs)
        cap = n
        if self.graphs is not None and n <= self.graphs.max_bs:
            cap = self.graphs.grouped_capacity(n)  # None: a plain graph runs this size
        if cap is None:
            self.grouper.note_plain(seq_lens)
            return []
        plan = self.grouper.plan(reqs, seq_lens, cap, self.num_splits)
        return plan.packed() if plan is not None else []
