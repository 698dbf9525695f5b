"""`build_app(args)`: the Ray Serve application of serve_config.yaml's `import_path`."""
from __future__ import annotations

from typing import Any

from pydantic import ValidationError
from ray import serve
from ray.serve import Application

from deployments.autoscaling import with_policy
from deployments.colocated import EngineIngress
from deployments.config import AppArgs
from deployments.engine_replica import EngineReplica
from deployments.ingress import OpenAIIngress
from deployments.tp_workers import placement_options


def engine_options(args: AppArgs) -> dict[str, Any]:
    """Serve options of a deployment that holds an engine (split or colocated)."""
    options: dict[str, Any] = {
        "max_ongoing_requests": args.engine_max_ongoing(),
        # Serve's own queue (all replicas at their cap) gets the same 503 as the engine's.
        "max_queued_requests": args.engine_capacity,
        "ray_actor_options": args.ray_actor_options,
        "graceful_shutdown_timeout_s": args.graceful_shutdown_timeout_s,
        "graceful_shutdown_wait_loop_s": args.graceful_shutdown_wait_loop_s,
        "health_check_period_s": args.health_check_period_s,
        "health_check_timeout_s": args.health_check_timeout_s,
    }
    if args.autoscaling_config is not None:
        # Split: Serve's policy minus the delta channels, which Serve counts as ongoing
        # requests. Colocated: no channels; its ongoing requests are HTTP requests.
        colocated = args.ingress == "colocated"
        options["autoscaling_config"] = (dict(args.autoscaling_config) if colocated
                                         else with_policy(args.autoscaling_config))
        options["num_replicas"] = "auto"
    else:
        options["num_replicas"] = args.num_replicas
    if args.tp_size > 1:  # one bundle per rank; the replica is rank 0 (deployments/tp_workers.py)
        options.update(placement_options(args.ray_actor_options, args.tp_size, args.tp_bundle,
                                         args.placement_group_strategy))
    return options


def engine_deployment(args: AppArgs, replica_class: type = EngineReplica):
    options = {"name": "EngineReplica", **engine_options(args)}
    router = args.router.to_serve()
    if router is not None:
        options["request_router_config"] = router
    block_size = args.router.request_router_kwargs.get("block_size", 16)
    return serve.deployment(replica_class).options(**options).bind(
        args.model, args.engine, block_size, args.gil_switch_interval_ms,
        args.use_engine_process, args.prefix_fetch_timeout_s)


def build_app(args: dict[str, Any] | None = None) -> Application:
    """The app of serve_config.yaml (Serve calls an app builder with exactly one argument)."""
    return build_app_with(args)


def build_app_with(args: dict[str, Any] | None, replica_class: type = EngineReplica) -> Application:
    """`replica_class`: EngineReplica, or a stand-in of it (scripts/bench_serve_path.py)."""
    try:
        app_args = AppArgs.model_validate(args or {})
    except ValidationError as e:
        raise ValueError(f"invalid radixserve app args:\n{e}") from None
    if app_args.engine.get("task", "generate") != "generate":  # embed / score
        from deployments.pooling_server import PoolingServer  # its engine's imports, at once

        return serve.deployment(PoolingServer).options(
            name="PoolingServer", **{**engine_options(app_args), "max_queued_requests": -1}).bind(
            app_args.model, app_args.engine, app_args.model_name(),
            max_body_bytes=app_args.max_request_body_bytes, api_key=app_args.api_key,
            admin_api_key=app_args.admin_api_key)
    ingress_kwargs = dict(max_model_len=app_args.engine.get("max_model_len"),
                          tokenizer=app_args.engine.get("tokenizer"),
                          max_body_bytes=app_args.max_request_body_bytes,
                          api_key=app_args.api_key, admin_api_key=app_args.admin_api_key,
                          tool_call_parser=app_args.tool_call_parser,
                          reasoning_parser=app_args.reasoning_parser,
                          max_calls_in_flight=app_args.engine_batch,
                          freeze_gc=app_args.freeze_gc)
    if app_args.ingress == "colocated":
        # Serve's own queue (max_queued_requests) would answer a burst's excess with its
        # plain-text 503 at the proxy; unbounded, every refusal is the engine's (OpenAI JSON,
        # at once: its bound is checked in this process).
        options = {**engine_options(app_args), "max_queued_requests": -1}
        return serve.deployment(EngineIngress).options(name="EngineIngress", **options).bind(
            app_args.model, app_args.engine, app_args.gil_switch_interval_ms,
            app_args.use_engine_process, app_args.model_name(), **ingress_kwargs)
    engine = engine_deployment(app_args, replica_class)
    ingress = serve.deployment(OpenAIIngress).options(
        name="OpenAIIngress", max_ongoing_requests=app_args.ingress_max_ongoing_requests,
        ray_actor_options=app_args.ingress_ray_actor_options,
        # An ingress removed by scale-in drains its streams too (Serve's default is 20 s:
        # longer streams were cut when it went, their channels with it).
        graceful_shutdown_timeout_s=app_args.graceful_shutdown_timeout_s,
        graceful_shutdown_wait_loop_s=app_args.graceful_shutdown_wait_loop_s,
        **app_args.ingress_scaling())
    router_reads_text = app_args.router.request_router_class not in ("prefix", "default")
    return ingress.bind(engine, app_args.model, app_args.model_name(),
                        router_reads_text=router_reads_text, **ingress_kwargs)
