"""The order in which the scheduler tries to admit waiting requests (`schedule_policy`).

- "fcfs": queue order (arrival; retracted requests re-queue at the front).
- "lpm": longest prefix match first, as SGLang's: the requests whose tokens have the
  longest cached prefix in the radix tree go first (ties in queue order), so a cached
  prefix is reused before eviction takes it, and requests that share one run back to back.
  Bounded two ways: a request that has been passed over in `MAX_WAIT_ORDERINGS` orderings
  goes ahead of all the others (in queue order), so none starves; and with more than
  `MAX_LPM_QUEUE` requests waiting the order is plain fcfs (as SGLang does: matching every
  waiting request each step would cost more than the order saves).
"""
from __future__ import annotations

from collections.abc import Iterable

from engine.core.radix_cache import RadixCache
from engine.core.request import Request

MAX_WAIT_ORDERINGS = 64
MAX_LPM_QUEUE = 128


class AdmissionOrder:
    def __init__(self, policy: str, cache: RadixCache,
                 max_wait: int = MAX_WAIT_ORDERINGS, max_queue: int = MAX_LPM_QUEUE) -> None:
        if policy not in ("fcfs", "lpm"):
            raise ValueError(f"schedule_policy must be 'fcfs' or 'lpm', not {policy!r}")
        self.lpm = policy == "lpm" and cache.enabled
        self.cache = cache
        self.max_wait = max_wait
        self.max_queue = max_queue
        self._orderings: dict[Request, int] = {}  # per waiting request: orderings it was in

    def __call__(self, waiting: Iterable[Request]) -> list[Request]:
        queue = list(waiting)
        if not self.lpm:
            return queue
        # (Rebuilt each time, so requests that left the queue are forgotten.)
        seen = {r: self._orderings.get(r, 0) + 1 for r in queue}
        self._orderings = seen
        if len(queue) > self.max_queue:
            return queue
        overdue = [r for r in queue if seen[r] > self.max_wait]
        rest = [r for r in queue if seen[r] <= self.max_wait]
        rest.sort(key=lambda r: -self.cache.match_len(r.token_ids))  # stable: ties keep order
        return overdue + rest
