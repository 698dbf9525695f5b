"""Offline benchmark on a GPU: W1 (throughput), W2 (shared prefix, cache on/off) and W3
(batch-1 latency) from ../shared/BENCHMARKS.md, with the Llama-3-8B-shaped dummy model (or,
with `--model moe`, a Qwen3-30B-A3B-shaped one; `--model gemma3-4b`, Gemma-3-4B's text
model), against its physical floors and the Hugging Face transformers peer.

    python scripts/bench_offline.py [--model llama3-8b|moe|gemma3-4b|demo] [--workloads W1,W2,W3] [--json PATH]
                                    [--no-hf] [--w2-modes cache_on,...]
                                    [--profile-w1 A:B] [--profile-w2 A:B] [--profile-w3 A:B]
                                    [--ttft-sweep] [--cold-start] [--long-prefill] [--w4] [--decode-batch N]
                                    [--quantization fp8] [--kv-cache-dtype fp8_e4m3] [--engine KEY=VALUE]

The latency and start-up rows, each by its flag (when any is given, W1-W3 run only if
--workloads names them):
- `--ttft-sweep`: warm time to first token at batch 1 for 1 ... 8,192 prompt tokens (median).
- `--cold-start`: a fresh process with an empty TRITON_CACHE_DIR, with the start-up warm-up,
  the same with the graph capture's compiles serial, and without warm-up: engine start time
  per phase, each shape's first-request TTFT, then warm.
- `--long-prefill`: 8 x 16,000-token prompts against the matmul + attention FLOP floor.
- `--w4`: multi-turn conversations (each turn's prompt = the previous prompt + the answer + a
  new user message); wall time per turn against the weight + KV-read floor of its decode steps.
`--model demo` runs any of them on the tiny demo model, on the CPU when there is no GPU (a
smoke test: tests/test_bench_offline.py; its "floors" use the CPU's measured ceilings).

With `--quantization fp8` the weight floors count float8 bytes (the parameters as loaded), and
with `--kv-cache-dtype fp8_e4m3` the KV floors count the pool's float8 bytes.

For an MoE model the floors count only the experts a step touches: at batch 1 the top-k of
each layer (W3), at batch B the expected number of distinct experts under uniform routing
(W1's decode steps, at their mean batch). W1's MoE decode row gives two floors: those weights
alone, and with every context token's K/V read once per step (the MoE goal's floor counts
attention). `--decode-batch N[,PROMPT,OUT]` times the decode steps that ran exactly N requests
(the MoE batch-256 goal) against that second floor.

W1 and W2 also report where their time goes: GPU time of decode steps vs steps with
prefill chunks (CUDA events), and the rest (host work the GPU waited for).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

from engine import SamplingParams  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.loading.demo_model import ensure_demo_model  # noqa: E402
from engine.runtime.engine import Engine  # noqa: E402
from engine.attention.kv_pool import KVPool  # noqa: E402

LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256,
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "hidden_act": "silu",
    "bos_token_id": 128000, "eos_token_id": 128001,
}
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
    "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128,
    "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
    "mlp_only_layers": [], "num_hidden_layers": 48, "num_attention_heads": 32,
    "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936,
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "hidden_act": "silu",
    "bos_token_id": 151643, "eos_token_id": 151645,
}
# A draft model's shape for speculative decoding (the 8B's vocabulary): Llama-3.2-1B.
LLAMA32_1B = dict(LLAMA3_8B, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                  head_dim=64, tie_word_embeddings=True)
# Gemma-3-4B's text model (its window layers: 5 of every 6, 1024 tokens; tied 262k vocab).
GEMMA3_4B = {
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 2560,
    "intermediate_size": 10240, "num_hidden_layers": 34, "num_attention_heads": 8,
    "num_key_value_heads": 4, "head_dim": 256, "vocab_size": 262208,
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "rope_local_base_freq": 10000.0, "rope_scaling": {"rope_type": "linear", "factor": 8.0},
    "sliding_window": 1024, "query_pre_attn_scalar": 256, "tie_word_embeddings": True,
    "torch_dtype": "bfloat16", "hidden_activation": "gelu_pytorch_tanh",
    "bos_token_id": 2, "eos_token_id": 1,
}
MODELS = {"llama3-8b": LLAMA3_8B, "moe": QWEN3_30B_A3B, "llama3.2-1b": LLAMA32_1B,
          "gemma3-4b": GEMMA3_4B}
DEMO = "demo"  # the tiny demo model (engine/loading/demo_model.py): real tiny weights, any device
H200_BF16_TFLOPS = 790.0  # dense bf16 peak the long-prefill floor is quoted against

GPU = torch.cuda.is_available()
# The timed workloads' sampling settings: greedy unless --temperature (then top_p 0.95, as a
# chat client's defaults would sample; the outputs' lengths stay fixed by ignore_eos).
REQUEST_SAMPLING: dict = {"temperature": 0.0}


def sync() -> None:
    if GPU:
        torch.cuda.synchronize()


def active_matmul_params(cfg: dict) -> tuple[float, float]:
    """Matmul params a prompt token passes through (no LM head), and an output token (with
    it): for an MoE layer only the top-k experts' (and the router's). Llama-3-8B: 6.98e9, 7.50e9."""
    h, d = cfg["hidden_size"], cfg["head_dim"]
    attn = h * d * (2 * cfg["num_attention_heads"] + 2 * cfg["num_key_value_heads"])
    if "num_experts" in cfg:
        mlp = cfg["num_experts_per_tok"] * 3 * h * cfg["moe_intermediate_size"] + h * cfg["num_experts"]
    else:
        mlp = 3 * h * cfg["intermediate_size"]
    per_prompt = cfg["num_hidden_layers"] * (attn + mlp)
    return per_prompt, per_prompt + h * cfg["vocab_size"]


def decode_weight_bytes(model: torch.nn.Module, batch: int) -> float:
    """Weight bytes one decode step of `batch` tokens must read: everything but the routed
    experts, plus the experts touched (top-k of E each layer at batch 1; for larger batches
    the expected distinct count under uniform routing)."""
    from engine.layers.moe import FusedMoE

    total = sum(p.numel() * p.element_size() for p in model.parameters())
    for m in model.modules():
        if isinstance(m, FusedMoE):
            experts = m.w13.numel() * m.w13.element_size() + m.w2.numel() * m.w2.element_size()
            e, k = m.num_experts, model.config.num_experts_per_tok
            touched = e * (1 - (1 - k / e) ** batch)
            total -= experts * (1 - touched / e)
    return total


def w1():
    r = random.Random(0)
    out = []
    for _ in range(1000):
        n_in, n_out = r.randint(128, 1024), r.randint(32, 512)
        out.append(([r.randint(100, 120000) for _ in range(n_in)], n_out))
    return out


def w2():
    r = random.Random(1)
    reqs = []
    for _ in range(32):
        system = [r.randint(100, 120000) for _ in range(2048)]
        reqs += [(system + [r.randint(100, 120000) for _ in range(128)], 256) for _ in range(16)]
    r.shuffle(reqs)
    return reqs


def w3():
    r = random.Random(2)
    return [([r.randint(100, 120000) for _ in range(512)], 256)]


def check_kernels(moe: bool = False) -> None:
    """Every Triton kernel against the torch reference on fresh inputs, before timing."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    from test_fused_kernels import all_fused_checks
    from test_prefix_groups import all_grouped_checks
    from test_triton_attention import all_checks

    rows = all_checks() + all_grouped_checks() + all_fused_checks()
    if moe:
        from test_moe_kernels import all_moe_checks

        rows += all_moe_checks()
    bad = [(name, r) for name, r in rows if not r["ok"]]
    if bad:
        raise SystemExit(f"kernel check failed: {bad}")
    print(f"kernel checks passed ({len(rows)} cases: attention, grouped decode, fused)", flush=True)


def model_dir(name: str = "llama3-8b", max_positions: int | None = None) -> str:
    """A directory with the dummy model's config.json (the demo model's own directory for
    `demo`); `max_positions` raises max_position_embeddings (16,000-token prompts)."""
    if name == DEMO:
        return ensure_demo_model()
    cfg = dict(MODELS[name])
    suffix = ""
    if max_positions:
        cfg["max_position_embeddings"] = max_positions
        suffix = f"-{max_positions}"
    path = os.path.join(tempfile.gettempdir(), f"radixserve-{name}-dummy{suffix}")
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return path


def model_config(path: str) -> dict:
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg.setdefault("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    return cfg


def measure_ceilings() -> dict:
    if not GPU:  # smoke runs: the CPU's own copy and fp32 matmul rates
        a = torch.randn(16 * 2**20)
        b = torch.empty_like(a)
        x, y = torch.randn(512, 512), torch.randn(512, 512)
        copy_ms, mm_ms = _time_ms(lambda: b.copy_(a), 5), _time_ms(lambda: x @ y, 5)
        return {"copy_tb_s": 2 * a.numel() * 4 / copy_ms / 1e9,
                "matmul_tflop_s": 2 * 512**3 / mm_ms / 1e9}
    n = 2 * 1024**3  # 2 GiB each way
    a = torch.empty(n // 2, dtype=torch.bfloat16, device="cuda").normal_()
    b = torch.empty_like(a)
    copy_ms = _time_ms(lambda: b.copy_(a))
    x = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    y = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    mm_ms = _time_ms(lambda: x @ y)
    del a, b, x, y
    torch.cuda.empty_cache()
    return {"copy_tb_s": 2 * n / copy_ms / 1e9, "matmul_tflop_s": 2 * 8192**3 / mm_ms / 1e9}


def _time_ms(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    start, end = _event(), _event()
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        sync()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def release_memory() -> None:
    """An engine holds reference cycles (its overlap stepper points back at it): collect
    them, or the next engine finds the GPU full."""
    gc.collect()
    if GPU:
        torch.cuda.empty_cache()


ENGINE_OVERRIDES: dict = {}  # --engine KEY=VALUE, applied to every engine made here


def parse_overrides(items: list[str]) -> dict:
    """KEY=VALUE strings as EngineConfig kwargs, values read as JSON where they parse;
    `kernels.pdl=false` sets a field of the kernel settings (EngineConfig.kernels)."""
    out: dict = {}
    for item in items:
        key, _, value = item.partition("=")
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            pass
        group, _, field = key.rpartition(".")
        (out.setdefault(group, {}) if group else out)[field] = value
    return out


def make_engine(path: str, **overrides) -> Engine:
    if path == ensure_demo_model():  # the tiny demo model: its own weights, any device
        kwargs = dict(model=path, device="cuda" if GPU else "cpu", max_running_requests=128,
                      chunked_prefill_size=512, max_prefill_tokens=2048)
    else:
        kwargs = dict(model=path, tokenizer=ensure_demo_model(), dtype="bfloat16", device="cuda",
                      load_format="dummy", max_running_requests=1024, chunked_prefill_size=8192,
                      max_prefill_tokens=16384, cuda_graph_max_bs=1024, mem_fraction_static=0.88)
    kwargs.update(overrides)
    kwargs.update(ENGINE_OVERRIDES)
    return Engine(EngineConfig(**kwargs))


class _HostEvent:
    """A CPU stand-in for torch.cuda.Event (forward passes on the CPU are synchronous)."""

    def record(self) -> None:
        self.t = time.perf_counter()

    def elapsed_time(self, end: "_HostEvent") -> float:
        return 1e3 * (end.t - self.t)


def _event():
    return torch.cuda.Event(enable_timing=True) if GPU else _HostEvent()


class StepPhases:
    """GPU time of every step's forward pass (CUDA events around runner.forward, so they
    also hold under the overlap scheduler), split into pure decode steps and steps with
    prefill chunks. Wall time minus their sum is host work and sampling the GPU waited on.
    `decode_ctx` keeps, per decode step, (batch, context tokens read) for KV-read floors."""

    def __init__(self, engine: Engine) -> None:
        self.events: list[tuple[object, object, bool, int, int]] = []
        self.decode_ctx: list[tuple[int, int]] = []
        self.runner = runner = engine.runner
        self._forward = forward = runner.forward

        def timed(plan, *rest):
            start, end = _event(), _event()
            start.record()
            out = forward(plan, *rest)
            end.record()
            self.events.append((start, end, plan.is_decode, len(plan.chunks), plan.num_tokens))
            if plan.is_decode:
                self.decode_ctx.append((len(plan.chunks),
                                        sum(c.start + c.num_tokens for c in plan.chunks)))
            return out

        runner.forward = timed

    def close(self) -> None:
        self.runner.forward = self._forward

    def decode_rows(self) -> list[tuple[float, int, int]]:
        """(GPU ms, batch, context tokens read) of every decode step, in order."""
        sync()
        steps = [(s.elapsed_time(e), b) for s, e, d, b, _ in self.events if d]
        return [(ms, b, ctx) for (ms, b), (_, ctx) in zip(steps, self.decode_ctx)]

    def summary(self, wall_s: float) -> dict:
        sync()
        out: dict = {}
        for kind, decode in (("decode", True), ("prefill_or_mixed", False)):
            rows = [(s.elapsed_time(e), b, n) for s, e, d, b, n in self.events if d == decode]
            total = sum(ms for ms, _, _ in rows)
            out[kind] = {"steps": len(rows), "gpu_s": total / 1e3,
                         "mean_ms": total / len(rows) if rows else 0.0,
                         "mean_batch": sum(b for _, b, _ in rows) / len(rows) if rows else 0.0,
                         "tokens": sum(n for _, _, n in rows)}
        out["other_s"] = wall_s - out["decode"]["gpu_s"] - out["prefill_or_mixed"]["gpu_s"]
        out["gaps"] = self.gaps()
        return out

    def gaps(self) -> dict:
        """GPU time from one forward's end to the next one's start, by the next step's kind:
        the previous step's sampling and token copy, plus any time the GPU waited for the
        host to launch the step (planning, batch building, eager launches). A step whose
        gap is much longer than sampling was host-bound."""
        out: dict = {}
        gaps = [(prev[1].elapsed_time(cur[0]), step, cur[2])
                for step, (prev, cur) in enumerate(zip(self.events, self.events[1:]), start=1)]
        for kind, decode in (("decode", True), ("prefill_or_mixed", False)):
            ms = sorted(g for g, _, d in gaps if d == decode)
            out[kind] = {"total_s": sum(ms) / 1e3, "p50_ms": ms[len(ms) // 2] if ms else 0.0,
                         "max_ms": ms[-1] if ms else 0.0}
        out["longest"] = [{"step": step, "ms": round(g, 2), "before": "decode" if d else "mixed"}
                          for g, step, d in sorted(gaps, reverse=True)[:8]]
        return out


def print_gpu_timeline(profiler, steps: int) -> None:
    """Where a profiled window's GPU time went: busy (the union of kernel and copy
    intervals) against the window's span, and the longest idle gaps with the kernels either
    side; a step slower than its kernels shows here as gaps."""
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        profiler.export_chrome_trace(f.name)
        events = json.load(open(f.name))["traceEvents"]
    spans = sorted((e["ts"], e["ts"] + e.get("dur", 0), e["name"]) for e in events
                   if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    if not spans:
        return
    busy, gaps, end, prev = 0.0, [], spans[0][0], spans[0][2]
    for start, stop, name in spans:
        if start > end:
            gaps.append((start - end, prev, name))
        busy += max(0.0, stop - max(start, end))
        if stop > end:
            end, prev = stop, name
    span = end - spans[0][0]
    idle = sum(g for g, _, _ in gaps)
    print(f"GPU timeline over {steps} steps: span {span / steps:.1f} us/step, busy "
          f"{busy / steps:.1f}, idle {idle / steps:.1f} in {len(gaps) / steps:.1f} gaps/step; "
          f"{len(spans) / steps:.1f} kernels+copies/step", flush=True)
    for gap, before, after in sorted(gaps, reverse=True)[:12]:
        print(f"  gap {gap:8.1f} us  after {before[:60]!r}  before {after[:60]!r}")
    totals: dict[str, float] = {}
    for start, stop, name in spans:
        kind = kernel_kind(name)
        totals[kind] = totals.get(kind, 0.0) + (stop - start)
    print("  kernel time by kind, us/step: " + ", ".join(
        f"{kind} {t / steps:.0f}" for kind, t in sorted(totals.items(), key=lambda kv: -kv[1])))


KERNEL_KINDS = (("gemm", ("nvjet", "gemm", "cutlass", "xmma", "gemv", "matmul", "_scaled_mm")),
                ("attention", ("extend", "decode", "attn", "flash", "merge")),
                ("norm+rope", ("rms", "norm", "rope", "rotary")),
                ("silu", ("silu", "glu", "act")),
                ("moe", ("moe", "expert", "route", "align")),
                ("copy", ("memcpy", "memset", "copy", "cat", "index", "gather", "scatter")))


def kernel_kind(name: str) -> str:
    """A kernel's coarse kind from its name, for the profile's per-kind sums."""
    low = name.lower()
    return next((kind for kind, keys in KERNEL_KINDS if any(k in low for k in keys)), "other")


def watch_compiles(on_compile, restore: bool = False):
    """Install Triton's post-compile hook (called for every compile or on-disk cache load;
    a kernel the warm-up missed shows here, and a compile inside a timed run costs seconds);
    returns the hook it replaced. `restore`: put `on_compile` (an old hook) back as is."""
    try:
        import triton
        runtime = triton.knobs.runtime
    except (ImportError, AttributeError):
        return None
    old = runtime.jit_post_compile_hook
    if restore:
        runtime.jit_post_compile_hook = on_compile
    else:
        def hook(**kwargs):
            on_compile(kwargs.get("repr", "?")[:80])
        runtime.jit_post_compile_hook = hook
    return old


def run_requests(engine: Engine, reqs, tag: str, phases: bool = False,
                 profile_steps: tuple[int, int] | None = None) -> dict:
    """All requests at once; returns wall time, token counts and per-step timings. With
    `phases`, the GPU time of decode vs prefill steps; with `profile_steps` (a, b), a
    torch.profiler table of the kernels of steps a..b-1."""
    handles = []
    for i, (ids, n_out) in enumerate(reqs):
        params = SamplingParams(max_tokens=n_out, ignore_eos=True, **REQUEST_SAMPLING)
        handles.append(engine.add_request(f"{tag}-{i}", ids, params))
    timer = StepPhases(engine) if phases else None
    profiler = None
    compiles: list[tuple[int, str]] = []
    old_hook = watch_compiles(lambda name: compiles.append((steps, name)))
    sync()
    t0 = time.perf_counter()
    first_token_at = None
    steps = 0
    while engine.has_work:
        if profile_steps and steps == profile_steps[0]:
            gpu = torch.cuda.is_available()
            activity = torch.profiler.ProfilerActivity.CUDA if gpu else torch.profiler.ProfilerActivity.CPU
            profiler = torch.profiler.profile(activities=[activity])
            profiler.__enter__()
        engine.step()
        steps += 1
        if profiler is not None and steps == profile_steps[1]:
            sync()
            profiler.__exit__(None, None, None)
            print(f"{tag}: kernels of steps {profile_steps[0]}..{steps - 1}", flush=True)
            sort = "device_time_total" if gpu else "cpu_time_total"
            print(profiler.key_averages().table(sort_by=sort, row_limit=20),
                  flush=True)
            if gpu:
                print_gpu_timeline(profiler, profile_steps[1] - profile_steps[0])
            profiler = None
        if first_token_at is None and any(h.num_output for h in handles):
            first_token_at = time.perf_counter()
    sync()
    wall = time.perf_counter() - t0
    watch_compiles(old_hook, restore=True)
    if compiles:
        print(f"{tag}: {len(compiles)} Triton compiles or cache loads during the run "
              f"(step, kernel): {compiles[:8]}", flush=True)
    if timer is not None:
        timer.close()
    out_tokens = sum(h.num_output for h in handles)
    for h in handles:
        engine.requests.pop(h.request_id, None)
    return {"wall_s": wall, "output_tokens": out_tokens, "steps": steps, "compiles": len(compiles),
            "output_ids": [list(h.output_ids) for h in handles],
            "prompt_tokens": sum(len(ids) for ids, _ in reqs),
            "cached_tokens": sum(h.cached_tokens for h in handles),
            "ttft_s": (first_token_at - t0) if first_token_at else None,
            "phases": timer.summary(wall) if timer else None,
            "decode_ctx": timer.decode_ctx if timer else None,
            "decode_rows": timer.decode_rows() if timer else None}


def bench_w1(path: str, ceilings: dict, plain_too: bool = False, cfg: dict = LLAMA3_8B,
             profile_steps: tuple[int, int] | None = None) -> dict:
    """W1 with grouped decode on (the default engine) and, with `plain_too`, off: W1 shares
    no prefixes, so the two should agree within noise."""
    out = {}
    for grouped in (True, False) if plain_too else (True,):
        engine = make_engine(path, enable_prefix_grouped_decode=grouped)
        run_requests(engine, w1()[:64], "warm")  # compile kernels for prefill shapes
        engine.cache.reset()
        res = run_requests(engine, w1(), "w1", phases=grouped,
                           profile_steps=profile_steps if grouped else None)
        if grouped and "num_experts" in cfg:
            out.update(moe_decode_floor(engine, res, ceilings))
        del engine
        release_memory()
        if not grouped:
            out["plain_decode_output_tok_s"] = res["output_tokens"] / res["wall_s"]
            continue
        per_prompt, per_output = active_matmul_params(cfg)
        flops = res["prompt_tokens"] * 2 * per_prompt + res["output_tokens"] * 2 * per_output
        floor_s = flops / (ceilings["matmul_tflop_s"] * 1e12)
        out.update({"output_tok_s": res["output_tokens"] / res["wall_s"], "wall_s": res["wall_s"],
                    "floor_s": floor_s, "floor_output_tok_s": res["output_tokens"] / floor_s,
                    "steps": res["steps"], "output_tokens": res["output_tokens"],
                    "phases": res["phases"], "compiles": res["compiles"]})
        print("W1", out, flush=True)
    return out


def decode_floor_s(engine: Engine, decode_ctx: list[tuple[int, int]], ceilings: dict) -> float:
    """Seconds the given decode steps must take at the copy rate: per step, the weights its
    batch touches (`decode_weight_bytes`) + every context token's K/V read once."""
    k = engine.runner.kv_pool.k
    kv_per_token = KVPool.bytes_per_token(len(k), k[0].shape[1], k[0].shape[2], k[0].dtype)
    weights: dict[int, float] = {}  # batch -> weight bytes per decode step
    total = 0.0
    for batch, ctx in decode_ctx:
        if batch not in weights:
            weights[batch] = decode_weight_bytes(engine.runner.model, batch)
        total += weights[batch] + ctx * kv_per_token
    return total / (ceilings["copy_tb_s"] * 1e12)


def moe_decode_floor(engine: Engine, res: dict, ceilings: dict) -> dict:
    """W1's mean decode step against the bytes it must read: at its mean batch, the weights
    of the experts touched + the rest; and per step, those + the K/V of every context token
    (the MoE goal's floor: experts touched + attention + embeddings)."""
    decode = res["phases"]["decode"]
    batch = max(1, round(decode["mean_batch"]))
    floor_ms = 1e3 * decode_weight_bytes(engine.runner.model, batch) / (ceilings["copy_tb_s"] * 1e12)
    with_kv_ms = 1e3 * decode_floor_s(engine, res["decode_ctx"], ceilings) / max(1, len(res["decode_ctx"]))
    return {"decode_mean_batch": batch, "decode_step_ms": decode["mean_ms"],
            "decode_weight_floor_ms": floor_ms, "decode_floor_ms": with_kv_ms}


def bench_decode_batch(path: str, ceilings: dict, batch: int, prompt: int = 512,
                       out: int = 128) -> dict:
    """The decode step at a fixed batch (the MoE batch-256 goal): `batch` requests of
    `prompt` random tokens and `out` output tokens, all at once; the decode steps that ran
    the whole batch, against their floor (weights touched + K/V read)."""
    engine = make_engine(path, max_running_requests=max(batch, 8), cuda_graph_max_bs=max(batch, 8))
    rng, vocab = random.Random(5), engine.runner.vocab_size
    run_requests(engine, [(random_prompt(rng, vocab, prompt), 8) for _ in range(16)], "warm")
    engine.cache.reset()
    reqs = [(random_prompt(rng, vocab, prompt), out) for _ in range(batch)]
    res = run_requests(engine, reqs, f"b{batch}", phases=True)
    full = [(ms, b, ctx) for ms, b, ctx in res["decode_rows"] if b == batch]
    floor = decode_floor_s(engine, [(b, ctx) for _, b, ctx in full], ceilings)
    del engine
    release_memory()
    step_ms = sum(ms for ms, _, _ in full) / max(1, len(full))
    floor_ms = 1e3 * floor / max(1, len(full))
    return {"batch": batch, "prompt": prompt, "steps": len(full), "step_ms": step_ms,
            "floor_ms": floor_ms, "ratio": step_ms / floor_ms if floor_ms else None}


W2_MODES = {"cache_on": (True, True), "plain_decode": (True, False), "cache_off": (False, False)}


def bench_w2(path: str, modes: list[str], profile_steps: tuple[int, int] | None = None) -> dict:
    """Radix cache on with grouped decode (engine/core/prefix_groups.py), on with the plain
    decode kernel, and off. KV bytes per decode step are counted by the grouper."""
    out = {}
    for key in modes:
        cache, grouped = W2_MODES[key]
        engine = make_engine(path, enable_radix_cache=cache, enable_prefix_grouped_decode=grouped)
        run_requests(engine, w1()[:16], "warm")
        engine.cache.reset()
        grouper = engine.runner.prefix_grouper
        if grouper is not None:
            grouper.reset_stats()
        res = run_requests(engine, w2(), "w2", phases=True,
                           profile_steps=profile_steps if key == "cache_on" else None)
        out[f"{key}_output_tok_s"] = res["output_tokens"] / res["wall_s"]
        out[f"{key}_phases"] = res["phases"]
        out[f"{key}_wall_s"] = res["wall_s"]
        if key == "cache_on":
            out["hit_rate"] = res["cached_tokens"] / res["prompt_tokens"]
            out["achievable_hit_rate"] = (32 * 15 * 2048) / res["prompt_tokens"]
            out.update(kv_read_per_step(engine))
        print("W2", key, {k: v for k, v in out.items() if k.startswith(key)}, flush=True)
        del engine
        release_memory()
    return out


def kv_read_per_step(engine: Engine) -> dict:
    """Mean KV bytes one decode step reads (all layers), grouped and as plain decode would."""
    g = engine.runner.prefix_grouper
    if g is None or not g.steps:
        return {}
    k = engine.runner.kv_pool.k
    per_token = KVPool.bytes_per_token(len(k), k[0].shape[1], k[0].shape[2], k[0].dtype)
    return {"decode_steps": g.steps, "grouped_steps": g.grouped_steps,
            "kv_gb_per_step_plain": g.kv_tokens_plain / g.steps * per_token / 1e9,
            "kv_gb_per_step_grouped": g.kv_tokens_read / g.steps * per_token / 1e9}


def bench_w3(path: str, ceilings: dict, profile_steps: tuple[int, int] | None = None) -> dict:
    """Batch-1 latency, with the overlap scheduler and without, plus the forward alone
    (graph replay timed with CUDA events): host overhead = sync step - forward."""
    from engine.executor.graph_runner import GraphKey

    (ids, n_out), = w3()
    out = {}
    for overlap in (True, False):
        engine = make_engine(path, max_running_requests=8, cuda_graph_max_bs=8,
                             enable_overlap_schedule=overlap)
        # Warm up at the measured prompt length (Triton specialises kernels on sizes), on
        # other tokens so that the measured prompt misses the cache.
        run_requests(engine, [(ids[::-1], 8)], "warm")
        engine.cache.reset()
        res = run_requests(engine, [(ids, n_out)], "w3", profile_steps=profile_steps if overlap else None)
        key = "step_ms" if overlap else "sync_step_ms"
        out[key] = 1e3 * (res["wall_s"] - res["ttft_s"]) / (n_out - 1)
        if overlap:
            out["ttft_ms"] = 1e3 * res["ttft_s"]
            graph = engine.runner.graphs.graphs[GraphKey(decode=True, bs=1, tokens=1)]
            out["forward_ms"] = _time_ms(graph.replay, reps=50)
            weights = decode_weight_bytes(engine.runner.model, batch=1)
            out["floor_ms"] = 1e3 * weights / (ceilings["copy_tb_s"] * 1e12)
            out["weight_gb"] = weights / 1e9
            out["unfused_forward_ms"] = unfused_forward_ms(engine)
        del engine
        release_memory()
    out["host_overhead_ms"] = out["sync_step_ms"] - out["forward_ms"]
    return out


def unfused_forward_ms(engine: Engine) -> float:
    """The batch-1 decode graph re-captured with the torch RMSNorm / RoPE / SiLU-mul path."""
    from engine.executor.graph_runner import GraphKey, GraphRunner
    from engine.layers import set_fused_kernels

    runner = engine.runner
    set_fused_kernels(runner.model, False, engine.config.kernels)
    graphs = GraphRunner(runner.model, runner.attn_backend, runner.req_to_token, 1)
    graphs.capture()
    ms = _time_ms(graphs.graphs[GraphKey(decode=True, bs=1, tokens=1)].replay, reps=50)
    set_fused_kernels(runner.model, True, engine.config.kernels)
    return ms


def bench_hf(path: str) -> dict:
    """HF transformers on the same dummy model: batch-1 decode and a static batch."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    r = random.Random(3)
    ids = torch.tensor([[r.randint(100, 120000) for _ in range(128)]], device="cuda")
    gen = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        model.generate(ids, max_new_tokens=4, min_new_tokens=4, **gen)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=129, min_new_tokens=129, **gen)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, **gen)
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        step_ms = 1e3 * ((t1 - t0) - (t2 - t1)) / 128
        # A static batch of 64 W1-like requests padded to one length (HF's plain generate).
        batch = torch.tensor([[r.randint(100, 120000) for _ in range(512)] for _ in range(64)],
                             device="cuda")
        t0 = time.perf_counter()
        model.generate(batch, max_new_tokens=128, min_new_tokens=128, **gen)
        torch.cuda.synchronize()
        batch_tok_s = 64 * 128 / (time.perf_counter() - t0)
    del model
    release_memory()
    return {"hf_step_ms": step_ms, "hf_output_tok_s": batch_tok_s}

# -- time to first token, cold start, long prefill, multi-turn (W4) ----------------------

TTFT_LENGTHS = (1, 32, 128, 512, 2048, 8192)
LONG_MAX_POSITIONS = 16384  # the dummy's context for the TTFT, cold-start and long-prefill rows


def random_prompt(rng: random.Random, vocab: int, n: int) -> list[int]:
    lo = min(100, vocab // 2)
    return [rng.randrange(lo, vocab) for _ in range(n)]


def fit_lengths(engine: Engine, lengths) -> list[int]:
    """The lengths a prompt + one output token fit in (the demo model's context is 512)."""
    return sorted({max(1, min(n, engine.max_context - 2)) for n in lengths})


def ttft_ms(engine: Engine, rng: random.Random, n: int, tag: str) -> float:
    """Time to the first token of one fresh n-token prompt (no cache hit), batch 1."""
    res = run_requests(engine, [(random_prompt(rng, engine.runner.vocab_size, n), 1)], tag)
    return 1e3 * res["ttft_s"]


def bench_ttft(engine: Engine, lengths, reps: int = 5) -> dict:
    """Warm TTFT per prompt length: one untimed request of each length, then the median of
    `reps` fresh prompts."""
    rng = random.Random(5)
    out = {}
    for n in fit_lengths(engine, lengths):
        ttft_ms(engine, rng, n, f"ttft-first-{n}")
        times = [ttft_ms(engine, rng, n, f"ttft-{n}-{i}") for i in range(reps)]
        out[str(n)] = {"ttft_ms": statistics.median(times), "min_ms": min(times),
                       "max_ms": max(times)}
        print(f"TTFT {n} tokens: {out[str(n)]}", flush=True)
    return out


def mixed_batch(engine: Engine, rng: random.Random, tag: str, n: int, n_out: int) -> float:
    """Wall seconds of a batch of n varied requests (prompts of 20-600 tokens, n_out outputs)."""
    vocab = engine.runner.vocab_size
    top = max(21, min(600, engine.max_context - n_out - 8))
    reqs = [(random_prompt(rng, vocab, rng.randint(20, top)), n_out) for _ in range(n)]
    return run_requests(engine, reqs, tag)["wall_s"]


def cold_start_child(model: str, lengths, warmup: bool, json_path: str, batch: tuple[int, int],
                     launched_at: float) -> None:
    """In a fresh process (the parent empties TRITON_CACHE_DIR): engine start per phase,
    every shape's first-request TTFT and the first mixed batch, then the same warm, and how
    many Triton binaries serving added after the start. `launched_at`: the parent's
    time.time() when it started this process (so imports count in ready_s)."""
    from engine.kernels import precompile
    from engine.runtime.warmup import compiled_kernels

    imports_s = time.time() - launched_at  # interpreter start and this script's imports
    path = model_dir(model, None if model == DEMO else LONG_MAX_POSITIONS)
    t0 = time.perf_counter()
    if GPU:
        torch.zeros(1, device="cuda")  # the CUDA context, outside the engine's phases
    cuda_init_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    engine = make_engine(path, enable_warmup=warmup)
    start_s = time.perf_counter() - t0
    ready_s = time.time() - launched_at
    before = sum(compiled_kernels().values())
    rng = random.Random(11)
    lengths = fit_lengths(engine, lengths)
    cold = {str(n): ttft_ms(engine, rng, n, f"cold-{n}") for n in lengths}
    cold_batch = mixed_batch(engine, rng, "cold-mix", *batch)
    warm = {str(n): statistics.median(ttft_ms(engine, rng, n, f"warm-{n}-{i}") for i in range(3))
            for n in lengths}
    warm_batch = mixed_batch(engine, rng, "warm-mix", *batch)
    out = {"warmup": warmup, "engine_start_s": start_s, "process_to_ready_s": ready_s,
           "imports_s": imports_s, "cuda_init_s": cuda_init_s,
           "batch": list(batch),
           "phases": dict(engine.runner.startup.phases), "warmup_report": engine.startup,
           "compiled_ahead": dict(precompile.totals),
           "capture_times": engine.runner.capture_times,
           "parallel_compile": engine.config.parallel_compile,
           "cold_ttft_ms": cold, "warm_ttft_ms": warm, "cold_batch_s": cold_batch,
           "warm_batch_s": warm_batch,
           "binaries_after_start": sum(compiled_kernels().values()) - before}
    out["warmup_report"].pop("phases", None)
    with open(json_path, "w") as f:
        json.dump(out, f, indent=1)


def bench_cold_start(model: str, lengths, batch: str) -> dict:
    """Each of {with warm-up, the same with the capture's compiles serial
    (parallel_compile=False), without warm-up} in a fresh Python process with an empty
    Triton cache (TRITON_CACHE_DIR), so every compile is a real one."""
    import subprocess

    out = {}
    for name, warmup, parallel in (("warmup", True, True), ("warmup_serial_compile", True, False),
                                   ("no_warmup", False, True)):
        with tempfile.TemporaryDirectory() as tmp:
            result = os.path.join(tmp, "cold.json")
            cmd = [sys.executable, os.path.abspath(__file__), "--cold-start-child", "--model", model,
                   "--json", result, "--ttft-lengths", ",".join(map(str, lengths)),
                   "--cold-batch", batch, "--launched-at", repr(time.time())]
            if not warmup:
                cmd.append("--no-warmup")
            overrides = {**ENGINE_OVERRIDES, "parallel_compile": parallel}
            cmd += [arg for key, value in overrides.items()
                    for arg in ("--engine", f"{key}={json.dumps(value)}")]
            env = dict(os.environ, TRITON_CACHE_DIR=os.path.join(tmp, "triton-cache"))
            subprocess.run(cmd, env=env, check=True)
            with open(result) as f:
                row = json.load(f)
        out[name] = row
        print("cold start", name, row, flush=True)
    return out


def bench_long_prefill(engine: Engine, ceilings: dict, num: int = 8, length: int = 16000) -> dict:
    """`num` prompts of `length` tokens at once (chunked as the engine chunks), to their first
    tokens, against the FLOP floor: matmuls (every prompt token through the layers, the LM
    head for each last token) + causal attention (4 * heads * head_dim per (query, key) pair
    and layer), at the H200's bf16 peak and at the measured matmul rate."""
    cfg = model_config(engine.config.model)
    length = max(1, min(length, engine.max_context - 2))
    rng = random.Random(9)
    vocab = engine.runner.vocab_size
    run_requests(engine, [(random_prompt(rng, vocab, length), 1)], "long-first")  # untimed
    engine.cache.reset()
    fi_before = flashinfer_steps(engine)
    res = run_requests(engine, [(random_prompt(rng, vocab, length), 1) for _ in range(num)],
                       "long", phases=True)
    fi_steps = None if fi_before is None else flashinfer_steps(engine) - fi_before
    per_prompt, _ = active_matmul_params(cfg)
    matmul = num * length * 2 * per_prompt + num * 2 * cfg["hidden_size"] * cfg["vocab_size"]
    attention = (num * cfg["num_hidden_layers"] * 4 * cfg["num_attention_heads"] * cfg["head_dim"]
                 * length * (length + 1) / 2)
    peak = H200_BF16_TFLOPS if GPU else ceilings["matmul_tflop_s"]
    prefill_gpu = res["phases"]["prefill_or_mixed"]["gpu_s"]
    return {"requests": num, "length": length, "wall_s": res["wall_s"],
            "prefill_gpu_s": prefill_gpu, "steps": res["steps"],
            "matmul_tflop": matmul / 1e12, "attention_tflop": attention / 1e12,
            "peak_tflop_s": peak, "floor_s": (matmul + attention) / (peak * 1e12),
            "floor_measured_s": (matmul + attention) / (ceilings["matmul_tflop_s"] * 1e12),
            "phases": res["phases"], "flashinfer_steps": fi_steps}


def flashinfer_steps(engine: Engine) -> int | None:
    """Steps whose extend attention FlashInfer ran so far (engine/attention/
    flashinfer_prefill.py); None when the engine runs without it."""
    fi = getattr(engine.runner.attn_backend, "flashinfer", None)
    return None if fi is None else fi.steps


def bench_w4(engine: Engine, ceilings: dict, conversations: int = 64, turns: int = 4,
             first: int = 1024, answer: int = 128, user: int = 64) -> dict:
    """W4, multi-turn chat: `conversations` users each send a `first`-token message; every
    turn they all get a `answer`-token reply, and the next turn's prompt is the previous
    prompt + that reply + a new `user`-token message (so it hits the radix cache up to the
    new message). Turns run one after another, each as one batch. Per turn: wall time
    against the floor of its decode steps (weights + every context token's K/V read once
    per step, at the copy rate), radix hit rate, and the GPU time split of the run."""
    rng = random.Random(4)
    vocab = engine.runner.vocab_size
    prompts = [random_prompt(rng, vocab, first) for _ in range(conversations)]
    rows = []
    for turn in range(turns):
        if max(map(len, prompts)) + answer + 1 > engine.max_context:
            break
        res = run_requests(engine, [(p, answer) for p in prompts], f"w4-{turn}", phases=True)
        floor_s = decode_floor_s(engine, res["decode_ctx"], ceilings)
        ph = res["phases"]
        rows.append({"turn": turn + 1, "prompt_tokens": res["prompt_tokens"] / conversations,
                     "hit_rate": res["cached_tokens"] / res["prompt_tokens"],
                     "wall_s": res["wall_s"], "decode_floor_s": floor_s,
                     "wall_over_floor": res["wall_s"] / floor_s if floor_s else None,
                     "decode_gpu_over_floor": ph["decode"]["gpu_s"] / floor_s if floor_s else None,
                     "phases": ph})
        print("W4 turn", rows[-1], flush=True)
        prompts = [p + out + random_prompt(rng, vocab, user)
                   for p, out in zip(prompts, res["output_ids"])]
    return {"conversations": conversations, "answer": answer, "user": user, "first": first,
            "turns": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="llama3-8b", choices=sorted(MODELS) + [DEMO],
                    help="the dummy model's shape: Llama-3-8B, or Qwen3-30B-A3B (moe); "
                         "demo: the tiny demo model (CPU smoke runs)")
    ap.add_argument("--workloads", default=None,
                    help="W1,W2,W3 (the default unless a latency row is asked for)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--skip-check", action="store_true", help="skip the kernel check")
    ap.add_argument("--w2-modes", default=",".join(W2_MODES), help="subset of " + ",".join(W2_MODES))
    ap.add_argument("--w1-plain", action="store_true", help="also run W1 without grouped decode")
    ap.add_argument("--profile-w2", default=None, metavar="A:B",
                    help="print torch.profiler's kernel table for steps A..B-1 of W2 cache-on")
    ap.add_argument("--profile-w1", default=None, metavar="A:B",
                    help="the same for steps A..B-1 of W1 (late steps are decode at ~480 rows)")
    ap.add_argument("--profile-w3", default=None, metavar="A:B",
                    help="the same for steps A..B-1 of W3 (batch-1 decode; e.g. MoE or FP8 weights)")
    ap.add_argument("--ttft-sweep", action="store_true", help="warm TTFT per prompt length, batch 1")
    ap.add_argument("--ttft-lengths", default=",".join(map(str, TTFT_LENGTHS)))
    ap.add_argument("--ttft-reps", type=int, default=5)
    ap.add_argument("--cold-start", action="store_true",
                    help="fresh processes, empty TRITON_CACHE_DIR, with and without the warm-up")
    ap.add_argument("--long-prefill", action="store_true", help="N x L-token prompts vs the FLOP floor")
    ap.add_argument("--long-shape", default="8x16000", metavar="NxL")
    ap.add_argument("--w4", action="store_true", help="multi-turn conversations (W4)")
    ap.add_argument("--decode-batch", default=None, metavar="N[,PROMPT,OUT]",
                    help="the decode step at batch N (prompts of PROMPT tokens, default 512; OUT "
                         "output tokens, default 128) against its floor (weights + K/V)")
    ap.add_argument("--w4-shape", default="64,4,1024,128,64",
                    metavar="CONVS,TURNS,FIRST,ANSWER,USER")
    ap.add_argument("--cold-batch", default="40,32", metavar="N,OUT",
                    help="the cold start's first mixed batch: N requests of OUT tokens")
    ap.add_argument("--cold-start-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--launched-at", type=float, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--no-warmup", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--engine", action="append", default=[], metavar="KEY=VALUE",
                    help="an EngineConfig override for every engine this process makes (repeatable), "
                         "e.g. --engine cuda_graph_max_extend_tokens=0, --engine kernels.pdl=false")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="sample the W1-W3 requests at this temperature (top_p 0.95) instead of greedy")
    ap.add_argument("--repetition-penalty", type=float, default=1.0,
                    help="every request's (1.05: Qwen2.5-Instruct's generation_config, which the "
                         "app applies by default)")
    ap.add_argument("--quantization", choices=["fp8"], default=None,
                    help="FP8 weights: the same as --engine quantization=fp8")
    ap.add_argument("--kv-cache-dtype", choices=["fp8_e4m3"], default=None,
                    help="an FP8 KV pool: the same as --engine kv_cache_dtype=fp8_e4m3")
    args = ap.parse_args()
    if args.temperature:
        REQUEST_SAMPLING.update(temperature=args.temperature, top_p=0.95)
    if args.repetition_penalty != 1.0:
        REQUEST_SAMPLING.update(repetition_penalty=args.repetition_penalty)
    ENGINE_OVERRIDES.update(parse_overrides(args.engine))
    ENGINE_OVERRIDES.update({key: value for key, value in (("quantization", args.quantization),
                                                           ("kv_cache_dtype", args.kv_cache_dtype))
                             if value is not None})
    lengths = [int(x) for x in args.ttft_lengths.split(",")]
    if args.cold_start_child:
        batch = tuple(int(x) for x in args.cold_batch.split(","))
        cold_start_child(args.model, lengths, not args.no_warmup, args.json, batch,
                         args.launched_at or time.time())
        return
    latency_rows = args.ttft_sweep or args.cold_start or args.long_prefill or args.w4
    work = (args.workloads or ("" if latency_rows or args.decode_batch else "W1,W2,W3")).split(",")
    profile = tuple(int(x) for x in args.profile_w2.split(":")) if args.profile_w2 else None
    profile3 = tuple(int(x) for x in args.profile_w3.split(":")) if args.profile_w3 else None
    profile1 = tuple(int(x) for x in args.profile_w1.split(":")) if args.profile_w1 else None
    if args.model == DEMO:
        args.skip_check = args.no_hf = True  # no Triton kernels on the CPU; no HF peer
    if not args.skip_check:
        check_kernels(moe=args.model == "moe")
    path = model_dir(args.model)
    ceilings = measure_ceilings()
    results: dict = {"ceilings": ceilings, "engine_overrides": dict(ENGINE_OVERRIDES)}
    if latency_rows:
        run_latency_rows(args, lengths, ceilings, results)
    for name, bench in (("W3", lambda: bench_w3(path, ceilings, profile3)),
                        ("W2", lambda: bench_w2(path, args.w2_modes.split(","), profile)),
                        ("W1", lambda: bench_w1(path, ceilings, args.w1_plain, MODELS[args.model],
                                                profile1))):
        if name in work:
            results[name] = bench()
            print(name, results[name], flush=True)
            save(results, args.json)
    if args.decode_batch:
        results["decode_batch"] = bench_decode_batch(
            path, ceilings, *(int(x) for x in args.decode_batch.split(",")))
        print("decode batch", results["decode_batch"], flush=True)
        save(results, args.json)
    if not args.no_hf and any(w in work for w in ("W1", "W2", "W3")):
        hf = bench_hf(path)
        if "W1" in results:
            results["W1"]["hf_output_tok_s"] = hf["hf_output_tok_s"]
        if "W3" in results:
            results["W3"]["hf_step_ms"] = hf["hf_step_ms"]
        results["HF"] = hf
    save(results, args.json)
    print_table(results)


def run_latency_rows(args, lengths: list[int], ceilings: dict, results: dict) -> None:
    """The TTFT sweep, long prefill and W4 share one engine (the dummy with a 16k context);
    the cold start runs in its own processes first, before this one holds the GPU."""
    if args.cold_start:
        results["cold_start"] = bench_cold_start(args.model, lengths, args.cold_batch)
        save(results, args.json)
    if not (args.ttft_sweep or args.long_prefill or args.w4):
        return
    engine = make_engine(model_dir(args.model, None if args.model == DEMO else LONG_MAX_POSITIONS))
    results["engine_start"] = {"phases": dict(engine.runner.startup.phases),
                               "total_s": engine.runner.startup.total}
    if args.ttft_sweep:
        results["ttft"] = bench_ttft(engine, lengths, args.ttft_reps)
        save(results, args.json)
    if args.long_prefill:
        num, length = (int(x) for x in args.long_shape.lower().split("x"))
        results["long_prefill"] = bench_long_prefill(engine, ceilings, num, length)
        print("long prefill", results["long_prefill"], flush=True)
        save(results, args.json)
    if args.w4:
        convs, turns, first, answer, user = (int(x) for x in args.w4_shape.split(","))
        engine.cache.reset()
        results["W4"] = bench_w4(engine, ceilings, convs, turns, first, answer, user)
        save(results, args.json)
    del engine
    release_memory()


def save(results: dict, path: str | None) -> None:
    """After every workload, so a run cut short keeps what it measured."""
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=1)


def print_step_row(label: str, step_ms: float, floor_ms: float, note: str) -> None:
    print(f"{label:<34} {step_ms:>10.2f} {floor_ms:>10.2f} {step_ms / floor_ms if floor_ms else 0:>7.2f}  ({note})")


def print_table(r: dict) -> None:
    c = r["ceilings"]
    print(f"\nceilings: copy {c['copy_tb_s']:.3f} TB/s, matmul {c['matmul_tflop_s']:.1f} TFLOP/s")
    if any(w in r for w in ("W1", "W2", "W3")):
        print(f"{'figure':<34} {'ours':>10} {'floor':>10} {'ratio':>7} {'HF':>9}")
    if "W1" in r:
        w = r["W1"]
        print(f"{'W1 output tok/s':<34} {w['output_tok_s']:>10.0f} {w['floor_output_tok_s']:>10.0f} "
              f"{w['output_tok_s'] / w['floor_output_tok_s']:>7.2f} {w.get('hf_output_tok_s', 0):>9.0f}")
        if "plain_decode_output_tok_s" in w:
            print(f"{'W1 output tok/s, plain decode':<34} {w['plain_decode_output_tok_s']:>10.0f}")
        if "decode_weight_floor_ms" in w:
            label = f"W1 decode step ms (batch {w['decode_mean_batch']})"
            print_step_row(label, w["decode_step_ms"], w["decode_weight_floor_ms"], "floor: weights")
            print_step_row(label, w["decode_step_ms"], w["decode_floor_ms"], "floor: weights + K/V")
    if "decode_batch" in r:
        d = r["decode_batch"]
        print_step_row(f"decode step ms at batch {d['batch']}", d["step_ms"], d["floor_ms"],
                       f"{d['steps']} steps, floor: weights + K/V")
    if "W2" in r:
        w = r["W2"]
        for key, label in (("cache_on", "cache on"), ("plain_decode", "plain decode"),
                           ("cache_off", "cache off")):
            if f"{key}_output_tok_s" in w:
                print(f"{'W2 output tok/s, ' + label:<34} {w[key + '_output_tok_s']:>10.0f}")
        on, plain, off = (w.get(f"{k}_output_tok_s") for k in W2_MODES)
        if on and plain:
            print(f"{'W2 grouped / plain decode':<34} {on / plain:>10.2f}")
        if "kv_gb_per_step_plain" in w:
            print(f"{'W2 KV GB/step grouped (plain)':<34} {w['kv_gb_per_step_grouped']:>10.1f} "
                  f"{w['kv_gb_per_step_plain']:>10.1f}")
        if on and off:
            print(f"{'W2 on/off speed-up':<34} {on / off:>10.2f}")
        if "hit_rate" in w:
            print(f"{'W2 hit rate (achievable)':<34} {w['hit_rate']:>10.3f} {w['achievable_hit_rate']:>10.3f}")
    phases = [(f"W2 {k}", r["W2"][f"{k}_phases"]) for k in W2_MODES if r.get("W2", {}).get(f"{k}_phases")]
    if r.get("W1", {}).get("phases"):
        phases.insert(0, ("W1", r["W1"]["phases"]))
    if phases:
        print(f"\n{'where the time goes':<20} {'decode steps':>12} {'GPU s':>7} {'ms/step':>8} {'batch':>6}"
              f" {'prefill steps':>13} {'GPU s':>7} {'ms/step':>8} {'tokens':>8} {'other s':>8}")
        for name, p in phases:
            d, f = p["decode"], p["prefill_or_mixed"]
            print(f"{name:<20} {d['steps']:>12} {d['gpu_s']:>7.2f} {d['mean_ms']:>8.2f} {d['mean_batch']:>6.0f}"
                  f" {f['steps']:>13} {f['gpu_s']:>7.2f} {f['mean_ms']:>8.2f} {f['tokens']:>8} {p['other_s']:>8.2f}")
        print(f"{'gaps before a step':<20} {'kind':>12} {'total s':>8} {'p50 ms':>8} {'max ms':>8}")
        for name, p in phases:
            gaps = p.get("gaps", {})
            for kind in ("decode", "prefill_or_mixed"):
                g = gaps.get(kind)
                if g:
                    print(f"{name:<20} {kind[:12]:>12} {g['total_s']:>8.3f} {g['p50_ms']:>8.2f} {g['max_ms']:>8.2f}")
            if gaps.get("longest"):
                print(f"{name:<20} longest: " + ", ".join(f"{x['ms']:.1f} ms before step {x['step']}"
                                                       for x in gaps["longest"][:5]))
    if "W3" in r:
        w = r["W3"]
        print(f"{'W3 decode step ms':<34} {w['step_ms']:>10.2f} {w['floor_ms']:>10.2f} "
              f"{w['step_ms'] / w['floor_ms']:>7.2f} {w.get('hf_step_ms', 0):>9.1f}")
        print(f"{'W3 step ms, overlap off':<34} {w['sync_step_ms']:>10.2f}")
        print(f"{'W3 forward only (graph replay) ms':<34} {w['forward_ms']:>10.2f} {w['floor_ms']:>10.2f} "
              f"{w['forward_ms'] / w['floor_ms']:>7.2f}")
        print(f"{'W3 forward ms, fused kernels off':<34} {w['unfused_forward_ms']:>10.2f} {w['floor_ms']:>10.2f} "
              f"{w['unfused_forward_ms'] / w['floor_ms']:>7.2f}")
        print(f"{'W3 host overhead ms (sync)':<34} {w['host_overhead_ms']:>10.2f}")
        print(f"{'W3 TTFT ms (512 tokens)':<34} {w['ttft_ms']:>10.1f}")
    print_latency_rows(r)


def print_latency_rows(r: dict) -> None:
    if "engine_start" in r:
        e = r["engine_start"]
        print(f"\nengine start {e['total_s']:.1f} s: "
              + ", ".join(f"{k} {v:.1f} s" for k, v in e["phases"].items()))
    if "ttft" in r:
        print(f"\n{'TTFT, batch 1, warm (ms)':<30} {'median':>8} {'min':>8} {'max':>8}")
        for n, t in r["ttft"].items():
            print(f"{n + ' tokens':<30} {t['ttft_ms']:>8.1f} {t['min_ms']:>8.1f} {t['max_ms']:>8.1f}")
    if "cold_start" in r:
        for key, c in r["cold_start"].items():
            print(f"\ncold start, {key.replace('_', ' ')}: process start to ready {c['process_to_ready_s']:.1f} s "
                  f"(imports {c.get('imports_s', 0.0):.1f} s, CUDA context {c.get('cuda_init_s', 0.0):.1f} s), engine "
                  f"{c['engine_start_s']:.1f} s (" + ", ".join(f"{k} {v:.1f} s" for k, v in c["phases"].items())
                  + f"); compiled ahead: {c.get('compiled_ahead', {}).get('specializations', 0)} in "
                  f"{c.get('compiled_ahead', {}).get('seconds', 0.0):.1f} s; binaries compiled after start: "
                  f"{c['binaries_after_start']}")
            ahead = c.get("compiled_ahead", {})
            if ahead.get("specializations"):
                print(f"  compile ahead: {ahead['seconds']:.2f} s wall, compile {ahead['compile_s']:.2f} s + "
                      f"load {ahead['load_s']:.2f} s summed over threads, slowest {ahead['slowest_s']:.2f} s")
            times = c.get("capture_times", {})
            print("  capture: " + ", ".join(f"{k} {v:.2f} s" for k, v in times.items()
                                             if not isinstance(v, dict)))
            for name, t in times.items():
                if isinstance(t, dict):
                    print(f"  {name}: " + ", ".join(f"{k} {v:.2f} s" for k, v in t.items()))
            print(f"{'prompt tokens':<16} {'first TTFT ms':>14} {'warm ms':>8} {'ratio':>6}")
            for n, ms in c["cold_ttft_ms"].items():
                warm = c["warm_ttft_ms"][n]
                print(f"{n:<16} {ms:>14.1f} {warm:>8.1f} {ms / warm:>6.2f}")
            label = f"first batch of {c['batch'][0]} (s)"
            print(f"{label:<16} {c['cold_batch_s']:>14.2f} {c['warm_batch_s']:>8.2f} "
                  f"{c['cold_batch_s'] / c['warm_batch_s']:>6.2f}")
    if "long_prefill" in r:
        lp = r["long_prefill"]
        print(f"\nlong prefill {lp['requests']} x {lp['length']}: {lp['wall_s']:.3f} s wall, "
              f"{lp['prefill_gpu_s']:.3f} s GPU; floor {lp['floor_s']:.3f} s at {lp['peak_tflop_s']:.0f} TFLOP/s "
              f"({lp['matmul_tflop']:.0f} matmul + {lp['attention_tflop']:.0f} attention TFLOP): "
              f"{lp['wall_s'] / lp['floor_s']:.2f}x; at the measured matmul rate {lp['wall_s'] / lp['floor_measured_s']:.2f}x"
              + (f"; {lp['flashinfer_steps']} of its {lp['steps']} steps' attention by FlashInfer"
                 if lp.get("flashinfer_steps") is not None else ""))
    if "W4" in r:
        w = r["W4"]
        print(f"\nW4: {w['conversations']} conversations, {w['first']}-token first message, "
              f"{w['answer']}-token answers, {w['user']}-token follow-ups")
        print(f"{'turn':<5} {'prompt':>7} {'hit':>6} {'wall s':>8} {'floor s':>8} {'wall/fl':>8} {'dec/fl':>7}"
              f" {'dec steps':>9} {'dec GPU s':>9} {'pf steps':>8} {'pf GPU s':>8} {'other s':>8}")
        for t in w["turns"]:
            d, f = t["phases"]["decode"], t["phases"]["prefill_or_mixed"]
            print(f"{t['turn']:<5} {t['prompt_tokens']:>7.0f} {t['hit_rate']:>6.3f} {t['wall_s']:>8.3f}"
                  f" {t['decode_floor_s']:>8.3f} {t['wall_over_floor'] or 0:>8.2f} {t['decode_gpu_over_floor'] or 0:>7.2f}"
                  f" {d['steps']:>9} {d['gpu_s']:>9.3f} {f['steps']:>8} {f['gpu_s']:>8.3f} {t['phases']['other_s']:>8.3f}")


if __name__ == "__main__":
    main()
