"""The application's arguments (serve_config.yaml `args`), validated with pydantic."""
from __future__ import annotations

import dataclasses
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from engine.config import EngineConfig

DEFAULT_ROUTER_CLASS = "router.request_router:PrefixAwareRequestRouter"


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
    max_ongoing_requests: int = 1024  # the engine batches: Serve must not serialize requests
    ray_actor_options: dict[str, Any] = Field(default_factory=lambda: {"num_cpus": 1})
    ingress_replicas: int = 1
    ingress_ray_actor_options: dict[str, Any] = Field(default_factory=lambda: {"num_cpus": 0.1})
    router: RouterArgs = Field(default_factory=RouterArgs)
    graceful_shutdown_timeout_s: float = 30.0
    # Serve health-checks each engine replica (`EngineReplica.check_health`: the engine loop
    # and, at tp_size > 1, every rank); after 3 failures in a row it restarts the replica.
    health_check_period_s: float = 10.0
    health_check_timeout_s: float = 30.0
    # Tensor parallelism (engine.tp_size > 1): one placement group bundle per rank, each
    # `tp_bundle` (plus `ray_actor_options` for rank 0, the replica). STRICT_PACK keeps the
    # ranks on one node; PACK or SPREAD lets them cross nodes.
    placement_group_strategy: Literal["STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD"] = "STRICT_PACK"
    tp_bundle: dict[str, float] = Field(default_factory=lambda: {"GPU": 1})

    @field_validator("engine")
    @classmethod
    def _check_engine(cls, value: dict[str, Any]) -> dict[str, Any]:
        names = {f.name for f in dataclasses.fields(EngineConfig)} - {"model"}
        unknown = sorted(set(value) - names)
        if unknown:
            raise ValueError(f"unknown engine setting(s) {unknown}; known: {sorted(names)}")
        EngineConfig(**value)  # raises ValueError with the engine's own message
        return value

    @field_validator("tp_bundle")
    @classmethod
    def _check_bundle(cls, value: dict[str, float]) -> dict[str, float]:
        if not value or any(v < 0 for v in value.values()) or not any(value.values()):
            raise ValueError("tp_bundle needs at least one positive resource, e.g. {'GPU': 1}")
        return value

    @field_validator("health_check_period_s", "health_check_timeout_s", "graceful_shutdown_timeout_s")
    @classmethod
    def _positive_seconds(cls, value: float) -> float:
        if value <= 0:
            raise ValueError("must be > 0")
        return value

    @field_validator("num_replicas", "ingress_replicas")
    @classmethod
    def _positive(cls, value: int | None) -> int | None:
        if value is not None and value < 1:
            raise ValueError("must be >= 1")
        return value

    @property
    def tp_size(self) -> int:
        return int(self.engine.get("tp_size", 1))

    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        return self.model.rstrip("/").split("/")[-1] if self.model else "radixserve-demo"
