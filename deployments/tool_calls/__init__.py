"""Tool-call parsers: model output text -> content + tool calls, streamed or whole.

`base.py` (the streaming state machine), `call_stream.py` (one call, a run of calls),
`json_scan.py` (incremental JSON object scanning), one file per model format (`hermes.py`,
`llama3.py`, `mistral.py`, `qwen3_coder.py`, `pythonic.py`), `forced.py` (output shaped by tool_choice's grammar) and
`grammar.py` (that grammar, from the function schemas).
"""
from __future__ import annotations

from deployments.tool_calls.base import ToolParser
from deployments.tool_calls.call_stream import ParsedDelta, ToolCallDelta
from deployments.tool_calls.forced import NamedToolParser, RequiredToolParser
from deployments.tool_calls.hermes import HermesToolParser
from deployments.tool_calls.llama3 import Llama3JsonToolParser
from deployments.tool_calls.mistral import MistralToolParser
from deployments.tool_calls.pythonic import PythonicToolParser
from deployments.tool_calls.qwen3_coder import Qwen3CoderToolParser

# App argument `tool_call_parser` -> parser class (the names vLLM and SGLang use).
PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser, "qwen25": HermesToolParser, "qwen3": HermesToolParser,
    "qwen": HermesToolParser, "llama3": Llama3JsonToolParser, "mistral": MistralToolParser,
    "qwen3_coder": Qwen3CoderToolParser, "pythonic": PythonicToolParser,
}


def detect_tool_parser(model_type: str, chat_template: str | None) -> str | None:
    """The parser for a model: first from what its chat template writes (the template is
    what taught the model the format), then from its architecture; None when unknown."""
    template = chat_template or ""
    if "<function=" in template and "<parameter=" in template:
        return "qwen3_coder"  # its template writes <tool_call> too: checked first
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_start|>" in template or "func_name1(" in template:
        return "pythonic"  # Llama 4; Llama 3.2's pythonic template
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3"
    if "tools" not in template:
        return "hermes"  # deployments/chat_render.py describes the tools in Hermes' format
    return {"qwen2": "hermes", "qwen3": "hermes", "qwen2_moe": "hermes", "qwen3_moe": "hermes",
            "mistral": "mistral", "mixtral": "mistral"}.get(model_type)


def tool_parser(name: str, tools: list[dict] | None = None) -> ToolParser:
    """`tools`: the request's functions ({name, parameters, ...})."""
    if name not in PARSERS:
        raise ValueError(f"unknown tool_call_parser {name!r}; known: {sorted(PARSERS)}")
    return PARSERS[name](tools)


__all__ = ["PARSERS", "NamedToolParser", "ParsedDelta", "RequiredToolParser", "ToolCallDelta",
           "ToolParser", "detect_tool_parser", "tool_parser"]
