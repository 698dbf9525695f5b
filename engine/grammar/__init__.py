"""Structured output: regex, JSON schema and EBNF constraints as per-token masks.

A constraint (`SamplingParams.regex / json_schema / ebnf / json_object`) is compiled once
against the model's vocabulary into a grammar; each constrained request gets its own
matcher of that grammar, which lives on the `Request` and advances only when a token is
appended (so a retracted request resumes with the right state). Each step, the matchers of
the batch fill a packed bitmask (1 bit per token), which becomes a bool mask on the logits'
device before sampling.

Backends: xgrammar by default; llguidance for JSON schemas and regexes that xgrammar
rejects (or as the only backend). Compiles run on a small thread pool and are cached by
constraint, so the same schema compiles once and a slow compile never runs on the step loop.

Jump-forward (SGLang's compressed FSM): when the grammar forces the next characters (the
`"name": "` between two JSON values), the engine appends their tokens at once instead of
decoding them one by one; the next step computes their KV in one chunk.

Files: `base.py` (the backend interface), `xgrammar_backend.py`, `llguidance_backend.py`,
`grammars.py` (`Grammars`, what the engine calls).
"""
from engine.grammar.grammars import BACKENDS, Grammars

__all__ = ["BACKENDS", "Grammars"]
