"""Llama 3.1 / 3.2 / 3.3 JSON format: the answer is the call itself,

    {"name": "get_weather", "parameters": {"city": "Paris"}}

optionally after the `<|python_tag|>` special token, several calls separated by `;`. Only
output that starts with `{` (or the tag) is taken as calls: JSON inside prose is content."""
from __future__ import annotations

from deployments.tool_calls.base import ToolParser
from deployments.tool_calls.call_stream import CallSection


class Llama3JsonToolParser(ToolParser):
    name = "llama3"
    markers = ("<|python_tag|>",)
    special_markers = ("<|python_tag|>",)

    def _open_section(self, marker: str) -> CallSection:
        return CallSection(self.num_calls, separator=";")

    def _starts_section_bare(self, text: str) -> bool:
        return text.lstrip().startswith("{")
