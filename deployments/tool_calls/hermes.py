"""Hermes format, used by Qwen2.5 and Qwen3 (and NousResearch Hermes):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

one block per call, text may come before or after."""
from __future__ import annotations

from deployments.tool_calls.base import ToolParser
from deployments.tool_calls.call_stream import CallSection


class HermesToolParser(ToolParser):
    name = "hermes"
    markers = ("<tool_call>",)

    def _open_section(self, marker: str) -> CallSection:
        return CallSection(self.num_calls, closer="</tool_call>")
