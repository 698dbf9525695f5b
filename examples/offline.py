"""Offline batch generation with the engine alone (no Ray): python examples/offline.py [MODEL_DIR]"""
import sys

from engine import LLM, SamplingParams
from engine.demo_model import ensure_demo_model

model = sys.argv[1] if len(sys.argv) > 1 else ensure_demo_model()
llm = LLM(model=model)
prompts = ["The capital of France is", "Once upon a time", "The capital of France is a city"]
for out in llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0)):
    print(f"{out.finish_reason:6} cached={out.cached_tokens:2} {out.text!r}")
print(llm.stats())
