"""Look inside one Serve deployment's replicas, one by one (tests, benchmarks, debugging).

Tooling, not part of the shipped package: tests import it as
`scripts.serve_replicas`, scripts as `serve_replicas`. Its hand-built Serve request uses
a Ray internal (RequestMetadata); tests/test_ray_adapter.py checks it with the adapter's.

A deployment handle lets the router pick the replica; sometimes we need a particular one:
to see which prompts its radix cache holds (its routing stats carry the `CacheDigest`) or
to read its engine counters. Serve names every replica actor
`SERVE_REPLICA::<app>#<deployment>#<unique id>` in the "serve" namespace, and the replica
actor answers `record_routing_stats()` directly. Calling any other user method on one
replica goes through the actor's `handle_request` entry point with Serve's request
metadata, an internal interface (checked against Ray 2.60).

    replicas = list_replicas("radixserve", "EngineReplica")      # {unique_id: actor}
    stats = routing_stats(replicas)                              # {unique_id: dict}
    held = holds_prefix(stats, prompt_ids[:192])                 # {unique_id: bool}
    counters = call_each(replicas, "stats")                      # {unique_id: result}
    items = stream_replica(replicas[rid], "generate", call)     # a streamed call's items
    pids = replica_pids(replicas)                                # {unique_id: pid}
"""
from __future__ import annotations

import pickle
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import ray

from router.cache_digest import decode_digest
from router.prefix_index import block_hashes

SERVE_NAMESPACE = "serve"
REPLICA_PREFIX = "SERVE_REPLICA::"


def list_replicas(app: str, deployment: str) -> dict[str, Any]:
    """{replica unique id: actor handle} of the live replicas of `app`'s `deployment`."""
    prefix = f"{REPLICA_PREFIX}{app}#{deployment}#"
    out: dict[str, Any] = {}
    for entry in ray.util.list_named_actors(all_namespaces=True):
        name, namespace = entry["name"], entry["namespace"]
        if namespace == SERVE_NAMESPACE and name.startswith(prefix):
            out[name[len(prefix):]] = ray.get_actor(name, namespace=SERVE_NAMESPACE)
    return out


def routing_stats(replicas: Mapping[str, Any], timeout: float = 30.0) -> dict[str, dict]:
    """Each replica's `record_routing_stats()` (fresh: computed now, not the last broadcast)."""
    keys = list(replicas)
    results = ray.get([replicas[k].record_routing_stats.remote() for k in keys], timeout=timeout)
    return dict(zip(keys, results))


def held_hashes(stats: Mapping[str, Any]) -> set[int]:
    """The block hashes one replica's routing stats say its radix cache holds."""
    raw = stats.get("cache_digest")
    return set(decode_digest(raw).hashes) if raw else set()


def cached_blocks(stats: Mapping[str, Any], token_ids: Sequence[int], block_size: int = 16) -> int:
    """How many leading full blocks of `token_ids` this replica's cache holds."""
    held = held_hashes(stats)
    n = 0
    for h in block_hashes(token_ids, block_size):
        if h not in held:
            break
        n += 1
    return n


def holds_prefix(all_stats: Mapping[str, Mapping[str, Any]], token_ids: Sequence[int],
                 block_size: int = 16) -> dict[str, bool]:
    """{replica: does its cache hold every full block of `token_ids`}."""
    want = len(token_ids) // block_size
    return {rid: cached_blocks(s, token_ids, block_size) >= want for rid, s in all_stats.items()}


def call_replica(actor: Any, method: str, *args: Any, **kwargs: Any):
    """An ObjectRef of `method(*args, **kwargs)` run on this very replica (unary methods)."""
    from ray.serve._private.common import RequestMetadata

    rid = uuid.uuid4().hex
    metadata = RequestMetadata(request_id=rid, internal_request_id=rid, call_method=method)
    return actor.handle_request.remote(pickle.dumps(metadata), *args, **kwargs)


def stream_replica(actor: Any, method: str, *args: Any, timeout: float = 60.0) -> list:
    """Every item of the streaming `method(*args)` run on this very replica (a generator
    method, such as an engine replica's `generate`), as Serve's router sends it."""
    from ray.serve._private.common import RequestMetadata

    rid = uuid.uuid4().hex
    metadata = RequestMetadata(request_id=rid, internal_request_id=rid, call_method=method,
                               is_streaming=True)
    refs = actor.handle_request_streaming.options(num_returns="streaming").remote(
        pickle.dumps(metadata), *args)
    return [ray.get(ref, timeout=timeout) for ref in refs]


def call_each(replicas: Mapping[str, Any], method: str, *args: Any, timeout: float = 30.0,
              **kwargs: Any) -> dict[str, Any]:
    """{replica: result of `method`} for every replica."""
    keys = list(replicas)
    refs = [call_replica(replicas[k], method, *args, **kwargs) for k in keys]
    return dict(zip(keys, ray.get(refs, timeout=timeout)))


def _getpid(_actor_self: Any) -> int:
    import os

    return os.getpid()


def replica_pids(replicas: Mapping[str, Any], timeout: float = 30.0) -> dict[str, int]:
    """{replica: its process id} (for per-process measurements on the same machine)."""
    keys = list(replicas)
    pids = ray.get([replicas[k].__ray_call__.remote(_getpid) for k in keys], timeout=timeout)
    return dict(zip(keys, pids))
