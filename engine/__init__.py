"""radixserve's inference engine: no Ray, no HTTP; usable alone.

`__all__` is the engine's public API: what the serving layer (deployments/) may import,
as `from engine import <name>` (tests/test_layering.py checks it). Everything else in the
package is internal to the engine.
"""
from engine.runtime.async_engine import AsyncEngine
from engine.runtime.step_report import EngineStepError
from engine.config import EngineConfig
from engine.loading.demo_model import ensure_demo_model
from engine.executor.distributed import init_tp, open_rendezvous
from engine.runtime.engine import Engine
from engine.core.queue_deadlines import QueueFullError
from engine.runtime.llm import LLM
from engine.runtime.pooling_engine import PoolingEngine
from engine.runtime.pooling_requests import (
    AsyncPooling, PoolingQueueFull, embedding_inputs, pair_inputs,
)
from engine.runtime.engine_client import EngineClient
from engine.runtime.gc_freeze import freeze_after_start
from engine.lora import LoRAError, LoRANotFoundError
from engine.loading.hf_config import load_hf_config, resolve_device
from engine.core.outputs import RequestOutput, StreamDelta, WireBatch, WireDelta, wire_of
from engine.runtime.process_engine import EngineProcessError, ProcessAsyncEngine
from engine.runtime.prefix_exchange import ExportedPrefix
from engine.core.queue_deadlines import QueueTimeoutError
from engine.core.request import validate_request
from engine.core.sampling_params import SamplingParams
from engine.runtime.step_report import StepReport
from engine.loading.tokenizer import ChatPrompt, IncrementalDetokenizer, Tokenizer
from engine.runtime.tp_worker import run_worker
from engine.executor.startup_timer import process_age_s

__all__ = [
    # running the engine
    "LLM", "AsyncEngine", "Engine", "EngineConfig", "EngineStepError", "QueueFullError",
    "QueueTimeoutError",
    "ensure_demo_model",
    # what a server holds of an engine (deployments/engine_replica.py): AsyncEngine, or
    # the engine in a process of its own
    "EngineClient", "ProcessAsyncEngine", "EngineProcessError", "StepReport",
    # the pooling tasks (task embed / score): the engine, its server-side batcher, inputs
    "PoolingEngine", "AsyncPooling", "PoolingQueueFull", "embedding_inputs", "pair_inputs",
    # requests and outputs
    "RequestOutput", "SamplingParams", "StreamDelta", "validate_request",
    # LoRA adapters: one that cannot serve (load), one a request names that is not loaded
    "LoRAError", "LoRANotFoundError",
    # a delta as a server forwards it (AsyncEngine.stream_to(..., wire=True))
    "WireBatch", "WireDelta", "wire_of",
    # text: tokenizer, chat rendering (`Tokenizer.render_chat`), streamed detokenizing
    "ChatPrompt", "IncrementalDetokenizer", "Tokenizer", "load_hf_config",
    # tensor parallelism across processes the caller starts (deployments/tp_workers.py)
    "init_tp", "open_rendezvous", "resolve_device", "run_worker",
    # a server process's own start-up: full garbage collections skip what is alive by then
    "freeze_after_start",
    # start-up logs: seconds since this process started (imports included)
    "process_age_s",
    # a cached prefix's KV as one replica hands it to another (host tier to host tier)
    "ExportedPrefix",
]
