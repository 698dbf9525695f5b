"""The holder a request's replica should fetch its prefix from, named on the request.

When the policy (`router.policy`) sends a request to a replica whose digest holds less of
its prompt than another replica's (the holder was past its load bound, or the receiver is
new), the cost model (`router.fetch_cost`) weighs fetching the difference from the holder
against computing it. Where fetching wins, the router writes the holder's replica id into
the request's `fetch_from` field (deployments/engine_replica.py `EngineCall`; duck-typed:
the router does not import the deployments), which travels with the call; the receiving
replica fetches before the prefill (deployments/prefix_fetch.py). Requests without that
field, without token ids or under a LoRA adapter get no holder.
"""
from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

from router.fetch_cost import FetchCosts, Holding, plan
from router.prefix_index import PrefixIndex

HINT_FIELD = "fetch_from"


class FetchHints:
    def __init__(self, index: PrefixIndex, costs: FetchCosts) -> None:
        self._index = index
        self._costs = costs

    def name_holder(self, pending_request: Any, hashes: list[int] | None, lora: str | None,
                    pick: Hashable, replicas: Sequence[Any],
                    load: Callable[[Any], float]) -> None:
        """Set (or clear, on a retry elsewhere) the request's `fetch_from` for `pick`."""
        arg = pending_request.args[0] if pending_request.args else None
        if arg is None or not hasattr(arg, HINT_FIELD):
            return
        holder = self.holder_for(hashes, lora, pick, replicas, load)
        setattr(arg, HINT_FIELD, None if holder is None else holder.unique_id)

    def holder_for(self, hashes: list[int] | None, lora: str | None, pick: Hashable,
                   replicas: Sequence[Any], load: Callable[[Any], float]) -> Any | None:
        """The ReplicaID `pick` should fetch from, or None (nothing worth fetching)."""
        if not hashes or lora is not None:
            return None
        holdings = [self._holding(r.replica_id, hashes, load(r)) for r in replicas]
        mine = next((h for h in holdings if h.replica_id == pick), None)
        if mine is None:
            return None
        return plan(mine, holdings, len(hashes) * self._index.block_size, self._costs).fetch_from

    def _holding(self, replica_id: Any, hashes: list[int], load: float) -> Holding:
        """What the replica's digest holds of the prompt, on its GPU and on its host (the
        device part leads: a node leaves the device only after its children)."""
        matched = self._index.match(hashes, [replica_id])[replica_id]
        host = self._index.on_host(replica_id, hashes[:matched])
        block = self._index.block_size
        return Holding(replica_id, (matched - host) * block, host * block, load)
