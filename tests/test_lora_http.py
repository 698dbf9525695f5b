"""LoRA adapters through the Serve app: real Ray, real HTTP, the official openai client,
SGLang's /generate (`lora_path`) and the front-end language. One app of two engine
replicas: an adapter from the app args, ones loaded and unloaded at runtime (vLLM's and
SGLang's endpoints) on every replica, ones loaded on first use from `lora_dynamic_path`,
requests routed to the replica holding their adapter, the errors, and a replica that Serve
starts after one was killed applying the runtime loads and unloads (the app's registry);
then the same load/unload on two `ingress: colocated` replicas."""
from __future__ import annotations

import random
import re
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import torch
from safetensors.torch import load_file, save_file

import frontend as sgl
from deployments.engine_replica import EngineCall
from engine import LLM, SamplingParams, ensure_demo_model
from lora_adapters import SPECS, make_adapter
from scripts.serve_replicas import call_each, call_replica, list_replicas, stream_replica
from serve_helpers import BASE, run_app, serve_config_args, start_ray, stop_ray, wait_until

pytestmark = pytest.mark.slow
MODEL = "radixserve-demo"
PROMPT = [1, 17, 230, 5, 88, 41, 9, 3]
STATS_PERIOD_S = 0.5  # the engine replicas' routing stats reach the router this often
SETTLE_S = 6 * STATS_PERIOD_S  # a change of a replica's adapters reaches every router by then
ENGINE = {"max_total_tokens": 2048, "max_loras": 2, "max_lora_rank": 16}


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("lora-http")
    base = ensure_demo_model()
    for i, name in enumerate(["boot", "late", "dyn/found"]):
        make_adapter(base, str(root / name), seed=i, **SPECS["qv-mlp-r8"])
    make_adapter(base, str(root / "wide"), r=32, lora_alpha=32, target_modules=["q_proj"])
    for name, like in (("dyn/third", "late"), ("solo", "late"), ("both", "boot"), ("busy", "late"),
                       ("kept", "late")):
        shutil.copytree(root / like, root / name)  # a name of its own is all these need
    # one made for another base (a wider q_proj input), one naming a layer the model lacks
    _edited(root / "boot", root / "other", lambda k, v: (
        k, torch.zeros(v.shape[0], 96) if "q_proj.lora_A" in k else v))
    _edited(root / "boot", root / "moved", lambda k, v: (k.replace("layers.0.", "layers.99."), v))
    names = ["boot", "late", "wide", "solo", "both", "busy", "other", "moved", "dyn", "kept"]
    return {name: str(root / name) for name in names}


def _edited(src: Path, dst: Path, edit) -> None:
    shutil.copytree(src, dst)
    file = dst / "adapter_model.safetensors"
    save_file(dict(edit(k, v) for k, v in load_file(str(file)).items()), str(file))


@pytest.fixture(scope="module")
def server(adapters):
    start_ray()
    args = serve_config_args(ingress_replicas=1, num_replicas=2, engine=ENGINE,
                             lora_modules={"boot": adapters["boot"]},
                             lora_dynamic_path=adapters["dyn"])
    args["router"] = {**args.get("router", {}), "request_routing_stats_period_s": STATS_PERIOD_S}
    run_app(args)
    yield
    stop_ray()
    # the app's adapter registry (deployments/lora_registry.py) ends with the app
    assert wait_until(lambda: not _registry_alive("radixserve"), timeout=20, interval=0.5)


def _registry_alive(app: str) -> bool:
    import ray

    from deployments.lora_registry import NAMESPACE, registry_name

    try:
        ray.get_actor(registry_name(app), namespace=NAMESPACE)
        return True
    except ValueError:
        return False


@pytest.fixture(scope="module")
def reference(adapters) -> dict[str | None, list[int]]:
    """Greedy tokens of PROMPT under each adapter, from the offline engine."""
    names = (None, "boot", "late", "found", "both")
    llm = LLM(model=ensure_demo_model(), max_total_tokens=1024, max_lora_rank=16, max_loras=4,
              lora_modules={"boot": adapters["boot"], "late": adapters["late"],
                            "found": f"{adapters['dyn']}/found", "both": adapters["both"]})
    outs = llm.generate([PROMPT] * len(names), [greedy(n) for n in names])
    return {n: o.token_ids for n, o in zip(names, outs)}


def greedy(lora: str | None) -> SamplingParams:
    return SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, lora=lora)


def _text(tokens: list[int]) -> str:
    from engine import Tokenizer

    return Tokenizer(ensure_demo_model()).decode(tokens)


def test_adapters_over_openai_and_sglang_apis(server, adapters, reference):
    client = openai.OpenAI(base_url=f"{BASE}/v1", api_key="x")
    models = {m.id: m for m in client.models.list().data}
    assert models["boot"].parent == MODEL and MODEL in models  # (pydantic keeps extras)
    base = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    boot = client.completions.create(model="boot", prompt=PROMPT, max_tokens=6, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    assert base == _text(reference[None]) and boot == _text(reference["boot"]) and boot != base
    with pytest.raises(openai.NotFoundError) as caught:
        client.completions.create(model="nope", prompt=PROMPT, max_tokens=2)
    assert caught.value.code == "model_not_found"

    # runtime load (vLLM's body), then the SGLang API's lora_path and the front-end language
    r = httpx.post(f"{BASE}/v1/load_lora_adapter",
                   json={"lora_name": "late", "lora_path": adapters["late"]}, timeout=60)
    assert r.status_code == 200, r.text
    r = httpx.post(f"{BASE}/generate", json={
        "input_ids": PROMPT, "lora_path": "late",
        "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}},
        timeout=60)
    assert r.status_code == 200 and r.json()["text"] == _text(reference["late"]), r.text

    @sgl.function
    def story(s):
        s += _text(PROMPT) + sgl.gen("x", max_tokens=3, temperature=0, lora="late")

    assert story.run(backend=sgl.RuntimeEndpoint(BASE))["x"]  # served under the adapter

    # a bad adapter: 400 naming the tensor; unloading: SGLang's endpoint, then the name is gone
    r = httpx.post(f"{BASE}/v1/load_lora_adapter",
                   json={"lora_name": "wide", "lora_path": adapters["wide"]}, timeout=60)
    assert r.status_code == 400 and "lora_A.weight" in r.json()["error"]["message"]
    r = httpx.post(f"{BASE}/unload_lora_adapter", json={"lora_name": "late"}, timeout=60)
    assert r.status_code == 200 and set(r.json()["loaded_adapters"]) == {"boot"}, r.text
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="late", prompt=PROMPT, max_tokens=2)
    r = httpx.post(f"{BASE}/v1/unload_lora_adapter", json={"lora_name": "late"}, timeout=60)
    assert r.status_code == 404

    # first use of an adapter in lora_dynamic_path loads it; /v1/stats counts it
    found = client.completions.create(model="found", prompt=PROMPT, max_tokens=6, temperature=0,
                                      extra_body={"ignore_eos": True}).choices[0].text
    assert found == _text(reference["found"])
    stats = httpx.get(f"{BASE}/v1/stats", timeout=30).json()
    assert stats["lora_dynamic_loads"] == 1 and stats["lora_slot_loads"] >= 3
    assert stats["lora_requests"] >= 4
    metrics = httpx.get(f"{BASE}/metrics", timeout=30).text
    assert "radixserve:lora_dynamic_loads_total" in metrics and "radixserve:lora_adapters" in metrics


# -- two engine replicas: routing, and load/unload on every replica ---------------------------

def replica_stats() -> dict[str, dict]:
    """Each engine replica's stats, by Serve's replica id (/v1/stats' `replicas`)."""
    return httpx.get(f"{BASE}/v1/stats", timeout=30).json()["replicas"]


def prompts(n: int, seed: int) -> list[list[int]]:
    """Distinct prompts of three blocks, whose prefixes spread over the replicas."""
    rng = random.Random(seed)
    return [[rng.randrange(3, 700) for _ in range(48)] for _ in range(n)]


def complete(model: str, prompt: list[int], base: str = BASE) -> httpx.Response:
    return httpx.post(f"{base}/v1/completions", timeout=60, json={
        "model": model, "prompt": prompt, "max_tokens": 3, "temperature": 0})


def complete_all(model: str, batch: list[list[int]]) -> list[int]:
    """Status codes of `batch`'s requests, sent at once."""
    with ThreadPoolExecutor(len(batch)) as pool:
        return [r.status_code for r in pool.map(lambda p: complete(model, p), batch)]


def gained(before: dict[str, dict], after: dict[str, dict], key: str) -> dict[str, int]:
    return {rid: after[rid][key] - before[rid][key] for rid in after}


def test_requests_go_to_the_replica_holding_their_adapter(server, adapters):
    """With two engine replicas, requests of many prefixes for an adapter go to the replica
    that holds it: registered there only (host memory), or loaded on first use from
    `lora_dynamic_path` (then in its GPU pool), where the other replica would answer 404
    or load it again; /v1/stats and /metrics count the hits and loads."""
    import ray

    engines = list_replicas("radixserve", "EngineReplica")
    assert len(engines) == 2
    holder, other = sorted(engines)
    answer = ray.get(call_replica(engines[holder], "lora_admin", "load_lora", "solo",
                                  adapters["solo"]), timeout=60)
    assert "result" in answer, answer
    time.sleep(SETTLE_S)
    before = replica_stats()
    assert "solo" in before[holder]["lora_in_cpu"] and "solo" not in before[other]["lora_in_cpu"]
    assert complete_all("solo", prompts(8, seed=1)) == [200] * 8  # the other would say 404
    after = replica_stats()
    assert gained(before, after, "lora_requests") == {holder: 8, other: 0}

    assert complete("third", prompts(1, seed=2)[0]).status_code == 200
    first = replica_stats()
    loads = gained(after, first, "lora_dynamic_loads")
    assert sorted(loads.values()) == [0, 1], loads
    loaded = next(rid for rid, n in loads.items() if n)
    time.sleep(SETTLE_S)
    assert complete_all("third", prompts(8, seed=3)) == [200] * 8
    end = replica_stats()
    assert gained(first, end, "lora_dynamic_loads") == {holder: 0, other: 0}  # loaded once
    assert gained(first, end, "lora_requests") == {loaded: 8, (set(end) - {loaded}).pop(): 0}
    assert gained(first, end, "lora_slot_hits")[loaded] == 8  # in its GPU pool already

    totals = httpx.get(f"{BASE}/v1/stats", timeout=30).json()
    assert totals["lora_requests"] == sum(s["lora_requests"] for s in end.values())
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{BASE}/metrics", timeout=30).text
    samples = {f.name: f.samples for f in text_string_to_metric_families(text)}
    by_engine = {s.labels["engine"]: s.value for s in samples["radixserve:lora_slot_hits"]}
    assert by_engine[loaded] >= 8 and set(by_engine) == set(engines)
    assert sum(s.value for s in samples["radixserve:lora_dynamic_loads"]) == \
        totals["lora_dynamic_loads"] >= 2  # "found" earlier, "third" here


def _direct(actor, lora: str) -> list:
    """A request sent to this very engine replica (no router): its deltas, or its error."""
    return stream_replica(actor, "generate", EngineCall(f"direct-{random.getrandbits(32)}",
                                                        PROMPT, greedy(lora)))


def test_load_and_unload_reach_every_replica(server, adapters, reference):
    engines = list_replicas("radixserve", "EngineReplica")
    r = httpx.post(f"{BASE}/v1/load_lora_adapter", timeout=60,
                   json={"lora_name": "both", "lora_path": adapters["both"]})
    assert r.status_code == 200, r.text
    for rid, actor in engines.items():  # each replica serves it, sent there directly
        tokens = [t for d in _direct(actor, "both") for t in d.token_ids]
        assert tokens == reference["both"], rid
    r = httpx.post(f"{BASE}/unload_lora_adapter", json={"lora_name": "both"}, timeout=60)
    assert r.status_code == 200 and "both" not in r.json()["loaded_adapters"], r.text
    for actor in engines.values():
        (error,) = _direct(actor, "both")
        assert error["status"] == 404 and error["code"] == "model_not_found"
    r = complete("both", PROMPT)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_bad_adapters_and_unloading_one_in_use(server, adapters):
    """400 naming the tensor for an adapter of another base and one targeting a layer the
    model lacks (a rank over max_lora_rank: the first test), with nothing registered; 404 model_not_found for
    an unknown name on every API; unloading an adapter that a request runs under is refused
    (400), stalling nothing, until the request ends (here: its client leaves)."""
    for name, says in (("other", r"lora_[AB]\.weight'.*does not fit the base model"),
                       ("moved", r"layers\.99\..*has no .* in layer 99")):
        r = httpx.post(f"{BASE}/v1/load_lora_adapter", timeout=60,
                       json={"lora_name": name, "lora_path": adapters[name]})
        error = r.json()["error"]
        assert r.status_code == 400 and ".lora_" in error["message"], r.text
        assert re.search(says, error["message"]), error["message"]
    listed = {c["id"] for c in httpx.get(f"{BASE}/v1/models", timeout=30).json()["data"]}
    assert not listed & {"other", "moved"}
    for path, body in (("/v1/chat/completions", {"model": "nope", "max_tokens": 2,
                                                  "messages": [{"role": "user", "content": "hi"}]}),
                       ("/generate", {"input_ids": PROMPT, "lora_path": "nope"})):
        r = httpx.post(f"{BASE}{path}", json=body, timeout=60)
        assert r.status_code == 404, r.text

    r = httpx.post(f"{BASE}/v1/load_lora_adapter", timeout=60,
                   json={"lora_name": "busy", "lora_path": adapters["busy"]})
    assert r.status_code == 200, r.text
    client = openai.OpenAI(base_url=f"{BASE}/v1", api_key="x", max_retries=0)
    stream = client.completions.create(model="busy", prompt=PROMPT, max_tokens=500, stream=True,
                                       temperature=0, extra_body={"ignore_eos": True})
    next(iter(stream))  # running now (500 tokens: seconds on this model)
    r = httpx.post(f"{BASE}/v1/unload_lora_adapter", json={"lora_name": "busy"}, timeout=60)
    assert r.status_code == 400 and "in use" in r.json()["error"]["message"], r.text
    assert complete(MODEL, PROMPT).status_code == 200  # the others go on meanwhile
    stream.close()  # the client leaves: the engine aborts the request and frees the adapter
    codes = []
    for _ in range(60):
        codes.append(httpx.post(f"{BASE}/v1/unload_lora_adapter", json={"lora_name": "busy"},
                                timeout=60).status_code)
        if codes[-1] != 400:
            break
        time.sleep(0.5)
    assert codes[-1] == 200, codes
    assert complete("busy", PROMPT).status_code == 404


def test_a_replica_started_later_applies_the_runtime_loads_and_unloads(server, adapters,
                                                                       reference):
    """An adapter loaded at runtime and a start-up adapter unloaded at runtime: an engine
    replica that Serve starts after its predecessor died has the first (same output as
    the offline engine) and not the second, before it takes a request."""
    import ray
    from ray import serve

    r = httpx.post(f"{BASE}/v1/load_lora_adapter", timeout=60,
                   json={"lora_name": "kept", "lora_path": adapters["kept"]})
    assert r.status_code == 200, r.text
    r = httpx.post(f"{BASE}/v1/unload_lora_adapter", json={"lora_name": "boot"}, timeout=60)
    assert r.status_code == 200, r.text
    old = list_replicas("radixserve", "EngineReplica")
    victim = sorted(old)[0]
    ray.kill(old[victim], no_restart=True)

    def replaced() -> dict | None:
        now = list_replicas("radixserve", "EngineReplica")
        running = serve.status().applications["radixserve"].status == "RUNNING"
        return now if running and len(now) == 2 and victim not in now else None

    now = wait_until(replaced, timeout=120, interval=1)
    assert now, "Serve did not replace the killed engine replica"
    (new,) = set(now) - set(old)
    tokens = [t for d in _direct(now[new], "kept") for t in d.token_ids]
    assert tokens == reference["late"]  # "kept" holds late's weights
    (error,) = _direct(now[new], "boot")
    assert error["status"] == 404 and error["code"] == "model_not_found"
    listed = {c["id"] for c in httpx.get(f"{BASE}/v1/models", timeout=30).json()["data"]}
    assert "kept" in listed and "boot" not in listed
    r = httpx.post(f"{BASE}/v1/completions", timeout=60, json={
        "model": "kept", "prompt": PROMPT, "max_tokens": 6, "temperature": 0,
        "ignore_eos": True})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == _text(reference["late"])


# -- `ingress: colocated`: every replica of the one deployment ------------------------------

COLOCATED = f"{BASE}/lora-colocated"


@pytest.fixture(scope="module")
def colocated():
    from ray import serve

    start_ray()
    run_app(serve_config_args(ingress="colocated", num_replicas=2,
                              engine={**ENGINE, "enable_lora": True}),
            name="lora-colocated", route_prefix="/lora-colocated")
    # A handle learns of the replicas from the controller's broadcasts, a moment after the
    # app is ready: until /metrics (a broadcast too) reaches both, a load might not either.
    assert wait_until(lambda: _scraped_replicas() == 2, timeout=30, interval=0.2)
    yield list_replicas("lora-colocated", "EngineIngress")
    serve.delete("lora-colocated")


def _scraped_replicas() -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{COLOCATED}/metrics", timeout=30).text
    return next(s.value for f in text_string_to_metric_families(text) for s in f.samples
                if f.name == "radixserve:scrape_replicas" and s.labels.get("role") == "ingress")


def _adapters_of(replicas) -> list[set[str]]:
    return [{a["name"] for a in answer["result"]}
            for answer in call_each(replicas, "lora_admin", "list_loras").values()]


def test_colocated_load_and_unload_reach_every_replica(colocated, adapters, reference):
    assert len(colocated) == 2
    r = httpx.post(f"{COLOCATED}/v1/load_lora_adapter", timeout=60,
                   json={"lora_name": "both", "lora_path": adapters["both"]})
    assert r.status_code == 200, r.text
    assert _adapters_of(colocated) == [{"both"}, {"both"}]
    for prompt in [PROMPT] * 4:  # Serve's proxy picks a replica: any can serve it
        r = httpx.post(f"{COLOCATED}/v1/completions", timeout=60, json={
            "model": "both", "prompt": prompt, "max_tokens": 6, "temperature": 0,
            "ignore_eos": True})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == _text(reference["both"])
    r = httpx.post(f"{COLOCATED}/v1/unload_lora_adapter", json={"lora_name": "both"}, timeout=60)
    assert r.status_code == 200, r.text
    assert _adapters_of(colocated) == [set(), set()]
    r = complete("both", PROMPT, base=COLOCATED)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
