"""Multi-LoRA serving on a GPU: the cost of adapters against the base model, on the
Llama-3-8B-shaped dummy model with dummy rank-16 adapters on all seven projections (the
S-LoRA / Punica comparison; issue 51's goals):

- decode step at batch 32, the requests spread over 4 adapters, against the base's step;
- decode step at batch 1 under an adapter, against the base's;
- time to first token of a 512-token prompt under an adapter, against the base's;
- 64 adapters registered, 8 in the GPU pool, a request stream cycling through them: output
  tokens/s against the base serving the same stream.

    python scripts/bench_lora.py [--model llama3-8b|demo] [--rank 16] [--json PATH]
    python scripts/bench_lora.py --kernels   # the kernels alone, per 8B linear (GPU)

The base rows run on an engine without LoRA; the adapter rows on one with `max_loras=8`
(the pool of the 64-adapter row), so they include what enabling LoRA costs. One more row,
the LoRA engine serving base requests only, isolates that. `--model demo` runs every row on
the tiny demo model, on the CPU when there is no GPU (a smoke test: tests/test_lora.py).
Adapters are written in PEFT's format (random A and B) to a temporary folder: 8 distinct
ones, registered under 64 names (each name is its own adapter to the engine).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench_offline import DEMO, model_config, model_dir  # noqa: E402
from engine import EngineConfig, SamplingParams  # noqa: E402
from engine.loading.demo_model import ensure_demo_model  # noqa: E402
from engine.runtime.engine import Engine  # noqa: E402

GPU = torch.cuda.is_available()
MODULES = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
           "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def module_shapes(cfg: dict) -> dict[str, tuple[int, int]]:
    """(in, out) of each projection."""
    h, inter, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}


def write_adapter(path: str, cfg: dict, rank: int, seed: int) -> str:
    """A random PEFT adapter (every layer, all seven projections) at `path`."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for module, (n_in, n_out) in module_shapes(cfg).items():
            key = f"base_model.model.model.layers.{layer}.{MODULES[module]}.{module}"
            tensors[f"{key}.lora_A.weight"] = (torch.randn(rank, n_in, generator=gen)
                                               / n_in ** 0.5).to(torch.bfloat16)
            tensors[f"{key}.lora_B.weight"] = (torch.randn(n_out, rank, generator=gen)
                                               * 0.01).to(torch.bfloat16)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                   "target_modules": list(MODULES)}, f)
    return path


def make_engine(path: str, **overrides) -> Engine:
    if path == ensure_demo_model():
        kwargs = dict(model=path, device="cuda" if GPU else "cpu", max_running_requests=64,
                      max_total_tokens=16384)
    else:
        kwargs = dict(model=path, tokenizer=ensure_demo_model(), dtype="bfloat16", device="cuda",
                      load_format="dummy", max_running_requests=256, mem_fraction_static=0.8)
    return Engine(EngineConfig(**{**kwargs, **overrides}))


def _prompt(vocab: int, n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab - 10, (n,), generator=gen).tolist()


def _params(lora: str | None, max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, lora=lora)


def _drain(engine: Engine) -> None:
    while engine.has_work:
        engine.step()
    engine.requests.clear()
    engine.flush_cache()


def decode_step_ms(engine: Engine, loras: list[str | None], vocab: int, steps: int) -> float:
    """Median wall time of a decode step of len(loras) requests (one per entry)."""
    for i, lora in enumerate(loras):
        engine.add_request(f"d{i}", _prompt(vocab, 64, i), _params(lora, steps + 8))
    while any(r.kv is None or r.pending_len > 1 for r in engine.requests.values()):
        engine.step()  # the prefills
    for _ in range(3):
        engine.step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        if GPU:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    _drain(engine)
    return statistics.median(times) * 1e3


def ttft_ms(engine: Engine, lora: str | None, vocab: int, n_tokens: int, reps: int) -> float:
    """Median time to the first token of an n-token prompt (fresh prompts: no cache hit)."""
    n_tokens = min(n_tokens, engine.max_context - 1)  # (the demo model's context is 512)
    times = []
    for rep in range(reps + 1):
        t0 = time.perf_counter()
        req = engine.add_request(f"t{rep}", _prompt(vocab, n_tokens, 1000 + rep), _params(lora, 1))
        while not req.output_ids:
            engine.step()
        times.append(time.perf_counter() - t0)
        _drain(engine)
    return statistics.median(times[1:]) * 1e3  # the first one warms up


def stream_tok_s(engine: Engine, names: list[str | None], vocab: int, n_requests: int,
                 max_tokens: int) -> float:
    """Output tokens/s of `n_requests` requests cycling through `names`, all queued at once."""
    for i in range(n_requests):
        engine.add_request(f"s{i}", _prompt(vocab, 128, 5000 + i),
                           _params(names[i % len(names)], max_tokens))
    t0 = time.perf_counter()
    while engine.has_work:
        engine.step()
    dt = time.perf_counter() - t0
    engine.requests.clear()
    engine.flush_cache()
    return n_requests * max_tokens / dt


def run(model: str, rank: int, smoke: bool, stream: bool = True) -> dict:
    path = model_dir(model)
    cfg = model_config(path)
    vocab = cfg["vocab_size"]
    steps, reps = (4, 2) if smoke else (50, 5)
    n_stream, stream_tokens = (16, 4) if smoke else (512, 64)
    folder = tempfile.mkdtemp(prefix="radixserve-lora-bench-")
    distinct = [write_adapter(os.path.join(folder, f"a{i}"), cfg, rank, i) for i in range(8)]
    names = {f"lora{i}": distinct[i % 8] for i in range(64)}
    rows: dict[str, float] = {}

    base = make_engine(path)
    rows["decode_b32_base_ms"] = decode_step_ms(base, [None] * 32, vocab, steps)
    rows["decode_b1_base_ms"] = decode_step_ms(base, [None], vocab, steps)
    rows["ttft_512_base_ms"] = ttft_ms(base, None, vocab, 512, reps)
    if stream:
        rows["stream_base_tok_s"] = stream_tok_s(base, [None], vocab, n_stream, stream_tokens)
    del base
    gc.collect()  # the base engine's weights and pool go before the LoRA engine sizes its own
    if GPU:
        torch.cuda.empty_cache()

    lora = make_engine(path, max_loras=8, max_lora_rank=rank, lora_modules=names)
    four = [f"lora{i % 4}" for i in range(32)]
    rows["decode_b32_lora_engine_base_ms"] = decode_step_ms(lora, [None] * 32, vocab, steps)
    rows["decode_b32_4_adapters_ms"] = decode_step_ms(lora, four, vocab, steps)
    rows["decode_b1_adapter_ms"] = decode_step_ms(lora, ["lora0"], vocab, steps)
    rows["ttft_512_adapter_ms"] = ttft_ms(lora, "lora0", vocab, 512, reps)
    rows["ttft_512_lora_engine_base_ms"] = ttft_ms(lora, None, vocab, 512, reps)
    if stream:
        rows["stream_64_adapters_tok_s"] = stream_tok_s(lora, list(names), vocab, n_stream,
                                                        stream_tokens)
    rows["lora_stats"] = {k: v for k, v in lora.stats().items() if k.startswith("lora_")}
    return rows


def gpu_us(fn, iters: int = 20) -> dict[str, float]:
    """Microseconds of GPU time per call of `fn`, by kernel ("shrink", "expand", "other"),
    from the profiler: the kernels' own time, without the Python launch cost an eager
    microbenchmark would add (a CUDA graph pays none)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    out = {"shrink": 0.0, "expand": 0.0, "other": 0.0}
    for event in prof.events():
        if event.device_type.name == "CUDA":
            kind = next((k for k in ("shrink", "expand") if k in event.name), "other")
            out[kind] += event.time_range.elapsed_us() / iters
    return out


def _kernel_case(k: int, parts: tuple[int, ...], rows: int, n_adapters: int, seg: int,
                 rank: int, slots: int = 8, dev: str = "cuda") -> dict[str, float]:
    """GPU microseconds of one lora_sgmv call (shrink, expand), beside the base GEMM and a
    cuBLAS LoRA of one adapter over all rows (x @ A^T, then y += xa @ B^T per part): `rows`
    rows in segments of `seg`, adapters interleaved over the segments (how a decode step's
    requests arrive; 0: none)."""
    from engine.kernels.lora import column_tile, lora_sgmv
    from engine.lora.tiles import TilePlan, block_m_for, split_packed, tile_bound

    n = sum(parts)
    a = torch.randn(slots, len(parts) * rank, k, device=dev, dtype=torch.bfloat16) * 0.02
    b = torch.randn(slots, n, rank, device=dev, dtype=torch.bfloat16) * 0.02
    ranks = torch.full((slots,), rank, dtype=torch.int32, device=dev)
    x = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
    y = torch.zeros(rows, n, device=dev, dtype=torch.bfloat16)
    lens = [seg] * (rows // seg)
    slot_of = [i % n_adapters if n_adapters else -1 for i in range(len(lens))]
    plan = TilePlan.of(slot_of, lens, block_m_for(sum(lens), seg == 1))
    # a CUDA graph's grid (decode, and extends of up to cuda_graph_max_extend_tokens): the
    # bound of the row count's tiles, over static buffers
    num_tiles = tile_bound(rows, plan.block_m, slots)
    tiles_cap = max(num_tiles, len(plan.tiles))
    order, tiles = split_packed(plan.pack(rows, tiles_cap).to(dev), rows)
    bounds = [sum(parts[:i + 1]) for i in range(len(parts) - 1)]
    tile_n = column_tile(bounds + [n])
    times = gpu_us(lambda: lora_sgmv(x, y, a, b, ranks, order, tiles, num_tiles, plan.block_m,
                                     bounds, tile_n))
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
    times["base"] = sum(gpu_us(lambda: x @ w.T).values())

    def cublas_lora() -> None:
        xa = x @ a[0].T
        for p, (lo, hi) in enumerate(zip([0] + bounds, bounds + [n])):
            y[:, lo:hi].addmm_(xa[:, p * rank:(p + 1) * rank], b[0, lo:hi].T)

    times["cublas"] = sum(gpu_us(cublas_lora).values())
    return times


def bench_kernels(rank: int) -> None:
    """lora_sgmv alone on the 8B model's four adapted linears, beside the base GEMM and a
    cuBLAS LoRA (the bar for one adapter over many rows)."""
    h, inter, kv = 4096, 14336, 1024
    linears = {"qkv": (h, (h, kv, kv)), "o": (h, (h,)), "gate_up": (h, (inter, inter)),
               "down": (inter, (h,))}
    cases = {"decode b1": (1, 1, 1), "decode b32, 4 adapters": (32, 4, 1),
             "decode b32, 8 adapters": (32, 8, 1), "decode b32, no adapter": (32, 0, 1),
             "prefill 512": (512, 1, 512), "prefill 2048": (2048, 1, 2048)}
    print(f"\nlora_sgmv, rank {rank} (pool rank {rank}), {torch.cuda.get_device_name()}; "
          "GPU us per call")
    print(f"{'case':<26}{'linear':<9}{'shrink':>8}{'expand':>8}{'lora':>8}{'base':>8}"
          f"{'ratio':>7}{'cuBLAS':>8}")
    for case, (rows, n_adapters, seg) in cases.items():
        total = {"lora": 0.0, "base": 0.0, "cublas": 0.0}
        for name, (k, parts) in linears.items():
            t = _kernel_case(k, parts, rows, n_adapters, seg, rank)
            lora = t["shrink"] + t["expand"] + t["other"]
            for key, value in (("lora", lora), ("base", t["base"]), ("cublas", t["cublas"])):
                total[key] += value
            print(f"{case:<26}{name:<9}{t['shrink']:>8.1f}{t['expand']:>8.1f}{lora:>8.1f}"
                  f"{t['base']:>8.1f}{lora / t['base']:>7.2f}{t['cublas']:>8.1f}")
        print(f"{case:<26}{'layer':<9}{'':>8}{'':>8}{total['lora']:>8.1f}{total['base']:>8.1f}"
              f"{total['lora'] / total['base']:>7.2f}{total['cublas']:>8.1f}")


def print_table(rows: dict, model: str, rank: int) -> None:
    device = torch.cuda.get_device_name() if GPU else "cpu"
    print(f"\nmulti-LoRA, {model}, rank {rank} on all 7 projections, {device}")
    print(f"{'measure':<44}{'base':>12}{'adapters':>12}{'ratio':>8}{'goal':>8}")
    for label, b, a, goal, higher in (
            ("decode step, batch 32, 4 adapters (ms)", "decode_b32_base_ms",
             "decode_b32_4_adapters_ms", 1.25, False),
            ("decode step, batch 32, LoRA on, no adapter", "decode_b32_base_ms",
             "decode_b32_lora_engine_base_ms", None, False),
            ("decode step, batch 1 (ms)", "decode_b1_base_ms", "decode_b1_adapter_ms", 1.30, False),
            ("TTFT, 512-token prompt (ms)", "ttft_512_base_ms", "ttft_512_adapter_ms", 1.30, False),
            ("TTFT, 512, LoRA on, no adapter (ms)", "ttft_512_base_ms",
             "ttft_512_lora_engine_base_ms", None, False),
            ("stream, 64 adapters / 8 slots (tok/s)", "stream_base_tok_s",
             "stream_64_adapters_tok_s", None, True)):
        if a not in rows:
            continue
        ratio = rows[a] / rows[b]
        mark = "" if goal is None else (f"<={goal:.2f}" + (" ok" if ratio <= goal else " MISS"))
        print(f"{label:<44}{rows[b]:>12.2f}{rows[a]:>12.2f}{ratio:>8.2f}  {mark}")
    print("adapter pool:", rows["lora_stats"])


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama3-8b" if GPU else DEMO, choices=["llama3-8b", DEMO])
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--no-stream", action="store_true",
                    help="skip the 64-adapter stream rows (the longest part)")
    ap.add_argument("--kernels", action="store_true",
                    help="time the LoRA kernels alone per 8B linear (GPU), then stop")
    args = ap.parse_args(argv)
    if args.kernels:
        bench_kernels(args.rank)
        return {}
    rows = run(args.model, args.rank, smoke=args.model == DEMO and not GPU,
               stream=not args.no_stream)
    print_table(rows, args.model, args.rank)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "rank": args.rank, **rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
