"""Prefixes fetched from another replica through Ray's object store, across two Ray nodes on
this machine (`ray.cluster_utils.Cluster`, one engine replica per node, both with a host KV
tier): the router sends a request away from the replica holding its prefix when that one is
busy, names the holder, and the receiver fetches the prefix instead of computing it (its
stats show the fetch, the holder's the export, the response's usage the cached tokens);
the output equals a recompute; a receiver that holds part of the prefix gets the rest
alone. Then a holder that is stopped mid-fetch and killed: the
receiver gives up as soon as Ray reports the holder dead, well before the fetch's timeout,
and the request is computed on the receiver and succeeds."""
from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest

from engine import LLM, SamplingParams
from serve_helpers import TWO_NODE_RESOURCES, serve_config_args, two_node_cluster

pytestmark = pytest.mark.slow

SLOT = "engine_slot"  # one per node: one engine replica on each
assert SLOT in TWO_NODE_RESOURCES
MODEL = "radixserve-demo"
ENGINE = {"max_total_tokens": 4096, "max_running_requests": 8, "chunked_prefill_size": 64,
          "host_kv_cache_gb": 0.01}
BUSY_TOKENS = 3000  # a few seconds at the least, on any machine: the holder stays busy
STATS_PERIOD_S = 0.5  # the engine replicas' routing stats
BLOCK = 16
PREFIX_TOKENS = 8 * BLOCK
FETCH_TIMEOUT_S = 20.0  # far longer than the dead holder's fetch may take
MAX_TOKENS = 6


def prompt(seed: int, tail: int) -> tuple[list[int], list[int]]:
    """(a prefix of PREFIX_TOKENS ids, that prefix plus a tail of its own)."""
    prefix = [3 + (seed * 131 + 17 * i) % 700 for i in range(PREFIX_TOKENS)]
    return prefix, prefix + [3 + (tail * 7 + i) % 700 for i in range(8)]


@pytest.fixture(scope="module")
def model(tiny_model_factory) -> str:
    """The demo model's shape with room for a long request (the demo's context is 512)."""
    return tiny_model_factory("llama", max_position_embeddings=4096)


@pytest.fixture(scope="module")
def app(request, model):
    from ray import serve

    from deployments.app import build_app

    _, port = two_node_cluster(request)
    args = serve_config_args(
        model=model, num_replicas=2, ingress_replicas=1, engine=ENGINE,
        ray_actor_options={"num_cpus": 0.2, "resources": {SLOT: 1}},
        # overflow as soon as the holder has a request in flight and the other none
        router={"request_router_class": "prefix", "request_routing_stats_period_s": STATS_PERIOD_S,
                "request_router_kwargs": {"block_size": BLOCK, "abs_threshold": 0,
                                          "rel_threshold": 1.0}},
        prefix_fetch_timeout_s=FETCH_TIMEOUT_S, health_check_period_s=2.0,
        graceful_shutdown_timeout_s=2.0)
    serve.run(build_app(args), name="radixserve", route_prefix="/")
    return f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def offline(model):
    return LLM(model=model, **ENGINE)


def complete(base: str, ids: list[int], max_tokens: int = MAX_TOKENS) -> dict:
    r = httpx.post(f"{base}/v1/completions", timeout=120, json={
        "model": MODEL, "prompt": ids, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, "logprobs": 1})
    assert r.status_code == 200, r.text
    return r.json()


def replicas():
    from scripts.serve_replicas import list_replicas

    found = list_replicas("radixserve", "EngineReplica")
    assert len(found) == 2
    return found


def holder_of(prefix: list[int], timeout: float = 30.0) -> str:
    """The one replica whose digest holds `prefix`, once the routers can know it too."""
    from scripts.serve_replicas import holds_prefix, routing_stats

    deadline = time.monotonic() + timeout
    while True:
        held = [rid for rid, yes in holds_prefix(routing_stats(replicas()), prefix).items() if yes]
        if len(held) == 1:
            time.sleep(1.5)  # three routing-stats periods: every router has the digest
            return held[0]
        assert time.monotonic() < deadline, f"no single holder of the prefix: {held}"
        time.sleep(0.3)


def engine_stats() -> dict[str, dict]:
    from scripts.serve_replicas import call_each

    return call_each(replicas(), "stats")


class Busy:
    """A long streamed request (to its prefix's holder) that runs until the block ends,
    when the client leaves and the engine aborts it. The router counts it on the holder
    from the moment it sends it, so a request after it finds the holder loaded."""

    def __init__(self, base: str, ids: list[int]) -> None:
        self.base, self.ids, self.stop = base, ids, threading.Event()
        self.streaming = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        body = {"model": MODEL, "prompt": self.ids, "max_tokens": BUSY_TOKENS, "temperature": 0,
                "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", f"{self.base}/v1/completions", json=body, timeout=120) as r:
                for _ in r.iter_lines():
                    self.streaming.set()
                    if self.stop.is_set():
                        return
        except httpx.HTTPError:
            pass  # (a killed holder takes its own request with it)
        finally:
            self.streaming.set()

    def __enter__(self) -> Busy:
        self.thread.start()
        # Running on the holder (on a loaded box the send alone can outlast any fixed wait),
        # then two stats periods: the holder's own report carries the load too.
        assert self.streaming.wait(60), "the busy request never started streaming"
        time.sleep(2 * STATS_PERIOD_S)
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(60)


def reference(offline: LLM, ids: list[int]):
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=True)
    offline.engine.flush_cache()
    return offline.generate([ids], params)[0]


def test_the_replicas_run_on_two_nodes(app):
    from scripts.serve_replicas import call_each

    nodes = {info["node_ids"][0] for info in call_each(replicas(), "tp_info").values()}
    assert len(nodes) == 2


def test_a_busy_holders_prefix_is_fetched_by_the_other_replica(app, offline):
    prefix, first = prompt(1, 1)
    complete(app, first)
    holder = holder_of(prefix)
    before = engine_stats()
    ids = prompt(1, 3)[1]
    with Busy(app, prompt(1, 2)[1]):
        body = complete(app, ids)
    after = engine_stats()
    other = next(rid for rid in after if rid != holder)
    fetched = after[other]["prefix_fetched_tokens"] - before[other]["prefix_fetched_tokens"]
    assert after[other]["prefix_fetches"] - before[other]["prefix_fetches"] == 1
    assert fetched == PREFIX_TOKENS
    assert after[other]["prefix_fetched_bytes"] > before[other]["prefix_fetched_bytes"]
    assert after[holder]["prefix_exports"] - before[holder]["prefix_exports"] == 1
    # the fetched tokens came from the host tier, not a prefill: usage counts them
    assert after[other]["host_cached_tokens"] - before[other]["host_cached_tokens"] >= PREFIX_TOKENS
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] >= PREFIX_TOKENS
    # the same as computing it all here
    ref = reference(offline, ids)
    choice = body["choices"][0]
    assert choice["text"] == ref.text
    assert choice["logprobs"]["token_logprobs"] == pytest.approx(ref.logprobs, abs=1e-4)


def test_the_holder_sends_only_what_the_receiver_lacks(app, offline):
    """The receiver holds the prefix's first half (computed there directly): the holder
    sends the other half alone, and the output equals a recompute."""
    from deployments.engine_replica import EngineCall
    from scripts.serve_replicas import stream_replica

    prefix, first = prompt(3, 1)
    complete(app, first)
    holder = holder_of(prefix)
    other = next(rid for rid in replicas() if rid != holder)
    half = PREFIX_TOKENS // 2
    seed = EngineCall("seed-half", prefix[:half], SamplingParams(max_tokens=1))
    stream_replica(replicas()[other], "generate", seed)
    time.sleep(1.5)  # three routing-stats periods: every router has the digest
    before = engine_stats()
    ids = prompt(3, 3)[1]
    with Busy(app, prompt(3, 2)[1]):
        body = complete(app, ids)
    after = engine_stats()
    gained = {k: after[other][k] - before[other][k]
              for k in ("prefix_fetches", "prefix_fetched_tokens", "prefix_fetched_bytes")}
    assert gained["prefix_fetches"] == 1 and gained["prefix_fetched_tokens"] == half, gained
    exported = after[holder]["prefix_exported_tokens"] - before[holder]["prefix_exported_tokens"]
    assert exported == half
    assert gained["prefix_fetched_bytes"] == half * offline.engine.kv_transfer.row_bytes
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] >= PREFIX_TOKENS
    ref = reference(offline, ids)
    assert body["choices"][0]["text"] == ref.text
    assert body["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx(ref.logprobs, abs=1e-4)


def test_a_holder_killed_mid_fetch_leaves_the_request_to_be_computed(app, offline):
    from scripts.serve_replicas import replica_pids

    prefix, first = prompt(2, 1)
    complete(app, first)
    holder = holder_of(prefix)
    pid = replica_pids(replicas())[holder]
    before = engine_stats()
    ids = prompt(2, 3)[1]
    result: dict = {}
    worker = threading.Thread(target=lambda: result.update(body=complete(app, ids)), daemon=True)
    other = next(rid for rid in before if rid != holder)
    with Busy(app, prompt(2, 2)[1]):
        os.kill(pid, signal.SIGSTOP)  # the holder answers nothing from now on: a fetch hangs
        try:
            start = time.monotonic()
            worker.start()
            time.sleep(1.5)  # the receiver is waiting on the holder
            assert worker.is_alive()
        finally:
            os.kill(pid, signal.SIGKILL)
        worker.join(FETCH_TIMEOUT_S + 60)
    assert "body" in result, "the request did not finish after its holder died"
    assert time.monotonic() - start < FETCH_TIMEOUT_S + 60
    from scripts.serve_replicas import call_each, list_replicas

    after = call_each({other: list_replicas("radixserve", "EngineReplica")[other]}, "stats")[other]
    assert after["prefix_fetch_failures"] - before[other]["prefix_fetch_failures"] == 1
    assert after["prefix_fetches"] == before[other]["prefix_fetches"]
    # stopped for 1.5 s, then dead: the fetch ended on the death, not at the timeout
    waited = after["prefix_fetch_seconds"] - before[other]["prefix_fetch_seconds"]
    assert waited < FETCH_TIMEOUT_S / 2, waited
    body = result["body"]
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    ref = reference(offline, ids)
    assert body["choices"][0]["text"] == ref.text
