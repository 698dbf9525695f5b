"""Prefix-aware routing end to end, at the product's defaults: a real Ray cluster, two engine
replicas of the demo model and the default ingress count (two per engine replica: four
ingress replicas, each with its own router instance), requests through the real HTTP API.

The check the issue asks for: a shared-prefix burst sent all at once through the four
ingresses finds the radix caches as well as through one ingress (>= 90% of its hit rate,
same machine, same prompts, fresh replicas). Routers that each decide for their own slice
of the traffic split a group's requests over the replicas and fail it. The hit rate is the
replicas' own (cached / prompt tokens from `/v1/stats`), not the routers' belief.

Under Ray Serve's throughput mode (HAProxy in front of the ingress replicas):
RADIXSERVE_THROUGHPUT_MODE_FILES=test_routing_e2e.py pytest tests/test_serve_throughput_mode.py
"""
from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from serve_helpers import BASE, PORT, deploy_all, start_ray, stop_ray, wait_until

APP, MODEL = "radixserve", "radixserve-demo"
BLOCK = 16
GROUPS, PER_GROUP = 16, 4
PREFIX_LEN, QUESTION_LEN = 12 * BLOCK, 16
ARGS = {
    # Product defaults but for the size of a 2-core test machine: no ingress_replicas, the
    # default router and its default stats period.
    "num_replicas": 2,
    "ray_actor_options": {"num_cpus": 0.2},
    "graceful_shutdown_timeout_s": 5.0,
    "graceful_shutdown_wait_loop_s": 0.2,  # as serve_helpers.serve_config_args
    "engine": {"max_total_tokens": 8192, "max_running_requests": 32, "chunked_prefill_size": 512},
}


@pytest.fixture(scope="module")
def base_url():
    """Serve on the session's Ray cluster; the test deploys its own apps."""
    from ray import serve

    start_ray()
    serve.start(http_options={"port": PORT})
    yield BASE
    stop_ray()


def burst(base_url: str, seed: int) -> list[list[int]]:
    """GROUPS x PER_GROUP prompts (a shared prefix per group plus a question), shuffled."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(GROUPS):
        prefix = [rng.randrange(10, 760) for _ in range(PREFIX_LEN)]  # vocab 768; 0..4 special
        prompts += [prefix + [rng.randrange(10, 760) for _ in range(QUESTION_LEN)]
                    for _ in range(PER_GROUP)]
    rng.shuffle(prompts)
    return prompts


def send_all(base_url: str, prompts: list[list[int]]) -> None:
    def one(prompt: list[int]) -> None:
        r = httpx.post(f"{base_url}/v1/completions", timeout=300, json={
            "model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text

    with ThreadPoolExecutor(len(prompts)) as pool:
        list(pool.map(one, prompts))


def stats(base_url: str) -> dict:
    r = httpx.get(f"{base_url}/v1/stats", timeout=60)
    r.raise_for_status()
    return r.json()


def wait_for_ingresses(base_url: str, n: int) -> None:
    """Every ingress replica answers (its router exists once it has routed a call: warm each
    with requests that share nothing with the burst, then empty the caches)."""
    rng = random.Random(99)

    def warm() -> bool:
        send_all(base_url, [[5 + i % 5] + [rng.randrange(5, 10) for _ in range(40)] for i in range(8)])
        return stats(base_url).get("router", {}).get("ingress_replicas", 0) >= n

    assert wait_until(warm, timeout=120, interval=0.5), stats(base_url).get("router")
    assert httpx.post(f"{base_url}/flush_cache", timeout=60).status_code == 200
    time.sleep(2.5)  # two stats periods: the routers see the emptied caches


def measured_burst(base_url: str, ingress: int) -> tuple[float, dict]:
    """(the replicas' hit rate over the burst, the routers' counters moved by it)."""
    wait_for_ingresses(base_url, ingress)
    before = stats(base_url)
    prompts = burst(base_url, seed=7)
    send_all(base_url, prompts)
    after = stats(base_url)
    prompt = after["prompt_tokens"] - before["prompt_tokens"]
    cached = after["cached_tokens"] - before["cached_tokens"]
    moved = {k: v - before["router"].get(k, 0) for k, v in after["router"].items()
             if isinstance(v, int)}
    assert moved["routed_with_match"] + moved["routed_without_match"] == len(prompts), moved
    assert after["router"]["ingress_replicas"] == ingress
    return cached / prompt, moved


def test_burst_through_every_ingress_hits_the_cache_as_through_one(base_url):
    # Two fresh apps, started side by side: the default (two ingress replicas per engine
    # replica) on "/", one ingress replica on "/one". Each burst reaches one app only.
    deploy_all([(APP, "/", ARGS), (APP + "-one", "/one", {**ARGS, "ingress_replicas": 1})])
    fleet_hit, fleet_router = measured_burst(base_url, ingress=4)
    one_hit, _ = measured_burst(f"{base_url}/one", ingress=1)
    # Ceiling: each group's first request misses, the rest hit the prefix.
    ceiling = (PER_GROUP - 1) / PER_GROUP * PREFIX_LEN / (PREFIX_LEN + QUESTION_LEN)
    print(f"burst hit rate: {fleet_hit:.1%} through 4 ingress replicas, {one_hit:.1%} through one "
          f"(ceiling {ceiling:.1%}); routers: {fleet_router}")
    assert one_hit > 0.6 * ceiling, (one_hit, ceiling)
    assert fleet_hit >= 0.9 * one_hit, (fleet_hit, one_hit, fleet_router)
