"""The requests one router instance has sent (or is about to send) to each replica and that
have not finished: the part of a replica's load that its last report cannot show yet.

A replica reports its load (`num_running` + `num_waiting`) with a timestamp in its routing
stats; every ingress reads the same report. What an ingress adds on top is only its own
sends after that timestamp (`unreported`): requests sent before it are in the report
already, if still running. So the load each ingress uses is the shared report plus a fresh,
private remainder that a stats period later is shared too.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable


class OwnSends:
    """Per replica, request id -> when this router picked it for that replica, in time order.

    A pick that Serve never confirms as sent (the request was cancelled while waiting for a
    replica) is dropped after `pick_ttl_s`; confirmed ones stay until completed."""

    def __init__(self, pick_ttl_s: float = 2.0, max_unconfirmed: int = 4096) -> None:
        self.pick_ttl_s = pick_ttl_s
        self.max_unconfirmed = max_unconfirmed
        self._by_replica: dict[Hashable, OrderedDict[str, float]] = {}
        self._where: dict[str, Hashable] = {}
        self._unconfirmed: OrderedDict[str, float] = OrderedDict()

    def pick(self, request_id: str, replica_id: Hashable, now: float) -> None:
        """`request_id` will most likely go to `replica_id`: count it there from now."""
        self._move(request_id, replica_id, now)
        self._unconfirmed.pop(request_id, None)
        self._unconfirmed[request_id] = now
        self._expire(now)

    def sent(self, request_id: str, replica_id: Hashable, now: float) -> None:
        """Serve sent it to `replica_id` (the pick, or another replica when the pick was full)."""
        self._unconfirmed.pop(request_id, None)
        where = self._where.get(request_id)
        if where == replica_id:
            return  # counted there since the pick
        at = self._by_replica.get(where, {}).get(request_id, now)
        self._move(request_id, replica_id, at)

    def completed(self, request_id: str) -> None:
        self._unconfirmed.pop(request_id, None)
        replica_id = self._where.pop(request_id, None)
        if replica_id is not None:
            self._by_replica.get(replica_id, {}).pop(request_id, None)

    def forget_replica(self, replica_id: Hashable) -> None:
        for request_id in self._by_replica.pop(replica_id, {}):
            self._where.pop(request_id, None)
            self._unconfirmed.pop(request_id, None)

    def count(self, replica_id: Hashable) -> int:
        return len(self._by_replica.get(replica_id, ()))

    def unreported(self, replica_id: Hashable, since: float) -> int:
        """Own requests at `replica_id` picked after `since` (a report's timestamp)."""
        n = 0
        for t in reversed(self._by_replica.get(replica_id, {}).values()):
            if t <= since:
                break
            n += 1
        return n

    def _move(self, request_id: str, replica_id: Hashable, at: float) -> None:
        old = self._where.get(request_id)
        if old is not None:
            self._by_replica.get(old, {}).pop(request_id, None)
        self._where[request_id] = replica_id
        sends = self._by_replica.setdefault(replica_id, OrderedDict())
        sends.pop(request_id, None)
        sends[request_id] = at  # newest last
        if len(sends) > 1 and at < _second_last(sends):
            # A pick re-sent with its original time (its first replica was full): keep
            # the time order `unreported` relies on.
            self._by_replica[replica_id] = OrderedDict(sorted(sends.items(), key=lambda kv: kv[1]))

    def _expire(self, now: float) -> None:
        while self._unconfirmed:
            request_id, t = next(iter(self._unconfirmed.items()))
            if t >= now - self.pick_ttl_s and len(self._unconfirmed) <= self.max_unconfirmed:
                break
            self.completed(request_id)


def _second_last(sends: OrderedDict[str, float]) -> float:
    values = reversed(sends.values())
    next(values)
    return next(values)
