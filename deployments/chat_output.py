"""One chat choice's output text -> reasoning, content and tool calls, as it streams.

The reasoning parser (if any) runs first: only the text after `</think>` can hold tool
calls. The non-streamed response feeds the whole text through the same object, so the
streamed deltas concatenate to exactly what the non-streamed message says.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from deployments.protocol_responses import DeltaFunctionCall, DeltaToolCall, FunctionCall, ToolCall
from deployments.reasoning import ReasoningParser
from deployments.tool_calls import ParsedDelta, ToolCallDelta


@dataclass
class OutputDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def wire_tool_calls(self) -> list[DeltaToolCall] | None:
        return [DeltaToolCall(index=d.index, id=d.id, type="function" if d.id else None,
                              function=DeltaFunctionCall(name=d.name, arguments=d.arguments))
                for d in self.tool_calls] or None


class ChatOutput:
    def __init__(self, reasoning: ReasoningParser | None, tools, echo: str = "") -> None:
        self.reasoning_parser = reasoning
        self.tool_parser = tools  # a ToolParser, a NamedToolParser, or None
        self.echo = echo  # content ahead of the model's (the request's `echo`), not parsed
        self.reasoning: list[str] = []
        self.content: list[str] = []
        self.calls: dict[int, list] = {}  # index -> [id, name, arguments]

    def feed(self, text: str, final: bool = False) -> OutputDelta:
        out = OutputDelta(content=self.echo)
        self.echo = ""
        if self.reasoning_parser is None:
            self._content(out, text)
        else:
            r = self.reasoning_parser.feed(text)
            out.reasoning = r.reasoning
            self._content(out, r.content)
        if final:
            self._finish(out)
        self._record(out)
        return out

    def _content(self, out: OutputDelta, text: str) -> None:
        if self.tool_parser is None:
            out.content += text
        elif text:
            self._take(out, self.tool_parser.feed(text))

    def _finish(self, out: OutputDelta) -> None:
        if self.reasoning_parser is not None:
            r = self.reasoning_parser.finish()
            out.reasoning += r.reasoning
            self._content(out, r.content)
        if self.tool_parser is not None:
            self._take(out, self.tool_parser.finish())

    @staticmethod
    def _take(out: OutputDelta, parsed: ParsedDelta) -> None:
        out.content += parsed.content
        out.tool_calls += parsed.tool_calls

    def _record(self, out: OutputDelta) -> None:
        self.reasoning.append(out.reasoning)
        self.content.append(out.content)
        for d in out.tool_calls:
            call = self.calls.setdefault(d.index, [d.id, d.name, ""])
            call[2] += d.arguments

    # -- the whole message --------------------------------------------------------------

    @property
    def has_tool_calls(self) -> bool:
        return bool(self.calls)

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """A stop that produced calls is OpenAI's "tool_calls"."""
        return "tool_calls" if engine_reason == "stop" and self.calls else engine_reason

    def message_fields(self) -> dict:
        reasoning, content = "".join(self.reasoning), "".join(self.content)
        calls = [ToolCall(id=c[0], function=FunctionCall(name=c[1], arguments=c[2]))
                 for _, c in sorted(self.calls.items())]
        return {"content": content if content or not (calls or reasoning) else None,
                "reasoning_content": reasoning or None, "tool_calls": calls or None}
