"""Programmatic dependent launch (engine/layers/pdl.py) and the one-row Triton GEMV
(engine/layers/gemv.py) on and off, on the GPU.

Runs `bench_offline.py` once per (model variant, setting) in fresh processes (the switches
are environment variables read once per process) and prints one table: the batch-1 decode
step (W3) and its forward, for the dense bf16 model, FP8 weights and the MoE model; with
`--w1`, W1's output throughput too. A setting is a comma-separated list of variables, e.g.
"RADIXSERVE_PDL=0,RADIXSERVE_TRITON_GEMV=0" (both off); "-" is the defaults. `TREE=DIR` in a
setting runs the copy of the project in DIR instead (another commit in the same device call,
e.g. `git archive main | tar -x -C main_tree` beside a branch's working tree).

    python3 scripts/bench_pdl.py [--variants bf16,fp8,moe] [--settings S1 S2 ...] [--w1]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {
    "bf16": [],
    "fp8": ["--quantization", "fp8"],
    "moe": ["--model", "moe"],
}


SETTINGS = ["RADIXSERVE_PDL=0,RADIXSERVE_TRITON_GEMV=0", "RADIXSERVE_TRITON_GEMV=0", "-"]


def parse_setting(setting: str) -> tuple[Path, dict[str, str]]:
    """(the project tree to run, the environment variables to set)."""
    env = dict(kv.split("=", 1) for kv in setting.split(",")) if setting != "-" else {}
    tree = env.pop("TREE", None)
    return (ROOT / tree if tree else ROOT), env


def run(variant: str, setting: str, i: int, workloads: str, out: Path, extra: list[str]) -> dict:
    path = out / f"bench_pdl_{variant}_{i}.json"
    tree, variables = parse_setting(setting)
    cmd = [sys.executable, str(tree / "scripts" / "bench_offline.py"), "--workloads", workloads,
           "--no-hf", "--skip-check", "--json", str(path), *VARIANTS[variant], *extra]
    env = dict(os.environ, **variables)
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=tree)
    if done.returncode != 0 or not path.exists():
        print(f"{variant} {setting} failed:\n{done.stdout[-1500:]}\n{done.stderr[-3000:]}")
        return {}
    return json.loads(path.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default="bf16,fp8,moe")
    ap.add_argument("--settings", nargs="+", default=SETTINGS)
    ap.add_argument("--w1", action="store_true", help="W1's throughput too")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/radixserve-out"))
    ap.add_argument("--engine", action="append", default=[], metavar="KEY=VALUE",
                    help="passed on to bench_offline.py")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    extra = [a for kv in args.engine for a in ("--engine", kv)]
    workloads = "W3,W1" if args.w1 else "W3"
    rows = []
    for variant in args.variants.split(","):
        for i, setting in enumerate(args.settings):
            res = run(variant, setting, i, workloads, out, extra)
            w3, w1 = res.get("W3", {}), res.get("W1", {})
            rows.append((variant, setting, w3.get("step_ms"), w3.get("forward_ms"), w3.get("floor_ms"),
                         w3.get("ttft_ms"), w1.get("output_tok_s")))
    print("\n| model | setting | W3 step ms | forward ms | floor ms | step/floor | TTFT ms | W1 tok/s |")
    print("|---|---|---|---|---|---|---|---|")
    fmt = lambda v, f="{:.3f}": "-" if v is None else f.format(v)  # noqa: E731
    for variant, setting, step, fwd, floor, ttft, tput in rows:
        ratio = step / floor if step and floor else None
        print(f"| {variant} | {setting} | {fmt(step)} | {fmt(fwd)} | {fmt(floor)} | {fmt(ratio, '{:.2f}')} "
              f"| {fmt(ttft, '{:.1f}')} | {fmt(tput, '{:,.0f}')} |")


if __name__ == "__main__":
    main()
