"""Generate radixserve's Grafana dashboard from the metric catalogue in deployments/metrics.py,
so panel queries always name metrics the code exports.

    python scripts/grafana_dashboard.py            # (re)write dashboards/radixserve.json
    python scripts/grafana_dashboard.py --check    # exit 1 if the committed JSON is stale
    python scripts/grafana_dashboard.py --metrics-table   # the table in docs/monitoring.md
    python scripts/grafana_dashboard.py --grafana-url http://localhost:3000 \\
        --grafana-token "$GRAFANA_TOKEN"           # also push it through Grafana's HTTP API

The JSON is a plain dashboard model: Grafana's file provisioning loads it as is
(dashboards/provisioning/), and it can be imported in the UI. Queries use a `datasource`
variable (any Prometheus that scrapes Ray's metrics) and an `application` filter.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from deployments import metrics as m  # noqa: E402

DASHBOARD_PATH = ROOT / "dashboards" / "radixserve.json"
UID = "radixserve-overview"
SEL = '{application=~"$application"}'
RATE = "[$__rate_interval]"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}

# -- PromQL helpers: each takes a catalogue name and picks the series Ray exports for it --


def series(name: str, suffix: str = "") -> str:
    """The exported series of metric `name` ("_bucket" etc. for a histogram part)."""
    wanted = [s for s in m.BY_NAME[name].series() if s.endswith(suffix)]
    return wanted[0]


def rate(name: str, by: str = "", selector: str = SEL) -> str:
    grouping = f" by ({by})" if by else ""
    return f"sum{grouping}(rate({series(name)}{selector}{RATE}))"


def quantile(q: float, name: str, by: str = "") -> str:
    labels = f"le, {by}" if by else "le"
    return f"histogram_quantile({q}, sum by ({labels}) (rate({series(name, '_bucket')}{SEL}{RATE})))"


def mean_of(name: str) -> str:
    """A histogram's mean: rate of its sum / rate of its count."""
    parts = [f"sum(rate({series(name, suffix)}{SEL}{RATE}))" for suffix in ("_sum", "_count")]
    return " / ".join(parts)


def gauge(name: str, agg: str = "sum", by: str = "") -> str:
    grouping = f" by ({by})" if by else ""
    return f"{agg}{grouping}({series(name)}{SEL})"


def ratio(numerator: str, denominator: str, by: str = "") -> str:
    return f"{rate(numerator, by)} / {rate(denominator, by)}"


# -- Panels ---------------------------------------------------------------------------


def target(expr: str, legend: str) -> dict[str, Any]:
    return {"datasource": DATASOURCE, "expr": expr, "legendFormat": legend, "refId": ""}


def timeseries(title: str, targets: list[dict[str, Any]], unit: str = "short",
               description: str = "") -> dict[str, Any]:
    for i, t in enumerate(targets):
        t["refId"] = chr(ord("A") + i)
    return {
        "type": "timeseries", "title": title, "description": description,
        "datasource": DATASOURCE, "targets": targets,
        "fieldConfig": {"defaults": {"unit": unit, "custom": {"fillOpacity": 10}}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                    "tooltip": {"mode": "multi", "sort": "desc"}},
    }


def percentiles(title: str, name: str, unit: str = "s", by: str = "") -> dict[str, Any]:
    suffix = f" {{{{{by}}}}}" if by else ""
    return timeseries(title, [target(quantile(q, name, by), f"p{round(q * 100)}{suffix}")
                              for q in (0.5, 0.95, 0.99)], unit, m.BY_NAME[name].description)


def overview_panels() -> list[dict[str, Any]]:
    return [
        timeseries("Request throughput by status", [
            target(rate(m.HTTP_REQUESTS, "status"), "{{status}}"),
        ], "reqps", m.BY_NAME[m.HTTP_REQUESTS].description),
        timeseries("Token throughput", [
            target(rate(m.ENGINE_GENERATED_TOKENS), "generated"),
            target(rate(m.ENGINE_PROMPT_TOKENS), "prompt"),
            target(rate(m.ENGINE_CACHED_TOKENS), "prompt, from cache"),
        ], "short", "Tokens per second over all engine replicas."),
        percentiles("Time to first token", m.TIME_TO_FIRST_TOKEN),
        percentiles("Inter-token latency", m.INTER_TOKEN_LATENCY),
        timeseries("End-to-end latency", [
            *[target(quantile(q, m.E2E_REQUEST_LATENCY), f"engine call p{round(q * 100)}")
              for q in (0.5, 0.95, 0.99)],
            target(quantile(0.95, m.HTTP_REQUEST_DURATION, "endpoint"), "HTTP p95 {{endpoint}}"),
        ], "s", "Engine calls (arrival at the replica to last token) and whole HTTP requests."),
        timeseries("Cache hit rate", [
            target(ratio(m.ENGINE_CACHED_TOKENS, m.ENGINE_PROMPT_TOKENS), "engine (admitted prompts)"),
            target(ratio(m.ACTUAL_CACHED_TOKENS, m.PROMPT_TOKENS), "finished calls (ingress view)"),
        ], "percentunit", "Prompt tokens served from the radix cache / prompt tokens."),
    ]


def engine_panels() -> list[dict[str, Any]]:
    return [
        timeseries("Running and waiting requests", [
            target(gauge(m.NUM_RUNNING), "running"),
            target(gauge(m.NUM_WAITING), "waiting"),
        ], "short", "Summed over engine replicas."),
        timeseries("KV cache usage", [
            target(gauge(m.KV_CACHE_USAGE, "max", "replica"), "{{replica}}"),
        ], "percentunit", m.BY_NAME[m.KV_CACHE_USAGE].description),
        timeseries("Batch size per step", [
            target(quantile(0.5, m.BATCH_SIZE), "p50"),
            target(quantile(0.95, m.BATCH_SIZE), "p95"),
            target(mean_of(m.BATCH_SIZE), "mean"),
        ], "short", m.BY_NAME[m.BATCH_SIZE].description),
        timeseries("Engine steps and preemptions", [
            target(rate(m.ENGINE_STEPS), "steps/s"),
            target(rate(m.PREEMPTIONS), "preemptions/s"),
        ], "short", "Forward passes per second, and requests retracted to free KV memory."),
        timeseries("Engine calls by outcome", [
            target(rate(m.ENGINE_REQUESTS, "finish_reason"), "{{finish_reason}}"),
            target(rate(m.ENGINE_CALLS_FINISHED), "finished (ingress view)"),
        ], "reqps", m.BY_NAME[m.ENGINE_REQUESTS].description),
        timeseries("Radix cache size", [
            target(gauge(m.RADIX_CACHE_TOKENS, "max", "replica"), "{{replica}}"),
        ], "short", m.BY_NAME[m.RADIX_CACHE_TOKENS].description),
        timeseries("Speculative decoding", [
            target(ratio(m.SPEC_ACCEPTED_TOKENS, m.SPEC_DRAFTED_TOKENS), "acceptance rate"),
            target(f"1 + {ratio(m.SPEC_ACCEPTED_TOKENS, m.SPEC_VERIFY_STEPS)}",
                   "mean acceptance length (tokens per verify)"),
        ], "short", "Draft tokens kept / verified, and tokens each verification emits "
           "(1 = no better than plain decoding). Empty when speculative decoding is off."),
    ]


def request_phase_panels() -> list[dict[str, Any]]:
    """Where an engine call's time goes, and how long its prompt and answer are."""
    return [
        timeseries("Queue, prefill and decode time p95", [
            target(quantile(0.95, m.QUEUE_TIME), "queue"),
            target(quantile(0.95, m.PREFILL_TIME), "prefill"),
            target(quantile(0.95, m.DECODE_TIME), "decode"),
        ], "s", "Per engine call: waiting for admission, admission to first token, first to "
                "last token."),
        percentiles("Time per output token", m.TIME_PER_OUTPUT_TOKEN),
        timeseries("Prompt and output length", [
            *[target(quantile(q, m.REQUEST_PROMPT_LENGTH), f"prompt p{round(q * 100)}")
              for q in (0.5, 0.95)],
            *[target(quantile(q, m.REQUEST_GENERATION_LENGTH), f"output p{round(q * 100)}")
              for q in (0.5, 0.95)],
        ], "short", "Tokens per finished engine call."),
        percentiles("Grammar compile time", m.GRAMMAR_COMPILE_TIME),
        timeseries("Garbage collection pauses", [
            target(quantile(q, m.GC_PAUSE, "deployment, generation"),
                   f"p{round(q * 100)} {{{{deployment}}}} generation {{{{generation}}}}")
            for q in (0.5, 0.99)
        ], "s", m.BY_NAME[m.GC_PAUSE].description),
    ]


def routing_panels() -> list[dict[str, Any]]:
    hits, misses = rate(m.ROUTER_ROUTED_WITH_MATCH), rate(m.ROUTER_ROUTED_WITHOUT_MATCH)
    return [
        timeseries("Routing decisions", [
            target(hits, "affinity hit"),
            target(misses, "miss"),
            target(rate(m.ROUTER_OVERFLOWS), "overflow"),
            target(rate(m.ROUTER_LOAD_FALLBACKS), "load fallback"),
            target(rate(m.ROUTER_MISROUTES), "misroute"),
            target(rate(m.ROUTER_DIGEST_CORRECTIONS), "digest correction"),
        ], "reqps", "Prefix-aware router decisions per second, summed over every ingress replica."),
        timeseries("Affinity hit ratio", [
            target(f"{hits} / ({hits} + {misses})", "affinity hits / routed"),
        ], "percentunit", "Share of routed engine calls sent where the replica's digest held >= 1 prompt block."),
        timeseries("Predicted vs actual cached tokens", [
            target(rate(m.ROUTER_PREDICTED_MATCHED_TOKENS), "predicted by the router"),
            target(rate(m.ACTUAL_CACHED_TOKENS), "found by the replicas"),
        ], "short", "Tokens per second: what the replicas' digests showed at routing vs what the radix caches held."),
    ]


def per_replica_panels() -> list[dict[str, Any]]:
    return [
        timeseries("Time to first token p95 by replica", [
            target(quantile(0.95, m.TIME_TO_FIRST_TOKEN, "replica"), "{{replica}}"),
        ], "s"),
        timeseries("Generated tokens/s by replica", [
            target(rate(m.ENGINE_GENERATED_TOKENS, "replica"), "{{replica}}"),
        ]),
        timeseries("Cache hit rate by replica", [
            target(ratio(m.ENGINE_CACHED_TOKENS, m.ENGINE_PROMPT_TOKENS, "replica"), "{{replica}}"),
        ], "percentunit"),
        timeseries("Running requests by replica", [
            target(gauge(m.NUM_RUNNING, "sum", "replica"), "running {{replica}}"),
            target(gauge(m.NUM_WAITING, "sum", "replica"), "waiting {{replica}}"),
        ]),
    ]


ROWS = (("Overview", overview_panels), ("Engine", engine_panels),
        ("Request phases", request_phase_panels),
        ("Routing", routing_panels), ("Per replica", per_replica_panels))


def layout(rows) -> list[dict[str, Any]]:
    """Rows of two half-width panels, each row under a row header."""
    panels: list[dict[str, Any]] = []
    y = 0
    for title, make in rows:
        panels.append({"type": "row", "title": title, "collapsed": False, "panels": [],
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}})
        y += 1
        row = make()
        for i, panel in enumerate(row):
            panel["gridPos"] = {"h": 8, "w": 12, "x": 12 * (i % 2), "y": y + 8 * (i // 2)}
            panels.append(panel)
        y += 8 * ((len(row) + 1) // 2)
    for panel_id, panel in enumerate(panels, start=1):
        panel["id"] = panel_id
    return panels


def templating() -> dict[str, Any]:
    return {"list": [
        {"name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus",
         "current": {}, "hide": 0, "refresh": 1},
        {"name": "application", "label": "Serve application", "type": "query",
         "datasource": DATASOURCE, "definition": f"label_values({series(m.NUM_RUNNING)}, application)",
         "query": {"query": f"label_values({series(m.NUM_RUNNING)}, application)", "refId": "A"},
         "includeAll": True, "allValue": ".*", "multi": True, "refresh": 2,
         "current": {"selected": True, "text": ["All"], "value": ["$__all"]}, "hide": 0},
    ]}


def build_dashboard() -> dict[str, Any]:
    return {
        "uid": UID, "title": "radixserve", "tags": ["radixserve", "ray-serve", "llm"],
        "description": "Generated by scripts/grafana_dashboard.py from deployments/metrics.py.",
        "editable": True, "graphTooltip": 1, "schemaVersion": 39, "version": 1,
        "refresh": "10s", "time": {"from": "now-30m", "to": "now"}, "timezone": "",
        "templating": templating(), "annotations": {"list": []}, "links": [],
        "panels": layout(ROWS),
    }


def render(dashboard: dict[str, Any]) -> str:
    return json.dumps(dashboard, indent=2) + "\n"


def push(dashboard: dict[str, Any], url: str, token: str | None, user: str | None,
         password: str | None, folder_uid: str | None) -> dict[str, Any]:
    """Create or overwrite the dashboard in a running Grafana (its HTTP API)."""
    from grafana_client import GrafanaApi

    credential = token or ((user, password) if user else None)
    api = GrafanaApi.from_url(url, credential=credential)
    payload: dict[str, Any] = {"dashboard": {**dashboard, "id": None}, "overwrite": True,
                               "message": "radixserve: scripts/grafana_dashboard.py"}
    if folder_uid:
        payload["folderUid"] = folder_uid
    return api.dashboard.update_dashboard(payload)


def metrics_table() -> str:
    """The catalogue as the markdown table of docs/monitoring.md."""
    lines = ["| Prometheus name | type | labels | recorded by | meaning |", "|---|---|---|---|---|"]
    for spec in m.METRICS:
        name = spec.series()[0].removesuffix("_bucket")
        labels = ", ".join(f"`{t}`" for t in spec.tag_keys) or "-"
        lines.append(f"| `{name}` | {spec.kind} | {labels} | {spec.recorded_by} | {spec.description} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", type=Path, default=DASHBOARD_PATH)
    parser.add_argument("--check", action="store_true", help="only compare with --output")
    parser.add_argument("--grafana-url", help="push to this Grafana, e.g. http://localhost:3000")
    parser.add_argument("--grafana-token", help="service account token (or --grafana-user)")
    parser.add_argument("--grafana-user")
    parser.add_argument("--grafana-password")
    parser.add_argument("--folder-uid", help="Grafana folder to push into")
    parser.add_argument("--metrics-table", action="store_true",
                        help="print the metric table of docs/monitoring.md and exit")
    args = parser.parse_args(argv)
    if args.metrics_table:
        print(metrics_table(), end="")
        return 0
    text = render(build_dashboard())
    if args.check:
        current = args.output.read_text() if args.output.exists() else ""
        if current != text:
            print(f"{args.output} is stale: run python scripts/grafana_dashboard.py", file=sys.stderr)
            return 1
        return 0
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text)
    print(f"wrote {args.output}")
    if args.grafana_url:
        result = push(build_dashboard(), args.grafana_url, args.grafana_token,
                      args.grafana_user, args.grafana_password, args.folder_uid)
        print(f"pushed to {args.grafana_url}: {result.get('url', result)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
