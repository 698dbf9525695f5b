"""scripts/bench_offline.py's latency rows (TTFT sweep, cold start, long prefill, W4) on the
tiny demo model, so they keep running between GPU sessions: one run of the script with every
row at toy sizes, then the JSON it wrote and the table it printed."""
from __future__ import annotations

from bench_scripts import run_script


def test_latency_rows_on_demo_model(tmp_path):
    r, stdout = run_script("bench_offline.py", "--model", "demo",
                           "--ttft-sweep", "--ttft-lengths", "1,16", "--ttft-reps", "1",
                           "--cold-start", "--cold-batch", "3,2",
                           "--long-prefill", "--long-shape", "2x40",
                           "--w4", "--w4-shape", "2,2,16,3,5", json_path=tmp_path / "bench.json",
                           timeout=600)

    assert set(r["ttft"]) == {"1", "16"} and all(t["ttft_ms"] > 0 for t in r["ttft"].values())
    assert set(r["engine_start"]["phases"]) >= {"load", "kv_pool", "cuda_graphs", "warmup"}

    assert not r["cold_start"]["warmup_serial_compile"]["parallel_compile"]
    for key in ("warmup", "warmup_serial_compile", "no_warmup"):
        c = r["cold_start"][key]
        assert c["compiled_ahead"]["specializations"] == 0  # (no graphs on the CPU)
        assert set(c["cold_ttft_ms"]) == set(c["warm_ttft_ms"]) == {"1", "16"}
        assert c["engine_start_s"] > 0 and c["process_to_ready_s"] >= c["engine_start_s"]
        assert 0 < c["imports_s"] < c["process_to_ready_s"] and c["cuda_init_s"] >= 0
        assert c["binaries_after_start"] == 0  # the CPU runs no Triton kernel
        assert c["cold_batch_s"] > 0 and c["warm_batch_s"] > 0

    lp = r["long_prefill"]
    assert lp["requests"] == 2 and lp["length"] == 40 and lp["floor_s"] > 0
    assert lp["phases"]["prefill_or_mixed"]["tokens"] == 80

    turns = r["W4"]["turns"]
    assert [t["turn"] for t in turns] == [1, 2]
    assert turns[0]["prompt_tokens"] == 16 and turns[1]["prompt_tokens"] == 16 + 3 + 5
    assert turns[0]["hit_rate"] == 0 and turns[1]["hit_rate"] > 0.5  # prompt + answer cached
    assert all(t["decode_floor_s"] > 0 and t["phases"]["decode"]["steps"] > 0 for t in turns)
    # the host's time between steps (sampling at least, on the CPU), by the next step's kind
    gaps = turns[0]["phases"]["gaps"]
    assert gaps["decode"]["total_s"] > 0 and gaps["decode"]["max_ms"] >= gaps["decode"]["p50_ms"] > 0
    longest = max(gaps["decode"]["max_ms"], gaps["prefill_or_mixed"]["max_ms"])
    assert max(g["ms"] for g in gaps["longest"]) == round(longest, 2)

    for heading in ("TTFT, batch 1, warm", "cold start, warmup", "long prefill 2 x 40", "W4: 2"):
        assert heading in stdout


def test_fp8_flags_reach_the_engine(tmp_path):
    """--quantization / --kv-cache-dtype (the FP8 rows) build FP8 engines: the TTFT sweep
    runs on the demo model with both, and the JSON records what the engines were given."""
    r, _ = run_script("bench_offline.py", "--model", "demo", "--ttft-sweep", "--ttft-lengths", "1,16",
                      "--ttft-reps", "1", "--quantization", "fp8", "--kv-cache-dtype", "fp8_e4m3",
                      json_path=tmp_path / "bench.json")
    assert r["engine_overrides"] == {"quantization": "fp8", "kv_cache_dtype": "fp8_e4m3"}
    assert set(r["ttft"]) == {"1", "16"} and all(t["ttft_ms"] > 0 for t in r["ttft"].values())


def test_decode_step_at_a_fixed_batch(tmp_path):
    """--decode-batch (the MoE batch-256 row): only steps that ran the whole batch count,
    against a floor of weights + K/V that grows with the context."""
    result, stdout = run_script("bench_offline.py", "--model", "demo", "--decode-batch", "4,24,6",
                                json_path=tmp_path / "bench.json")
    d = result["decode_batch"]
    assert d["batch"] == 4 and d["prompt"] == 24
    assert d["steps"] == 5  # 6 output tokens: the first comes from the prefill
    assert d["floor_ms"] > 0 and d["step_ms"] > 0 and d["ratio"] == d["step_ms"] / d["floor_ms"]
    assert "decode step ms at batch 4" in stdout


def test_scheduler_bench_runs(tmp_path):
    """scripts/bench_scheduler.py (the host side of a step with a null forward) at toy sizes:
    its forward stand-in must keep the runner's return types (it once returned a list where
    the step resolves prompt logprobs, and the script died at its first step)."""
    out = tmp_path / "sched.json"
    rows, _ = run_script("bench_scheduler.py", "--batch-sizes", "1,4", "--steps", "5", json_path=out)
    assert [r["batch"] for r in rows] == [1, 4] and all(r["mean_ms"] > 0 for r in rows)
    res, _ = run_script("bench_scheduler.py", "--w1", "12", json_path=out)  # W1's shapes, 12 requests
    assert res["mixed"]["steps"] >= 1 and res["decode"]["steps"] >= 31
