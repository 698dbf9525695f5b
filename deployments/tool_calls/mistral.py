"""Mistral format (v0.3 tokenizers): a special token, then a JSON array of calls:

    [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]

`[TOOL_CALLS]` is a special token, which skip_special_tokens would drop: the chat plan
lists `special_markers`, and the ingress's detokenizer writes those (only those) out.
(The newer `[TOOL_CALLS]name[ARGS]{...}` form of tekken v11+ tokenizers is not handled.)"""
from __future__ import annotations

from deployments.tool_calls.base import ToolParser
from deployments.tool_calls.call_stream import CallSection


class MistralToolParser(ToolParser):
    name = "mistral"
    markers = ("[TOOL_CALLS]",)
    special_markers = ("[TOOL_CALLS]",)

    def _open_section(self, marker: str) -> CallSection:
        return CallSection(self.num_calls, opener="[", separator=",", closer="]")
