"""The ingress's admission gate (deployments/admission.py) and the load reports that feed it
(deployments/channel.py), without Ray: quick. End to end: tests/test_serve_path.py."""
from __future__ import annotations

import asyncio

import httpx
from fastapi import FastAPI, Request

from deployments.admission import AdmissionGate, install_admission
from deployments.channel import ChannelOpen, Outbox, serve_channel
from deployments.errors import OVERLOADED_MESSAGE, install_error_handlers
from engine import SamplingParams, WireDelta


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def gate_of(replicas, fresh_s: float = 0.25) -> tuple[AdmissionGate, Clock]:
    clock = Clock()
    gate = AdmissionGate(fresh_s, clock)
    gate.replicas = lambda: replicas
    return gate, clock


def test_gate_refuses_only_on_every_replicas_fresh_word():
    gate, clock = gate_of(["a", "b"])
    assert not gate.full()  # nothing heard: the engines decide
    gate.report("a", 12, 12)
    assert not gate.full()  # "b" said nothing: it may have room
    gate.report("b", 13, 12)
    assert gate.full()
    clock.now += 0.2
    gate.report("a", 12, 12)
    assert gate.full()
    clock.now += 0.1  # "b"'s report is 0.3 s old
    assert not gate.full()
    gate.report("b", 12, 12)
    assert gate.full()
    gate.report("a", 11, 12)  # room on "a"
    assert not gate.full()


def test_gate_forgets_full_reports_when_a_call_ends_or_a_channel_closes():
    gate, _ = gate_of(["a"])
    gate.report("a", 4, 4)
    assert gate.full()
    gate.call_finished()  # one of our calls ended: room may have opened anywhere
    assert not gate.full()
    gate.report("a", 4, 4)
    gate.forget("a")
    assert not gate.full()


def test_gate_disbelieves_full_reports_arriving_just_after_a_call_ended():
    """A channel batch sent while a stream still ran can arrive after its call ended: its
    "full" must not shut the gate (tests/test_serve_path.py's full-engine test then got a 503
    on an empty engine, and so did the tests after it)."""
    gate, clock = gate_of(["a"])
    gate.call_finished()
    clock.now += 0.1
    gate.report("a", 4, 4)  # in transit when the call ended
    assert not gate.full()
    clock.now += 0.2  # the window has passed: a new "full" is believed
    gate.report("a", 4, 4)
    assert gate.full()


def test_gate_without_bound_or_replica_list_never_refuses():
    gate, _ = gate_of(["a"])
    gate.report("a", 10**6, None)  # an engine without max_queued_requests
    assert not gate.full()
    for replicas in (None, []):  # the router cannot be read, or lists nobody
        gate, _ = gate_of(replicas)
        gate.report("a", 4, 4)
        assert not gate.full()


def _app() -> tuple[FastAPI, AdmissionGate, list[str]]:
    app = FastAPI()
    install_error_handlers(app)
    gate = install_admission(app)
    gate.replicas = lambda: ["a"]
    reached: list[str] = []

    @app.post("/v1/completions")
    async def completions(request: Request):
        reached.append("completions")
        return {"body": len(await request.body())}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        reached.append("tokenize")
        return {}

    return app, gate, reached


def test_middleware_answers_the_engines_503_before_the_app_when_full():
    app, gate, reached = _app()

    async def run():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://x") as client:
            ok = await client.post("/v1/completions", json={"prompt": "hi"})
            gate.report("a", 8, 8)
            refused = await client.post("/v1/completions", content=b"{not even json")
            other = await client.post("/tokenize", json={"prompt": "hi"})  # not gated
            gate.report("a", 7, 8)
            again = await client.post("/v1/completions", json={"prompt": "hi"})
            return ok, refused, other, again

    ok, refused, other, again = asyncio.run(run())
    assert ok.status_code == other.status_code == again.status_code == 200
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    assert refused.json() == {"error": {"message": OVERLOADED_MESSAGE, "type": "service_unavailable",
                                        "param": None, "code": None}}
    assert reached == ["completions", "tokenize", "completions"] and gate.refused == 1


def test_channel_batches_carry_load_without_their_finishing_streams():
    async def scenario():
        outboxes: dict[str, Outbox] = {}
        load = [5, 8]
        channel = serve_channel(outboxes, "rep", ChannelOpen("ing", "rep"), lambda _: None,
                                lambda: tuple(load))
        assert await channel.__anext__() == {"replica": "rep"}
        outboxes["ing"].put(WireDelta("r1", [1], False, None, 1))
        outboxes["ing"].put(WireDelta("r2", [2], True, "stop", 1))  # may still count in the engine
        batch, in_flight, capacity = await asyncio.wait_for(channel.__anext__(), 2)
        assert [d.request_id for d in batch] == ["r1", "r2"] and (in_flight, capacity) == (4, 8)
        await channel.aclose()

    asyncio.run(scenario())


def test_engine_refusal_item_feeds_the_gate():
    """merged_stream hands an engine 503's load to the hub's gate, and its end does not
    clear it (a refused call freed no room); a call that finished clears it."""
    from deployments.channel import ChannelHub
    from deployments.engine_replica import EngineCall
    from deployments.streams import merged_stream

    class Response:
        def __init__(self, items):
            self.items = items

        def __aiter__(self):
            return self._gen()

        async def _gen(self):
            for item in self.items:
                yield item

        def cancel(self):
            pass

    class Method:
        def __init__(self, items):
            self.items = items

        def remote(self, call):
            return Response(self.items)

    class Handle:
        def __init__(self, items):
            self.generate = Method(items)

    gate, _ = gate_of(["rep"])

    async def run(items):
        hub = ChannelHub(None, loads=gate)
        return [b async for b in merged_stream(Handle(items), [EngineCall("x", [1], SamplingParams())], hub)]

    refusal = {"error": OVERLOADED_MESSAGE, "status": 503, "load": ["rep", 12, 12]}
    asyncio.run(run([refusal]))
    assert gate.full()
    done = WireDelta("x", [3], True, "stop", 1)
    asyncio.run(run([done]))
    assert not gate.full()
