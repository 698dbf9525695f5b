"""The replica's side of prefix fetches (deployments/prefix_fetch.py) between two real
engines in this process, the Serve handle replaced by a direct call to the holder's
`PrefixFetcher.export` (the Ray path: tests/test_prefix_fetch_http.py): a fetched prefix
is loaded instead of computed, with the same output; a holder that hangs costs the
timeout and the request computes; a request aborted mid-fetch leaves nothing behind."""
from __future__ import annotations

import asyncio

import pytest

from deployments.prefix_fetch import PrefixFetch, PrefixFetcher
from engine import AsyncEngine, EngineConfig, ProcessAsyncEngine, SamplingParams, ensure_demo_model
from test_engine import assert_slots_accounted

PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=True)
HISTORY = [3 + (11 * i) % 500 for i in range(60)]
PROMPT = HISTORY + [2] * 4
TOKEN_BYTES = 2 * 2 * 2 * 16 * 4  # k+v, layers, kv heads, head dim, float32


class Response:
    """What the fetcher uses of a Serve DeploymentResponse: awaitable, cancellable."""

    def __init__(self, coro) -> None:
        self.task = asyncio.ensure_future(coro)

    def __await__(self):
        return self.task.__await__()

    def cancel(self) -> None:
        self.task.cancel()


class Method:
    def __init__(self, fn) -> None:
        self.fn = fn
        self.calls: list[Response] = []

    def remote(self, arg):
        self.calls.append(Response(self.fn(arg)))
        return self.calls[-1]


class Handle:
    """The engine deployment's handle as the fetcher calls it: to one holder's export."""

    def __init__(self, export) -> None:
        self.export_prefix = Method(export)


def engine(kind: type = AsyncEngine):
    config = EngineConfig(model=ensure_demo_model(), dtype="float32", max_total_tokens=160,
                          chunked_prefill_size=32, host_kv_cache_gb=0.01)
    return AsyncEngine(config, detokenize=False) if kind is AsyncEngine else ProcessAsyncEngine(config)


@pytest.fixture(scope="module")
def engines():
    """The holder's engine in a child process (as on a GPU replica), the receiver's on a thread."""
    a, b = engine(ProcessAsyncEngine), engine()
    yield a, b
    a.shutdown()
    b.shutdown()


def outputs(eng: AsyncEngine, rid: str, prompt: list[int] = PROMPT):
    tokens, logprobs = [], []

    async def run():
        async for delta in eng.generate(prompt, PARAMS, rid):
            tokens.extend(delta.token_ids)
            logprobs.extend(delta.logprobs or [])
            if delta.finished:
                return delta
    last = asyncio.run(run())
    return tokens, logprobs, last


def test_a_fetched_prefix_is_loaded_not_computed(engines):
    a, b = engines
    asyncio.run(a.flush_cache())
    asyncio.run(b.flush_cache())
    outputs(a, "a-history", HISTORY)
    holder = PrefixFetcher(a, "a", lambda: None)
    receiver = PrefixFetcher(b, "b", lambda: Handle(holder.export))
    assert asyncio.run(receiver.fetch_for("a", PROMPT, PARAMS)) == len(HISTORY)
    assert asyncio.run(receiver.fetch_for("b", PROMPT, PARAMS)) == 0  # itself: never
    assert asyncio.run(receiver.fetch_for(None, PROMPT, PARAMS)) == 0
    s = receiver.counters()
    assert s["prefix_fetches"] == 1 and s["prefix_fetched_tokens"] == len(HISTORY)
    assert s["prefix_fetched_bytes"] == len(HISTORY) * TOKEN_BYTES
    assert holder.counters()["prefix_exports"] == 1
    on_b, on_a = outputs(b, "b-fetched"), outputs(a, "a-cached")
    assert on_b[2].cached_tokens == on_a[2].cached_tokens == len(HISTORY)
    assert on_b[:2] == on_a[:2]  # the same KV bytes: the same tokens and logprobs
    # the holder no longer has it: a miss, not a failure
    asyncio.run(a.flush_cache())
    missed = PrefixFetcher(b, "b", lambda: Handle(holder.export))
    assert asyncio.run(missed.fetch_for("a", PROMPT, PARAMS)) == 0
    assert missed.counters()["prefix_fetch_misses"] == 1
    assert_slots_accounted(b.engine, idle=True)
    # and back: the engine in a process imports as well
    back = PrefixFetcher(a, "a", lambda: Handle(receiver.export))
    assert asyncio.run(back.fetch_for("b", PROMPT, PARAMS)) == len(PROMPT)
    tokens, logprobs, last = outputs(a, "a-fetched")
    assert last.cached_tokens == len(PROMPT) - 1  # (its last token is computed: it samples)
    assert tokens == on_a[0] and logprobs == pytest.approx(on_a[1], abs=1e-4)


def test_only_what_the_receiver_lacks_travels(engines):
    """The receiver holds the history's first part: the holder sends the rest alone, and
    the output is the same as the holder's own."""
    a, b = engines
    asyncio.run(a.flush_cache())
    asyncio.run(b.flush_cache())
    outputs(a, "a-history-2", HISTORY)
    outputs(b, "b-part", HISTORY[:32])
    held = asyncio.run(b.cached_length(PROMPT))
    assert 32 <= held < len(HISTORY)
    holder = PrefixFetcher(a, "a", lambda: None)
    receiver = PrefixFetcher(b, "b", lambda: Handle(holder.export))
    assert asyncio.run(receiver.fetch_for("a", PROMPT, PARAMS)) == len(HISTORY) - held
    assert holder.counters()["prefix_exported_tokens"] == len(HISTORY) - held
    assert receiver.counters()["prefix_fetched_bytes"] == (len(HISTORY) - held) * TOKEN_BYTES
    on_b, on_a = outputs(b, "b-fetched-tail"), outputs(a, "a-cached-2")
    assert on_b[2].cached_tokens == on_a[2].cached_tokens == len(HISTORY)
    assert on_b[:2] == on_a[:2]
    # everything held: nothing is asked; rows past what an importer no longer holds: refused
    assert asyncio.run(receiver.fetch_for("a", PROMPT, PARAMS)) == 0
    assert holder.counters()["prefix_exports"] == 1
    tail = asyncio.run(a.export_prefix(PROMPT, 32))
    assert tail.start == 32 and tail.rows.k.shape[1] == len(tail.tokens) - 32
    asyncio.run(b.flush_cache())
    assert asyncio.run(b.import_prefix(tail)) == 0
    assert_slots_accounted(b.engine, idle=True)


def test_a_hanging_holder_costs_the_timeout_then_the_request_computes(engines):
    _, b = engines
    asyncio.run(b.flush_cache())

    async def never(fetch: PrefixFetch):
        await asyncio.Event().wait()

    hung = Handle(never)
    receiver = PrefixFetcher(b, "b", lambda: hung, timeout_s=0.3)
    assert asyncio.run(receiver.fetch_for("a", PROMPT, PARAMS)) == 0
    s = receiver.counters()
    assert s["prefix_fetch_failures"] == 1 and s["prefix_fetches"] == 0
    assert 0.3 <= s["prefix_fetch_seconds"] < 5
    assert hung.export_prefix.calls[0].task.cancelled()  # the call was given up, not left running
    tokens, _, last = outputs(b, "b-computed")
    assert len(tokens) == 4 and last.cached_tokens == 0


def test_a_dead_holder_fails_the_fetch_at_once(engines):
    """A holder whose call hangs but that Ray reports dead: the fetch gives up at the next
    look-up, long before its timeout, and the request computes."""
    _, b = engines
    asyncio.run(b.flush_cache())
    looked_up = []

    async def never(fetch: PrefixFetch):
        await asyncio.Event().wait()

    def alive(holder: str) -> bool:
        looked_up.append(holder)
        return len(looked_up) < 3  # dead from the third look-up on

    hung = Handle(never)
    receiver = PrefixFetcher(b, "b", lambda: hung, timeout_s=60, holder_alive=alive)
    assert asyncio.run(receiver.fetch_for("a", PROMPT, PARAMS)) == 0
    s = receiver.counters()
    assert s["prefix_fetch_failures"] == 1 and s["prefix_fetches"] == 0
    assert s["prefix_fetch_seconds"] < 10 and looked_up == ["a"] * 3
    assert hung.export_prefix.calls[0].task.cancelled()
    tokens, _, last = outputs(b, "b-computed-dead")
    assert len(tokens) == 4 and last.cached_tokens == 0


def test_a_request_aborted_mid_fetch_leaves_nothing_behind(engines):
    _, b = engines
    asyncio.run(b.flush_cache())
    started = []

    async def slow(fetch: PrefixFetch):
        started.append(fetch)
        await asyncio.Event().wait()

    receiver = PrefixFetcher(b, "b", lambda: Handle(slow), timeout_s=30)

    async def abort_mid_fetch():
        task = asyncio.ensure_future(receiver.fetch_for("a", PROMPT, PARAMS))
        while not started:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return await b.stats()

    stats = asyncio.run(abort_mid_fetch())
    assert started[0].holder_replica == "a" and started[0].tokens == PROMPT
    assert receiver.counters()["prefix_fetch_failures"] == 0  # aborted, not failed
    assert stats["host_used_slots"] == 0 and stats["running"] == 0
    assert_slots_accounted(b.engine, idle=True)
