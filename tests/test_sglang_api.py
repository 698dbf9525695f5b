"""SGLang's native API (/generate, /get_model_info, ...) end to end: real Ray, real HTTP, and
SGLang's own front end (`sgl.RuntimeEndpoint`) where the `sglang` package is installed."""
from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest

from engine import LLM, SamplingParams
from engine.loading.demo_model import ensure_demo_model
from serve_helpers import BASE, run_app, serve_config_args, start_ray, stop_ray

pytestmark = pytest.mark.slow


MODEL_DEFAULTS = {"temperature": 0.7, "top_k": 1}  # top_k 1: unset requests decode greedily


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The demo model, with sampling defaults in its generation_config.json."""
    model = tmp_path_factory.mktemp("model")
    demo = Path(ensure_demo_model())
    for f in demo.iterdir():
        (model / f.name).symlink_to(f)
    (model / "generation_config.json").unlink()
    gen = json.loads((demo / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**gen, **MODEL_DEFAULTS}))
    start_ray()
    run_app(serve_config_args(model=str(model), served_model_name="radixserve-demo", ingress_replicas=1,
                              engine={"max_running_requests": 16, "chunked_prefill_size": 128,
                                      "max_total_tokens": 4096, "max_queued_requests": 64}))
    yield
    stop_ray()


@pytest.fixture(scope="module")
def offline() -> LLM:
    return LLM(model=ensure_demo_model(), dtype="float32", max_total_tokens=2048)


def generate(body: dict, status: int = 200):
    r = httpx.post(f"{BASE}/generate", json=body, timeout=60)
    assert r.status_code == status, r.text
    return r.json()


def test_model_info_server_info_and_health_generate(server):
    info = httpx.get(f"{BASE}/get_model_info", timeout=30).json()
    assert info["served_model_name"] == "radixserve-demo" and info["is_generation"] is True
    assert httpx.get(f"{BASE}/model_info", timeout=30).json()["model_path"] == info["model_path"]
    for path in ("/get_server_info", "/server_info"):
        body = httpx.get(f"{BASE}{path}", timeout=30).json()
        assert body["internal_states"][0]["total_slots"] > 0
    assert httpx.get(f"{BASE}/health_generate", timeout=30).status_code == 200


def test_generation_config_defaults_apply_when_the_request_leaves_them_unset(server):
    info = httpx.get(f"{BASE}/get_model_info", timeout=30).json()
    assert info["preferred_sampling_params"] == MODEL_DEFAULTS
    body = {"text": "Once upon a time", "sampling_params": {"max_new_tokens": 8, "ignore_eos": True}}
    greedy = generate({**body, "sampling_params": {**body["sampling_params"], "temperature": 0}})
    seeded = [generate({**body, "sampling_params": {**body["sampling_params"], "sampling_seed": s}})
              for s in (1, 2, 3)]
    assert all(o["text"] == greedy["text"] for o in seeded)  # top_k=1 from the model
    free = [generate({**body, "sampling_params": {**body["sampling_params"], "sampling_seed": s,
                                                  "top_k": -1, "temperature": 1.5}})["text"]
            for s in (1, 2, 3)]
    assert len(set(free)) > 1  # the request's own values win
    plain = httpx.post(f"{BASE}/v1/completions", timeout=60, json={
        "prompt": "Once upon a time", "max_tokens": 8, "ignore_eos": True, "seed": 5}).json()
    assert plain["choices"][0]["text"] == greedy["text"]  # the OpenAI routes too


def test_generate_text_equals_offline(server, offline):
    out = generate({"text": "The old lighthouse keeper", "sampling_params": {
        "max_new_tokens": 12, "temperature": 0, "ignore_eos": True}})
    ref = offline.generate(["The old lighthouse keeper"],
                           SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    assert out["text"] == ref.text and out["output_ids"] == ref.token_ids
    meta = out["meta_info"]
    assert meta["prompt_tokens"] == len(ref.prompt_token_ids) and meta["completion_tokens"] == 12
    assert meta["finish_reason"] == {"type": "length", "length": 12} and meta["id"]


def test_generate_batch_of_input_ids_with_n(server, offline):
    prompts = [[5, 6, 7, 8], [100, 200, 300]]
    outs = generate({"input_ids": prompts, "rid": ["first", "second"], "sampling_params": {
        "max_new_tokens": 5, "temperature": 0, "ignore_eos": True, "n": 2}})
    assert [o["meta_info"]["id"] for o in outs] == ["first"] * 2 + ["second"] * 2
    refs = offline.generate(prompts, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    assert [o["text"] for o in outs] == [refs[0].text] * 2 + [refs[1].text] * 2
    assert [o["meta_info"]["prompt_tokens"] for o in outs] == [4, 4, 3, 3]


def test_generate_stream_as_bench_serving_sends_it(server):
    """bench_serving's sglang backend: null/false extras, cumulative text, completion_tokens."""
    body = {"text": "A long time ago", "sampling_params": {"max_new_tokens": 16, "temperature": 0,
                                                           "ignore_eos": True},
            "stream": True, "lora_path": None, "return_logprob": False,
            "return_routed_experts": False, "logprob_start_len": -1}
    full = generate({**body, "stream": False})["text"]
    events = []
    with httpx.stream("POST", f"{BASE}/generate", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: "):])
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["text"] == full and chunks[-1]["meta_info"]["completion_tokens"] == 16
    assert all(b["text"].startswith(a["text"]) for a, b in zip(chunks, chunks[1:]))
    counts = [c["meta_info"]["completion_tokens"] for c in chunks]
    assert counts == sorted(counts) and len(chunks) > 1


def test_logprobs_from_logprob_start_len(server, offline):
    prompt = [5, 17, 33, 60, 2, 9, 41]
    out = generate({"input_ids": prompt, "return_logprob": True, "logprob_start_len": 2,
                    "top_logprobs_num": 2, "return_text_in_logprobs": True,
                    "sampling_params": {"max_new_tokens": 3, "temperature": 0}})
    ref = offline.generate([prompt], SamplingParams(max_tokens=3, temperature=0, logprobs=True,
                                                    top_logprobs=2, prompt_logprobs_start=2))[0]
    meta = out["meta_info"]
    inputs = meta["input_token_logprobs"]
    assert [t[1] for t in inputs] == prompt[2:]
    assert [t[0] for t in inputs] == pytest.approx(ref.prompt_logprobs[2:], abs=1e-4)
    assert all(isinstance(t[2], str) for t in inputs)
    tops = meta["input_top_logprobs"]
    assert [[a[1] for a in alts] for alts in tops] == [[t for t, _ in alts] for alts in
                                                       ref.prompt_top_logprobs[2:]]
    outputs = meta["output_token_logprobs"]
    assert [t[1] for t in outputs] == out["output_ids"] == ref.token_ids
    assert [len(alts) for alts in meta["output_top_logprobs"]] == [2, 2, 2]
    assert meta["output_top_logprobs"][0][0][1] == out["output_ids"][0]  # greedy: the best one


def test_max_new_tokens_zero_scores_the_prompt_only(server):
    out = generate({"text": ["Hello there", "Hello world"], "return_logprob": True,
                    "logprob_start_len": 0, "sampling_params": {"max_new_tokens": 0}})
    for o in out:
        assert o["text"] == "" and o["output_ids"] == [] and o["meta_info"]["completion_tokens"] == 0
        lps = o["meta_info"]["input_token_logprobs"]
        assert lps[0][0] is None and all(t[0] < 0 for t in lps[1:])


@pytest.mark.parametrize("body", [
    {"text": "x", "sampling_params": {"stop_regex": "a+"}},
    {"text": "x", "sampling_params": {"min_new_tokens": 3, "max_new_tokens": 2}},
    {"text": "x", "sampling_params": {"no_stop_trim": "yes"}},
    {"text": "x", "sampling_params": {"max_new_tokens": "many"}},
    {"text": "x", "sampling_params": {"some_future_knob": 1}},
    {"text": "x", "image_data": "http://example.com/cat.png"},
    {"text": "x", "input_ids": [1, 2]},
    {"sampling_params": {}},
    {"text": ["a", "b"], "sampling_params": [{}]},
    {"text": "x", "sampling_params": {"temperature": -1}},
])
def test_unsupported_or_invalid_fields_are_400(server, body):
    err = generate(body, status=400)["error"]
    assert err["message"]


def test_unknown_lora_path_is_404_model_not_found(server):
    err = generate({"text": "x", "lora_path": "my-adapter"}, status=404)["error"]
    assert err["code"] == "model_not_found" and "my-adapter" in err["message"]


def test_sglang_frontend_program_runs_unchanged(server):
    """SGLang's own client, unchanged: gen with a regex, select, fork, run_batch, streaming."""
    sgl = pytest.importorskip("sglang")

    backend = sgl.RuntimeEndpoint(BASE)
    assert backend.get_server_info()["internal_states"]

    @sgl.function
    def program(s, topic):
        s += "Facts about " + topic + ".\n"
        s += "Year: " + sgl.gen("year", max_tokens=8, regex=r"(19|20)[0-9]{2}", temperature=0)
        s += "\nIs it good? " + sgl.select("verdict", choices=["yes", "no", "maybe"])
        forks = s.fork(2)
        for i, f in enumerate(forks):
            f += f"\nIdea {i}:" + sgl.gen("idea", max_tokens=6, temperature=0, stop="\n")
        forks.join()

    state = program.run(topic="lighthouses", backend=backend)
    assert re.fullmatch(r"(19|20)[0-9]{2}", state["year"])
    assert state["verdict"] in ("yes", "no", "maybe")
    assert state.get_meta_info("year")["completion_tokens"] >= 1

    states = program.run_batch([{"topic": t} for t in ("cats", "ships", "trees")],
                               backend=backend, num_threads=3)
    assert all(re.fullmatch(r"(19|20)[0-9]{2}", st["year"]) for st in states)

    @sgl.function
    def story(s):
        s += "Once upon a time" + sgl.gen("rest", max_tokens=12, temperature=0, ignore_eos=True)

    streamed = "".join(story.run(backend=backend, stream=True).text_iter("rest"))
    assert streamed == story.run(backend=backend)["rest"] and streamed


def test_sglang_bench_serving_sglang_backend_runs_unchanged(server):
    """`python -m sglang.bench_serving --backend sglang` (through scripts/sglang_bench_serving.py,
    which only stands in for the CUDA-only torchvision its imports pull in) on random ids: every
    request succeeds and the token counts it measured are the ones asked for."""
    pytest.importorskip("sglang")
    pytest.importorskip("datasets")  # bench_serving's dataset modules import it at load time
    import subprocess
    import sys

    from serve_helpers import ROOT

    n, input_len, output_len = 16, 24, 12
    # --model: the model's own folder, so bench_serving's chat-template check reads it there
    # instead of asking the Hugging Face Hub for the served name (five retries per lookup,
    # ~45 s, on a box without the Hub); the requests still name the served model.
    model_path = httpx.get(f"{BASE}/get_model_info", timeout=30).json()["model_path"]
    result = Path(tmp_dir := ROOT / ".pytest_cache") / "sglang_bench_serving.jsonl"
    tmp_dir.mkdir(exist_ok=True)
    result.unlink(missing_ok=True)
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "sglang_bench_serving.py"), "--backend", "sglang",
         "--base-url", BASE, "--model", model_path, "--served-model-name", "radixserve-demo",
         "--dataset-name", "random-ids", "--num-prompts", str(n),
         "--random-input-len", str(input_len), "--random-output-len", str(output_len),
         "--random-range-ratio", "1", "--tokenize-prompt",  # ids as sampled, not re-tokenized
         "--request-rate", "inf", "--disable-tqdm",
         "--output-file", str(result)],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    print(proc.stdout[-2500:])  # the benchmark's own table, for the record (pytest -s)
    record = json.loads(result.read_text().splitlines()[-1])
    assert record["completed"] == n
    assert record["total_output_tokens"] == n * output_len
    assert record["total_input_tokens"] == n * input_len
    assert record["output_throughput"] > 0 and record["median_ttft_ms"] > 0


def _completion_stream(body: dict) -> dict[int, dict]:
    """A streamed /v1/completions reassembled per choice: text and logprob lists joined."""
    out: dict[int, dict] = {}
    with httpx.stream("POST", f"{BASE}/v1/completions", json={**body, "stream": True},
                      timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for ch in json.loads(line[len("data: "):])["choices"]:
                got = out.setdefault(ch["index"], {"text": "", "tokens": [], "token_logprobs": [],
                                                   "top_logprobs": [], "text_offset": []})
                got["text"] += ch["text"]
                for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                    got[key] += (ch["logprobs"] or {}).get(key, [])
    return out


@pytest.mark.parametrize("echo", [False, True])
def test_streamed_completion_logprobs_equal_the_whole_response(server, echo):
    """Streamed text_offset (and tokens, scores, alternatives) equal the non-streamed
    response's exactly, with echo (the prompt's tokens lead the first chunk) and with a stop
    string cutting the text mid-stream; offsets point into the returned text."""
    body = {"model": "radixserve-demo", "prompt": "Once upon a time, in a small town", "n": 2,
            "max_tokens": 24, "temperature": 0, "ignore_eos": True, "logprobs": 2, "echo": echo}
    plain = httpx.post(f"{BASE}/v1/completions", json={**body, "echo": False}, timeout=60).json()
    body["stop"] = [plain["choices"][0]["text"][9:12]]  # cuts the text after ~9 characters
    whole = httpx.post(f"{BASE}/v1/completions", json=body, timeout=60).json()
    streamed = _completion_stream(body)
    assert sorted(streamed) == [0, 1]
    for choice in whole["choices"]:
        got, want = streamed[choice["index"]], choice["logprobs"]
        assert got["text"] == choice["text"]
        assert got["tokens"] == want["tokens"] and got["text_offset"] == want["text_offset"]
        # Scores: equal up to batch-dependent float rounding (the two runs batch differently).
        assert got["token_logprobs"] == pytest.approx(want["token_logprobs"], abs=1e-4)
        assert [t and sorted(t) for t in got["top_logprobs"]] == [
            t and sorted(t) for t in want["top_logprobs"]]
        text, offsets = choice["text"], want["text_offset"]
        assert len(text) < (len(body["prompt"]) if echo else 0) + 12  # the stop cut it
        assert offsets == sorted(offsets)
        whole_tokens = [(t, o) for t, o in zip(want["tokens"], offsets)  # not cut by the stop
                        if t.strip() and o + len(t) <= len(text) and t != "<s>"]
        assert whole_tokens and all(text.startswith(t.strip(), o + len(t) - len(t.lstrip()))
                                    for t, o in whole_tokens), list(zip(want["tokens"], offsets))
