"""Prefixes fetched from another engine replica, through Ray's object store.

The request router (router/fetch_cost.py) may send a request to a replica that holds less
of its prompt than another one does (the holder is busy, or the receiver is new), and then
names the holder on the request's `EngineCall.fetch_from`. Before the request enters its
engine, the receiving replica asks the holder for the prompt's longest cached prefix
(`EngineReplica.export_prefix`, a call the request router sends to the holder alone), past
the tokens the receiver holds already in either tier (`PrefixFetch.held`). The holder's
engine writes that part back to its host tier and reads its rows; they return as
the call's result, an object in Ray's object store (a Ray actor call, whatever transport
Serve's handles use by default), which Ray pulls to the receiver's node. The receiver puts
them into its own host tier (`import_prefix`), where the request finds them and loads them
like any host-tier hit: its prefill of that prefix is skipped, and `cached_tokens` in its
usage counts them.

Nothing here can fail a request: a holder that is stopped or slow (past `timeout_s`), that
no longer holds the prefix, or whose rows do not fit this engine costs the request the
wait, then it computes the prefix as it would have. A holder that died costs less: while the
call is out, the receiver looks the holder up in Ray's actor table every
`HOLDER_CHECK_PERIOD_S` (router/ray_adapter.py `peer_replica_alive`), and gives up as soon
as Ray reports it dead, whether the call was waiting in Serve's router for a replica that
is gone or had reached it before it died. A request aborted during the fetch
cancels the call; nothing was held for it (an import that already finished is plain cache,
evictable like the rest).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from deployments.channel import submit
from engine import EngineClient, ExportedPrefix, SamplingParams

logger = logging.getLogger(__name__)

DEFAULT_FETCH_TIMEOUT_S = 10.0
HOLDER_CHECK_PERIOD_S = 0.25


class HolderGone(RuntimeError):
    """Ray reports the holder's actor dead."""


@dataclass
class PrefixFetch:
    """The argument of `EngineReplica.export_prefix`; the request router sends it to
    `holder_replica` and nowhere else (router/request_router.py)."""

    holder_replica: str
    tokens: list[int]
    held: int = 0  # the leading tokens the receiver has: their KV is not sent


@dataclass
class FetchStats:
    """This replica's side of prefix fetches, in /v1/stats and the metrics (summed over
    replicas)."""

    prefix_fetches: int = 0  # fetches whose KV went into this replica's host tier
    prefix_fetch_failures: int = 0  # holder gone, stopped, past the timeout, or unusable KV
    prefix_fetch_misses: int = 0  # the holder had nothing more (any more), or this replica had it all
    prefix_fetched_tokens: int = 0  # tokens imported: prefill they skip
    prefix_fetched_bytes: int = 0
    prefix_fetch_seconds: float = 0.0  # request to import done, every fetch (failed ones too)
    prefix_exports: int = 0  # prefixes this replica handed to others
    prefix_exported_tokens: int = 0  # tokens whose KV was sent (past what the receiver held)


def kv_bytes(prefix: ExportedPrefix) -> int:
    return sum(t.nbytes for t in (prefix.rows.k, prefix.rows.v))


class PrefixFetcher:
    """Both sides of prefix fetches for one replica: `fetch_for` (the receiver's, before a
    request's prefill) and `export` (the holder's)."""

    def __init__(self, engine: EngineClient, replica_id: str, handle: Callable[[], Any],
                 timeout_s: float = DEFAULT_FETCH_TIMEOUT_S,
                 holder_alive: Callable[[str], bool] = lambda holder: True) -> None:
        self.engine = engine
        self.replica_id = replica_id
        self._make_handle = handle
        self._handle: Any = None  # the engine deployment's, by reference: made on first use
        self.timeout_s = timeout_s
        self.holder_alive = holder_alive  # (a blocking lookup: run on a thread)
        self.stats = FetchStats()

    @property
    def enabled(self) -> bool:
        """Only an engine with a host tier takes prefixes in."""
        return self.engine.config.host_kv_cache_gb > 0

    def wanted(self, fetch_from: str | None, params: SamplingParams) -> bool:
        # (an adapter's prefixes are not the base model's: the router never names a holder
        # for them, and one named anyway is ignored)
        return (self.enabled and bool(fetch_from) and fetch_from != self.replica_id
                and params.lora is None)

    async def fetch_for(self, fetch_from: str | None, tokens: list[int],
                        params: SamplingParams) -> int:
        """Bring the longest prefix of `tokens` that `fetch_from` holds into this engine's
        host tier; the tokens imported (0 on any failure: the request recomputes)."""
        if not self.wanted(fetch_from, params):
            return 0
        start = time.perf_counter()
        try:
            return await self._fetch(fetch_from, tokens)
        except asyncio.CancelledError:
            raise  # the request was aborted: the call is cancelled with it
        except Exception as e:  # noqa: BLE001 - any failure means: compute it here
            self.stats.prefix_fetch_failures += 1
            logger.warning("prefix fetch from %s failed (%s: %s); computing it instead",
                           fetch_from, type(e).__name__, e)
            return 0
        finally:
            self.stats.prefix_fetch_seconds += time.perf_counter() - start

    async def _fetch(self, holder: str, tokens: list[int]) -> int:
        held = await self.engine.cached_length(tokens)
        if held >= len(tokens):
            self.stats.prefix_fetch_misses += 1
            return 0
        if self._handle is None:
            self._handle = self._make_handle()
        response = submit(self._handle.export_prefix, PrefixFetch(holder, list(tokens), held))
        try:
            prefix = await self._answer_or_death(response, holder)
        except BaseException:
            response.cancel()  # timed out, holder dead or aborted: the holder need not finish
            raise
        if prefix is None:
            self.stats.prefix_fetch_misses += 1
            return 0
        added = await self.engine.import_prefix(prefix)
        if not added:
            self.stats.prefix_fetch_misses += 1
            return 0
        self.stats.prefix_fetches += 1
        self.stats.prefix_fetched_tokens += added
        self.stats.prefix_fetched_bytes += kv_bytes(prefix)
        return added

    async def _answer_or_death(self, response: Any, holder: str) -> ExportedPrefix | None:
        """The holder's answer; TimeoutError past `timeout_s`, HolderGone once Ray reports
        the holder dead."""
        answer = asyncio.ensure_future(_result(response))
        watch = asyncio.ensure_future(self._until_dead(holder))
        try:
            done, _ = await asyncio.wait((answer, watch), timeout=self.timeout_s,
                                        return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not answer.done():
                answer.cancel()
        if answer in done:
            return answer.result()
        if watch in done:
            raise HolderGone(f"replica {holder} died")
        raise TimeoutError(f"no answer in {self.timeout_s} s")

    async def _until_dead(self, holder: str) -> None:
        while await asyncio.to_thread(self.holder_alive, holder):
            await asyncio.sleep(HOLDER_CHECK_PERIOD_S)

    async def export(self, fetch: PrefixFetch) -> ExportedPrefix | None:
        """The holder's side: the longest cached prefix of `fetch.tokens`, with the KV of
        its tokens past `fetch.held`; None when nothing past them is cached here."""
        prefix = await self.engine.export_prefix(fetch.tokens, fetch.held)
        if prefix is not None:
            self.stats.prefix_exports += 1
            self.stats.prefix_exported_tokens += len(prefix.tokens) - prefix.start
        return prefix

    def counters(self) -> dict[str, int | float]:
        return asdict(self.stats)


async def _result(response: Any) -> Any:
    return await response


def engine_handle() -> Any:
    """This replica's own deployment, by reference (router/ray_adapter.py `by_reference`):
    the handle a fetch goes through to reach the holder."""
    from ray import serve

    from router import ray_adapter

    deployment = serve.get_replica_context().replica_id.deployment_id
    handle = serve.get_deployment_handle(deployment.name, deployment.app_name)
    return ray_adapter.by_reference(handle)
