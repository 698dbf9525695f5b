"""The Serve app with `engine_process: true` (the engine's step loop in a child process of
the replica): streamed and whole completions through the official openai client, over the
delta channels and the own-stream path, and /v1/stats."""
from __future__ import annotations

import asyncio
import subprocess

import httpx
import openai
import pytest

from engine import LLM, SamplingParams
from engine.loading.demo_model import ensure_demo_model
from serve_helpers import BASE, run_app, serve_config_args, start_ray, stop_ray

pytestmark = pytest.mark.slow
MODEL = "radixserve-demo"
URL = f"{BASE}/engine-process"


@pytest.fixture(scope="module")
def server():
    start_ray()
    run_app(serve_config_args(engine_process=True, ingress_replicas=1,
                              engine={"max_total_tokens": 4096, "max_queued_requests": 64}),
            name="engine-process", route_prefix="/engine-process")
    yield
    stop_ray()


def test_completions_streamed_and_whole(server):
    procs = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert "multiprocessing.spawn" in procs  # the replica's engine process
    client = openai.OpenAI(base_url=f"{URL}/v1", api_key="unused", max_retries=0, timeout=60)
    prompts = [f"The old lighthouse keeper {i}" for i in range(6)]
    greedy = dict(max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    offline = LLM(model=ensure_demo_model(), dtype="float32", max_total_tokens=4096).generate(
        prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))

    whole = [client.completions.create(model=MODEL, prompt=p, **greedy) for p in prompts]
    assert [r.choices[0].text for r in whole] == [o.text for o in offline]
    assert all(r.usage.completion_tokens == 16 and r.choices[0].finish_reason == "length"
               for r in whole)

    async def stream(aclient, prompt):
        chunks = [c async for c in await aclient.completions.create(
            model=MODEL, prompt=prompt, stream=True, stream_options={"include_usage": True}, **greedy)]
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        return text, reasons, chunks[-1].usage

    async def streams():  # all at once: the first opens the channel, the rest may ride it
        aclient = openai.AsyncOpenAI(base_url=f"{URL}/v1", api_key="unused", max_retries=0, timeout=60)
        return await asyncio.gather(*[stream(aclient, p) for p in prompts + prompts])

    for (text, reasons, usage), o in zip(asyncio.run(streams()), offline + offline):
        assert text == o.text and reasons == ["length"]
        assert usage.completion_tokens == 16 and usage.prompt_tokens == len(o.prompt_token_ids)

    stats = httpx.get(f"{URL}/v1/stats", timeout=30).json()
    assert stats["finished_requests"] >= 18 and stats["running"] == 0
    assert stats["requests_on_channel"] + stats["requests_on_own_stream"] >= 18
    assert stats["free_slots"] + stats["evictable_slots"] == stats["total_slots"]
