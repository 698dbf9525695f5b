"""Parsers for output whose shape a grammar forced (`tool_choice` "required" or a named
function, see `grammar.py`): it is JSON from its first character, whatever the model's own
tool-call format, so these parse the JSON directly."""
from __future__ import annotations

from deployments.tool_calls.base import ToolParser
from deployments.tool_calls.call_stream import CallSection, ParsedDelta, ToolCallDelta, new_call_id


class RequiredToolParser(ToolParser):
    """`[{"name": ..., "parameters": {...}}, ...]`: one or more calls."""

    name = "required"

    def _open_section(self, marker: str) -> CallSection:
        return CallSection(self.num_calls, opener="[", separator=",", closer="]")

    def _starts_section_bare(self, text: str) -> bool:
        return text.lstrip().startswith("[")


class NamedToolParser:
    """The whole output is the arguments object of the one named function."""

    def __init__(self, function_name: str) -> None:
        self.function_name = function_name
        self.started = False

    def feed(self, text: str) -> ParsedDelta:
        if not text:
            return ParsedDelta()
        if self.started:
            return ParsedDelta(tool_calls=[ToolCallDelta(0, arguments=text)])
        self.started = True
        return ParsedDelta(tool_calls=[ToolCallDelta(0, id=new_call_id(), name=self.function_name,
                                                     arguments=text.lstrip())])

    def finish(self) -> ParsedDelta:
        if self.started:
            return ParsedDelta()
        return self.feed("{}")  # nothing was generated (max_tokens hit at once): no arguments
