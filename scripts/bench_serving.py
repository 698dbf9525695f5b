#!/usr/bin/env python
"""HTTP load generator for OpenAI-compatible servers (in the style of SGLang's bench_serving).

Sends streaming /v1/completions or /v1/chat/completions requests with fixed
output lengths (`ignore_eos`) and reports throughput, TTFT, inter-token
latency, end-to-end latency and the prefix-cache hit rate (from
`usage.prompt_tokens_details.cached_tokens`).

Examples:
    python scripts/bench_serving.py --num-prompts 200 --input-len 512 --output-len 128 --request-rate 8
    python scripts/bench_serving.py --dataset shared-prefix --num-groups 8 --prompts-per-group 16 \
        --system-len 1024 --question-len 64 --max-concurrency 32 --json out.json
    python scripts/bench_serving.py --self-test     # against a built-in fake server

As a library:
    args = make_args(base_url="http://127.0.0.1:8000", num_prompts=50)
    metrics = await run_benchmark(args)
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import socket
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

# Common English words: each is usually a single token (with its leading space),
# so a text prompt of N words is roughly N tokens.
_WORDS = (
    "the of and to in is was he for it with as his on be at by had are but from or have an they "
    "which one you were all we her she there would their will when who him been has more if no out "
    "do so can what up said about other into than its time only could new them man some these then "
    "two first may any like now my such make over our even most me state after also made many did "
    "must before back see through way where get much go well your know should down work year because"
).split()


# --------------------------------------------------------------------------
# Arguments
# --------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    p.add_argument("--model", default=None, help="model name (default: first from GET /v1/models)")
    p.add_argument("--dataset", choices=["random", "shared-prefix"], default="random")
    p.add_argument("--num-prompts", type=int, default=100, help="random dataset size")
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--range-ratio", type=float, default=1.0,
                   help="random lengths are uniform in [len*ratio, len]; 1.0 = fixed")
    p.add_argument("--num-groups", type=int, default=8, help="shared-prefix: number of system prompts")
    p.add_argument("--prompts-per-group", type=int, default=16)
    p.add_argument("--system-len", type=int, default=1024)
    p.add_argument("--question-len", type=int, default=64)
    p.add_argument("--no-shuffle", action="store_true",
                   help="shared-prefix: send groups one after another instead of interleaved")
    p.add_argument("--prompt-format", choices=["auto", "tokens", "text"], default="auto",
                   help="auto: token ids for completions, text for chat")
    p.add_argument("--token-id-low", type=int, default=1000,
                   help="random token ids are drawn from [low, high): avoid special tokens")
    p.add_argument("--token-id-high", type=int, default=30000)
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="Poisson arrival rate in req/s; inf sends everything at once")
    p.add_argument("--max-concurrency", type=int, default=None, help="cap on in-flight requests")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--extra-body", type=json.loads, default=None,
                   help="JSON object merged into every request body")
    p.add_argument("--warmup-requests", type=int, default=1,
                   help="short untimed requests sent first; a failure aborts the run")
    p.add_argument("--timeout", type=float, default=3600.0, help="per-request timeout (s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", dest="json_path", default=None, help="also write the results here")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    p.add_argument("--self-test", action="store_true", help="run against a built-in fake server and exit")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    validate_args(args)
    return args


def make_args(**overrides: Any) -> argparse.Namespace:
    """Defaults plus overrides (python names, e.g. num_prompts=10), for library use."""
    args = build_parser().parse_args([])
    for key, value in overrides.items():
        if not hasattr(args, key):
            raise TypeError(f"unknown benchmark option {key!r}")
        setattr(args, key, value)
    validate_args(args)
    return args


def validate_args(args: argparse.Namespace) -> None:
    problems = []
    if not 0.0 <= args.range_ratio <= 1.0:
        problems.append("--range-ratio must be in [0, 1]")
    if args.request_rate <= 0:
        problems.append("--request-rate must be > 0")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        problems.append("--max-concurrency must be >= 1")
    if min(args.input_len, args.output_len, args.system_len, args.question_len) < 1:
        problems.append("lengths must be >= 1")
    if not 0 <= args.token_id_low < args.token_id_high:
        problems.append("need 0 <= --token-id-low < --token-id-high")
    if args.extra_body is not None and not isinstance(args.extra_body, dict):
        problems.append("--extra-body must be a JSON object")
    if problems:
        raise ValueError("; ".join(problems))


# --------------------------------------------------------------------------
# Workloads
# --------------------------------------------------------------------------


@dataclass
class RequestSpec:
    prompt: list[int] | str  # token ids (completions) or text
    prompt_len: int  # intended length in tokens (approximate for text)
    output_len: int
    system: str | None = None  # chat shared-prefix: the group's system message
    group: int | None = None


def _use_text(args: argparse.Namespace) -> bool:
    if args.prompt_format == "auto":
        return args.endpoint == "chat"
    return args.prompt_format == "text"


def random_tokens(n: int, rng: random.Random, low: int, high: int) -> list[int]:
    return [rng.randrange(low, high) for _ in range(n)]


def random_text(n: int, rng: random.Random) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n))


def _sample_len(length: int, ratio: float, rng: random.Random) -> int:
    return rng.randint(max(1, int(length * ratio)), length)


def random_workload(args: argparse.Namespace, rng: random.Random) -> list[RequestSpec]:
    specs = []
    for _ in range(args.num_prompts):
        n_in = _sample_len(args.input_len, args.range_ratio, rng)
        n_out = _sample_len(args.output_len, args.range_ratio, rng)
        prompt: list[int] | str = (
            random_text(n_in, rng) if _use_text(args)
            else random_tokens(n_in, rng, args.token_id_low, args.token_id_high)
        )
        specs.append(RequestSpec(prompt, n_in, n_out))
    return specs


def shared_prefix_workload(args: argparse.Namespace, rng: random.Random) -> list[RequestSpec]:
    """num_groups system prompts, each followed by prompts_per_group distinct questions."""
    text = _use_text(args)
    specs = []
    for g in range(args.num_groups):
        if text:
            system = random_text(args.system_len, rng)
        else:
            prefix = random_tokens(args.system_len, rng, args.token_id_low, args.token_id_high)
        for _ in range(args.prompts_per_group):
            n_len = args.system_len + args.question_len
            if text and args.endpoint == "chat":
                spec = RequestSpec(random_text(args.question_len, rng), n_len, args.output_len, system, g)
            elif text:
                spec = RequestSpec(system + " " + random_text(args.question_len, rng), n_len, args.output_len, None, g)
            else:
                question = random_tokens(args.question_len, rng, args.token_id_low, args.token_id_high)
                spec = RequestSpec(prefix + question, n_len, args.output_len, None, g)
            specs.append(spec)
    if not args.no_shuffle:
        rng.shuffle(specs)
    return specs


def build_workload(args: argparse.Namespace) -> list[RequestSpec]:
    rng = random.Random(args.seed)
    if args.dataset == "shared-prefix":
        return shared_prefix_workload(args, rng)
    return random_workload(args, rng)


# --------------------------------------------------------------------------
# Sending one request
# --------------------------------------------------------------------------


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    ttft: float = 0.0  # seconds to the first non-empty content chunk
    latency: float = 0.0  # seconds, end to end
    itl: list[float] = field(default_factory=list)  # gaps between content chunks
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0


def build_payload(args: argparse.Namespace, model: str, spec: RequestSpec) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": spec.output_len,
        "temperature": args.temperature,
        "ignore_eos": True,  # fixed output lengths make runs comparable
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if args.endpoint == "chat":
        text = spec.prompt if isinstance(spec.prompt, str) else " ".join(map(str, spec.prompt))
        messages = [{"role": "system", "content": spec.system}] if spec.system else []
        body["messages"] = messages + [{"role": "user", "content": text}]
    else:
        body["prompt"] = spec.prompt
    body.update(args.extra_body or {})
    return body


def endpoint_url(base_url: str, endpoint: str) -> str:
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    return base_url.rstrip("/") + path


def _chunk_text(chunk: dict[str, Any]) -> str:
    """Generated text carried by one stream chunk (either endpoint)."""
    text = ""
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta")
        text += (delta.get("content") or "") if isinstance(delta, dict) else (choice.get("text") or "")
    return text


def _record_usage(result: RequestResult, usage: dict[str, Any]) -> None:
    result.prompt_tokens = usage.get("prompt_tokens") or 0
    result.output_tokens = usage.get("completion_tokens") or 0
    details = usage.get("prompt_tokens_details") or {}
    result.cached_tokens = details.get("cached_tokens") or 0


async def _sse_payloads(resp: aiohttp.ClientResponse) -> AsyncIterator[str]:
    async for raw in resp.content:
        line = raw.decode("utf-8").strip()
        if line.startswith("data:"):
            yield line[len("data:"):].strip()


async def send_request(session: aiohttp.ClientSession, url: str, payload: dict[str, Any]) -> RequestResult:
    result = RequestResult()
    start = last = time.perf_counter()
    content_chunks = 0
    try:
        async with session.post(url, json=payload) as resp:
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return result
            async for data in _sse_payloads(resp):
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = f"stream error: {json.dumps(chunk['error'])[:300]}"
                    return result
                now = time.perf_counter()
                if _chunk_text(chunk):
                    if content_chunks == 0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    content_chunks += 1
                    last = now
                if chunk.get("usage"):
                    _record_usage(result, chunk["usage"])
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError, UnicodeDecodeError) as e:
        result.error = f"{type(e).__name__}: {e}"
        return result
    result.latency = time.perf_counter() - start
    if content_chunks == 0:
        result.error = "no content received"
        return result
    result.output_tokens = result.output_tokens or content_chunks  # no usage chunk: count chunks
    result.ok = True
    return result


# --------------------------------------------------------------------------
# Running the workload
# --------------------------------------------------------------------------


async def fetch_model(session: aiohttp.ClientSession, base_url: str) -> str:
    async with session.get(base_url.rstrip("/") + "/v1/models") as resp:
        resp.raise_for_status()
        models = (await resp.json()).get("data") or []
    if not models:
        raise RuntimeError(f"{base_url}/v1/models lists no models; pass --model")
    return models[0]["id"]


async def _arrivals(specs: list[RequestSpec], rate: float, rng: random.Random) -> AsyncIterator[RequestSpec]:
    """Yield specs at Poisson-process times (all at once when rate is inf)."""
    for i, spec in enumerate(specs):
        if i and math.isfinite(rate):
            await asyncio.sleep(rng.expovariate(rate))
        yield spec


async def _warmup(session: aiohttp.ClientSession, args: argparse.Namespace, model: str) -> None:
    rng = random.Random(args.seed + 1)
    for _ in range(args.warmup_requests):
        prompt = random_text(8, rng) if _use_text(args) else random_tokens(8, rng, args.token_id_low, args.token_id_high)
        payload = build_payload(args, model, RequestSpec(prompt, 8, 4))
        result = await send_request(session, endpoint_url(args.base_url, args.endpoint), payload)
        if not result.ok:
            raise RuntimeError(f"warmup request failed: {result.error}")


def _progress(total: int, quiet: bool) -> Callable[[], None]:
    done = 0
    step = max(1, total // 10)

    def tick() -> None:
        nonlocal done
        done += 1
        if not quiet and (done % step == 0 or done == total):
            print(f"  {done}/{total} requests done", file=sys.stderr, flush=True)

    return tick


async def _run_workload(
    session: aiohttp.ClientSession, args: argparse.Namespace, model: str, specs: list[RequestSpec]
) -> tuple[list[RequestResult], float]:
    url = endpoint_url(args.base_url, args.endpoint)
    limit = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    tick = _progress(len(specs), args.quiet)

    async def one(spec: RequestSpec) -> RequestResult:
        payload = build_payload(args, model, spec)
        if limit is None:
            result = await send_request(session, url, payload)
        else:
            async with limit:
                result = await send_request(session, url, payload)
        if not result.prompt_tokens:
            result.prompt_tokens = spec.prompt_len
        tick()
        return result

    start = time.perf_counter()
    tasks = [asyncio.create_task(one(s)) async for s in _arrivals(specs, args.request_rate, random.Random(args.seed))]
    results = await asyncio.gather(*tasks)
    return list(results), time.perf_counter() - start


async def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    """Run the configured workload; return the metrics (also written to args.json_path if set)."""
    specs = build_workload(args)
    timeout = aiohttp.ClientTimeout(total=args.timeout)
    connector = aiohttp.TCPConnector(limit=0)  # concurrency is ours to control, not the pool's
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        model = args.model or await fetch_model(session, args.base_url)
        await _warmup(session, args, model)
        results, duration = await _run_workload(session, args, model, specs)
    metrics = compute_metrics(results, duration)
    metrics["config"] = _config(args, model)
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(metrics, f, indent=2)
    return metrics


# --------------------------------------------------------------------------
# Metrics
# --------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default); 0.0 for no values."""
    if not values:
        return 0.0
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _ms_stats(name: str, seconds: Sequence[float]) -> dict[str, float]:
    ms = [s * 1000.0 for s in seconds]
    return {f"{name}_ms_mean": _mean(ms), f"{name}_ms_p50": percentile(ms, 50), f"{name}_ms_p99": percentile(ms, 99)}


def compute_metrics(results: Sequence[RequestResult], duration: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    cached_tokens = sum(r.cached_tokens for r in ok)
    duration = max(duration, 1e-9)
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    errors = [r.error for r in results if not r.ok]
    return {
        "completed": len(ok),
        "failed": len(errors),
        "first_errors": list(dict.fromkeys(errors))[:5],
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "input_throughput": prompt_tokens / duration,
        "output_throughput": output_tokens / duration,
        "total_input_tokens": prompt_tokens,
        "total_output_tokens": output_tokens,
        "total_cached_tokens": cached_tokens,
        "cache_hit_rate": cached_tokens / prompt_tokens if prompt_tokens else 0.0,
        **_ms_stats("ttft", [r.ttft for r in ok]),
        **_ms_stats("itl", [gap for r in ok for gap in r.itl]),
        **_ms_stats("e2e", [r.latency for r in ok]),
        "tpot_ms_mean": _mean(tpot) * 1000.0,
        "mean_concurrency": sum(r.latency for r in ok) / duration,
    }


def _config(args: argparse.Namespace, model: str) -> dict[str, Any]:
    keep = ("base_url", "endpoint", "dataset", "num_prompts", "input_len", "output_len", "range_ratio",
            "num_groups", "prompts_per_group", "system_len", "question_len", "request_rate",
            "max_concurrency", "temperature", "seed")
    config = {k: getattr(args, k) for k in keep}
    config["request_rate"] = str(args.request_rate) if math.isinf(args.request_rate) else args.request_rate
    config["model"] = model
    return config


_ROWS = (
    ("Successful requests", "completed", "{:d}"),
    ("Failed requests", "failed", "{:d}"),
    ("Benchmark duration (s)", "duration_s", "{:.2f}"),
    ("Request throughput (req/s)", "request_throughput", "{:.2f}"),
    ("Input token throughput (tok/s)", "input_throughput", "{:.2f}"),
    ("Output token throughput (tok/s)", "output_throughput", "{:.2f}"),
    ("Total input tokens", "total_input_tokens", "{:d}"),
    ("Total output tokens", "total_output_tokens", "{:d}"),
    ("Cache hit rate", "cache_hit_rate", "{:.2%}"),
    ("Mean TTFT (ms)", "ttft_ms_mean", "{:.2f}"),
    ("Median TTFT (ms)", "ttft_ms_p50", "{:.2f}"),
    ("P99 TTFT (ms)", "ttft_ms_p99", "{:.2f}"),
    ("Mean ITL (ms)", "itl_ms_mean", "{:.2f}"),
    ("Median ITL (ms)", "itl_ms_p50", "{:.2f}"),
    ("P99 ITL (ms)", "itl_ms_p99", "{:.2f}"),
    ("Mean TPOT (ms)", "tpot_ms_mean", "{:.2f}"),
    ("Median E2E latency (ms)", "e2e_ms_p50", "{:.2f}"),
    ("P99 E2E latency (ms)", "e2e_ms_p99", "{:.2f}"),
    ("Mean concurrency", "mean_concurrency", "{:.2f}"),
)


def format_table(metrics: dict[str, Any]) -> str:
    width = 50
    lines = ["{s:=^{w}}".format(s=" Serving Benchmark Result ", w=width)]
    for label, key, fmt in _ROWS:
        lines.append(f"{label + ':':<36}{fmt.format(metrics[key]):>{width - 36}}")
    for err in metrics.get("first_errors", []):
        lines.append(f"error: {err}")
    lines.append("=" * width)
    return "\n".join(lines)


# --------------------------------------------------------------------------
# Self-test: a fake OpenAI-ish streaming server
# --------------------------------------------------------------------------


def _common_prefix_len(a: Sequence[Any], b: Sequence[Any]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class FakeOpenAIServer:
    """Streams `max_tokens` one-word chunks; reports prefix reuse as cached_tokens.

    Prompt "tokens" are token ids or whitespace-split words, which is enough to
    check the benchmark's bookkeeping without a model.
    """

    def __init__(self, token_delay_s: float = 0.001, model: str = "fake-model") -> None:
        self.token_delay_s = token_delay_s
        self.model = model
        self.seen: list[list[Any]] = []
        self.requests = 0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_post("/v1/chat/completions", self._generate)
        return app

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.model, "object": "model"}]})

    def _prompt_tokens(self, body: dict[str, Any]) -> list[Any]:
        if "messages" in body:
            return " ".join(m["content"] for m in body["messages"]).split()
        prompt = body["prompt"]
        return prompt.split() if isinstance(prompt, str) else list(prompt)

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests += 1
        chat = request.path.endswith("/chat/completions")
        tokens = self._prompt_tokens(body)
        cached = max((_common_prefix_len(tokens, s) for s in self.seen), default=0)
        self.seen.append(tokens)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if chat:  # OpenAI's first chat chunk carries the role and no text
            await self._send(resp, {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        n = body.get("max_tokens", 16)
        for i in range(n):
            await asyncio.sleep(self.token_delay_s)
            text = f" w{i}"
            choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
            choice["finish_reason"] = "length" if i == n - 1 else None
            await self._send(resp, {"choices": [choice]})
        usage = {"prompt_tokens": len(tokens), "completion_tokens": n, "total_tokens": len(tokens) + n,
                 "prompt_tokens_details": {"cached_tokens": cached}}
        await self._send(resp, {"choices": [], "usage": usage})
        await resp.write(b"data: [DONE]\n\n")
        return resp

    @staticmethod
    async def _send(resp: web.StreamResponse, chunk: dict[str, Any]) -> None:
        await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())


@asynccontextmanager
async def fake_server(token_delay_s: float = 0.001) -> AsyncIterator[tuple[str, FakeOpenAIServer]]:
    """Start a FakeOpenAIServer on a free local port; yields (base_url, server)."""
    server = FakeOpenAIServer(token_delay_s)
    runner = web.AppRunner(server.app())
    await runner.setup()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    try:
        await web.SockSite(runner, sock).start()
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", server
    finally:
        await runner.cleanup()
        sock.close()


async def self_test() -> None:
    """Both endpoints and both datasets against the fake server; raises AssertionError on a bug."""
    async with fake_server() as (url, server):
        for endpoint in ("completions", "chat"):
            args = make_args(base_url=url, endpoint=endpoint, num_prompts=8, input_len=32,
                             output_len=8, max_concurrency=4, quiet=True)
            m = await run_benchmark(args)
            assert m["completed"] == 8 and m["failed"] == 0, m
            assert m["total_output_tokens"] == 64, m
            assert len(server.seen) > 0 and m["ttft_ms_p50"] > 0 and m["itl_ms_p50"] > 0, m

            args = make_args(base_url=url, endpoint=endpoint, dataset="shared-prefix", num_groups=2,
                             prompts_per_group=4, system_len=64, question_len=8, output_len=4,
                             request_rate=500.0, quiet=True)
            m = await run_benchmark(args)
            assert m["completed"] == 8 and m["cache_hit_rate"] > 0.5, m
    print("self-test passed")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.self_test:
        asyncio.run(self_test())
        return 0
    metrics = asyncio.run(run_benchmark(args))
    print(format_table(metrics))
    return 0 if metrics["completed"] else 1


if __name__ == "__main__":
    sys.exit(main())
