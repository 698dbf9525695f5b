"""The application's arguments (serve_config.yaml `args`), validated with pydantic."""
from __future__ import annotations

import dataclasses
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from deployments.request_body import DEFAULT_MAX_BODY_BYTES
from engine import EngineConfig
from router.policy import PolicyConfig

DEFAULT_ROUTER_CLASS = "router.request_router:PrefixAwareRequestRouter"
DEFAULT_MAX_QUEUED_REQUESTS = 1024  # per engine replica, when the engine config sets none
INGRESS_PER_ENGINE = 2
SERVE_DEFAULT_TARGET = 2  # Serve's default target_ongoing_requests


class RouterArgs(BaseModel):
    """Which request router Serve uses in front of the engine replicas."""

    model_config = ConfigDict(extra="forbid")
    # "prefix" = ours; "default" = Serve's power-of-two choices; or an import path.
    request_router_class: str = "prefix"
    request_router_kwargs: dict[str, Any] = Field(default_factory=dict)
    request_routing_stats_period_s: float = 1.0
    request_routing_stats_timeout_s: float = 5.0

    def to_serve(self) -> dict | None:
        if self.request_router_class == "default":
            return None
        cls = DEFAULT_ROUTER_CLASS if self.request_router_class == "prefix" else self.request_router_class
        return {"request_router_class": cls, "request_router_kwargs": self.request_router_kwargs,
                "request_routing_stats_period_s": self.request_routing_stats_period_s,
                "request_routing_stats_timeout_s": self.request_routing_stats_timeout_s}


class AppArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None  # HF model directory; None = the built-in demo model
    served_model_name: str | None = None
    engine: dict[str, Any] = Field(default_factory=dict)  # EngineConfig fields
    num_replicas: int | None = 1
    autoscaling_config: dict[str, Any] | None = None
    # Serve's cap on requests in flight per engine replica. None = the engine's capacity
    # (max_running_requests + max_queued_requests) plus slack, so that the engine, not
    # Serve's queue, is where a request over the bound is refused (503 at once).
    max_ongoing_requests: int | None = None
    ray_actor_options: dict[str, Any] = Field(default_factory=lambda: {"num_cpus": 1})
    # "split": OpenAI ingress replicas in front of the engine replicas (prefix-aware routing
    # between engines, the HTTP work on other CPUs). "colocated": each engine replica serves
    # HTTP itself, ~3 ms less per request (deployments/colocated.py); no ingress replicas and
    # no request router: `ingress_*` may not be set with it, nor a router other than "prefix"
    # (whose settings are then unused: HTTP reaches a replica through Serve's proxy or HAProxy).
    ingress: Literal["split", "colocated"] = "split"
    # Ingress replicas tokenize, decode text and frame SSE for all streams. None = two per
    # engine replica (scaling with them under autoscaling), at least two for availability.
    ingress_replicas: int | None = None
    ingress_ray_actor_options: dict[str, Any] = Field(default_factory=lambda: {"num_cpus": 0.1})
    ingress_max_ongoing_requests: int = 8192  # async and cheap per request: never the bound
    max_request_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # larger bodies get a 413
    router: RouterArgs = Field(default_factory=RouterArgs)
    # Bearer keys (deployments/auth.py); None = the ingress's RADIXSERVE_API_KEY /
    # RADIXSERVE_ADMIN_API_KEY environment variables, or no authentication. The admin key,
    # when set, is the only one /flush_cache takes.
    api_key: str | None = Field(default=None, repr=False)
    admin_api_key: str | None = Field(default=None, repr=False)
    # How tool calls and reasoning are read out of chat output: a parser name, "none" (off),
    # or None = chosen from the model's chat template and type (deployments/tool_calls/,
    # deployments/reasoning.py).
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    # How long a replica removed by scale-in (engine or ingress) may take to finish its
    # streams; keep it above the longest generation you serve.
    graceful_shutdown_timeout_s: float = 30.0
    # How often a stopping replica looks for its last request to end (Serve's own setting),
    # and so the least time any replica takes to stop: an idle one goes after one look.
    graceful_shutdown_wait_loop_s: float = 2.0
    # The engine replica's GIL switch interval (sys.setswitchinterval). Its engine thread
    # shares the GIL with the event loop that streams deltas; a thread that wants the GIL
    # waits up to this long for the holder to let go. None: Python's default (5 ms).
    gil_switch_interval_ms: float | None = None
    # Run the engine's step loop in a child process of the replica (engine/runtime/process_engine.py):
    # its own GIL, so request intake and delta sends no longer slow the steps. One more
    # process per replica (it holds the model; the replica keeps a tokenizer); tp_size 1 only.
    # "auto": on for replicas given a GPU at tp_size 1, where sharing the GIL with the
    # Serve side slowed a steady stream's decode steps by half (docs/deploy.md); off on CPUs.
    engine_process: bool | Literal["auto"] = "auto"
    # A replica fetching a prompt's prefix from the replica the router names as its holder
    # (deployments/prefix_fetch.py; needs engine.host_kv_cache_gb > 0) gives up after this
    # long and computes the prefix instead.
    prefix_fetch_timeout_s: float = Field(default=10.0, gt=0)
    # Serve health-checks each engine replica (`EngineReplica.check_health`: the engine loop
    # and, at tp_size > 1, every rank); after 3 failures in a row it restarts the replica.
    health_check_period_s: float = 10.0
    health_check_timeout_s: float = 30.0
    # Tensor parallelism (engine.tp_size > 1): one placement group bundle per rank, each
    # `tp_bundle` (plus `ray_actor_options` for rank 0, the replica). STRICT_PACK keeps the
    # ranks on one node; PACK or SPREAD lets them cross nodes.
    placement_group_strategy: Literal["STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD"] = "STRICT_PACK"
    tp_bundle: dict[str, float] = Field(default_factory=lambda: {"GPU": 1})
    # LoRA adapters served at start ({name: PEFT folder}), and the folder adapters named
    # by requests load from on first use (`<dir>/<name>`): the engine's settings of these
    # names, here at the top level as vLLM's and Ray Serve LLM's configs have them.
    lora_modules: dict[str, str] | None = None
    lora_dynamic_path: str | None = None

    @field_validator("engine")
    @classmethod
    def _check_engine(cls, value: dict[str, Any]) -> dict[str, Any]:
        names = {f.name for f in dataclasses.fields(EngineConfig)} - {"model"}
        unknown = sorted(set(value) - names)
        if unknown:
            raise ValueError(f"unknown engine setting(s) {unknown}; known: {sorted(names)}")
        EngineConfig(**value)  # raises ValueError with the engine's own message
        return value

    @field_validator("tool_call_parser", "reasoning_parser")
    @classmethod
    def _known_parser(cls, value: str | None, info) -> str | None:
        from deployments.reasoning import PARSERS as REASONING
        from deployments.tool_calls import PARSERS as TOOLS

        known = sorted(TOOLS if info.field_name == "tool_call_parser" else REASONING)
        if value not in (None, "none", *known):
            raise ValueError(f"unknown {info.field_name} {value!r}; known: {known}, 'none'")
        return value

    @field_validator("tp_bundle")
    @classmethod
    def _check_bundle(cls, value: dict[str, float]) -> dict[str, float]:
        if not value or any(v < 0 for v in value.values()) or not any(value.values()):
            raise ValueError("tp_bundle needs at least one positive resource, e.g. {'GPU': 1}")
        return value

    @field_validator("health_check_period_s", "health_check_timeout_s", "graceful_shutdown_timeout_s",
                     "graceful_shutdown_wait_loop_s")
    @classmethod
    def _positive_seconds(cls, value: float) -> float:
        if value <= 0:
            raise ValueError("must be > 0")
        return value

    @field_validator("gil_switch_interval_ms")
    @classmethod
    def _switch_interval(cls, value: float | None) -> float | None:
        if value is not None and not 0.01 <= value <= 100:
            raise ValueError("must be between 0.01 and 100 (milliseconds)")
        return value

    @field_validator("num_replicas", "ingress_replicas", "max_request_body_bytes")
    @classmethod
    def _positive(cls, value: int | None) -> int | None:
        if value is not None and value < 1:
            raise ValueError("must be >= 1")
        return value

    @model_validator(mode="after")
    def _engine_process_at_tp_1(self) -> AppArgs:
        if self.engine_process is True and self.tp_size > 1:
            raise ValueError("engine_process: true does not support engine.tp_size > 1 yet; "
                             "leave engine_process unset at tensor parallelism")
        return self

    @model_validator(mode="after")
    def _colocated_has_no_ingress_or_router(self) -> AppArgs:
        if self.ingress == "colocated":
            unused = sorted(self.model_fields_set & {"ingress_replicas", "ingress_ray_actor_options",
                                                     "ingress_max_ongoing_requests"})
            if self.router.request_router_class != "prefix":  # the default's settings may stay
                unused.append("router")
            if unused:
                raise ValueError(f"ingress: colocated has no ingress replicas and no request router; "
                                 f"remove {unused} (or use ingress: split)")
        return self

    @model_validator(mode="after")
    def _lora_into_engine(self) -> AppArgs:
        lora = {k: v for k, v in (("lora_modules", self.lora_modules),
                                  ("lora_dynamic_path", self.lora_dynamic_path)) if v is not None}
        if lora:
            self.engine = {**self.engine, **lora}
            EngineConfig(**self.engine)
        return self

    @model_validator(mode="after")
    def _bounded_engine_queue(self) -> AppArgs:
        if not self.engine.get("max_queued_requests"):
            self.engine = {**self.engine, "max_queued_requests": DEFAULT_MAX_QUEUED_REQUESTS}
        if self.max_ongoing_requests is not None and self.max_ongoing_requests < self.engine_capacity:
            raise ValueError(f"max_ongoing_requests ({self.max_ongoing_requests}) is below the "
                             f"engine's capacity ({self.engine_capacity} = max_running_requests "
                             "+ max_queued_requests): Serve would queue requests the engine "
                             "has room for; raise it or leave it unset")
        return self

    @model_validator(mode="after")
    def _router_spreads_onto_new_replicas(self) -> AppArgs:
        """Under autoscaling, the prefix router's imbalance threshold stays below the target.

        Serve adds a replica when the replicas average more than `target_ongoing_requests`;
        the router moves a request off its prefix's replica only when that replica is more
        than `abs_threshold` requests over the fair share (router/policy.py). With the
        threshold at or above the target, a hot replica keeps every request of the prefixes
        it holds and the new, empty replicas get none
        (tests/test_autoscaling.py saw 0 of 102 requests reach two new replicas with the
        default 16 against a target of 2)."""
        if self.autoscaling_config is None or self.router.request_router_class != "prefix":
            return self
        target = self.autoscaling_config.get("target_ongoing_requests", SERVE_DEFAULT_TARGET)
        kwargs = self.router.request_router_kwargs
        if "abs_threshold" not in kwargs:
            kwargs["abs_threshold"] = min(PolicyConfig.abs_threshold, target / 2)
        elif kwargs["abs_threshold"] >= target:
            raise ValueError(f"router abs_threshold ({kwargs['abs_threshold']}) must be below the "
                             f"autoscaling target_ongoing_requests ({target}), or new replicas "
                             "get no requests while their peers hold the prefixes")
        return self

    @property
    def freeze_gc(self) -> bool:
        """The engine's freeze_gc_after_start, which the app's ingress replicas follow too."""
        return EngineConfig(**self.engine).freeze_gc_after_start

    @property
    def engine_batch(self) -> int:
        """Requests an engine replica runs at once (max_running_requests)."""
        return self.engine.get("max_running_requests", EngineConfig.max_running_requests)

    @property
    def engine_capacity(self) -> int:
        return self.engine_batch + self.engine["max_queued_requests"]

    def engine_max_ongoing(self) -> int:
        # Slack: refused requests leave at once, but briefly count against Serve's cap.
        return self.max_ongoing_requests or self.engine_capacity + max(16, self.engine_capacity // 8)

    def ingress_scaling(self) -> dict[str, Any]:
        """`num_replicas` or `autoscaling_config` options of the ingress deployment."""
        if self.ingress_replicas is not None:
            return {"num_replicas": self.ingress_replicas}
        if self.autoscaling_config is None:
            return {"num_replicas": max(2, INGRESS_PER_ENGINE * (self.num_replicas or 1))}
        auto = self.autoscaling_config
        lo = auto.get("min_replicas", 1)
        hi = auto.get("max_replicas", lo)
        # An ingress replica's ongoing requests are HTTP requests, about the engine calls it
        # makes: at half the engine's target, the ingress count follows two per engine
        # replica under the same load (a target of the engine's capacity kept it at its
        # minimum until the engine replicas were far past their own target).
        target = auto.get("target_ongoing_requests", SERVE_DEFAULT_TARGET) / INGRESS_PER_ENGINE
        timing = {k: auto[k] for k in ("upscale_delay_s", "downscale_delay_s", "look_back_period_s",
                                       "metrics_interval_s") if k in auto}
        return {"num_replicas": "auto", "autoscaling_config": {
            "min_replicas": max(2, INGRESS_PER_ENGINE * lo), "max_replicas": max(2, INGRESS_PER_ENGINE * hi),
            "target_ongoing_requests": target, **timing}}

    @property
    def tp_size(self) -> int:
        return int(self.engine.get("tp_size", 1))

    @property
    def use_engine_process(self) -> bool:
        """`engine_process` resolved: "auto" means a GPU replica at tp_size 1."""
        if self.engine_process != "auto":
            return bool(self.engine_process)
        return self.tp_size == 1 and float(self.ray_actor_options.get("num_gpus") or 0) > 0

    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        return self.model.rstrip("/").split("/")[-1] if self.model else "radixserve-demo"
