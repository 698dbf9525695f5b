"""What a step's deltas cost on the wire: build, pickle and unpickle one batch of WireDeltas
(engine/core/outputs.py) against the same batch as bare tuples. Forms: `tuple` (bare
tuples in a list), `WireDelta list` (NamedTuples in a plain list), `WireBatch` (what the
channels and the engine process send: NamedTuples, pickled as tuples). Times are CPU time
(best of 10), so that other processes on a loaded machine count less.

A batch is what one engine step sends: over the engine process's pipe (multiprocessing
pickles, protocol 5) and, per ingress, on a delta channel (Ray pickles with cloudpickle).
Mostly middle deltas (one token, no extras), as a decode step at batch 512 makes them; the
`--extras` share carry a first/last delta's counts.

    python scripts/bench_wire_delta.py [--batch 512] [--repeat 2000] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import pickle
import sys
import time
import timeit
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.core.outputs import WireBatch, WireDelta, wire_delta_of  # noqa: E402

EXTRAS = {"prompt_tokens": 812, "cached_tokens": 640, "queue_time": 0.0123}


def fields(batch: int, extras_share: float) -> list[tuple]:
    every = max(1, round(1 / extras_share)) if extras_share else 0
    return [(f"cmpl-{i:032x}-0-0", [1000 + i], False, None, 37,
             dict(EXTRAS) if every and i % every == 0 else None) for i in range(batch)]


def timings(name: str, build, items: list[tuple], dumps, repeat: int) -> dict:
    batch = build(items)
    data = dumps(batch)
    assert pickle.loads(data) == batch

    def us(fn) -> float:
        n = max(1, repeat // 10)
        return min(timeit.repeat(fn, number=n, repeat=10, timer=time.process_time)) / n * 1e6

    return {"form": name, "bytes": len(data), "build_us": us(lambda: build(items)),
            "dumps_us": us(lambda: dumps(batch)), "loads_us": us(lambda: pickle.loads(data))}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=2000)
    ap.add_argument("--extras", type=float, default=1 / 64, help="share of deltas with extras")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    items = fields(args.batch, args.extras)
    forms = {"tuple": lambda xs: [(a, b, c, d, e, f) for a, b, c, d, e, f in xs],
             "WireDelta list": lambda xs: [WireDelta(a, b, c, d, e, f) for a, b, c, d, e, f in xs],
             "WireBatch": lambda xs: WireBatch([wire_delta_of((a, b, c, d, e, f))
                                                for a, b, c, d, e, f in xs])}
    picklers = {"pickle-5": lambda b: pickle.dumps(b, protocol=5)}
    try:
        from ray import cloudpickle
        picklers["cloudpickle"] = lambda b: cloudpickle.dumps(b, protocol=5)
    except ImportError:
        pass
    rows = [{"pickler": p, **timings(f, build, items, dumps, args.repeat)}
            for p, dumps in picklers.items() for f, build in forms.items()]
    print(f"{args.batch} deltas a batch, {args.extras:.3f} of them with extras; "
          f"microseconds per batch (best of 10)")
    print(f"{'pickler':<12} {'form':<15} {'bytes':>7} {'build':>8} {'dumps':>8} {'loads':>8} {'total':>8}")
    for r in rows:
        total = r["build_us"] + r["dumps_us"] + r["loads_us"]
        print(f"{r['pickler']:<12} {r['form']:<15} {r['bytes']:>7} {r['build_us']:>8.1f} "
              f"{r['dumps_us']:>8.1f} {r['loads_us']:>8.1f} {total:>8.1f}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
