"""The engine replica's metrics: `EngineMetrics` folds the engine's stats into counters and
gauges from its step hook, and `RequestTimer` times one engine call (TTFT, inter-token
latency, queue/prefill/decode time, lengths) on the replica's event loop."""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from deployments.metric_catalogue import (
    BATCH_SIZE, BY_NAME, DECODE_TIME, E2E_REQUEST_LATENCY, ENGINE_CACHED_TOKENS, ENGINE_GENERATED_TOKENS, ENGINE_PROMPT_TOKENS, ENGINE_REQUESTS, ENGINE_STEPS, GRAMMAR_COMPILE_TIME, INTER_TOKEN_LATENCY, KV_CACHE_USAGE, NUM_RUNNING, NUM_WAITING, PREEMPTIONS, PREFILL_TIME, QUEUE_TIME, RADIX_CACHE_TOKENS, REQUEST_GENERATION_LENGTH, REQUEST_PROMPT_LENGTH, SPEC_ACCEPTED_TOKENS, SPEC_DRAFTED_TOKENS, SPEC_VERIFY_STEPS, TIME_PER_OUTPUT_TOKEN, TIME_TO_FIRST_TOKEN,
)
from deployments.metrics import MetricFactory, MetricSet, ray_metric

logger = logging.getLogger(__name__)

_STAT_COUNTERS = {  # engine.stats() key -> counter fed with its increase
    "prompt_tokens": ENGINE_PROMPT_TOKENS,
    "cached_tokens": ENGINE_CACHED_TOKENS,
    "generated_tokens": ENGINE_GENERATED_TOKENS,
    "preemptions": PREEMPTIONS,
    "steps": ENGINE_STEPS,
    "spec_steps": SPEC_VERIFY_STEPS,
    "spec_drafted_tokens": SPEC_DRAFTED_TOKENS,
    "spec_accepted_tokens": SPEC_ACCEPTED_TOKENS,
}
_STAT_GAUGES = {  # engine.stats() key -> gauge
    "running": NUM_RUNNING,
    "waiting": NUM_WAITING,
    "kv_usage": KV_CACHE_USAGE,
    "cached_slots": RADIX_CACHE_TOKENS,
}
_ITL_BOUNDS = BY_NAME[INTER_TOKEN_LATENCY].boundaries
_REQUEST_METRICS = (ENGINE_REQUESTS, TIME_TO_FIRST_TOKEN, INTER_TOKEN_LATENCY, E2E_REQUEST_LATENCY,
                    QUEUE_TIME, PREFILL_TIME, DECODE_TIME, TIME_PER_OUTPUT_TOKEN,
                    REQUEST_PROMPT_LENGTH, REQUEST_GENERATION_LENGTH)


class EngineMetrics:
    """The metrics of one engine replica.

    `on_step(stats)` runs in the engine's step hook (engine thread, after every step and
    command batch, and at least every 0.5 s when idle) with the `engine.stats()` snapshot
    the replica takes anyway: it observes the batch size of each new step, and folds stat
    increases into counters and current values into gauges at most every
    `flush_interval_s` (Ray exports every few seconds; recording per step would only cost).
    `track_request()` times one engine call on the replica's event loop.
    """

    def __init__(self, factory: MetricFactory = ray_metric, flush_interval_s: float = 0.5,
                 clock: Callable[[], float] = time.monotonic) -> None:
        names = [*_STAT_COUNTERS.values(), *_STAT_GAUGES.values(), BATCH_SIZE, GRAMMAR_COMPILE_TIME,
                 *_REQUEST_METRICS]
        self.metrics = MetricSet(names, factory)
        self._flush_interval_s = flush_interval_s
        self._clock = clock
        self._last_flush = -float("inf")
        # High-water marks: the engine can take back an admission within a step, and a
        # counter must never count the same tokens twice.
        self._counted = dict.fromkeys(_STAT_COUNTERS, 0)
        self._steps_seen = 0
        self._finished_seen = 0

    def on_step(self, stats: dict[str, Any]) -> None:
        self._observe_batch(stats)
        now = self._clock()
        if now - self._last_flush >= self._flush_interval_s:
            self._last_flush = now
            self._flush(stats)

    def _observe_batch(self, stats: dict[str, Any]) -> None:
        steps, finished = stats.get("steps", 0), stats.get("finished_requests", 0)
        if steps > self._steps_seen:
            # At most one step runs between two hook calls; requests that finished in it
            # have left `running` already.
            batch = stats.get("running", 0) + max(0, finished - self._finished_seen)
            self.metrics.observe(BATCH_SIZE, batch)
            self._steps_seen = steps
        self._finished_seen = finished

    def _flush(self, stats: dict[str, Any]) -> None:
        for key, name in _STAT_COUNTERS.items():
            value = stats.get(key, 0)
            if value > self._counted[key]:
                self.metrics.inc(name, value - self._counted[key])
                self._counted[key] = value
        for key, name in _STAT_GAUGES.items():
            if key in stats:
                self.metrics.set(name, stats[key])

    def on_grammar_compiles(self, seconds: list[float]) -> None:
        for s in seconds:
            self.metrics.observe(GRAMMAR_COMPILE_TIME, s)

    def track_request(self) -> RequestTimer:
        return RequestTimer(self.metrics, self._clock)


class RequestTimer:
    """Times one engine call from its arrival at the replica: TTFT at the first delta with
    tokens (split into queue and prefill time by the engine's queue time), inter-token
    latency; at the end: end-to-end latency, decode time, time per output token, prompt and
    output lengths, and the outcome.

    Inter-token latency is one sample per `itl_window_s` of a stream (the mean gap over the
    window), not one per delta: a Ray Histogram.observe costs tens of microseconds under
    the GIL the engine loop needs, and per delta it took 12% of a loaded replica's
    samples (py-spy, W2 on the H200). The process's local copy, which /metrics serves, takes
    every delta (a histogram update, ~0.4 us): vLLM's inter-token latency is per token, and
    a window's mean would hide its tail."""

    def __init__(self, metrics: MetricSet, clock: Callable[[], float], itl_window_s: float = 0.25) -> None:
        self._metrics = metrics
        self._token_gaps = metrics.local.histogram(INTER_TOKEN_LATENCY, _ITL_BOUNDS)
        self._clock = clock
        self._start = self._window_start = clock()
        self._window_tokens = 0
        self._itl_window_s = itl_window_s
        self._got_tokens = False
        self._first_token_at = self._last_delta_at = 0.0
        self._done = False

    def on_delta(self, num_tokens: int, finished: bool, finish_reason: str | None,
                 prompt_tokens: int = 0, completion_tokens: int = 0,
                 queue_time: float | None = None) -> None:
        now = self._clock()
        if num_tokens:
            if not self._got_tokens:
                self._first_token(now, queue_time)
                if num_tokens > 1:
                    # Tokens that came with the first reached the client with it: no gap.
                    self._token_gaps.observe(0.0, num_tokens - 1)
            else:
                # /metrics: every token after the first, its delta's gap shared among them.
                self._token_gaps.observe((now - self._last_delta_at) / num_tokens, num_tokens)
                self._window_tokens += num_tokens
                if now - self._window_start >= self._itl_window_s or finished:
                    self._metrics.observe(INTER_TOKEN_LATENCY,
                                          (now - self._window_start) / self._window_tokens, local=False)
                    self._window_start, self._window_tokens = now, 0
            self._last_delta_at = now
        if finished:
            self._metrics.observe(E2E_REQUEST_LATENCY, now - self._start)
            if self._got_tokens:
                self._finished(now, prompt_tokens, completion_tokens)
            self.close(finish_reason or "unknown")

    def _first_token(self, now: float, queue_time: float | None) -> None:
        ttft = now - self._start
        self._metrics.observe(TIME_TO_FIRST_TOKEN, ttft)
        if queue_time is not None:
            self._metrics.observe(QUEUE_TIME, queue_time)
            self._metrics.observe(PREFILL_TIME, max(0.0, ttft - queue_time))
        self._got_tokens = True
        self._first_token_at = self._window_start = now

    def _finished(self, now: float, prompt_tokens: int, completion_tokens: int) -> None:
        decode = now - self._first_token_at
        self._metrics.observe(DECODE_TIME, decode)
        if completion_tokens > 1:
            self._metrics.observe(TIME_PER_OUTPUT_TOKEN, decode / (completion_tokens - 1))
        if prompt_tokens:  # (0: the caller did not say)
            self._metrics.observe(REQUEST_PROMPT_LENGTH, prompt_tokens)
        if completion_tokens:
            self._metrics.observe(REQUEST_GENERATION_LENGTH, completion_tokens)

    def close(self, outcome: str = "cancelled") -> None:
        """Count the call once: with `outcome` unless it already finished."""
        if not self._done:
            self._done = True
            self._metrics.inc(ENGINE_REQUESTS, 1, {"finish_reason": outcome})


