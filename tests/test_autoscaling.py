"""Serve autoscaling under load on a real two-node Ray cluster (`ray.cluster_utils.Cluster`,
CPU, the tiny demo model), with the prefix router and the delta channels.

Load rises (engine replicas 1 -> 3), holds, and falls (3 -> 1) while streaming clients keep
going. Checked: every stream ends with [DONE] and all its tokens (nothing lost or cut, also
on replicas that scale-in removes while they stream: Serve's graceful shutdown drains them);
a draining replica ends its delta channels and goes once its requests are done, instead of
waiting out graceful_shutdown_timeout_s; the router sends requests to the new replicas and
none to removed ones; the hit rate after scale-up recovers to >= 90% of before (over a window
of recent requests, within a deadline); no KV slot
leaks on the survivor. Times (scale-out, first request on a new replica, drain) are printed
as a table, not asserted, except the drain's bound (far below the shutdown timeout).
"""
from __future__ import annotations

import json
import random
import threading
import time
from dataclasses import dataclass, field

import httpx
import pytest

from scripts.serve_replicas import call_each, list_replicas, routing_stats
from serve_helpers import serve_config_args, start_local_cluster, wait_until

APP, DEPLOYMENT, MODEL = "radixserve", "EngineReplica", "radixserve-demo"
STATS_PERIOD_S = 0.5
SHUTDOWN_TIMEOUT_S = 60.0  # long: a drain held up by open channels would take all of it
TARGET = 2  # target_ongoing_requests per engine replica
HIGH, LOW = 8, 2  # concurrent clients while load is high / falling (8 / 2 = 4 > 3 replicas)
PREFIXES = 4
PREFIX_LEN = 128
RECOVERY_WINDOW = 24  # finished requests over which the recovered hit rate is judged
RECOVERY_DEADLINE_S = 45.0  # after scale-out and the 12 s hold
ARGS = dict(
    autoscaling_config={
        "min_replicas": 1, "max_replicas": 3, "target_ongoing_requests": TARGET,
        # Short windows so that the test fits in its budget on 2 cores.
        "upscale_delay_s": 1.0, "downscale_delay_s": 4.0,
        "look_back_period_s": 2.0, "metrics_interval_s": 0.5,
    },
    graceful_shutdown_timeout_s=SHUTDOWN_TIMEOUT_S,
    graceful_shutdown_wait_loop_s=2.0,  # Serve's: scale-in under load as users run it
    health_check_period_s=2.0,
    engine={"max_total_tokens": 4096, "max_running_requests": 16, "chunked_prefill_size": 256},
    router={"request_router_class": "prefix",
            "request_router_kwargs": {"block_size": 16},
            "request_routing_stats_period_s": STATS_PERIOD_S},
)


@pytest.fixture(scope="module")
def base(request):
    """Head + one worker node; the app with Serve autoscaling on the engine deployment."""
    from ray import serve

    from deployments.app import build_app

    _, port = start_local_cluster(request, {"num_cpus": 4}, {"num_cpus": 4})
    serve.run(build_app(serve_config_args(**ARGS)), name=APP, route_prefix="/")
    return f"http://127.0.0.1:{port}"


def replica_states(deployment: str = DEPLOYMENT) -> dict[str, str]:
    """{replica id: Serve state (STARTING, RUNNING, STOPPING, ...)} from the controller."""
    import ray
    from ray import serve

    controller = serve.context._get_global_client()._controller
    details = ray.get(controller.get_serve_instance_details.remote(), timeout=10)
    replicas = details["applications"][APP]["deployments"][deployment]["replicas"]
    return {r["replica_id"]: r["state"] for r in replicas}


def running(deployment: str = DEPLOYMENT) -> set[str]:
    return {rid for rid, state in replica_states(deployment).items() if state == "RUNNING"}


@dataclass
class Result:
    """One streamed completion, as the client saw it."""

    prefix: int
    max_tokens: int
    tokens: int = 0
    done: bool = False  # the stream ended with data: [DONE]
    error: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    ttft: float = 0.0  # seconds to the first token event
    end: float = 0.0


def stream_one(client: httpx.Client, rng: random.Random, prefixes: list[list[int]],
               max_tokens: int) -> Result:
    k = rng.randrange(len(prefixes))
    result = Result(prefix=k, max_tokens=max_tokens)
    prompt = prefixes[k] + [rng.randrange(10, 760) for _ in range(16)]
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    start = time.monotonic()
    try:
        with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                result.error = f"HTTP {r.status_code}: {r.read()!r}"
                return result
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    result.done = True
                    break
                event = json.loads(data)
                if not result.ttft and event.get("choices"):
                    result.ttft = time.monotonic() - start
                if "error" in event:
                    result.error = str(event["error"])
                if event.get("usage"):
                    usage = event["usage"]
                    result.tokens = usage["completion_tokens"]
                    result.prompt_tokens = usage["prompt_tokens"]
                    result.cached_tokens = usage["prompt_tokens_details"]["cached_tokens"]
    except httpx.HTTPError as e:
        result.error = f"{type(e).__name__}: {e}"
    result.end = time.monotonic()
    return result


@dataclass
class Load:
    """Client threads streaming completions in a loop; `clients` can be lowered live."""

    base: str
    prefixes: list[list[int]]
    max_tokens: int = 48
    clients: int = 0
    results: list[Result] = field(default_factory=list)
    threads: list[threading.Thread] = field(default_factory=list)
    stop: bool = False
    fresh: bool = False  # prompts nobody caches: routed by load alone, so they spread

    def set_clients(self, n: int, max_tokens: int | None = None) -> None:
        if max_tokens is not None:
            self.max_tokens = max_tokens
        self.clients = n
        while len(self.threads) < n:
            t = threading.Thread(target=self._run, args=(len(self.threads),), daemon=True)
            self.threads.append(t)
            t.start()

    def _run(self, index: int) -> None:
        rng = random.Random(index)
        with httpx.Client(base_url=self.base, timeout=120) as client:
            while not self.stop:
                if index >= self.clients:
                    time.sleep(0.05)
                    continue
                prefixes = [[rng.randrange(10, 760) for _ in range(PREFIX_LEN)]] if self.fresh else self.prefixes
                self.results.append(stream_one(client, rng, prefixes, self.max_tokens))

    def finish(self) -> None:
        self.stop = True
        for t in self.threads:
            t.join(timeout=120)

    def hit_rate(self, since: float, until: float = float("inf")) -> float:
        done = [r for r in self.results if since <= r.end < until and r.done]
        return sum(r.cached_tokens for r in done) / max(1, sum(r.prompt_tokens for r in done))

    def recent_hit_rate(self, since: float, n: int) -> float | None:
        """Hit rate of the last `n` finished requests that ended after `since` (None: fewer)."""
        done = sorted((r for r in self.results if r.end >= since and r.done), key=lambda r: r.end)
        if len(done) < n:
            return None
        last = done[-n:]
        return sum(r.cached_tokens for r in last) / sum(r.prompt_tokens for r in last)

    def ttft_p50(self, since: float, until: float = float("inf")) -> float:
        ttfts = sorted(r.ttft for r in self.results if since <= r.end < until and r.done)
        return ttfts[len(ttfts) // 2] if ttfts else float("nan")


class Watcher(threading.Thread):
    """Polls the controller: when each replica became RUNNING, began STOPPING (and how many
    requests it was running then) and was gone."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.running_at: dict[str, float] = {}
        self.stopping_at: dict[str, float] = {}
        self.running_when_stopped: dict[str, int] = {}
        self.gone_at: dict[str, float] = {}
        self.first_busy_at: dict[str, float] = {}  # first seen running a request
        self.last_load: dict[str, int] = {}  # running + waiting at the last poll, per replica
        self.stop = False
        self.errors: list[str] = []
        self.states_seen: set[str] = set()

    def run(self) -> None:
        seen: set[str] = set()
        while not self.stop:
            try:
                self.poll(seen)
            except Exception as e:  # noqa: BLE001 - keep watching; report at the end
                self.errors.append(repr(e))
            time.sleep(0.1)

    def poll(self, seen: set[str]) -> None:
        if True:
            now = time.monotonic()
            states = replica_states()
            self.states_seen.update(states.values())
            for rid, state in states.items():
                seen.add(rid)
                if state == "RUNNING":
                    self.running_at.setdefault(rid, now)
                if state == "STOPPING" and rid not in self.stopping_at:
                    self.stopping_at[rid] = now
                    try:
                        stats = routing_stats({rid: list_replicas(APP, DEPLOYMENT)[rid]}, timeout=5)
                        load = stats[rid]["num_running"] + stats[rid]["num_waiting"]
                    except Exception:  # noqa: BLE001 - already gone
                        load = -1
                    # A short stream can finish between Serve's stop and this poll: the load
                    # seen at the last poll while it was RUNNING (0.1 s before) counts too.
                    self.running_when_stopped[rid] = max(load, self.last_load.get(rid, 0))
            running = {rid for rid, state in states.items() if state == "RUNNING"}
            if running:
                actors = list_replicas(APP, DEPLOYMENT)
                try:
                    stats = routing_stats({rid: actors[rid] for rid in running if rid in actors}, timeout=5)
                except Exception:  # noqa: BLE001 - one went away meanwhile
                    stats = {}
                for rid, s in stats.items():
                    self.last_load[rid] = s["num_running"] + s["num_waiting"]
                    if self.last_load[rid] > 0:
                        self.first_busy_at.setdefault(rid, now)
            for rid in seen - set(states) - set(self.gone_at):
                self.gone_at[rid] = now


def finished_by_replica() -> dict[str, int]:
    return {rid: s["finished_requests"] for rid, s in call_each(list_replicas(APP, DEPLOYMENT), "stats").items()}


@pytest.mark.slow
def test_client_leaving_the_request_that_opened_a_channel_does_not_close_it(base):
    """A request streaming while its ingress's delta channel opens (or just opened: the
    ingress opens one as its router lists the replica) leaves: the channel must stay, other
    requests stream on it."""
    rng = random.Random(5)
    body = {"model": MODEL, "max_tokens": 120, "temperature": 0, "ignore_eos": True, "stream": True}

    def prompt() -> list[int]:
        return [rng.randrange(10, 760) for _ in range(20)]

    # One ingress in this app serves both: try until both requests meet the same ingress
    # (two are running) and the second one streams on the channel the first one opened.
    for _ in range(6):
        with httpx.Client(base_url=base, timeout=120) as first_client, \
                httpx.Client(base_url=base, timeout=120) as second_client:
            before = call_each(list_replicas(APP, DEPLOYMENT), "stats")
            opening = first_client.stream("POST", "/v1/completions", json={**body, "prompt": prompt()})
            next(opening.__enter__().iter_lines())  # streaming: the channel is being opened
            assert wait_until(lambda: sum(s["open_channels"] for s in call_each(
                list_replicas(APP, DEPLOYMENT), "stats").values()) > 0, timeout=20), (
                before, call_each(list_replicas(APP, DEPLOYMENT), "stats"))
            on_channel_before = sum(s["requests_on_channel"] for s in before.values())
            result: list[Result] = []
            t = threading.Thread(target=lambda: result.append(
                stream_one(second_client, rng, [prompt()], 120)))
            t.start()
            wait_until(lambda: sum(s["requests_on_channel"] for s in call_each(
                list_replicas(APP, DEPLOYMENT), "stats").values()) > on_channel_before, timeout=20)
            opening.__exit__(None, None, None)  # the first client leaves mid-stream
            t.join(timeout=120)
        after = call_each(list_replicas(APP, DEPLOYMENT), "stats")
        if sum(s["requests_on_channel"] for s in after.values()) > on_channel_before:
            break
    else:
        pytest.skip("the second request never streamed on the first one's channel")
    [second] = result
    assert second.done and not second.error and second.tokens == 120, second


@pytest.mark.slow
def test_scale_out_and_in_under_streaming_load(base):
    rng = random.Random(0)
    prefixes = [[rng.randrange(10, 760) for _ in range(PREFIX_LEN)] for _ in range(PREFIXES)]
    load = Load(base, prefixes)
    watcher = Watcher()
    watcher.start()
    t0 = time.monotonic()
    try:
        [first] = running()
        # Low load on one replica: its cache holds every prefix; the hit rate before.
        load.set_clients(1)
        assert wait_until(lambda: len([r for r in load.results if r.done]) >= 3 * PREFIXES, timeout=60)
        before_since = time.monotonic()
        assert wait_until(lambda: len([r for r in load.results if r.end >= before_since]) >= 2 * PREFIXES,
                          timeout=60)
        hit_before = load.hit_rate(before_since)
        ttft_before = load.ttft_p50(before_since)
        assert running() == {first}, "scaled out under one client"

        # High load: Serve adds replicas up to max_replicas.
        rise = time.monotonic()
        load.set_clients(HIGH)
        # Two replicas start while the first one keeps 2 cores busy: 97 s on an AVX2-only
        # EPYC box, under 90 on faster ones.
        assert wait_until(lambda: len(running()) == 3, timeout=180, interval=0.5), replica_states()
        scaled_out = time.monotonic()
        new = running() - {first}
        # Hold: the new replicas serve (not starved), the hit rate recovers.
        time.sleep(4.0)
        hold_since = time.monotonic()
        served_before_hold = finished_by_replica()
        time.sleep(8.0)
        # Recovery: each new replica misses each prefix once (more when two requests for one
        # prefix arrive together); how many of those land in a fixed window depends on how
        # fast 2 cores serve. So: wait (bounded) until the last RECOVERY_WINDOW requests hit
        # as well as before; a router that keeps sending prefixes where they are not cached
        # (or a cache that evicts them) never gets there.
        recovered = wait_until(lambda: (load.recent_hit_rate(scaled_out, RECOVERY_WINDOW) or 0)
                               >= 0.9 * hit_before, timeout=RECOVERY_DEADLINE_S, interval=0.25)
        hit_recovered_s = time.monotonic() - scaled_out
        hit_after = load.recent_hit_rate(scaled_out, RECOVERY_WINDOW) or 0.0
        hit_hold = load.hit_rate(hold_since)
        # The ingress autoscales with the engine (two per engine replica at the same load).
        ingress_high = len(running("OpenAIIngress"))
        assert ingress_high > 2, ingress_high
        ttft_rise = load.ttft_p50(rise, scaled_out)  # 8 clients on one replica
        ttft_hold = load.ttft_p50(hold_since)  # 8 clients on three
        served_in_hold = {rid: n - served_before_hold.get(rid, 0) for rid, n in finished_by_replica().items()}
        assert all(served_in_hold[rid] > 0 for rid in new), served_in_hold
        # Seconds from RUNNING to the first request seen running there (polled every 0.2 s).
        first_request_s = {rid: watcher.first_busy_at[rid] - watcher.running_at[rid] for rid in new}

        # Fall: two long streams (the longest that fit) on fresh prompts, which the router spreads by load over two
        # replicas: whichever two of the three scale-in removes, one of them is streaming.
        fall = time.monotonic()
        load.fresh = True
        load.set_clients(LOW, max_tokens=360)  # as long as the context allows (144 + 360 <= 512)
        assert wait_until(lambda: len(running()) == 1, timeout=90, interval=0.5), replica_states()
        # The watcher polls (and asks each stopping replica for its load): let it catch up.
        wait_until(lambda: len(watcher.stopping_at) >= 2, timeout=30)
        removed = set(watcher.stopping_at)
        assert len(removed) == 2, (watcher.gone_at, watcher.errors[-3:], watcher.states_seen)
        assert wait_until(lambda: removed <= set(watcher.gone_at), timeout=SHUTDOWN_TIMEOUT_S)
        [survivor] = running()
        load.set_clients(LOW, max_tokens=16)
        time.sleep(3.0)
    finally:
        load.finish()
        watcher.stop = True

    results = load.results
    broken = [r for r in results if not r.done or r.error or r.tokens != r.max_tokens]
    assert not broken, (len(broken), broken[:5])
    # Every removed replica went long before graceful_shutdown_timeout_s. Whether one was
    # still streaming when Serve began stopping it is up to Serve's choice of replicas (on a
    # quiet machine it picks idle ones): reported, not asserted; the drain of a busy channel
    # is asserted in test_draining_replica_ends_idle_channels_and_busy_ones_after_their_last_request.
    drained_busy = max(watcher.running_when_stopped[rid] for rid in removed) > 0
    drain_s = {rid: watcher.gone_at[rid] - watcher.stopping_at[rid] for rid in removed}
    assert max(drain_s.values()) < SHUTDOWN_TIMEOUT_S / 2, drain_s
    assert recovered, (hit_before, hit_after, hit_hold)

    # After scale-in: every request is served by the survivor, and its KV pool is whole.
    with httpx.Client(base_url=base, timeout=60) as client:
        counts = finished_by_replica()
        assert set(counts) == {survivor}
        later = [stream_one(client, rng, prefixes, 8) for _ in range(6)]
        assert all(r.done and r.tokens == 8 for r in later)
        assert finished_by_replica()[survivor] - counts[survivor] == 6
        router = client.get("/v1/stats").json().get("router", {})
    assert router.get("replicas_tracked") == 1, router
    stats = call_each(list_replicas(APP, DEPLOYMENT), "stats")[survivor]
    assert stats["running"] == 0 and stats["free_slots"] + stats["evictable_slots"] == stats["total_slots"]
    # With no stream left, the survivor's ongoing requests are its channels alone.
    assert stats["open_channels"] >= 1

    rows = [("requests streamed", len(results)), ("a removed replica was streaming", drained_busy),
            ("hit rate before scale-out", f"{hit_before:.3f}"),
            ("hit rate during the 8 s hold (3 replicas)", f"{hit_hold:.3f}"),
            (f"hit rate of the last {RECOVERY_WINDOW} requests once >= 90% of before", f"{hit_after:.3f}"),
            ("hit rate recovered after scale-out (s)", f"{hit_recovered_s:.1f}"),
            ("TTFT p50: 1 client, 1 replica (s)", f"{ttft_before:.2f}"),
            ("TTFT p50: 8 clients, while scaling out (s)", f"{ttft_rise:.2f}"),
            ("TTFT p50: 8 clients, 3 replicas (s)", f"{ttft_hold:.2f}"),
            ("ingress replicas at the end of the hold (min 2, max 6)", ingress_high),
            ("ingress replicas at the end", len(running("OpenAIIngress"))),
            ("1 -> 3 replicas after high load began (s)", f"{scaled_out - rise:.1f}"),
            *((f"replica {rid[:8]} RUNNING -> first request (s)", f"{s:.1f}") for rid, s in first_request_s.items()),
            *((f"replica {rid[:8]} served in 8 s hold", n) for rid, n in served_in_hold.items()),
            ("3 -> 1 replicas after load fell (s)", f"{max(watcher.gone_at.values()) - fall:.1f}"),
            *((f"replica {rid[:8]} drain (s), requests then", f"{s:.1f}, {watcher.running_when_stopped[rid]}")
              for rid, s in drain_s.items()),
            ("test time (s)", f"{time.monotonic() - t0:.0f}")]
    print("\n" + "\n".join(f"| {k} | {v} |" for k, v in rows))


# ---------------------------------------------------------------------------------------
# The pieces, without a cluster
# ---------------------------------------------------------------------------------------

class _Config:
    def get_target_ongoing_requests(self) -> float:
        return TARGET


class _Ctx:
    """The fields of Serve's AutoscalingContext that the policy reads."""

    def __init__(self, replicas: int, requests: float, channels: list[float] | None) -> None:
        self.current_num_replicas = replicas
        self.target_num_replicas = replicas
        self.total_num_requests = requests
        self.aggregated_metrics = None if channels is None else {
            "open_channels": {f"r{i}": c for i, c in enumerate(channels)}}
        self.config = _Config()


def test_engine_policy_does_not_count_delta_channels():
    from deployments.autoscaling import engine_policy, with_policy

    # 3 replicas x 2 ingress channels each and no request: one replica is enough. Serve's
    # default would see 6 ongoing requests and keep 3 (6 / target 2).
    assert engine_policy(_Ctx(3, 6.0, [2, 2, 2]))[0] == 0.0
    assert engine_policy(_Ctx(3, 6.0 + 8, [2, 2, 2]))[0] == 8 / TARGET
    # No metric yet (a replica just started): Serve's own figure.
    assert engine_policy(_Ctx(1, 4.0, None))[0] == 4 / TARGET
    assert engine_policy(_Ctx(2, 1.0, [2, 2]))[0] == 0.0  # never negative
    assert engine_policy(_Ctx(0, 0.0, None))[0] == 0  # cold start: Serve decides
    assert with_policy({"min_replicas": 1})["policy"] == {
        "policy_function": "deployments.autoscaling:engine_policy"}
    own = {"policy": {"policy_function": "my:policy"}}
    assert with_policy(own) == own


def test_app_sets_the_policy_and_keeps_the_router_threshold_below_the_target():
    from deployments.app import engine_deployment
    from deployments.config import AppArgs

    auto = {"min_replicas": 1, "max_replicas": 3, "target_ongoing_requests": 8}
    args = AppArgs.model_validate({"autoscaling_config": auto})
    config = engine_deployment(args)._bound_deployment._deployment_config  # what Serve gets
    assert config.autoscaling_config.policy.policy_function == "deployments.autoscaling:engine_policy"
    assert args.router.request_router_kwargs["abs_threshold"] == 4
    with pytest.raises(ValueError, match="abs_threshold"):
        AppArgs.model_validate({"autoscaling_config": auto, "router": {
            "request_router_kwargs": {"abs_threshold": 8}}})
    fixed = AppArgs.model_validate({"num_replicas": 2})  # no autoscaling: untouched
    assert "abs_threshold" not in fixed.router.request_router_kwargs


def test_ingress_autoscales_two_per_engine_replica_and_drains_like_it():
    from deployments.app import build_app

    auto = {"min_replicas": 1, "max_replicas": 3, "target_ongoing_requests": 8, "downscale_delay_s": 5}
    app = build_app({"autoscaling_config": auto, "graceful_shutdown_timeout_s": 90,
                     "graceful_shutdown_wait_loop_s": 0.5})
    ingress = app._bound_deployment
    config = ingress._deployment_config
    [engine] = ingress.init_args[:1]
    assert engine._bound_deployment._deployment_config.graceful_shutdown_wait_loop_s == 0.5
    assert config.graceful_shutdown_wait_loop_s == 0.5
    assert ingress.name == "OpenAIIngress"
    assert (config.autoscaling_config.min_replicas, config.autoscaling_config.max_replicas) == (2, 6)
    assert config.autoscaling_config.target_ongoing_requests == 4  # half the engine's
    assert config.autoscaling_config.downscale_delay_s == 5
    # Not Serve's 20 s: an ingress removed by scale-in may take as long as an engine replica.
    assert config.graceful_shutdown_timeout_s == 90


def test_draining_replica_ends_idle_channels_and_busy_ones_after_their_last_request():
    import asyncio

    from deployments.channel import ChannelOpen, Outbox, end_idle_channels_when_draining, serve_channel
    from engine import WireDelta

    async def scenario():
        outboxes: dict[str, Outbox] = {}
        aborted: list[str] = []
        idle = serve_channel(outboxes, "rep", ChannelOpen("idle", "rep"), aborted.append)
        busy = serve_channel(outboxes, "rep", ChannelOpen("busy", "rep"), aborted.append)
        assert await idle.__anext__() == {"replica": "rep"}
        assert await busy.__anext__() == {"replica": "rep"}
        outboxes["busy"].request_ids.add("req")  # a request streaming on the busy channel
        draining = [False]
        watch = asyncio.ensure_future(end_idle_channels_when_draining(outboxes, lambda: draining[0]))
        idle_next = asyncio.ensure_future(idle.__anext__())
        await asyncio.sleep(0.7)
        assert not idle_next.done()  # not draining: channels stay open however idle
        draining[0] = True
        with pytest.raises(StopAsyncIteration):
            await asyncio.wait_for(idle_next, 2)
        # The busy channel still delivers its request's deltas, then ends once it is done.
        outboxes["busy"].put(WireDelta("req", [1], True, "stop", 1))
        assert await asyncio.wait_for(busy.__anext__(), 2) == ([WireDelta("req", [1], True, "stop", 1)], 0, None)
        busy_next = asyncio.ensure_future(busy.__anext__())
        await asyncio.sleep(0.7)
        assert not busy_next.done()
        outboxes["busy"].request_ids.discard("req")
        with pytest.raises(StopAsyncIteration):
            await asyncio.wait_for(busy_next, 2)
        assert outboxes == {} and aborted == []  # ended, not cut: nothing aborted
        watch.cancel()

    asyncio.run(scenario())


def test_replica_draining_is_false_outside_serve():
    from deployments.channel import replica_draining

    assert replica_draining() is False
