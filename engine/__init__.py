"""radixserve's inference engine: no Ray, no HTTP; usable alone.

`__all__` is the engine's public API: what the serving layer (deployments/) may import,
as `from engine import <name>` (tests/test_layering.py checks it). Everything else in the
package is internal to the engine.

Each name is imported from its module on first use (PEP 562), not when the package is:
a server process that needs only the light names (requests, outputs, errors, the config)
never imports torch, transformers or Triton, and starts the engine's process sooner
(docs/deploy.md, "Start-up"). `tests/test_startup_imports.py` keeps it so.
"""
from __future__ import annotations

import importlib
from typing import Any

# public name -> the module that defines it
_EXPORTS = {
    # running the engine
    "LLM": "engine.runtime.llm",
    "AsyncEngine": "engine.runtime.async_engine",
    "Engine": "engine.runtime.engine",
    "EngineConfig": "engine.config",
    "EngineStepError": "engine.runtime.step_report",
    "QueueFullError": "engine.core.queue_deadlines",
    "QueueTimeoutError": "engine.core.queue_deadlines",
    "ensure_demo_model": "engine.loading.demo_model",
    # what a server holds of an engine (deployments/engine_replica.py): AsyncEngine, or
    # the engine in a process of its own
    "EngineClient": "engine.runtime.engine_client",
    "ProcessAsyncEngine": "engine.runtime.process_engine",
    "EngineProcessError": "engine.runtime.engine_process_main",
    "StepReport": "engine.runtime.step_report",
    # the pooling tasks (task embed / score): the engine, its server-side batcher, inputs
    "PoolingEngine": "engine.runtime.pooling_engine",
    "AsyncPooling": "engine.runtime.pooling_requests",
    "PoolingQueueFull": "engine.runtime.pooling_requests",
    "embedding_inputs": "engine.runtime.pooling_requests",
    "pair_inputs": "engine.runtime.pooling_requests",
    # requests and outputs
    "RequestOutput": "engine.core.outputs",
    "SamplingParams": "engine.core.sampling_params",
    "StreamDelta": "engine.core.outputs",
    "validate_request": "engine.core.request",
    # LoRA adapters: one that cannot serve (load), one a request names that is not loaded
    "LoRAError": "engine.lora",
    "LoRANotFoundError": "engine.lora",
    # a delta as a server forwards it (AsyncEngine.stream_to(..., wire=True))
    "WireBatch": "engine.core.outputs",
    "WireDelta": "engine.core.outputs",
    "wire_of": "engine.core.outputs",
    # text: tokenizer, chat rendering (`Tokenizer.render_chat`), streamed detokenizing
    "ChatPrompt": "engine.loading.tokenizer",
    "IncrementalDetokenizer": "engine.loading.tokenizer",
    "Tokenizer": "engine.loading.tokenizer",
    "load_hf_config": "engine.loading.hf_config",
    "resolve_model_path": "engine.loading.model_source",  # package:, Hub ID or path -> local path
    # tensor parallelism across processes the caller starts (deployments/tp_workers.py)
    "init_tp": "engine.executor.distributed",
    "open_rendezvous": "engine.executor.distributed",
    "resolve_device": "engine.loading.hf_config",
    "run_worker": "engine.runtime.tp_worker",
    # a server process's own start-up: full garbage collections skip what is alive by then
    "freeze_after_start": "engine.runtime.gc_freeze",
    # start-up logs: seconds since this process started (imports included)
    "process_age_s": "engine.executor.startup_timer",
    # a cached prefix's KV as one replica hands it to another (host tier to host tier)
    "ExportedPrefix": "engine.runtime.prefix_exchange",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    """`engine.<name>` (and `from engine import <name>`): imported from its module once."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
