"""Tensor parallelism through Ray placement groups, across nodes: a real two-node Ray cluster
on this machine (`ray.cluster_utils.Cluster`, each node with one `fake_gpu`, the resource
that stands for a GPU), the Serve app at tp_size=2 with a SPREAD placement group, so rank 0
(the replica) and rank 1 (its worker actor) run on different nodes. Greedy text over HTTP
equals tp=1 offline; killing the worker fails the replica's health check, Serve restarts
the replica (fresh ranks) and requests succeed again."""
from __future__ import annotations

import time

import httpx
import pytest

from engine import LLM, SamplingParams
from serve_helpers import TWO_NODE_RESOURCES, call_deployment, serve_config_args, two_node_cluster

GPU = "fake_gpu"
assert GPU in TWO_NODE_RESOURCES
MODEL = "radixserve-demo"  # serve_config.yaml's served_model_name
PROMPTS = ["The old lighthouse keeper", "Once upon a time, in a small village"]
MAX_TOKENS = 8
DIST_TIMEOUT_S = 20.0  # rank start-up and every model collective; a dead rank fails fast


def app_args(model: str, **extra) -> dict:
    return serve_config_args(
        model=model,
        engine={"tp_size": 2, "dist_timeout_s": DIST_TIMEOUT_S, "max_total_tokens": 1024,
                "max_running_requests": 8, "chunked_prefill_size": 64},
        placement_group_strategy="SPREAD", tp_bundle={GPU: 1},
        health_check_period_s=1.0, health_check_timeout_s=10.0, graceful_shutdown_timeout_s=3.0,
        **extra)


@pytest.fixture(scope="module")
def cluster(request, tiny_llama):
    """Head (2 CPUs) + worker node (1 CPU), one fake GPU each; the app deployed on it.
    Yields the HTTP base URL."""
    from ray import serve

    from deployments.app import build_app

    cluster, port = two_node_cluster(request)
    serve.run(build_app(app_args(tiny_llama)), name="radixserve", route_prefix="/")
    cluster.node_ids = {cluster.head_node.node_id} | {n.node_id for n in cluster.worker_nodes}
    cluster.base = f"http://127.0.0.1:{port}"
    return cluster


@pytest.fixture(scope="module")
def reference(tiny_llama) -> list[str]:
    llm = LLM(model=tiny_llama, dtype="float32", max_total_tokens=1024)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return [o.text for o in llm.generate(PROMPTS, params)]


def tp_info() -> dict:
    return call_deployment("EngineReplica", "tp_info")  # works under Serve's throughput mode too


def complete(base: str, timeout: float = 60.0) -> httpx.Response:
    return httpx.post(f"{base}/v1/completions", timeout=timeout, json={
        "model": MODEL, "prompt": PROMPTS, "max_tokens": MAX_TOKENS, "temperature": 0,
        "ignore_eos": True})


def texts(r: httpx.Response) -> list[str]:
    assert r.status_code == 200, r.text
    return [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]


def test_ranks_run_on_different_nodes(cluster):
    import ray

    info = tp_info()
    assert len(info["node_ids"]) == 2 and len(info["workers"]) == 1
    assert set(info["node_ids"]) == cluster.node_ids  # one rank on each node
    # The worker says so itself, and the GCS agrees.
    worker = info["workers"][0]
    assert ray.get(worker.node_id.remote(), timeout=30) == info["node_ids"][1]
    actor = ray._private.state.actors(worker._actor_id.hex())
    assert actor["Address"]["NodeID"] == info["node_ids"][1]


def test_greedy_over_http_equals_offline_tp1(cluster, reference):
    r = complete(cluster.base)
    assert texts(r) == reference
    assert r.json()["usage"]["completion_tokens"] == MAX_TOKENS * len(PROMPTS)


def test_a_dead_rank_restarts_the_replica(cluster, reference):
    import ray

    before = tp_info()
    worker = before["workers"][0]
    ray.kill(worker, no_restart=True)
    # ray.kill is asynchronous: a ping sent right after it can still be answered.
    deadline = time.monotonic() + 30
    while True:
        try:
            ray.get(worker.ping.remote(), timeout=30)
        except ray.exceptions.RayActorError:
            break
        assert time.monotonic() < deadline, "the killed rank still answers pings"
        time.sleep(0.2)

    # A request now meets the dead rank (or, if Serve was quick, the new replica): either
    # way it must end, within the collective timeout, not hang.
    start = time.monotonic()
    try:
        r = complete(cluster.base, timeout=DIST_TIMEOUT_S + 30)
        if r.status_code == 200:
            assert texts(r) == reference
        else:
            assert r.status_code >= 500, r.text
    except httpx.ReadTimeout:
        pytest.fail("a request to the replica with a dead rank hung")
    assert time.monotonic() - start < DIST_TIMEOUT_S + 30

    deadline = time.monotonic() + 60
    outcome = None
    while time.monotonic() < deadline:
        try:
            r = complete(cluster.base, timeout=15)
            outcome = r.status_code, r.text[:200]
            if r.status_code == 200 and tp_info()["replica"] != before["replica"]:
                break
        except httpx.HTTPError as e:
            outcome = repr(e)
        time.sleep(0.5)
    else:
        pytest.fail(f"no new replica served requests within 60 s; last: {outcome}")
    assert texts(r) == reference
    after = tp_info()
    assert set(after["node_ids"]) == cluster.node_ids
    assert after["workers"][0]._actor_id != worker._actor_id


def test_colocated_ingress_at_tp2(cluster, reference, tiny_llama):
    """`ingress: colocated` (deployments/colocated.py) places its one deployment like the
    engine's: the replica is rank 0, its worker on the other node. Last in the module: it
    replaces the app."""
    from ray import serve

    from deployments.app import build_app

    serve.run(build_app(app_args(tiny_llama, ingress="colocated")), name="radixserve",
              route_prefix="/")
    assert set(serve.status().applications["radixserve"].deployments) == {"EngineIngress"}
    assert texts(complete(cluster.base)) == reference
    info = call_deployment("EngineIngress", "tp_info")
    assert set(info["node_ids"]) == cluster.node_ids and len(info["workers"]) == 1
