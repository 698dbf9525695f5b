"""A real Prometheus for tests: started from the committed dashboards/prometheus.yml with the
scrape interval cut to 1 s and the targets pointed at the test's cluster, queried by PromQL."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import httpx
import yaml

from serve_helpers import ROOT, free_port

PROMETHEUS = shutil.which("prometheus")
SKIP_REASON = ("prometheus binary not found: `apt-get install -y prometheus` "
               "(scripts/setup.sh does it where apt-get is available)")


def committed_config() -> dict[str, Any]:
    config = yaml.safe_load((ROOT / "dashboards/prometheus.yml").read_text())
    config["global"]["scrape_interval"] = config["global"]["evaluation_interval"] = "1s"
    return config


def scrape_job(config: dict[str, Any], name: str) -> dict[str, Any]:
    return next(job for job in config["scrape_configs"] if job["job_name"] == name)


def start_prometheus(tmp: Path, config: dict[str, Any]) -> tuple[subprocess.Popen, str]:
    """Prometheus running `config`; (process, base URL). Stop it with `stop_prometheus`."""
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    proc = subprocess.Popen(
        [PROMETHEUS, f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=(tmp / "prometheus.log").open("w"))
    return proc, f"http://127.0.0.1:{port}"


def stop_prometheus(proc: subprocess.Popen) -> None:
    proc.terminate()
    proc.wait(timeout=30)


def promql(base: str, query: str) -> list[dict]:
    try:
        reply = httpx.get(f"{base}/api/v1/query", params={"query": query}, timeout=5).json()
    except httpx.HTTPError:
        return []
    return reply.get("data", {}).get("result", []) if reply.get("status") == "success" else []


def scalar(base: str, query: str) -> float | None:
    """A query's one value (None: no result yet)."""
    result = promql(base, query)
    return float(result[0]["value"][1]) if len(result) == 1 else None
