"""Queue deadlines: how long a request may wait for its first admission (and the refusal of
one that finds the queue full, `QueueFullError`).

A request's limit is the shorter of the engine's `max_queue_time_s` and its own
`queue_timeout_s`, counted from its arrival. A request still waiting for its first admission
past it ends (finish reason "queue_timeout") without any of its tokens computed; the
streaming layers turn that into a `QueueTimeoutError`. A request that was admitted and later
retracted (preempted) is never timed out: it has streamed tokens already, and resumes.

The scheduler checks the deadlines before planning every step, so they fire whether the
engine is busy (a full batch) or has nothing to run. Deadlines live in a heap: a step costs
O(log n) per request that expires or leaves, not a scan of the queue.
"""
from __future__ import annotations

import heapq
import itertools

from engine.core.request import Request, Status

QUEUE_TIMEOUT = "queue_timeout"  # the finish reason of a request timed out in the queue


class QueueFullError(RuntimeError):
    """The engine's waiting queue is over `max_queued_requests`; retry later."""


class QueueTimeoutError(RuntimeError):
    """A request waited in the queue past its limit. `by_request`: the limit was the
    request's own `queue_timeout_s` (a server answers 408), not the engine's
    `max_queue_time_s` (503: the server is too busy)."""

    def __init__(self, message: str, by_request: bool) -> None:
        super().__init__(message, by_request)  # both in args: it pickles to another process
        self.by_request = by_request

    def __str__(self) -> str:
        return self.args[0]


def queue_limit(req: Request, max_queue_time_s: float | None) -> tuple[float, bool] | None:
    """(seconds, whether the request's own limit is the tighter) or None: no limit."""
    own = req.params.queue_timeout_s
    if own is None and max_queue_time_s is None:
        return None
    if own is not None and (max_queue_time_s is None or own <= max_queue_time_s):
        return own, True
    return max_queue_time_s, False


def timeout_error(req: Request, max_queue_time_s: float | None) -> QueueTimeoutError:
    limit, by_request = queue_limit(req, max_queue_time_s) or (0.0, False)
    if by_request:
        return QueueTimeoutError(f"the request waited in the queue past its queue_timeout_s "
                                 f"({limit:g} s) and was not run", True)
    return QueueTimeoutError(f"the server is busy: the request waited in the queue past the "
                             f"server's limit ({limit:g} s) and was not run; retry later", False)


class QueueDeadlines:
    def __init__(self, max_queue_time_s: float | None) -> None:
        self.max_queue_time_s = max_queue_time_s
        self._heap: list[tuple[float, int, Request]] = []
        self._order = itertools.count()  # ties: requests are not comparable

    def add(self, req: Request) -> None:
        limit = queue_limit(req, self.max_queue_time_s)
        if limit is not None:
            heapq.heappush(self._heap, (req.arrival + limit[0], next(self._order), req))

    def expired(self, now: float) -> list[Request]:
        """Requests past their deadline and still waiting for their first admission.
        (Entries of requests admitted, aborted or finished meanwhile are dropped here.)"""
        out = []
        while self._heap and self._heap[0][0] <= now:
            req = heapq.heappop(self._heap)[2]
            if req.status is Status.WAITING and not req.admitted_once:
                out.append(req)
        return out
