"""Serve autoscaling policy of the engine deployment: Serve's own, minus the delta channels.

Serve's default policy scales on the ongoing requests per replica (handle calls in flight,
averaged over `look_back_period_s`). Every ingress replica keeps one long-lived delta-channel
call open on every engine replica (deployments/channel.py), and Serve counts those too: with
two ingress replicas per engine replica, n engine replicas would each carry 2n calls that are
not load, so the deployment scaled out early and never scaled back in. The engine replica
reports its open channels as a custom metric (`EngineReplica.record_autoscaling_stats`); this
policy takes them out and otherwise decides exactly as Serve's default does (Serve applies
min/max replicas, the scaling factors and the up/downscale delays around it).
"""
from __future__ import annotations

from typing import Any

OPEN_CHANNELS = "open_channels"
POLICY = "deployments.autoscaling:engine_policy"


def engine_policy(ctx) -> tuple[float, dict[str, Any]]:
    """`ctx`: ray.serve.config.AutoscalingContext. Returns (desired replicas, policy state)."""
    if ctx.current_num_replicas == 0:  # cold start: Serve's fast path handles it
        return ctx.target_num_replicas, {}
    channels = sum((ctx.aggregated_metrics or {}).get(OPEN_CHANNELS, {}).values())
    requests = max(0.0, ctx.total_num_requests - channels)
    return requests / ctx.config.get_target_ongoing_requests(), {}


def with_policy(autoscaling_config: dict[str, Any]) -> dict[str, Any]:
    """The engine's autoscaling_config with this policy, unless it names its own."""
    if "policy" in autoscaling_config:
        return autoscaling_config
    return {**autoscaling_config, "policy": {"policy_function": POLICY}}
