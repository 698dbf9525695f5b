"""LoRA adapters through the Serve app: real Ray, real HTTP, the official openai client,
SGLang's /generate (`lora_path`) and the front-end language. One app, one engine replica:
an adapter from the app args, one loaded and unloaded at runtime (vLLM's and SGLang's
endpoints), one loaded on first use from `lora_dynamic_path`, and the errors."""
from __future__ import annotations

import httpx
import openai
import pytest

import frontend as sgl
from engine import LLM, SamplingParams, ensure_demo_model
from lora_adapters import SPECS, make_adapter
from serve_helpers import BASE, run_app, serve_config_args, start_ray, stop_ray

pytestmark = pytest.mark.slow
MODEL = "radixserve-demo"
PROMPT = [1, 17, 230, 5, 88, 41, 9, 3]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("lora-http")
    base = ensure_demo_model()
    for i, name in enumerate(["boot", "late", "dyn/found"]):
        make_adapter(base, str(root / name), seed=i, **SPECS["qv-mlp-r8"])
    make_adapter(base, str(root / "wide"), r=32, lora_alpha=32, target_modules=["q_proj"])
    return {"boot": str(root / "boot"), "late": str(root / "late"), "wide": str(root / "wide"),
            "dyn": str(root / "dyn")}


@pytest.fixture(scope="module")
def server(adapters):
    start_ray()
    run_app(serve_config_args(ingress_replicas=1, lora_modules={"boot": adapters["boot"]},
                              lora_dynamic_path=adapters["dyn"],
                              engine={"max_total_tokens": 2048, "max_loras": 2,
                                      "max_lora_rank": 16}))
    yield
    stop_ray()


@pytest.fixture(scope="module")
def reference(adapters) -> dict[str | None, list[int]]:
    """Greedy tokens of PROMPT under each adapter, from the offline engine."""
    llm = LLM(model=ensure_demo_model(), max_total_tokens=1024, max_lora_rank=16,
              lora_modules={"boot": adapters["boot"], "late": adapters["late"],
                            "found": f"{adapters['dyn']}/found"})
    params = [SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, lora=n)
              for n in (None, "boot", "late", "found")]
    outs = llm.generate([PROMPT] * 4, params)
    return {n: o.token_ids for n, o in zip((None, "boot", "late", "found"), outs)}


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
