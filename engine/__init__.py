"""radixserve's inference engine: no Ray, no HTTP; usable alone."""
from engine.async_engine import AsyncEngine, EngineStepError
from engine.config import EngineConfig
from engine.engine import LLM, Engine, QueueFullError
from engine.outputs import RequestOutput, StreamDelta
from engine.sampling_params import SamplingParams

__all__ = ["LLM", "AsyncEngine", "Engine", "EngineConfig", "EngineStepError", "QueueFullError",
           "RequestOutput", "SamplingParams", "StreamDelta"]
