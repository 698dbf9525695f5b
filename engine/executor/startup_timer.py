"""Start-up timing: each phase's wall time, and how long this process has lived."""
from __future__ import annotations

import os
import time


def process_age_s() -> float:
    """Seconds since this process started (Linux; 0.0 elsewhere): start-up logs say where a
    replica's first minute went, imports included."""
    try:
        with open("/proc/self/stat") as f:
            started_ticks = int(f.read().rpartition(")")[2].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0.0
    return uptime - started_ticks / os.sysconf("SC_CLK_TCK")


def format_seconds(times: dict[str, float]) -> str:
    """"load 0.31s, kv_pool 0.10s, ..." for start-up logs."""
    return ", ".join(f"{name} {s:.2f}s" for name, s in times.items())


class StartupTimer:
    """Wall time of each start-up phase: `mark(name)` closes the phase that started at the
    previous mark (or at construction)."""

    def __init__(self) -> None:
        self.start = self.last = time.perf_counter()
        self.phases: dict[str, float] = {}

    def mark(self, name: str) -> float:
        now = time.perf_counter()
        took = now - self.last
        self.phases[name] = self.phases.get(name, 0.0) + took
        self.last = now
        return took

    @property
    def total(self) -> float:
        return self.last - self.start

    def summary(self) -> str:
        return f"{self.total:.2f}s ({format_seconds(self.phases)})"
