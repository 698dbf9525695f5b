"""Streaming tool calls out of JSON text: one call (`CallStream`) and a run of calls
between two delimiters (`CallSection`).

A call's name is sent once it is complete; its arguments are sent as their raw JSON text,
piece by piece as it grows. The non-streamed response runs the very same code over the
whole text, so streamed pieces always concatenate to the non-streamed arguments.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from deployments.tool_calls.json_scan import ObjectScanner

ARGUMENT_KEYS = ("arguments", "parameters")  # Hermes/Qwen/Mistral say arguments, Llama 3 parameters


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCallDelta:
    """A piece of tool call `index`: the first piece carries id and name."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class ParsedDelta:
    """What one piece of model text means: plain content and tool-call pieces."""

    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def extend(self, other: ParsedDelta) -> ParsedDelta:
        self.content += other.content
        self.tool_calls += other.tool_calls
        return self


class CallStream:
    """One `{"name": ..., "arguments": {...}}` object as it is written."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.scanner = ObjectScanner()
        self.named = False
        self.sent = 0  # characters of the arguments' raw text sent so far

    @property
    def done(self) -> bool:
        return self.scanner.done

    def feed(self, text: str) -> tuple[list[ToolCallDelta], str]:
        """Deltas for `text`, and the text after the object (once it ended)."""
        rest = self.scanner.feed(text)
        return self._deltas(final=self.done), rest

    def finish(self) -> list[ToolCallDelta]:
        """The text ended (maybe mid-object): send what is left."""
        return self._deltas(final=True)

    @property
    def is_call(self) -> bool:
        """False for a finished object without a "name": it was not a tool call."""
        return self.named or not self.done

    def _deltas(self, final: bool) -> list[ToolCallDelta]:
        out = []
        if not self.named:
            name = self._name()
            if name is None:
                return out
            self.named = True
            out.append(ToolCallDelta(self.index, id=new_call_id(), name=name))
        args = self._new_arguments(final)
        if args:
            if out:
                out[0].arguments = args
            else:
                out.append(ToolCallDelta(self.index, arguments=args))
        return out

    def _name(self) -> str | None:
        if not self.scanner.complete("name"):
            return None
        name = json.loads(self.scanner.value("name"))
        return name if isinstance(name, str) else str(name)

    def _new_arguments(self, final: bool) -> str:
        key = next((k for k in ARGUMENT_KEYS if k in self.scanner.spans), None)
        if key is None:  # a call without arguments: "{}" once it is known there are none
            if final and self.sent == 0:
                self.sent = 2
                return "{}"
            return ""
        raw = self.scanner.value(key)
        if raw.startswith('"'):  # arguments written as a JSON string: send its text whole
            if not self.scanner.complete(key) or self.sent:
                return ""
            self.sent = len(raw)
            return json.loads(raw)
        piece, self.sent = raw[self.sent:], len(raw)
        return piece


class CallSection:
    """Calls between an `opener` and a `closer`, separated by `separator`: Mistral's
    `[{...}, {...}]`, Llama 3's `{...}; {...}` (no closer: runs to the end), one Hermes
    `{...}</tool_call>`. Anything unexpected between calls ends the section."""

    def __init__(self, first_index: int, opener: str = "", separator: str = "",
                 closer: str = "") -> None:
        self.next_index = first_index
        self.opener, self.separator, self.closer = opener, separator, closer
        self.opened = not opener
        self.call: CallStream | None = None
        self.pending = ""  # text between calls not yet understood
        self.done = False
        self.leftover = ""  # raw text of objects that were not calls

    def feed(self, text: str) -> tuple[list[ToolCallDelta], str | None]:
        """Deltas, and the text after the section (None while it goes on)."""
        out: list[ToolCallDelta] = []
        while text and not self.done:
            if self.call is not None:
                deltas, text = self.call.feed(text)
                out += deltas
                if not self.call.done:
                    return out, None
                self._end_call()
                continue
            text = self._between(self.pending + text)
        return out, (text if self.done else None)

    def finish(self) -> list[ToolCallDelta]:
        if self.call is None:
            return []
        out = self.call.finish()
        self._end_call()
        return out

    def _end_call(self) -> None:
        if self.call.is_call:
            self.next_index += 1
        else:
            self.leftover += self.call.scanner.text
        self.call = None

    def _between(self, text: str) -> str:
        """Consume delimiters; returns the text for the next call (or after the section)."""
        self.pending = ""
        body = text.lstrip()
        if not body:
            return ""
        if not self.opened:
            if body[0] != self.opener:
                return self._close(body)
            self.opened = True
            return body[1:]
        if self.closer and body.startswith(self.closer):
            return self._close(body[len(self.closer):])
        if self.closer and self.closer.startswith(body):
            self.pending = body  # maybe the start of the closer
            return ""
        if self.separator and body[0] == self.separator:
            return body[1:]
        if body[0] == "{":
            self.call = CallStream(self.next_index)
            return body
        return self._close(body)

    def _close(self, rest: str) -> str:
        self.done = True
        return rest
