"""The Serve path alone: how many streamed tokens/s it carries, with a stand-in engine.

    python scripts/bench_serve_path.py [--streams 64 512 2048] [--tokens 128] [--step-ms 20]
                                       [--step-cpu-ms 2] [--hops inproc handle http] [--json PATH]

The stand-in (`StandInEngine`, a benchmark harness: the app never uses it) replaces the
model inside the real AsyncEngine and EngineReplica: every `step_ms` it gives each running
request one token (real token ids of the demo tokenizer, so the ingress decodes real text),
spending `step_cpu_ms` of Python under the GIL as a real scheduler does. Everything else is
the product: AsyncEngine, EngineReplica, the Serve handle, the ingress, the proxy.

Per hop: `inproc` consumes AsyncEngine streams in this process; `handle` consumes the
replica's streams through a Serve deployment handle, one stream per request (replica ->
caller, the path without a delta channel); `http` sends /v1/completions streams through the
Serve proxy (proxy -> ingress -> replica, deltas on the ingress's delta channel). Reported:
streamed tokens/s, SSE events (or stream items) per second, tokens per event, the mean gap
between a stream's events, and the engine's achieved step time (when the path starves the
engine thread of the GIL, steps stretch beyond `step_ms`). For `http`, also the CPU time
each Serve role (proxy, ingress, engine replica: all their processes on this machine) spent
per 1,000 streamed tokens: the ingress's figure times an engine's tokens/s says how many
ingress cores (replicas) that engine needs.

`--admission` instead measures admission control through HTTP: a burst of 256 requests at
an engine that takes 64 (503 latency, Retry-After, every accepted request complete); single
requests arriving while 64 long streams fill that engine (their 503 latency: the bound in
steady state), then GET /v1/models the same way (the proxy -> ingress floor under that
load); how much a 10 MB text prompt delays a small request sent beside it; and a burst of
256 GET /v1/models on the idle server (how long any burst takes to get through the proxy
and the ingress: the floor of a burst's 503s).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from types import SimpleNamespace

ROOT = os.path.join(os.path.dirname(__file__), "..")
sys.path.insert(0, ROOT)

from deployments.engine_replica import EngineReplica  # noqa: E402
from engine import AsyncEngine, EngineConfig, SamplingParams  # noqa: E402
from engine.loading.demo_model import ensure_demo_model  # noqa: E402
from engine.runtime.engine import TokenUpdate  # noqa: E402
from engine.core.request import Request, Status  # noqa: E402
from engine.loading.tokenizer import IncrementalDetokenizer, Tokenizer  # noqa: E402

PORT = int(os.environ.get("RADIXSERVE_TEST_PORT", "8000"))  # the Serve proxy's port
PROMPT = list(range(20, 52))
TEXT = ("The quick brown fox jumps over the lazy dog while the engine streams tokens "
        "to every client at once, and the path must keep up with it. ") * 4


class StandInEngine:
    """What AsyncEngine needs of an Engine, without a model: one token per request per step."""

    def __init__(self, config: EngineConfig, step_ms: float, step_cpu_ms: float) -> None:
        self.config = config
        self.tokenizer = Tokenizer(config.model)
        self.text_ids = self.tokenizer.encode(TEXT)
        self.requests: dict[str, Request] = {}
        self.scheduler = SimpleNamespace(waiting=[], running=[])
        self.step_s, self.cpu_s = step_ms / 1e3, step_cpu_ms / 1e3
        self.num_steps, self._next = 0, time.monotonic()

    def tokenize_prompt(self, prompt):
        return list(prompt)

    def validate(self, prompt_ids, params) -> None:
        pass

    def drain_cache_events(self) -> list:
        return []

    def drain_grammar_compile_times(self) -> list[float]:
        return []

    def add_request(self, request_id: str, prompt_ids, params: SamplingParams,
                    validated: bool = False) -> Request:
        req = Request(request_id, list(prompt_ids), params, status=Status.RUNNING)
        req.detok = IncrementalDetokenizer(self.tokenizer, req.prompt_ids, params.stop)
        self.requests[request_id] = req
        self.scheduler.running.append(req)
        return req

    def abort(self, request_id: str) -> Request | None:
        req = self.requests.pop(request_id, None)
        if req is not None and req in self.scheduler.running:
            self.scheduler.running.remove(req)
        return req

    @property
    def has_work(self) -> bool:
        return bool(self.scheduler.running)

    def step(self) -> list[TokenUpdate]:
        start = time.monotonic()
        if not self.num_steps or start > self._next + self.step_s:
            self._next = start  # idle since the last step: start a new clock
        while time.monotonic() - start < self.cpu_s:  # the scheduler's Python, holding the GIL
            pass
        time.sleep(max(0.0, self._next + self.step_s - time.monotonic()))  # "the GPU"
        self._next += self.step_s
        self.num_steps += 1
        updates, still = [], []
        for req in self.scheduler.running:
            token = self.text_ids[req.num_output % len(self.text_ids)]
            req.token_ids.append(token)
            done = req.num_output >= req.params.max_tokens
            if done:
                req.status, req.finish_reason = Status.FINISHED, "length"
            else:
                still.append(req)
            updates.append(TokenUpdate(req, [token], done))
        self.scheduler.running = still
        return updates

    def stats(self) -> dict:
        return {"running": len(self.scheduler.running), "waiting": 0, "kv_usage": 0.0,
                "steps": self.num_steps, "clock": time.monotonic()}


def stand_in_replica(step_ms: float, step_cpu_ms: float) -> type:
    """EngineReplica with the stand-in engine (a class made here, so Ray pickles the settings)."""

    class StandInReplica(EngineReplica):
        def _start_engine(self, config: EngineConfig) -> AsyncEngine:
            return AsyncEngine(config, StandInEngine(config, step_ms, step_cpu_ms), detokenize=False)

    return StandInReplica


def _config() -> EngineConfig:
    return EngineConfig(model=ensure_demo_model(), device="cpu", max_running_requests=4096,
                        max_queued_requests=4096)


def _row(hop: str, streams: int, tokens: int, wall: float, events: int, gaps: list[float],
         step_ms: float) -> dict:
    return {"hop": hop, "streams": streams, "tok_s": tokens / wall, "events_s": events / wall,
            "tok_per_event": tokens / max(1, events), "mean_gap_ms": 1e3 * sum(gaps) / max(1, len(gaps)),
            "step_ms": step_ms, "wall_s": wall}


async def run_inproc(streams: int, tokens: int, step_ms: float, cpu_ms: float) -> dict:
    engine = AsyncEngine(_config(), StandInEngine(_config(), step_ms, cpu_ms), detokenize=False)
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    events, gaps = 0, []

    async def one(i: int) -> None:
        nonlocal events
        last = None
        async for _ in engine.generate(PROMPT, params, f"r{i}"):
            now = time.perf_counter()
            events += 1
            if last is not None:
                gaps.append(now - last)
            last = now

    before = await engine.stats()
    t0 = time.perf_counter()
    await asyncio.gather(*[one(i) for i in range(streams)])
    wall = time.perf_counter() - t0
    after = await engine.stats()
    engine.shutdown()
    return _row("inproc", streams, streams * tokens, wall, events, gaps, _step_ms(before, after))


async def run_handle(handle, streams: int, tokens: int) -> dict:
    from deployments.channel import submit
    from deployments.engine_replica import EngineCall

    stream_handle = handle.options(stream=True)
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    events, count, gaps = 0, 0, []

    async def one(i: int) -> None:
        nonlocal events, count
        last = None
        async for item in submit(stream_handle.generate, EngineCall(f"h{i}-{time.time_ns()}", PROMPT, params)):
            now = time.perf_counter()
            events += 1
            count += len(item.token_ids)
            if last is not None:
                gaps.append(now - last)
            last = now

    before = await handle.stats.remote()
    t0 = time.perf_counter()
    await asyncio.gather(*[one(i) for i in range(streams)])
    wall = time.perf_counter() - t0
    after = await handle.stats.remote()
    return _row("handle", streams, count, wall, events, gaps, _step_ms(before, after))


async def run_http(handle, streams: int, tokens: int) -> dict:
    import aiohttp

    body = {"prompt": PROMPT, "max_tokens": tokens, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    events, count, gaps, failures = 0, 0, [], 0

    async def one(session) -> None:
        nonlocal events, count, failures
        last, usage = None, None
        async with session.post(f"http://127.0.0.1:{PORT}/v1/completions", json=body) as resp:
            if resp.status != 200:
                failures += 1
                return
            async for raw in resp.content:
                if not raw.startswith(b"data:"):
                    continue
                now = time.perf_counter()
                if raw.startswith(b"data: [DONE]"):
                    break
                if b'"usage":{' in raw:
                    usage = json.loads(raw[5:])["usage"]
                    continue
                events += 1
                if last is not None:
                    gaps.append(now - last)
                last = now
        if usage is None or usage["completion_tokens"] != tokens:
            failures += 1
        else:
            count += tokens

    before = await handle.stats.remote()
    cpu_before = role_cpu_seconds()
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        t0 = time.perf_counter()
        await asyncio.gather(*[one(session) for _ in range(streams)])
        wall = time.perf_counter() - t0
    cpu_after = role_cpu_seconds()
    after = await handle.stats.remote()
    if failures:
        print(f"  http: {failures} of {streams} streams failed or came back short", file=sys.stderr)
    return {**_row("http", streams, count, wall, events, gaps, _step_ms(before, after)),
            **_cpu_per_ktok(cpu_before, cpu_after, count)}


# Process-title markers per role; under RAY_SERVE_ENABLE_HA_PROXY=1 the proxy is HAProxy's
# own process (beside Serve's ProxyActor, which then only manages it).
ROLES = {"proxy": ("ProxyActor", "haproxy"), "ingress": ("OpenAIIngress",),
         "replica": ("EngineReplica",)}


def role_cpu_seconds() -> dict[str, float]:
    """CPU seconds (user + system) used so far by the Serve processes of each role on this
    machine, found by the process titles Ray gives them (e.g. ray::ServeReplica:path:OpenAIIngress)."""
    import psutil

    totals = dict.fromkeys(ROLES, 0.0)
    for proc in psutil.process_iter(["cmdline"]):
        title = " ".join(proc.info["cmdline"] or [])
        for role, markers in ROLES.items():
            if any(marker in title for marker in markers):
                try:
                    times = proc.cpu_times()
                    totals[role] += times.user + times.system
                except psutil.Error:
                    pass
    return totals


def _cpu_per_ktok(before: dict[str, float], after: dict[str, float], tokens: int) -> dict:
    """CPU milliseconds each role spent per 1,000 streamed tokens."""
    return {f"{role}_cpu_ms_per_ktok": 1e6 * (after[role] - before[role]) / max(1, tokens)
            for role in ROLES}


def _step_ms(before: dict, after: dict) -> float:
    """The engine's achieved step time over a run (longer than --step-ms: GIL starvation)."""
    return 1e3 * (after["clock"] - before["clock"]) / max(1, after["steps"] - before["steps"])


async def run_burst(n: int, capacity: int, tokens: int) -> dict:
    """`n` requests at once against an engine that takes `capacity`: how fast the excess
    is refused (503), and whether every accepted request completes."""
    import aiohttp

    body = {"prompt": PROMPT, "max_tokens": tokens, "ignore_eos": True}

    async def one(session):
        t0 = time.perf_counter()
        async with session.post(f"http://127.0.0.1:{PORT}/v1/completions", json=body) as resp:
            data = await resp.json()
            done = resp.status == 200 and data["usage"]["completion_tokens"] == tokens
            return resp.status, time.perf_counter() - t0, done, resp.headers.get("Retry-After")

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        results = await asyncio.gather(*[one(session) for _ in range(n)])
    refused = sorted(t for status, t, _, _ in results if status == 503)
    accepted = [r for r in results if r[0] == 200]
    return {"requests": n, "capacity": capacity, "accepted": len(accepted),
            "accepted_complete": sum(r[2] for r in accepted), "refused": len(refused),
            "refused_with_retry_after": sum(r[3] is not None for r in results if r[0] == 503),
            "refused_p50_ms": 1e3 * _pct(refused, 0.5), "refused_p99_ms": 1e3 * _pct(refused, 0.99),
            "other_statuses": sorted({r[0] for r in results} - {200, 503})}


async def run_probes_when_full(capacity: int, probes: int, gap_s: float,
                               hold_tokens: int = 2000) -> dict:
    """The bound in steady state: `capacity` long streams fill the engine, then `probes`
    single requests arrive one every `gap_s`; each should get its 503 at once. Then as many
    GET /v1/models (proxy -> ingress, no engine, no body) the same way: what any answer
    from the ingress costs under the same load, the floor of a 503."""
    import aiohttp

    url = f"http://127.0.0.1:{PORT}/v1/completions"
    hold = {"prompt": PROMPT, "max_tokens": hold_tokens, "ignore_eos": True, "stream": True}
    probe = {"prompt": PROMPT, "max_tokens": 8}

    async def held(session, started):
        async with session.post(url, json=hold) as resp:
            started.append(resp.status)
            async for _ in resp.content:
                pass

    async def timed(session, models=False):
        t0 = time.perf_counter()
        request = session.get(url.replace("/completions", "/models")) if models else session.post(url, json=probe)
        async with request as resp:
            await resp.read()
            return resp.status, time.perf_counter() - t0

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        started: list[int] = []
        holders = [asyncio.create_task(held(session, started)) for _ in range(capacity)]
        while len(started) < capacity:
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)
        results, models = [], []
        for _ in range(probes):
            results.append(await timed(session))
            await asyncio.sleep(gap_s)
        for _ in range(probes):
            models.append((await timed(session, models=True))[1])
            await asyncio.sleep(gap_s)
        still_held = sum(not t.done() for t in holders)
        for t in holders:
            t.cancel()
        await asyncio.gather(*holders, return_exceptions=True)
    refused = sorted(t for status, t in results if status == 503)
    models.sort()
    return {"holders_accepted": started.count(200), "probes": probes, "refused": len(refused),
            "refused_p50_ms": 1e3 * _pct(refused, 0.5), "refused_p99_ms": 1e3 * _pct(refused, 0.99),
            "other_statuses": sorted({s for s, _ in results} - {503}),
            "models_p50_ms": 1e3 * _pct(models, 0.5), "models_p99_ms": 1e3 * _pct(models, 0.99),
            "holders_still_streaming": still_held}


async def run_burst_floor(n: int) -> dict:
    """`n` GET /v1/models at once on an idle server: how long a burst takes to get through
    Serve's proxy and the ingress when the ingress answers at once (a 503's floor)."""
    import aiohttp

    url = f"http://127.0.0.1:{PORT}/v1/models"

    async def one(session):
        t0 = time.perf_counter()
        async with session.get(url) as resp:
            await resp.read()
            return time.perf_counter() - t0

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        times = sorted(await asyncio.gather(*[one(session) for _ in range(n)]))
    return {"requests": n, "p50_ms": 1e3 * _pct(times, 0.5), "p99_ms": 1e3 * _pct(times, 0.99)}


async def run_intake(n: int, prompt_len: int) -> dict:
    """`n` requests at once, each a `prompt_len`-token id prompt and one output token (W2's
    request shape): how fast the path takes requests in (proxy, ingress, router, replica)."""
    import aiohttp

    url = f"http://127.0.0.1:{PORT}/v1/completions"

    async def one(session, i):
        body = {"prompt": [20 + (i * 7 + j) % 700 for j in range(prompt_len)], "max_tokens": 1}
        async with session.post(url, json=body) as resp:
            text = await resp.read()
            if resp.status != 200 and not errors:
                errors.append(text.decode()[:300])
            return resp.status, time.perf_counter()

    errors: list[str] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        await one(session, 0)
        t0 = time.perf_counter()
        results = await asyncio.gather(*[one(session, i) for i in range(n)])
    ends = sorted(t - t0 for _, t in results)
    return {"requests": n, "prompt_len": prompt_len, "ok": sum(s == 200 for s, _ in results),
            "wall_s": ends[-1], "requests_per_s": n / ends[-1], "p50_s": _pct(ends, 0.5),
            "other_statuses": sorted({s for s, _ in results} - {200}), "first_error": errors[:1]}


async def run_big_prompt(megabytes: float) -> dict:
    """A small request's latency alone, and while a `megabytes` text prompt is in flight."""
    import aiohttp

    small = {"prompt": "hello there", "max_tokens": 1}
    big = {"prompt": "lorem ipsum " * int(megabytes * 1e6 / 12), "max_tokens": 1}
    url = f"http://127.0.0.1:{PORT}/v1/completions"
    async with aiohttp.ClientSession() as session:
        async def timed(body):
            t0 = time.perf_counter()
            async with session.post(url, json=body) as resp:
                await resp.read()
                return resp.status, time.perf_counter() - t0

        alone = sorted([(await timed(small))[1] for _ in range(5)])[2]
        big_task = asyncio.create_task(timed(big))
        await asyncio.sleep(0.05)  # the big body is on its way / being handled
        during = (await timed(small))[1]
        big_status, big_s = await big_task
    return {"small_alone_ms": 1e3 * alone, "small_during_big_ms": 1e3 * during,
            "delay_ms": 1e3 * (during - alone), "big_status": big_status, "big_s": big_s}


async def _engine_calls(handle) -> int:
    """Requests that reached the engine replica so far (accepted or refused there)."""
    stats = await handle.stats.remote()
    return stats["requests_on_channel"] + stats["requests_on_own_stream"]


def _pct(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))] if values else 0.0


def start_serve(step_ms: float, cpu_ms: float, ingress_replicas: int | None,
                running: int = 4096, queued: int = 4096, context: int | None = None):
    import ray
    from ray import serve

    from deployments.app import build_app_with

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # Keep the caller's PYTHONPATH: on the GPU machine Ray itself comes from it (/tmp/site),
    # and workers without it die on `import ray`.
    path = os.pathsep.join(p for p in (os.path.abspath(ROOT), os.environ.get("PYTHONPATH")) if p)
    ray.init(include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": path}})
    serve.start(http_options={"host": "127.0.0.1", "port": PORT})
    engine = {"max_running_requests": running, "max_queued_requests": queued, "device": "cpu",
              "max_model_len": context}
    args = {"engine": engine,
            "ray_actor_options": {"num_cpus": 0}, "ingress_ray_actor_options": {"num_cpus": 0},
            "ingress_replicas": ingress_replicas}
    serve.run(build_app_with(args, replica_class=stand_in_replica(step_ms, cpu_ms)), name="path",
              route_prefix="/")
    return serve.get_deployment_handle("EngineReplica", app_name="path")


def format_table(rows: list[dict]) -> str:
    head = (f"{'hop':<7} {'streams':>7} {'tok/s':>9} {'events/s':>9} {'tok/event':>9} "
            f"{'gap ms':>7} {'step ms':>7}")
    cpu = [f"{role} cpu ms/ktok" for role in ROLES]
    head += "".join(f" {c:>19}" for c in cpu)
    lines = [head, "-" * len(head)]
    for r in rows:
        line = (f"{r['hop']:<7} {r['streams']:>7} {r['tok_s']:>9.0f} {r['events_s']:>9.0f} "
                f"{r['tok_per_event']:>9.2f} {r['mean_gap_ms']:>7.1f} {r['step_ms']:>7.1f}")
        line += "".join(f" {r.get(f'{role}_cpu_ms_per_ktok', float('nan')):>19.1f}" for role in ROLES)
        lines.append(line)
    return "\n".join(lines)


async def admission(args) -> None:
    """The bound and the body: a burst 4x over a small engine's capacity, and a big prompt."""
    # A context long enough for holders that outlast the probes (the stand-in has no model).
    handle = start_serve(args.step_ms, args.step_cpu_ms, args.ingress_replicas, running=16,
                         queued=48, context=4096)
    before = await _engine_calls(handle)
    burst = await run_burst(256, 64, 32)
    after_burst = await _engine_calls(handle)
    burst["reached_engine"] = after_burst - before  # the rest were refused by the ingress
    await asyncio.sleep(2.0)  # the burst's accepted requests finish
    full = await run_probes_when_full(64, 50, 0.02)
    full["probes_reached_engine"] = await _engine_calls(handle) - after_burst - 64  # - holders
    big = await run_big_prompt(10.0)
    floor = await run_burst_floor(256)
    print("\nburst of 256 at an engine of capacity 64 (16 running + 48 queued):")
    print("  " + ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in burst.items()))
    print("engine full (64 streams held), 50 single requests 20 ms apart, then 50 GET /v1/models:")
    print("  " + ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in full.items()))
    print("a 10 MB prompt beside a small request:")
    print("  " + ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in big.items()))
    print("a burst of 256 GET /v1/models, idle (the floor of a burst's 503s):")
    print("  " + ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in floor.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "burst": burst, "full": full, "big_prompt": big,
                       "burst_floor": floor}, f, indent=1)


async def main_async(args) -> list[dict]:
    rows = []
    if "inproc" in args.hops:
        for n in args.streams:
            rows.append(await run_inproc(n, args.tokens, args.step_ms, args.step_cpu_ms))
            print(format_table(rows[-1:]).splitlines()[-1], flush=True)
    if {"handle", "http"} & set(args.hops):
        # The stand-in's context is whatever the streams need (the demo model's is 512).
        handle = start_serve(args.step_ms, args.step_cpu_ms, args.ingress_replicas,
                             context=max(512, len(PROMPT) + args.tokens))
        for hop, run in (("handle", run_handle), ("http", run_http)):
            if hop in args.hops:
                await run(handle, 8, 8)  # warm-up: connections, first imports
                for n in args.streams:
                    rows.append(await run(handle, n, args.tokens))
                    print(format_table(rows[-1:]).splitlines()[-1], flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, nargs="+", default=[64, 512, 2048])
    p.add_argument("--tokens", type=int, default=128, help="tokens per stream")
    p.add_argument("--step-ms", type=float, default=20.0, help="stand-in engine step time")
    p.add_argument("--step-cpu-ms", type=float, default=2.0, help="Python time per step, GIL held")
    p.add_argument("--hops", nargs="+", default=["inproc", "handle", "http"],
                   choices=["inproc", "handle", "http"])
    p.add_argument("--ingress-replicas", type=int, default=None, help="default: the app's own")
    p.add_argument("--admission", action="store_true",
                   help="instead: 503 latency of a burst over the bound, and a 10 MB prompt's effect")
    p.add_argument("--intake", type=int, nargs=2, metavar=("REQUESTS", "PROMPT_LEN"),
                   help="instead: how fast REQUESTS one-token requests of PROMPT_LEN-token "
                        "prompts, sent at once, get through the path")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args()
    if args.admission:
        asyncio.run(admission(args))
        return
    if args.intake:
        start_serve(args.step_ms, args.step_cpu_ms, args.ingress_replicas, context=8192)
        print(asyncio.run(run_intake(*args.intake)))
        return
    rows = asyncio.run(main_async(args))
    print(f"\nstand-in engine: step {args.step_ms} ms ({args.step_cpu_ms} ms of it Python), "
          f"{args.tokens} tokens per stream\n" + format_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
