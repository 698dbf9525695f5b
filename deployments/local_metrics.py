"""The process's own copy of what its metrics record, for the app's `GET /metrics`.

Ray's metrics leave a replica through the node's metrics agent, seconds later, and only
there. `/metrics` must answer from the replicas themselves, so every record that goes to a
Ray metric (deployments/metrics.py, `MetricSet`) also lands here: counters and gauges as
numbers, histograms as cumulative bucket counts, by catalogue name and tags. A scrape asks
each replica for `snapshot()` (deployments/scrape.py) and renders them side by side.

A record is a dict update under a lock (~1 us): cheap beside a Ray metric call (tens of us).
"""
from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass, field

Tags = tuple[tuple[str, str], ...]  # sorted (key, value) pairs


@dataclass
class HistogramCounts:
    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)  # per bucket, the last one is +Inf
    total: float = 0.0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float, times: int = 1) -> None:
        """`times` equal observations at once (a delta's tokens sharing one gap)."""
        # `le` buckets: a value equal to a bound belongs to that bound's bucket.
        self.counts[bisect.bisect_left(self.bounds, value)] += times
        self.total += value * times


class LocalMetrics:
    """Counters, gauges and histograms of one process, keyed by (name, tags)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[tuple[str, Tags], float] = {}
        self._histograms: dict[tuple[str, Tags], HistogramCounts] = {}

    def inc(self, name: str, value: float, tags: dict[str, str] | None = None) -> None:
        key = (name, _tags(tags))
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + value

    def set(self, name: str, value: float, tags: dict[str, str] | None = None) -> None:
        with self._lock:
            self._values[(name, _tags(tags))] = float(value)

    def observe(self, name: str, value: float, bounds: tuple[float, ...],
                tags: dict[str, str] | None = None) -> None:
        hist = self.histogram(name, bounds, tags)
        with self._lock:
            hist.observe(value, 1)

    def histogram(self, name: str, bounds: tuple[float, ...],
                  tags: dict[str, str] | None = None) -> HistogramCounts:
        """The histogram itself, for a caller that observes it often from one thread (the
        replica's event loop): no lookup and no lock per value. A scrape reading it
        meanwhile may see a bucket a value ahead of the sum, never a torn count."""
        key = (name, _tags(tags))
        with self._lock:
            hist = self._histograms.get(key)
            if hist is None:
                hist = self._histograms[key] = HistogramCounts(bounds)
            return hist

    def snapshot(self) -> dict[str, list]:
        """Plain lists (they cross to the scraping ingress through Ray):
        {"values": [[name, {tags}, value]], "histograms": [[name, {tags}, bounds, counts, sum]]}."""
        with self._lock:
            values = [[n, dict(t), v] for (n, t), v in self._values.items()]
            hists = [[n, dict(t), list(h.bounds), list(h.counts), h.total]
                     for (n, t), h in self._histograms.items()]
        return {"values": values, "histograms": hists}


def _tags(tags: dict[str, str] | None) -> Tags:
    return tuple(sorted(tags.items())) if tags else ()


_process = LocalMetrics()


def process_metrics() -> LocalMetrics:
    """This process's recorder: every replica in it shares it (one per Serve replica process;
    the colocated deployment's ingress and engine records sit side by side)."""
    return _process

