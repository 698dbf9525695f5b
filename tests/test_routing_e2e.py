"""Prefix-aware routing end to end: a real Ray cluster, three engine replicas of the demo
model, requests through the real HTTP API (token-id prompts), and the replicas' own view.

Where a request was served is read from the replicas themselves: each replica's routing
stats carry the cache digest of its radix cache (`scripts/serve_replicas.py`), so "which replica
holds this prompt's blocks" is the replica's truth, not the router's belief; the
`cached_tokens` of each response is the serving replica's actual radix-cache hit.

Targeting a replica without knowing the router's tie-breaks: long requests with distinct
prompts sent one at a time each go to the least loaded replica, so n of them cover n
replicas, one each (`anchors`); afterwards any prompt starting with a replica's anchor is
routed there by affinity.
"""
from __future__ import annotations

import random
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from scripts.serve_replicas import (
    cached_blocks, call_each, holds_prefix, list_replicas, routing_stats,
)
from serve_helpers import start_ray, stop_ray, wait_until

APP, DEPLOYMENT, MODEL = "radixserve", "EngineReplica", "radixserve-demo"
BLOCK = 16
LONG = 400  # max_tokens of a long-running request (the demo model's context is 512)
ARGS = {
    "num_replicas": 3,
    # One ingress, so one router instance decides: these tests pin down its choices. (With
    # the default two, each ingress's router learns the other's routings only from the
    # replicas' digests, a stats period later, and on a loaded machine the tests flaked.)
    "ingress_replicas": 1,
    "ray_actor_options": {"num_cpus": 0.2},
    "graceful_shutdown_timeout_s": 5.0,
    "engine": {"max_total_tokens": 1600, "max_running_requests": 16, "chunked_prefill_size": 256},
    "router": {
        "request_router_class": "prefix",
        # Small thresholds so that three long requests on one replica count as imbalanced.
        "request_router_kwargs": {"block_size": BLOCK, "abs_threshold": 2, "rel_threshold": 1.5,
                                  "digest_grace_s": 1.0},
        "request_routing_stats_period_s": 0.2,
    },
}
# The router keeps what it routed for `digest_grace_s` even against a digest: wait longer
# than that plus a couple of stats periods before relying on a digest having landed.
DIGEST_SETTLE_S = 1.0 + 3 * 0.2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def deploy(port: int, engine_replicas: int | None = None) -> None:
    """Deploy the app from a config, as `serve deploy serve_config.yaml` does. Changing a
    deployment's `num_replicas` in the config's `deployments` section is a lightweight
    update (the other replicas keep running, caches intact); changing `args` (or calling
    `serve.run` again) redeploys every replica."""
    from ray import serve
    from ray.serve.schema import ServeDeploySchema

    app = {"name": APP, "route_prefix": "/", "import_path": "deployments.app:build_app", "args": ARGS}
    if engine_replicas is not None:
        app["deployments"] = [{"name": DEPLOYMENT, "num_replicas": engine_replicas}]
    config = ServeDeploySchema.model_validate(
        {"http_options": {"host": "127.0.0.1", "port": port}, "applications": [app]})
    serve.context._get_global_client().deploy_apps(config, _blocking=True)


@pytest.fixture(scope="module")
def port():
    from ray import serve

    start_ray()
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    deploy(port)
    yield port
    stop_ray()


@pytest.fixture(scope="module")
def base_url(port):
    return f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def client(base_url):
    with httpx.Client(base_url=base_url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def pool():
    with ThreadPoolExecutor(8) as ex:
        yield ex


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, 760) for _ in range(n)]  # vocab 768; 0..4 are special


def complete(client: httpx.Client, prompt: list[int], max_tokens: int = 4) -> dict:
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
                                             "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["completion_tokens"] == max_tokens
    return body["usage"]


def cached(usage: dict) -> int:
    return usage["prompt_tokens_details"]["cached_tokens"]


def replicas() -> dict:
    return list_replicas(APP, DEPLOYMENT)


def holders(prompt: list[int]) -> set[str]:
    """Replicas whose radix cache holds every full block of `prompt`."""
    return {rid for rid, held in holds_prefix(routing_stats(replicas()), prompt, BLOCK).items() if held}


def ongoing(rid: str) -> int:
    s = routing_stats({rid: replicas()[rid]})[rid]
    return s["num_running"] + s["num_waiting"]


def start_long(pool, client, prompt: list[int], on: str | None, expect_ongoing: int):
    """Submit a long-running request; return its future once a replica runs it (`on`: the
    replica expected to reach `expect_ongoing` requests; None: any replica, summed)."""
    fut = pool.submit(complete, client, prompt, LONG)

    def started() -> bool:
        if on is not None:
            return ongoing(on) >= expect_ongoing
        return sum(s["num_running"] + s["num_waiting"] for s in routing_stats(replicas()).values()) >= expect_ongoing

    assert wait_until(started, timeout=20, interval=0.01), "long request never started"
    return fut


@pytest.fixture(scope="module")
def anchors(client, pool) -> dict[str, list[int]]:
    """{replica: a 64-token prompt cached on that replica only}."""
    rng = random.Random(1)
    reps = replicas()
    prompts = [tokens(rng, 64) for _ in reps]
    futures = [start_long(pool, client, p, None, i + 1) for i, p in enumerate(prompts)]
    stats = routing_stats(reps)
    out = {}
    for p in prompts:
        owners = [rid for rid, s in stats.items() if cached_blocks(s, p, BLOCK) == len(p) // BLOCK]
        assert len(owners) == 1, f"anchor prompt cached on {owners}"
        out[owners[0]] = p
    for f in futures:
        assert cached(f.result()) == 0
    assert set(out) == set(reps), "least-loaded routing should give each replica one anchor"
    return out


def test_shared_prefix_lands_on_one_replica_and_hits_its_cache(client):
    rng = random.Random(10)
    prefix = tokens(rng, 200)
    hits = [cached(complete(client, prefix + tokens(rng, 12))) for _ in range(6)]
    assert hits[0] < BLOCK  # nothing cached yet (at most a chance match of a token or two)
    assert all(200 <= h < 212 for h in hits[1:]), hits
    assert len(holders(prefix)) == 1


ROUTER_COUNTERS = ("routed_with_match", "routed_without_match", "load_fallbacks",
                   "predicted_matched_tokens")


def test_router_counters_and_predicted_vs_actual_cached_tokens(client):
    """The router's counters (in /v1/stats) move with each routed call, and what it predicts
    is cached (whole blocks) matches what the replica actually found (each response's
    cached_tokens, and the replicas' own counters) up to the partial last block."""
    rng = random.Random(15)
    prefix = tokens(rng, 10 * BLOCK)
    before = client.get("/v1/stats").json()
    usages = [complete(client, prefix + tokens(rng, 8)) for _ in range(4)]
    after = client.get("/v1/stats").json()
    moved = {k: after["router"][k] - before["router"][k] for k in ROUTER_COUNTERS}
    assert moved == {"routed_with_match": 3, "routed_without_match": 1, "load_fallbacks": 0,
                     "predicted_matched_tokens": 3 * len(prefix)}
    actual = [cached(u) for u in usages]
    assert actual[0] < BLOCK and all(len(prefix) <= a < len(prefix) + 8 for a in actual[1:]), actual
    assert after["cached_tokens"] - before["cached_tokens"] == sum(actual)


def test_router_stops_preferring_a_replica_that_evicted_the_prefix(client, pool, anchors):
    rng = random.Random(20)
    prefix = tokens(rng, 200)
    complete(client, prefix + tokens(rng, 12))
    routed_at = time.monotonic()
    [home] = holders(prefix)
    anchor = anchors[home]

    # Fill `home`'s small pool with other traffic routed there (by its anchor) until its
    # radix cache has evicted the prefix.
    for _ in range(20):
        assert cached(complete(client, anchor + tokens(rng, 340), max_tokens=40)) >= len(anchor)
        if cached_blocks(routing_stats(replicas())[home], prefix, BLOCK) == 0:
            break
    else:
        pytest.fail("the prefix was never evicted")
    time.sleep(max(0.0, routed_at + DIGEST_SETTLE_S - time.monotonic()))

    # Make `home` slightly busier than the others (not enough to count as imbalanced): a
    # router that still believed `home` held the prefix would send it there by affinity;
    # knowing it was evicted, it sends it to a less loaded replica.
    long = start_long(pool, client, anchor + tokens(rng, 16), home, 1)
    assert cached(complete(client, prefix + tokens(rng, 12))) < BLOCK
    now = holders(prefix)
    assert len(now) == 1 and home not in now, (home, now)
    assert cached(long.result()) >= len(anchor)


def test_load_imbalance_overrides_affinity(client, pool):
    rng = random.Random(30)
    prefix = tokens(rng, 96)
    complete(client, prefix + tokens(rng, 8))
    [home] = holders(prefix)

    # Balanced enough (loads 0, 1, 2 vs 0 with abs_threshold 2): affinity keeps the long
    # requests on `home`.
    longs = [start_long(pool, client, prefix + tokens(rng, 8), home, k + 1) for k in range(3)]
    # Now 3 vs 0 > abs_threshold and > rel_threshold * 0: the next one spills.
    assert ongoing(home) == 3
    spilled = complete(client, prefix + tokens(rng, 8))
    assert cached(spilled) < len(prefix)
    now = holders(prefix)
    assert home in now and len(now) == 2, (home, now)
    assert all(cached(f.result()) >= len(prefix) for f in longs)


def test_replica_removed_by_scaling_down_is_never_chosen(client, anchors, port):
    before = set(replicas())
    assert len(before) == 3
    deploy(port, engine_replicas=2)
    assert wait_until(lambda: len(replicas()) == 2, timeout=60), replicas()
    after = set(replicas())
    [gone] = before - after
    counts_before = {rid: s["finished_requests"] for rid, s in call_each(replicas(), "stats").items()}

    rng = random.Random(40)
    sent = 0
    # Its anchor was cached only on the removed replica: the requests still succeed, served
    # (and cached) by the remaining ones.
    gone_anchor = anchors[gone]
    usages = [complete(client, gone_anchor + tokens(rng, 16)) for _ in range(3)]
    sent += 3
    assert cached(usages[0]) == 0
    assert all(cached(u) >= len(gone_anchor) for u in usages[1:])
    assert holders(gone_anchor) <= after and len(holders(gone_anchor)) == 1
    # The remaining replicas still attract their own prefixes, and fresh prompts go somewhere
    # alive.
    for rid in after:
        still_cached = rid in holders(anchors[rid])  # earlier tests may have evicted it
        hit = cached(complete(client, anchors[rid] + tokens(rng, 16)))
        sent += 1
        assert hit >= len(anchors[rid]) or not still_cached
    for _ in range(4):
        complete(client, tokens(rng, 40))
        sent += 1
    counts_after = {rid: s["finished_requests"] for rid, s in call_each(replicas(), "stats").items()}
    assert set(counts_after) == after
    assert sum(counts_after[r] - counts_before[r] for r in after) == sent
