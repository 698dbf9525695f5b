"""Generate radixserve's Grafana dashboard from the table of the app's /metrics
(deployments/served_metrics.py: vLLM's names and ours) and, for what only Ray exports, the
catalogue in deployments/metric_catalogue.py, so panel queries always name metrics the code serves.

    python scripts/grafana_dashboard.py            # (re)write dashboards/radixserve.json
    python scripts/grafana_dashboard.py --check    # exit 1 if the committed JSON is stale
    python scripts/grafana_dashboard.py --served-table    # /metrics' table in docs/monitoring.md
    python scripts/grafana_dashboard.py --metrics-table   # Ray's export's table there
    python scripts/grafana_dashboard.py --grafana-url http://localhost:3000 \\
        --grafana-token "$GRAFANA_TOKEN"           # also push it through Grafana's HTTP API

The JSON is a plain dashboard model: Grafana's file provisioning loads it as is
(dashboards/provisioning/), and it can be imported in the UI. Queries use a `datasource`
variable (a Prometheus scraping the app's /metrics, and Ray's metrics for the GC panel), a
`model_name` filter and, on Ray's series, an `application` filter.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from deployments import metric_catalogue as cat  # noqa: E402
from deployments.served_metrics import BY_SERVED_NAME, SERVED  # noqa: E402

DASHBOARD_PATH = ROOT / "dashboards" / "radixserve.json"
UID = "radixserve-overview"
# The app's /metrics (vLLM's names and ours) by model; Ray's export by Serve application.
SERVED_SEL = '{model_name=~"$model_name"}'
SEL = '{application=~"$application"}'
RATE = "[$__rate_interval]"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}

# -- PromQL helpers: each takes a /metrics name (vllm:*, radixserve:*, deployments/
# served_metrics.py) or a catalogue name of Ray's export (deployments/metric_catalogue.py) -


def spec_of(name: str):
    return BY_SERVED_NAME.get(name) or cat.BY_NAME[name]


def series(name: str, suffix: str = "") -> str:
    """The exported series of metric `name` ("_bucket" etc. for a histogram part)."""
    wanted = [s for s in spec_of(name).series() if s.endswith(suffix)]
    return wanted[0]


def selected(name: str, suffix: str = "") -> str:
    return series(name, suffix) + (SERVED_SEL if name in BY_SERVED_NAME else SEL)


def describe(name: str) -> str:
    spec = spec_of(name)
    return getattr(spec, "help", None) or spec.description


def rate(name: str, by: str = "") -> str:
    grouping = f" by ({by})" if by else ""
    return f"sum{grouping}(rate({selected(name)}{RATE}))"


def quantile(q: float, name: str, by: str = "") -> str:
    labels = f"le, {by}" if by else "le"
    return f"histogram_quantile({q}, sum by ({labels}) (rate({selected(name, '_bucket')}{RATE})))"


def mean_of(name: str) -> str:
    """A histogram's mean: rate of its sum / rate of its count."""
    parts = [f"sum(rate({selected(name, suffix)}{RATE}))" for suffix in ("_sum", "_count")]
    return " / ".join(parts)


def gauge(name: str, agg: str = "sum", by: str = "") -> str:
    grouping = f" by ({by})" if by else ""
    return f"{agg}{grouping}({selected(name)})"


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
                              for q in (0.5, 0.95, 0.99)], unit, describe(name))


def overview_panels() -> list[dict[str, Any]]:
    return [
        timeseries("Request throughput by status", [
            target(rate("radixserve:http_requests", "status"), "{{status}}"),
        ], "reqps", describe("radixserve:http_requests")),
        timeseries("Token throughput", [
            target(rate("vllm:generation_tokens"), "generated"),
            target(rate("vllm:prompt_tokens"), "prompt"),
            target(rate("vllm:prefix_cache_hits"), "prompt, from cache"),
        ], "short", "Tokens per second over all engine replicas."),
        percentiles("Time to first token", "vllm:time_to_first_token_seconds"),
        percentiles("Inter-token latency", "vllm:inter_token_latency_seconds"),
        timeseries("End-to-end latency", [
            *[target(quantile(q, "vllm:e2e_request_latency_seconds"), f"engine call p{round(q * 100)}")
              for q in (0.5, 0.95, 0.99)],
            target(quantile(0.95, "radixserve:http_request_duration_seconds", "endpoint"),
                   "HTTP p95 {{endpoint}}"),
        ], "s", "Engine calls (arrival at the replica to last token) and whole HTTP requests."),
        timeseries("Cache hit rate", [
            target(ratio("vllm:prefix_cache_hits", "vllm:prefix_cache_queries"), "engine (admitted prompts)"),
            target(ratio("radixserve:finished_cached_tokens", "radixserve:finished_prompt_tokens"),
                   "finished calls (ingress view)"),
        ], "percentunit", "Prompt tokens served from the radix cache / prompt tokens."),
    ]


def engine_panels() -> list[dict[str, Any]]:
    return [
        timeseries("Running and waiting requests", [
            target(gauge("vllm:num_requests_running"), "running"),
            target(gauge("vllm:num_requests_waiting"), "waiting"),
        ], "short", "Summed over engine replicas. Waiting is the autoscaling signal "
                    "(docs/monitoring.md)."),
        timeseries("KV cache usage", [
            target(gauge("vllm:kv_cache_usage_perc", "max", "engine"), "{{engine}}"),
        ], "percentunit", describe("vllm:kv_cache_usage_perc")),
        timeseries("Batch size per step", [
            target(quantile(0.5, "radixserve:batch_size"), "p50"),
            target(quantile(0.95, "radixserve:batch_size"), "p95"),
            target(mean_of("radixserve:batch_size"), "mean"),
        ], "short", describe("radixserve:batch_size")),
        timeseries("Engine steps, preemptions and queue timeouts", [
            target(rate("radixserve:engine_steps"), "steps/s"),
            target(rate("vllm:num_preemptions"), "preemptions/s"),
            target(rate("radixserve:priority_preemptions"), "of them for priority/s"),
            target(rate("radixserve:queue_timeouts"), "queue timeouts/s"),
        ], "short", "Forward passes per second, requests retracted (to free KV memory, or for a "
                    "waiting request of a higher priority), and requests ended unrun past their "
                    "queue deadline."),
        timeseries("Engine calls by outcome", [
            target(rate("radixserve:engine_requests", "finish_reason"), "{{finish_reason}}"),
            target(rate("vllm:request_success"), "successes (vLLM's stop, length, abort)"),
            target(rate("radixserve:engine_calls_finished"), "finished (ingress view)"),
        ], "reqps", describe("radixserve:engine_requests")),
        timeseries("Radix cache size", [
            target(gauge("radixserve:radix_cache_tokens", "max", "engine"), "cached {{engine}}"),
            target(gauge("radixserve:radix_cache_evictable_tokens", "max", "engine"), "evictable {{engine}}"),
            target(gauge("radixserve:kv_cache_slots", "max", "engine"), "KV slots {{engine}}"),
        ], "short", "Tokens the radix cache holds, those no running request locks, and the "
                    "pool's size, per engine replica."),
        timeseries("Host KV tier", [
            target(rate("radixserve:host_cache_hit_tokens"), "prompt tokens from the host/s"),
            target(gauge("radixserve:host_kv_cache_tokens", "max", "engine"), "held {{engine}}"),
        ], "short", "The tier under the radix cache (host_kv_cache_gb): prompt tokens it "
                    "served (loaded back) and tokens it holds. Empty when the tier is off."),
        timeseries("Host KV tier bandwidth", [
            target(rate("radixserve:host_kv_load_bytes"), "host->device"),
            target(rate("radixserve:host_kv_write_back_bytes"), "device->host"),
            target(ratio("radixserve:host_kv_load_bytes", "radixserve:host_kv_load_seconds"),
                   "host->device while copying"),
            target(ratio("radixserve:host_kv_write_back_bytes", "radixserve:host_kv_write_back_seconds"),
                   "device->host while copying"),
        ], "Bps", "Bytes moved per second, and per second of copy time (the bandwidth the "
                  "copies reach; compare the link's peak)."),
        timeseries("Prefixes fetched from other replicas", [
            target(rate("radixserve:prefix_fetched_tokens"), "prompt tokens fetched/s"),
            target(rate("radixserve:prefix_fetches"), "fetches/s"),
            target(rate("radixserve:prefix_fetch_failures"), "failed (recomputed)/s"),
            target(rate("radixserve:prefix_exports"), "handed to others/s"),
            target(ratio("radixserve:prefix_fetch_seconds", "radixserve:prefix_fetches"),
                   "seconds per fetch"),
            target(ratio("radixserve:prefix_fetched_bytes", "radixserve:prefix_fetch_seconds"),
                   "bytes/s while fetching"),
        ], "short", "Prompt prefixes a replica took from another one's cache through Ray's "
                    "object store instead of computing them (the router names the holder). "
                    "Empty without a host tier."),
        timeseries("LoRA adapters", [
            target(rate("radixserve:lora_requests"), "requests under an adapter/s"),
            target(rate("radixserve:lora_slot_hits"), "adapter already in a GPU slot/s"),
            target(rate("radixserve:lora_slot_loads"), "loaded into a GPU slot/s"),
            target(rate("radixserve:lora_disk_loads"), "read from disk/s"),
            target(rate("radixserve:lora_dynamic_loads"), "registered on first use/s"),
            target(gauge("radixserve:lora_adapters", "max", "engine"), "registered {{engine}}"),
        ], "short", "Requests that ran under a LoRA adapter, how their adapters reached a GPU "
                    "slot, and the adapters each engine replica knows. Empty without adapters."),
        timeseries("Speculative decoding", [
            target(ratio("vllm:spec_decode_num_accepted_tokens", "vllm:spec_decode_num_draft_tokens"),
                   "acceptance rate"),
            target(f"1 + {ratio('vllm:spec_decode_num_accepted_tokens', 'vllm:spec_decode_num_drafts')}",
                   "mean acceptance length (tokens per verify)"),
        ], "short", "Draft tokens kept / verified, and tokens each verification emits "
           "(1 = no better than plain decoding). Empty when speculative decoding is off."),
    ]


def request_phase_panels() -> list[dict[str, Any]]:
    """Where an engine call's time goes, and how long its prompt and answer are."""
    return [
        timeseries("Queue, prefill and decode time p95", [
            target(quantile(0.95, "vllm:request_queue_time_seconds"), "queue"),
            target(quantile(0.95, "vllm:request_prefill_time_seconds"), "prefill"),
            target(quantile(0.95, "vllm:request_decode_time_seconds"), "decode"),
        ], "s", "Per engine call: waiting for admission, admission to first token, first to "
                "last token."),
        percentiles("Time per output token", "vllm:request_time_per_output_token_seconds"),
        timeseries("Prompt and output length", [
            *[target(quantile(q, "vllm:request_prompt_tokens"), f"prompt p{round(q * 100)}")
              for q in (0.5, 0.95)],
            *[target(quantile(q, "vllm:request_generation_tokens"), f"output p{round(q * 100)}")
              for q in (0.5, 0.95)],
        ], "short", "Tokens per finished engine call."),
        percentiles("Grammar compile time", "radixserve:grammar_compile_seconds"),
        timeseries("Garbage collection pauses (Ray's export)", [
            target(quantile(q, cat.GC_PAUSE, "deployment, generation"),
                   f"p{round(q * 100)} {{{{deployment}}}} generation {{{{generation}}}}")
            for q in (0.5, 0.99)
        ], "s", cat.BY_NAME[cat.GC_PAUSE].description),
    ]


def routing_panels() -> list[dict[str, Any]]:
    hits, misses = rate("radixserve:router_routed_with_match"), rate("radixserve:router_routed_without_match")
    return [
        timeseries("Routing decisions", [
            target(hits, "affinity hit"),
            target(misses, "miss"),
            target(rate("radixserve:router_overflows"), "overflow"),
            target(rate("radixserve:router_load_fallbacks"), "load fallback"),
            target(rate("radixserve:router_misroutes"), "misroute"),
            target(rate("radixserve:router_digest_corrections"), "digest correction"),
        ], "reqps", "Prefix-aware router decisions per second, summed over every ingress replica."),
        timeseries("Affinity hit ratio", [
            target(f"{hits} / ({hits} + {misses})", "affinity hits / routed"),
        ], "percentunit", "Share of routed engine calls sent where the replica's digest held >= 1 prompt block."),
        timeseries("Predicted vs actual cached tokens", [
            target(rate("radixserve:router_predicted_matched_tokens"), "predicted by the router"),
            target(rate("radixserve:finished_cached_tokens"), "found by the replicas"),
        ], "short", "Tokens per second: what the replicas' digests showed at routing vs what the radix caches held."),
    ]


def per_replica_panels() -> list[dict[str, Any]]:
    return [
        timeseries("Time to first token p95 by engine replica", [
            target(quantile(0.95, "vllm:time_to_first_token_seconds", "engine"), "{{engine}}"),
        ], "s"),
        timeseries("Generated tokens/s by engine replica", [
            target(rate("vllm:generation_tokens", "engine"), "{{engine}}"),
        ]),
        timeseries("Cache hit rate by engine replica", [
            target(ratio("vllm:prefix_cache_hits", "vllm:prefix_cache_queries", "engine"), "{{engine}}"),
        ], "percentunit"),
        timeseries("Running requests by engine replica", [
            target(gauge("vllm:num_requests_running", "sum", "engine"), "running {{engine}}"),
            target(gauge("vllm:num_requests_waiting", "sum", "engine"), "waiting {{engine}}"),
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
        variable("model_name", "Model", series("vllm:num_requests_running")),
        variable("application", "Serve application (Ray's export)", series(cat.NUM_RUNNING)),
    ]}


def variable(name: str, label: str, from_series: str) -> dict[str, Any]:
    query = f"label_values({from_series}, {name})"
    return {"name": name, "label": label, "type": "query", "datasource": DATASOURCE,
            "definition": query, "query": {"query": query, "refId": "A"},
            "includeAll": True, "allValue": ".*", "multi": True, "refresh": 2,
            "current": {"selected": True, "text": ["All"], "value": ["$__all"]}, "hide": 0}


def build_dashboard() -> dict[str, Any]:
    return {
        "uid": UID, "title": "radixserve", "tags": ["radixserve", "ray-serve", "llm"],
        "description": "Generated by scripts/grafana_dashboard.py from deployments/metric_catalogue.py.",
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
    for spec in cat.METRICS:
        name = spec.series()[0].removesuffix("_bucket")
        labels = ", ".join(f"`{t}`" for t in spec.tag_keys) or "-"
        lines.append(f"| `{name}` | {spec.kind} | {labels} | {spec.recorded_by} | {spec.description} |")
    return "\n".join(lines) + "\n"


def served_table() -> str:
    """/metrics' table (deployments/served_metrics.py) as markdown for docs/monitoring.md."""
    lines = ["| name | type | labels | meaning |", "|---|---|---|---|"]
    for spec in SERVED:
        labels = ", ".join(f"`{label}`" for label in ("model_name", spec.role, *(t for _, t in spec.tags)))
        lines.append(f"| `{spec.series()[0].removesuffix('_bucket')}` | {spec.kind} | {labels} | {spec.help} |")
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
    parser.add_argument("--served-table", action="store_true",
                        help="print the /metrics table of docs/monitoring.md and exit")
    args = parser.parse_args(argv)
    if args.metrics_table or args.served_table:
        print(metrics_table() if args.metrics_table else served_table(), end="")
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
