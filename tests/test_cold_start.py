"""Cold start: after the engine starts (graph capture + engine/runtime/warmup.py), serving
compiles no Triton kernel, and a fresh replica's first request of each prompt shape takes
at most twice the warm time to its first token.

GPU test: a Llama-3-8B-shaped dummy model (bf16, and with FP8 weights) with an empty
TRITON_CACHE_DIR, so any specialization the warm-up missed would cost a real compile
(seconds), not a disk load.
Compiles are counted two ways (Triton 3.6): the in-memory binaries of every engine kernel
(`JITFunction.device_caches[dev][0]`, see engine.warmup.compiled_kernels) and Triton's
`knobs.runtime.jit_post_compile_hook`, called after every compile or disk-cache load.

The CPU test checks that the warm-up itself leaves the engine clean.
"""
from __future__ import annotations

import json
import os
import random
import statistics
import sys
import time

import pytest
import torch

from engine import SamplingParams
from engine.config import EngineConfig
from engine.runtime.engine import Engine
from engine.runtime.warmup import compiled_kernels, warm_up, warmup_waves

# Prompt lengths around every boundary the kernels' launch configs and the graphs care
# about: 1 token, odd/even token counts (the flat upload's field offsets), BLOCK_M (64),
# the extend graphs' buckets (512, 768, 1,024: the largest), one wave of extend programs,
# chunk sizes.
SHAPES = [1, 2, 7, 16, 37, 64, 65, 129, 300, 511, 512, 513, 769, 1000, 1024, 1025, 2047, 2049,
          4097, 8192]


def _ttft(engine: Engine, ids: list[int], params: SamplingParams, tag: str) -> float:
    """Seconds from add_request to the request's first output token."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    req = engine.add_request(tag, ids, params)
    while not req.num_output:
        engine.step()
    elapsed = time.perf_counter() - t0
    while engine.has_work:
        engine.step()
    engine.requests.pop(tag, None)
    return elapsed


def _run_all(engine: Engine, reqs: list[tuple[list[int], SamplingParams]], tag: str,
             delays: list[int] | None = None) -> None:
    """Requests added after their delay in steps (default 0), run to completion."""
    delays = delays or [0] * len(reqs)
    pending = sorted(zip(delays, range(len(reqs))))
    step = 0
    while pending or engine.has_work:
        while pending and pending[0][0] <= step:
            _, i = pending.pop(0)
            engine.add_request(f"{tag}-{i}", *reqs[i])
        engine.step()
        step += 1
    for i in range(len(reqs)):
        engine.requests.pop(f"{tag}-{i}", None)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("quantization", [None, "fp8"], ids=["bf16", "fp8"])
def test_no_compile_after_start_and_first_ttft_within_2x(tmp_path, monkeypatch, quantization):
    import gc

    import triton

    from engine.loading.demo_model import ensure_demo_model

    gc.collect()  # the other parametrization's engine must give its GPU memory back first
    torch.cuda.empty_cache()

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton-cache"))
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
    from bench_offline import LLAMA3_8B

    config = dict(LLAMA3_8B, max_position_embeddings=16384)  # room for 8,192-token prompts
    model = tmp_path / "llama3-8b-dummy"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(config))
    # Decode graphs up to 16 requests and up to 64 running: batches of 17-64 decode
    # eagerly, so the warm-up's eager decode shapes are exercised too.
    engine = Engine(EngineConfig(
        model=str(model), tokenizer=ensure_demo_model(), dtype="bfloat16", device="cuda",
        load_format="dummy", max_running_requests=64, cuda_graph_max_bs=16,
        chunked_prefill_size=8192, max_prefill_tokens=16384, mem_fraction_static=0.7,
        quantization=quantization))
    print("start-up:", engine.runner.startup.summary(), engine.startup)

    compiled: list[str] = []
    old_hook = triton.knobs.runtime.jit_post_compile_hook

    def hook(**kwargs):  # key, repr, fn, compile, is_manual_warmup, already_compiled
        compiled.append(kwargs["repr"])
        return None

    triton.knobs.runtime.jit_post_compile_hook = hook
    before = compiled_kernels()
    rng = random.Random(7)
    vocab = config["vocab_size"]

    def prompt(n: int) -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(n)]

    greedy = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    try:
        cold, warm = {}, {}
        for n in SHAPES:  # each shape's first request, on fresh tokens (no cache hit)
            cold[n] = _ttft(engine, prompt(n), greedy, f"cold-{n}")
        for n in SHAPES:
            warm[n] = statistics.median(_ttft(engine, prompt(n), greedy, f"warm-{n}-{i}")
                                        for i in range(3))

        # Batch mixes: 40 varied prompts; decoding requests joined by long and short
        # prompts; radix hits; sampling settings; prompt logprobs; decode batches on both
        # sides of the largest decode graph, plain and with a shared prefix.
        g = lambda k: SamplingParams(max_tokens=k, temperature=0.0, ignore_eos=True)  # noqa: E731
        _run_all(engine, [(prompt(rng.randint(1, 600)), g(8)) for _ in range(40)], "mix40")
        _run_all(engine, [(prompt(37), g(24)) for _ in range(8)]
                 + [(prompt(3000), g(2)), (prompt(45), g(2)), (prompt(700), g(2))],
                 "mixed", delays=[0] * 8 + [3, 5, 7])
        # eager mixed steps whose decoders' attention splits their contexts (decode kernel)
        _run_all(engine, [(prompt(rng.randint(300, 2500)), g(24)) for _ in range(20)]
                 + [(prompt(3000), g(2))], "mixed-split", delays=[0] * 20 + [8])
        _run_all(engine, [(prompt(3000), g(24)), (prompt(700), g(2))], "mixed-one",
                 delays=[0, 3])
        system = prompt(2000)
        _run_all(engine, [(system, g(1))], "sys")
        _run_all(engine, [(system + prompt(rng.randint(1, 300)), g(16)) for _ in range(24)],
                 "hits")
        _run_all(engine, [(prompt(100), SamplingParams(max_tokens=8, temperature=0.7, top_p=0.9,
                                                        top_k=40, min_p=0.05,
                                                        repetition_penalty=1.1, seed=i))
                          for i in range(6)], "sampled")
        _run_all(engine, [(prompt(n), SamplingParams(max_tokens=2, temperature=0.0,
                                                     prompt_logprobs_start=0))
                          for n in (5, 129, 1000)], "plogprobs")
        for bs in (3, 16, 17, 33, 64):
            _run_all(engine, [(prompt(rng.randint(20, 400)), g(12)) for _ in range(bs)], f"dec{bs}")
        for bs in (20, 64):
            _run_all(engine, [(system + prompt(rng.randint(5, 200)), g(12)) for _ in range(bs)],
                     f"grouped{bs}")
        # the sampler's cut (engine/kernels/sampling_cut.py): rows past this engine's 64
        # running requests, as a larger engine would sample, and few rows
        from engine.kernels.sampling_cut import MANY_ROWS
        from engine.core.request import Request

        for rows, kw in ((MANY_ROWS + 5, dict(top_p=0.9)), (MANY_ROWS + 16, dict(top_k=40)),
                         (MANY_ROWS * 2, dict(top_p=0.9, top_k=40)), (1, dict(min_p=0.1)),
                         (3, dict(top_p=0.9)), (17, dict(top_k=40, top_p=0.8))):
            reqs = [Request(f"cut{i}", [1, 2], SamplingParams(max_tokens=2, temperature=0.7, **kw))
                    for i in range(rows)]
            engine.sampler.sample_tokens(torch.randn(rows, vocab, device="cuda"), reqs)
    finally:
        triton.knobs.runtime.jit_post_compile_hook = old_hook
    after = compiled_kernels()
    new = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
    print("TTFT ms, cold / warm:", {n: (round(1e3 * cold[n], 1), round(1e3 * warm[n], 1))
                                    for n in SHAPES})
    assert not compiled and not new, f"compiled after start: {new} {compiled[:5]}"
    slow = {n: (cold[n], warm[n]) for n in SHAPES if cold[n] > 2 * warm[n]}
    assert not slow, f"first-request TTFT over 2x warm (s): {slow}"
    del engine


def test_warmup_leaves_engine_clean(tiny_llama):
    """The warm-up (forced on CPU, where it is otherwise skipped) runs its waves and leaves
    no request, no cached KV and zeroed counters behind."""
    engine = Engine(EngineConfig(model=tiny_llama, device="cpu", max_total_tokens=4096,
                                 max_model_len=160, enable_warmup=False))
    assert engine.startup["waves"] == 0 and "load" in engine.startup["phases"]
    waves = warmup_waves(engine)
    assert len(waves) >= 10 and all(len(ids) <= 160 for w in waves for _, ids, _ in w)
    report = warm_up(engine, force=True)
    assert report["waves"] == len(waves) and report["steps"] > len(waves)
    stats = engine.stats()
    assert not engine.requests and engine.cache.total_size == 0
    assert stats["free_slots"] == stats["total_slots"]
    assert stats["steps"] == 0 and stats["prompt_tokens"] == 0 and stats["finished_requests"] == 0
    assert set(report["phases"]) >= {"load", "kv_pool", "cuda_graphs", "warmup"}
    # still serves
    out = engine.add_request("after", [5, 6, 7], SamplingParams(max_tokens=3, temperature=0.0))
    while engine.has_work:
        engine.step()
    assert out.num_output == 3
