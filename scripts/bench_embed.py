"""Embeddings throughput of the pooling engine against a padded `transformers` batch,
measured in the same run, and a decoder used as an embedder against the engine's own
prefill. Dummy weights (shapes are what cost time), random token ids.

    python scripts/bench_embed.py                 # GPU: 10,000 inputs of 16-256 tokens
    python scripts/bench_embed.py --tiny          # CPU smoke test at tiny sizes
    python scripts/bench_embed.py --skip-decoder  # encoders only
    python scripts/bench_embed.py --attention-backend torch  # the padded SDPA path instead

Rows: all-MiniLM-L6-v2-shaped and BGE-large-shaped (335M) encoders (embeddings/s: the engine
packs length-sorted inputs, no padding in the linears; transformers runs batches of
`--hf-batch` inputs padded to their longest, in arrival order and length-sorted), and an
8B Llama-shaped decoder with last-token pooling (prefill tokens/s against `LLM.generate`
with max_tokens=1 on the same inputs). GPU utilisation is sampled during the engine's run
(pynvml, when installed). Prints a table; `--json PATH` writes the rows. The tokenizer does
not matter (the inputs are token ids): MiniLM's when its package is installed, else the
demo model's, so the GPU machine needs no model package."""
from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import random
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

from engine import LLM, EngineConfig, PoolingEngine, SamplingParams  # noqa: E402
from engine.loading.demo_model import ensure_demo_model  # noqa: E402
from engine.loading.model_source import resolve_model_path  # noqa: E402
from engine.runtime.pooling_input import PoolInput  # noqa: E402

ENCODERS = {  # name -> (hidden, layers, heads, intermediate)
    "minilm-l6 (22M)": (384, 6, 12, 1536),
    "bge-large (335M)": (1024, 24, 16, 4096),
    "tiny-bert": (64, 2, 4, 128),
}
MINILM = "package:all_minilm_l6_v2"
DECODERS = {  # name -> (hidden, layers, heads, kv heads, intermediate, vocab)
    "llama-8b": (4096, 32, 32, 8, 14336, 128256),
    "tiny-llama": (64, 2, 4, 2, 128, 512),
}


def encoder_dir(root: Path, shape: tuple[int, int, int, int], tokenizer_from: str) -> str:
    """A BERT config of `shape` with MiniLM's tokenizer (weights: load_format dummy)."""
    hidden, layers, heads, inter = shape
    path = root / f"bert-{hidden}-{layers}"
    path.mkdir(parents=True, exist_ok=True)
    src = Path(resolve_model_path(tokenizer_from))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (src / name).exists():
            shutil.copy(src / name, path / name)
    config = {"architectures": ["BertModel"], "model_type": "bert", "hidden_size": hidden,
              "num_hidden_layers": layers, "num_attention_heads": heads, "intermediate_size": inter,
              "vocab_size": 30522, "max_position_embeddings": 512, "type_vocab_size": 2,
              "layer_norm_eps": 1e-12, "hidden_act": "gelu", "pad_token_id": 0}
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def decoder_dir(root: Path, shape: tuple[int, ...]) -> str:
    hidden, layers, heads, kv, inter, vocab = shape
    path = root / f"llama-{hidden}-{layers}"
    path.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
              "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv,
              "intermediate_size": inter, "vocab_size": vocab, "max_position_embeddings": 8192,
              "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "hidden_act": "silu",
              "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def random_inputs(n: int, lo: int, hi: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(min(1000, vocab // 2), vocab - 1) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class GPUUtil:
    """Mean GPU utilisation (%) sampled every 50 ms while in use; None without pynvml."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.samples, self._stop = device, [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            try:
                self.samples.append(torch.cuda.utilization(self.device))
            except Exception:  # noqa: BLE001 - no pynvml: report n/a
                return

    def __enter__(self) -> "GPUUtil":
        if self.device.type == "cuda":
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()

    @property
    def mean(self) -> float | None:
        return sum(self.samples) / len(self.samples) if self.samples else None


def time_engine(engine: PoolingEngine, inputs: list[list[int]]) -> tuple[float, float | None]:
    items = [PoolInput(ids) for ids in inputs]
    engine.embed(items[:64])  # warm-up
    sync(engine.device)
    with GPUUtil(engine.device) as util:
        t0 = time.perf_counter()
        engine.embed(items)
        sync(engine.device)
        seconds = time.perf_counter() - t0
    return seconds, util.mean


@torch.inference_mode()
def time_hf(path: str, inputs: list[list[int]], batch: int, device: torch.device,
            dtype: torch.dtype, sort: bool) -> float:
    """A padded transformers BertModel batch loop with mean pooling (what a plain
    transformers embedding server runs)."""
    from transformers import AutoConfig, BertModel

    model = BertModel(AutoConfig.from_pretrained(path), add_pooling_layer=False)
    model = model.to(device=device, dtype=dtype).eval()
    order = sorted(inputs, key=len) if sort else inputs

    def run(seqs: list[list[int]]) -> None:
        for i in range(0, len(seqs), batch):
            chunk = seqs[i:i + batch]
            width = max(map(len, chunk))
            ids = torch.zeros(len(chunk), width, dtype=torch.long)
            mask = torch.zeros(len(chunk), width, dtype=torch.long)
            for j, s in enumerate(chunk):
                ids[j, :len(s)], mask[j, :len(s)] = torch.tensor(s), 1
            ids, mask = ids.to(device), mask.to(device)
            hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
            m = mask.unsqueeze(-1).to(hidden.dtype)
            torch.nn.functional.normalize((hidden * m).sum(1) / m.sum(1), dim=-1).cpu()

    run(order[:64])
    sync(device)
    t0 = time.perf_counter()
    run(order)
    sync(device)
    del model
    return time.perf_counter() - t0


def encoder_rows(args, root: Path, device: torch.device, dtype: str) -> list[dict]:
    rows = []
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    for name in args.encoders:
        path = encoder_dir(root, ENCODERS[name], args.tokenizer_from)
        inputs = random_inputs(args.num_inputs, args.min_len, args.max_len, 30522)
        engine = PoolingEngine(EngineConfig(model=path, task="embed", load_format="dummy",
                                            dtype=dtype, device=str(device),
                                            max_prefill_tokens=args.max_prefill_tokens,
                                            max_running_requests=4096,
                                            attention_backend=args.attention_backend))
        seconds, util = time_engine(engine, inputs)
        del engine
        gc.collect()
        hf_arrival = time_hf(path, inputs, args.hf_batch, device, torch_dtype, sort=False)
        hf_sorted = time_hf(path, inputs, args.hf_batch, device, torch_dtype, sort=True)
        n = len(inputs)
        rows.append({"model": name, "inputs": n, "tokens": sum(map(len, inputs)),
                     "engine_emb_per_s": n / seconds, "hf_padded_emb_per_s": n / hf_arrival,
                     "hf_sorted_emb_per_s": n / hf_sorted, "speedup_vs_padded": hf_arrival / seconds,
                     "speedup_vs_sorted": hf_sorted / seconds, "gpu_util_pct": util})
    return rows


def decoder_row(args, root: Path, device: torch.device, dtype: str) -> dict:
    path = decoder_dir(root, DECODERS[args.decoder])
    vocab = DECODERS[args.decoder][5]
    inputs = random_inputs(args.decoder_inputs, args.min_len, args.max_len, vocab, seed=1)
    tokens = sum(map(len, inputs))
    common = dict(load_format="dummy", dtype=dtype, device=str(device),
                  tokenizer=ensure_demo_model(), max_prefill_tokens=args.max_prefill_tokens)
    engine = PoolingEngine(EngineConfig(model=path, task="embed", max_running_requests=4096,
                                        attention_backend=args.attention_backend, **common))
    seconds, util = time_engine(engine, inputs)
    del engine
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    llm = LLM(path, max_total_tokens=args.max_prefill_tokens * 4, max_running_requests=256,
              chunked_prefill_size=args.max_prefill_tokens, **common)
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    llm.generate(inputs[:16], params)  # warm-up
    sync(device)
    t0 = time.perf_counter()
    llm.generate(inputs, params)
    sync(device)
    prefill = time.perf_counter() - t0
    llm.close()
    return {"model": f"{args.decoder} (last token)", "inputs": len(inputs), "tokens": tokens,
            "pooling_tok_per_s": tokens / seconds, "engine_prefill_tok_per_s": tokens / prefill,
            "ratio_prefill_over_pooling": seconds and prefill / seconds, "gpu_util_pct": util}


def print_table(enc: list[dict], dec: dict | None) -> None:
    def pct(u):
        return "n/a" if u is None else f"{u:.0f}%"
    print(f"\n{'encoder':<18}{'inputs':>8}{'engine emb/s':>14}{'hf padded':>12}{'hf sorted':>12}"
          f"{'x padded':>10}{'x sorted':>10}{'GPU util':>10}")
    for r in enc:
        print(f"{r['model']:<18}{r['inputs']:>8}{r['engine_emb_per_s']:>14.1f}"
              f"{r['hf_padded_emb_per_s']:>12.1f}{r['hf_sorted_emb_per_s']:>12.1f}"
              f"{r['speedup_vs_padded']:>10.2f}{r['speedup_vs_sorted']:>10.2f}{pct(r['gpu_util_pct']):>10}")
    if dec:
        print(f"\n{'decoder':<24}{'tokens':>10}{'pooling tok/s':>16}{'prefill tok/s':>16}"
              f"{'pooling/prefill':>17}{'GPU util':>10}")
        print(f"{dec['model']:<24}{dec['tokens']:>10}{dec['pooling_tok_per_s']:>16.0f}"
              f"{dec['engine_prefill_tok_per_s']:>16.0f}"
              f"{dec['pooling_tok_per_s'] / dec['engine_prefill_tok_per_s']:>17.2f}{pct(dec['gpu_util_pct']):>10}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="CPU smoke test: tiny shapes and counts")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on GPUs, float32 on the CPU")
    p.add_argument("--num-inputs", type=int, default=10_000)
    p.add_argument("--decoder-inputs", type=int, default=2_000)
    p.add_argument("--min-len", type=int, default=16)
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--hf-batch", type=int, default=256)
    p.add_argument("--max-prefill-tokens", type=int, default=32768)
    p.add_argument("--skip-decoder", action="store_true")
    p.add_argument("--tokenizer-from", default=None,
                   help="the encoders' tokenizer (a package: name or a folder); default: MiniLM's "
                        "package when installed, else the demo model's")
    p.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"],
                   help="the engine's packed attention: auto = the Triton varlen kernel on a GPU")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.tokenizer_from is None:
        args.tokenizer_from = (MINILM if importlib.util.find_spec("all_minilm_l6_v2")
                               else ensure_demo_model())
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available()
                          else ("cpu" if args.device == "auto" else args.device))
    dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    args.encoders, args.decoder = ["minilm-l6 (22M)", "bge-large (335M)"], "llama-8b"
    if args.tiny:
        args.encoders, args.decoder = ["tiny-bert"], "tiny-llama"
        args.num_inputs, args.decoder_inputs = min(args.num_inputs, 64), min(args.decoder_inputs, 32)
        args.max_len, args.max_prefill_tokens = min(args.max_len, 64), min(args.max_prefill_tokens, 2048)
    with tempfile.TemporaryDirectory() as tmp:
        enc = encoder_rows(args, Path(tmp), device, dtype)
        dec = None if args.skip_decoder else decoder_row(args, Path(tmp), device, dtype)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"bench_embed on {name}, {dtype}, attention {args.attention_backend}, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print_table(enc, dec)
    if args.json:
        Path(args.json).write_text(json.dumps({"device": name, "dtype": dtype, "encoders": enc,
                                               "decoder": dec}, indent=1))


if __name__ == "__main__":
    main()
