"""The order in which the scheduler tries to admit waiting requests (`schedule_policy`).

- "fcfs": queue order (arrival; retracted requests re-queue at the front).
- "lpm": longest prefix match first, as SGLang's: the requests whose tokens have the
  longest cached prefix in the radix tree go first (ties in queue order), so a cached
  prefix is reused before eviction takes it, and requests that share one run back to back.
  Bounded two ways: a request that has been passed over in `MAX_WAIT_ORDERINGS` orderings
  goes ahead of all the others (in queue order), so none starves; and with more than
  `MAX_LPM_QUEUE` requests waiting the order is plain fcfs (as SGLang does: matching every
  waiting request each step would cost more than the order saves).

Priorities (`SamplingParams.priority`, lower first, as vLLM's) come before the policy:
the queue is ordered by priority, and within one priority by the policy above (so lpm's
starvation bound holds among requests of the same priority; a lower priority waits for
every higher one). With `priority_scheduling="off"` requests may not set one
(`check_priority`); when all priorities are equal the order is the policy's alone.
"""
from __future__ import annotations

from collections.abc import Iterable

from engine.core.radix_cache import RadixCache
from engine.core.request import Request
from engine.core.sampling_params import SamplingParams

MAX_WAIT_ORDERINGS = 64
MAX_LPM_QUEUE = 128


class AdmissionOrder:
    def __init__(self, policy: str, cache: RadixCache,
                 max_wait: int = MAX_WAIT_ORDERINGS, max_queue: int = MAX_LPM_QUEUE,
                 by_priority: bool = True) -> None:
        if policy not in ("fcfs", "lpm"):
            raise ValueError(f"schedule_policy must be 'fcfs' or 'lpm', not {policy!r}")
        self.lpm = policy == "lpm" and cache.enabled
        self.by_priority = by_priority
        # Set once a request with a priority other than 0 is queued: until then the sort
        # is skipped (150 us a step over 1,000 waiting requests on a loaded 2-core box).
        self.saw_priority = False
        self.cache = cache
        self.max_wait = max_wait
        self.max_queue = max_queue
        self._orderings: dict[Request, int] = {}  # per waiting request: orderings it was in

    def __call__(self, waiting: Iterable[Request]) -> list[Request]:
        queue = self._policy_order(list(waiting))
        if self.by_priority and self.saw_priority:
            queue.sort(key=_priority)  # stable: the policy's order within a priority
        return queue

    def _policy_order(self, queue: list[Request]) -> list[Request]:
        if not self.lpm:
            return queue
        # (Rebuilt each time, so requests that left the queue are forgotten.)
        seen = {r: self._orderings.get(r, 0) + 1 for r in queue}
        self._orderings = seen
        if len(queue) > self.max_queue:
            return queue
        overdue = [r for r in queue if seen[r] > self.max_wait]
        rest = [r for r in queue if seen[r] <= self.max_wait]
        # stable: ties keep their order
        rest.sort(key=lambda r: -self.cache.match_len(r.token_ids, r.lora_id))
        return overdue + rest


def _priority(req: Request) -> int:
    return req.params.priority


def check_priority(params: SamplingParams, priority_scheduling: str) -> None:
    """Raise ValueError for a priority the engine would not honour (never a silent drop)."""
    if priority_scheduling == "off" and params.priority != 0:
        raise ValueError(f"priority {params.priority} was given, but this server does not "
                         "schedule by priority (priority_scheduling is 'off')")
