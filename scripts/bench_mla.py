"""MLA on a GPU: a DeepSeek-V2-Lite-shaped dummy model (16B total, 2.4B active, bf16) against
its read floors, and its latent KV cache against per-head K/V caches (issue 53's goals).

    python scripts/bench_mla.py [--rows b1,b64,kv,w1] [--json PATH]

Rows (each prints as it finishes; the table at the end):
- `b1`: the batch-1 decode step (GPU time of the decode forwards, CUDA graphs) at 512 and
  4,096 context tokens, against its floor at the measured copy rate: the weights a step must
  read (all but the routed experts, plus the top-k experts of each MoE layer; the embedding
  table counts one row) + every context token's latent row once.
- `b64`: the decode step at batch 64 with 4,096-token contexts, against the same floor
  (the experts a batch of 64 is expected to touch).
- `kv`: KV bytes one such step reads (64 x 4,096 tokens), the latent pool's bytes a token
  against a cache of per-head K/V of the same attention (16 heads, K 192 and V 128 wide: MHA,
  as MLA's heads are) and against GQA caches of that width with 8 and 4 KV heads of 128.
- `w1`: W1's shape (1,000 requests, 128-1,024 prompt and 32-512 output tokens, all at once)
  as output tokens/s.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))

import bench_offline as bo

DEEPSEEK_V2_LITE = {
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "hidden_size": 2048,
    "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_hidden_layers": 27,
    "num_attention_heads": 16, "num_key_value_heads": 16, "q_lora_rank": None,
    "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "n_routed_experts": 64, "n_shared_experts": 2, "num_experts_per_tok": 6,
    "first_k_dense_replace": 1, "moe_layer_freq": 1, "topk_method": "greedy", "n_group": 1,
    "topk_group": 1, "norm_topk_prob": False, "routed_scaling_factor": 1.0, "vocab_size": 102400,
    "max_position_embeddings": 163840, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                     "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
    "rope_theta": 10000, "torch_dtype": "bfloat16", "hidden_act": "silu",
    "bos_token_id": 100000, "eos_token_id": 100001,
}


MAX_MODEL_LEN = 8192  # the engines' context limit (the request table's width)


def model_dir() -> str:
    path = os.path.join(tempfile.gettempdir(), "radixserve-deepseek-v2-lite-dummy")
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(DEEPSEEK_V2_LITE, f)
    return path


def step_floor_ms(engine, batch: int, context_tokens: int, ceilings: dict) -> float:
    """Weights a decode step of `batch` reads (the embedding table: one row a token) plus
    every context token's pool row, at the copy rate."""
    model = engine.runner.model
    embed = model.model.embed_tokens.weight
    weights = bo.decode_weight_bytes(model, batch) - embed.numel() * embed.element_size()
    weights += batch * embed.shape[1] * embed.element_size()
    kv = context_tokens * engine.runner.kv_pool.token_bytes
    return 1e3 * (weights + kv) / (ceilings["copy_tb_s"] * 1e12)


def decode_step(path: str, ceilings: dict, batch: int, context: int, out: int = 64) -> dict:
    """Mean GPU time of the decode steps that ran the whole batch, against their floor."""
    engine = bo.make_engine(path, max_running_requests=max(batch, 8), max_model_len=MAX_MODEL_LEN,
                            cuda_graph_max_bs=max(batch, 8), chunked_prefill_size=8192)
    rng, vocab = random.Random(3), engine.runner.vocab_size
    bo.run_requests(engine, [(bo.random_prompt(rng, vocab, context), 4)], "warm")
    engine.cache.reset()
    reqs = [(bo.random_prompt(rng, vocab, context), out) for _ in range(batch)]
    res = bo.run_requests(engine, reqs, f"b{batch}", phases=True)
    full = [(ms, ctx) for ms, b, ctx in res["decode_rows"] if b == batch]
    step_ms = sum(ms for ms, _ in full) / max(1, len(full))
    floor_ms = sum(step_floor_ms(engine, batch, ctx, ceilings) for _, ctx in full) / max(1, len(full))
    kv_gb = sum(ctx for _, ctx in full) / max(1, len(full)) * engine.runner.kv_pool.token_bytes / 1e9
    del engine
    bo.release_memory()
    return {"batch": batch, "context": context, "steps": len(full), "step_ms": step_ms,
            "floor_ms": floor_ms, "ratio": step_ms / floor_ms if floor_ms else None,
            "kv_gb_per_step": kv_gb}


def kv_comparison(batch: int = 64, context: int = 4096) -> dict:
    """Bytes a decode step reads from the KV cache (bf16), MLA's latent pool against per-head
    caches of the same attention width."""
    cfg = DEEPSEEK_V2_LITE
    layers, heads, tokens = cfg["num_hidden_layers"], cfg["num_attention_heads"], batch * context
    mla = layers * (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * 2
    mha = layers * heads * (cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"] + cfg["v_head_dim"]) * 2
    gqa = {kv: layers * kv * 2 * 128 * 2 for kv in (8, 4)}
    out = {"tokens": tokens, "mla_bytes_per_token": mla, "mla_gb_per_step": tokens * mla / 1e9,
           "mha_gb_per_step": tokens * mha / 1e9, "mla_over_mha": mla / mha}
    for kv, per_token in gqa.items():
        out[f"gqa{kv}_gb_per_step"] = tokens * per_token / 1e9
        out[f"mla_over_gqa{kv}"] = mla / per_token
    return out


def w1_shape(path: str) -> dict:
    engine = bo.make_engine(path, max_model_len=MAX_MODEL_LEN)
    vocab = engine.runner.vocab_size
    reqs = [([t % vocab for t in ids], n) for ids, n in bo.w1()]
    bo.run_requests(engine, reqs[:64], "warm")
    engine.cache.reset()
    res = bo.run_requests(engine, reqs, "w1", phases=True)
    del engine
    bo.release_memory()
    return {"output_tok_s": res["output_tokens"] / res["wall_s"], "wall_s": res["wall_s"],
            "output_tokens": res["output_tokens"], "decode_mean_batch":
            res["phases"]["decode"]["mean_batch"], "decode_step_ms": res["phases"]["decode"]["mean_ms"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", default="b1,b64,kv,w1")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = args.rows.split(",")
    path = model_dir()
    ceilings = bo.measure_ceilings()
    results: dict = {"ceilings": ceilings}
    if "b1" in rows:
        results["b1"] = [decode_step(path, ceilings, 1, ctx) for ctx in (512, 4096)]
        print("b1", results["b1"], flush=True)
    if "b64" in rows:
        results["b64"] = decode_step(path, ceilings, 64, 4096, out=32)
        print("b64", results["b64"], flush=True)
    if "kv" in rows:
        results["kv"] = kv_comparison()
    if "w1" in rows:
        results["w1"] = w1_shape(path)
        print("w1", results["w1"], flush=True)
    bo.save(results, args.json)
    print(f"\nDeepSeek-V2-Lite-shaped dummy, bf16; copy rate {ceilings['copy_tb_s']:.2f} TB/s")
    for r in results.get("b1", []) + ([results["b64"]] if "b64" in results else []):
        print(f"decode step batch {r['batch']:>2} x {r['context']:>4} ctx: {r['step_ms']:.3f} ms, "
              f"floor {r['floor_ms']:.3f} ms, ratio {r['ratio']:.2f} "
              f"(KV {r['kv_gb_per_step']:.3f} GB/step)")
    if "kv" in results:
        kv = results["kv"]
        print(f"KV read per step at 64 x 4096: MLA {kv['mla_gb_per_step']:.2f} GB; per-head K/V "
              f"(MHA) {kv['mha_gb_per_step']:.2f} GB (MLA/MHA {kv['mla_over_mha']:.3f}); GQA 8x128 "
              f"{kv['gqa8_gb_per_step']:.2f} GB ({kv['mla_over_gqa8']:.3f}); GQA 4x128 "
              f"{kv['gqa4_gb_per_step']:.2f} GB ({kv['mla_over_gqa4']:.3f})")
    if "w1" in results:
        print(f"W1 shape: {results['w1']['output_tok_s']:.0f} output tok/s "
              f"({results['w1']['wall_s']:.1f} s)")


if __name__ == "__main__":
    main()
