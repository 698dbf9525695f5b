"""Launch to first token: `serve run` of a config, probed from the moment it starts.

    python scripts/bench_startup.py serve_config.yaml            # scripts/serve.sh's mode
    python scripts/bench_startup.py CONFIG --plain --port 8104   # plain `serve run`, another port
    python scripts/bench_startup.py CONFIG --set engine_process=true --set engine.max_total_tokens=4096

Starts `scripts/serve.sh CONFIG` (its `http_options.port` replaced by --port) and, every
--interval seconds until a completion succeeds, sends GET /health and GET /v1/models; a
completion of one token is sent in a loop of its own (one at a time, so a server that holds
it while starting does not hide the probes). Prints, per endpoint, when it first answered
at all and when it first answered 200 (seconds after launch), the latency of its probes
while the engine was starting, and how many probe rounds saw /health and /v1/models
disagree. Then the launch's phases, from `serve run`'s log and Serve's logs of the Ray
session it started (the engine process's lines are in the former): Ray and Serve up, the app's build,
each replica's constructor (it starts once Serve has imported the replica's module), the
engine process's imports and start. If `serve run` exits or the app fails to deploy, it
stops at once and prints the log's tail. No timing is asserted: it is a table for the GPU
machine's launch-to-first-token figure (docs/deploy.md, "Start-up and readiness";
`PARTS=startup scripts/gpu_serve_check.sh` runs it on the GPU config).
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from serve_helpers import kill_session  # noqa: E402 - every process of `serve run`'s session
TIMED_OUT = -1  # the status recorded for a probe that got no answer within its timeout


@dataclass
class Probes:
    """One endpoint's answers: (seconds from launch to the answer, status, latency in s)."""

    answers: list[tuple[float, int, float]] = field(default_factory=list)

    def first(self, ok_only: bool = False) -> float | None:
        return next((t for t, status, _ in self.answers if not ok_only or status == 200), None)

    def starting_latencies(self) -> list[float]:
        """Latencies of the answers before the first 200."""
        ready = self.first(ok_only=True)
        return [lat for t, _, lat in self.answers if ready is None or t < ready]


def probe(client: httpx.Client, method: str, url: str, t0: float, probes: Probes, **kw) -> int:
    start = time.monotonic()
    try:
        status = client.request(method, url, **kw).status_code
    except httpx.TimeoutException:
        status = TIMED_OUT
    except httpx.HTTPError:
        return 0  # nothing listening yet: not an answer
    end = time.monotonic()
    probes.answers.append((end - t0, status, end - start))
    return status


def with_overrides(doc: dict, sets: list[str]) -> dict:
    """`--set a.b=value` (value in YAML) into the first app's args."""
    args = doc["applications"][0].setdefault("args", {})
    for item in sets:
        key, _, value = item.partition("=")
        *parents, last = key.split(".")
        target = args
        for name in parents:
            target = target.setdefault(name, {})
        target[last] = yaml.safe_load(value)
    return doc


def launch(config: str, port: int, plain: bool, sets: list[str]) -> tuple[subprocess.Popen, Path]:
    doc = with_overrides(yaml.safe_load(Path(config).read_text()), sets)
    doc.setdefault("http_options", {})["port"] = port
    tmp = Path(tempfile.mkdtemp(prefix="bench_startup_"))
    (tmp / "config.yaml").write_text(yaml.safe_dump(doc))
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=path, RAY_USAGE_STATS_ENABLED="0")
    log = open(tmp / "serve.log", "wb")
    command = ["serve", "run"] if plain else ["bash", str(ROOT / "scripts" / "serve.sh")]
    proc = subprocess.Popen([*command, str(tmp / "config.yaml")],
                            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    return proc, tmp


def run(args: argparse.Namespace) -> dict[str, Probes]:
    base = f"http://127.0.0.1:{args.port}"
    model = with_overrides(yaml.safe_load(Path(args.config).read_text()), args.set)[
        "applications"][0]["args"].get("served_model_name")
    found = {name: Probes() for name in ("/health", "/v1/models", "completion")}
    t0, launched = time.monotonic(), time.time()
    proc, tmp = launch(args.config, args.port, args.plain, args.set)
    done = threading.Event()

    def complete() -> None:
        body = {"prompt": "Hello", "max_tokens": 1, **({"model": model} if model else {})}
        with httpx.Client(timeout=args.timeout) as client:
            while not done.is_set() and time.monotonic() - t0 < args.timeout:
                if probe(client, "POST", f"{base}/v1/completions", t0, found["completion"],
                         json=body) == 200:
                    done.set()
                else:
                    time.sleep(args.interval)

    worker = threading.Thread(target=complete, daemon=True)
    worker.start()
    try:
        with httpx.Client(timeout=2.0) as client:
            while not done.is_set() and time.monotonic() - t0 < args.timeout:
                failed = "serve run exited" if proc.poll() is not None else deploy_failure(tmp / "serve.log")
                if failed:
                    raise SystemExit(f"{failed}; the end of its log ({tmp / 'serve.log'}):\n"
                                     + tail(tmp / "serve.log"))
                for path in ("/health", "/v1/models"):
                    probe(client, "GET", base + path, t0, found[path])
                time.sleep(args.interval)
    finally:
        done.set()
        kill_session(proc.pid)  # serve run and the Ray cluster it started
        proc.wait()
    print(f"serve run's log: {tmp / 'serve.log'}")
    if found["completion"].first(ok_only=True) is None:
        print(f"no completion within {args.timeout:.0f} s; the end of the log:\n{tail(tmp / 'serve.log')}")
    lines = log_lines(tmp / "serve.log", proc.pid)
    for name, seconds in phases(lines, launched):
        print(f"{seconds:7.2f} s  {name}")
    for line in [line for line in lines if "engine-process" in line][:8]:
        print("  " + line.split("engine-process", 1)[1].strip()[:150])
    return found


# Lines of serve run's log that mark the launch's phases: (phase, words on the line); the
# first line with all of them counts. The engine process's lines are engine/runtime's.
PHASES = [("`serve run` started (its imports done)", ("Running config file",)),
          ("Ray started", ("Started a local Ray instance",)),
          ("Serve started", ("Started Serve in namespace",)),
          ("app build began (imports deployments.app)", ("Importing application",)),
          ("app built", ("Imported and built app",)),
          ("replicas created", ("Adding ",)),
          ("ingress constructor began (its module imported)", ("OpenAIIngress", "Started initializing")),
          ("ingress ready", ("OpenAIIngress", "Finished initializing")),
          ("engine replica constructor began (its module imported)",
           ("EngineReplica", "Started initializing")),
          ("engine process up (before the engine's imports)", ("engine process up",)),
          ("engine process: the engine's imports done", ("the engine's imports done",)),
          ("engine: tokenizer loaded", ("tokenizer loaded in",)),
          ("engine: model built", ("loaded ", "ForCausalLM")),
          ("engine: KV pool allocated", ("KV pool:",)),
          ("engine: decode CUDA graphs captured", ("captured decode CUDA graphs",)),
          ("engine: extend CUDA graphs captured", ("captured extend CUDA graphs",)),
          ("engine started (model, KV, graphs, warm-up)", ("engine started in",)),
          ("engine replica ready", ("EngineReplica", "Finished initializing"))]
LOG_TIME = re.compile(r"(\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2},\d{3})")
# What says the launch failed: the app's build, or a replica's constructor (Serve retries
# one a few times, a minute each on a slow box: the figure would not be a launch's anyway)
FAILED = ("DEPLOY_FAILED", "failed with exception", "initialize_and_get_metadata()")


def log_lines(log: Path, pid: int) -> list[str]:
    """serve run's log, and Serve's own logs of the Ray session it started (named after its
    pid; Serve writes some lines, a replica's constructor start and end among them, there
    only)."""
    lines = log.read_text(errors="replace").splitlines()
    for path in sorted(Path("/tmp/ray").glob(f"session_*_{pid}/logs/serve/*.log")):
        lines += path.read_text(errors="replace").splitlines()
    return lines


def phases(text: list[str], launched: float) -> list[tuple[str, float]]:
    """(phase, seconds after launch) for each of PHASES found in the launch's log lines."""
    out = []
    for name, words in PHASES:
        line = next((line for line in text
                     if all(w in line for w in words) and LOG_TIME.search(line)), None)
        if line is not None:
            stamp = datetime.strptime(LOG_TIME.search(line).group(1), "%Y-%m-%d %H:%M:%S,%f")
            out.append((name, stamp.timestamp() - launched))
    return sorted(out, key=lambda phase: phase[1])


def deploy_failure(log: Path) -> str | None:
    text = log.read_text(errors="replace")
    return next((f"the launch failed ({marker!r} in the log)" for marker in FAILED
                 if marker in text), None)


def tail(log: Path, lines: int = 40) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def disagreements(found: dict[str, Probes]) -> int:
    """Probe rounds in which /health and /v1/models gave different statuses."""
    health, models = found["/health"].answers, found["/v1/models"].answers
    return sum(1 for a, b in zip(health, models) if (a[1] == 200) != (b[1] == 200))


def report(found: dict[str, Probes]) -> None:
    print(f"\n{'endpoint':<12} {'first answer s':>15} {'first 200 s':>12} {'probes':>7} "
          f"{'starting p50 ms':>16} {'starting max ms':>16}")
    for name, probes in found.items():
        lat = probes.starting_latencies()
        first, ok = probes.first(), probes.first(ok_only=True)
        print(f"{name:<12} {first if first is not None else float('nan'):>15.2f} "
              f"{ok if ok is not None else float('nan'):>12.2f} {len(probes.answers):>7} "
              f"{statistics.median(lat) * 1e3 if lat else float('nan'):>16.1f} "
              f"{max(lat) * 1e3 if lat else float('nan'):>16.1f}")
    print(f"rounds where /health and /v1/models disagreed: {disagreements(found)}")
    for name, probes in found.items():
        print(f"{name}: " + ", ".join(f"{status} from {t:.1f} s" for t, status in transitions(probes)))


def transitions(probes: Probes) -> list[tuple[float, int]]:
    """(when, status) each time the endpoint's answer changed (-1: timed out)."""
    out: list[tuple[float, int]] = []
    for t, status, _ in probes.answers:
        if not out or out[-1][1] != status:
            out.append((t, status))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("config", nargs="?", default=str(ROOT / "serve_config.yaml"))
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--plain", action="store_true", help="plain `serve run` (no HAProxy)")
    parser.add_argument("--interval", type=float, default=0.1, help="seconds between probe rounds")
    parser.add_argument("--timeout", type=float, default=300.0, help="give up after this long")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override an app arg (dotted for nested, value in YAML), repeatable")
    report(run(parser.parse_args()))


if __name__ == "__main__":
    main()
