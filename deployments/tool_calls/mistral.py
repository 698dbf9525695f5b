"""Mistral formats. v0.3 tokenizers: a special token, then a JSON array of calls:

    [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]

tekken v11+ tokenizers (Mistral Small 3.2, Magistral, Devstral): one marker per call, the
name, another special token, then the arguments object:

    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{"tz": "UTC"}

Which one follows is told by the first character after `[TOOL_CALLS]`. Both markers are
special tokens, which skip_special_tokens would drop: the chat plan lists
`special_markers`, and the ingress's detokenizer writes those (only those) out."""
from __future__ import annotations

import re

from deployments.tool_calls.base import ToolParser
from deployments.tool_calls.call_stream import CallSection, ToolCallDelta, new_call_id
from deployments.tool_calls.json_scan import ObjectScanner

ARGS = "[ARGS]"
_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")  # what a function name may be, in full
_MAX_NAME = 64


class MistralToolParser(ToolParser):
    name = "mistral"
    markers = ("[TOOL_CALLS]",)
    special_markers = ("[TOOL_CALLS]", ARGS)

    def _open_section(self, marker: str):
        return _MistralSection(self.num_calls)


class _MistralSection:
    """After `[TOOL_CALLS]`: an array of calls (v0.3), or `name[ARGS]{...}` (v11)."""

    def __init__(self, first_index: int) -> None:
        self.next_index = first_index
        self.form: CallSection | _NamedCall | None = None
        self.leftover = ""
        self.head = ""  # text before the form is known

    def feed(self, text: str) -> tuple[list[ToolCallDelta], str | None]:
        if self.form is None:
            self.head += text
            body = self.head.lstrip()
            if not body:
                return [], None
            self.form = (CallSection(self.next_index, opener="[", separator=",", closer="]")
                         if body[0] == "[" else _NamedCall(self.next_index))
            text = body
        deltas, rest = self.form.feed(text)
        self._sync()
        return deltas, rest

    def finish(self) -> list[ToolCallDelta]:
        deltas = self.form.finish() if self.form is not None else []
        self._sync()
        return deltas

    def _sync(self) -> None:
        if self.form is not None:
            self.next_index, self.leftover = self.form.next_index, self.form.leftover


class _NamedCall:
    """One `name[ARGS]{...}` call: the name once `[ARGS]` ends it, then the arguments'
    raw text as it grows. Text that is not a name and `[ARGS]` is handed back as content."""

    def __init__(self, index: int) -> None:
        self.next_index = index
        self.head = ""  # the text before [ARGS]
        self.scanner: ObjectScanner | None = None
        self.sent = 0  # characters of the scanner's text handled (sent or skipped)
        self.has_arguments = False
        self.leftover = ""

    def feed(self, text: str) -> tuple[list[ToolCallDelta], str | None]:
        out: list[ToolCallDelta] = []
        if self.scanner is None:
            self.head += text
            at = self.head.find(ARGS)
            if at < 0:  # still the name, unless it cannot be one
                return out, (self.head if len(self.head) > _MAX_NAME + len(ARGS) else None)
            name, text = self.head[:at].strip(), self.head[at + len(ARGS):]
            if not _NAME.fullmatch(name):
                return out, self.head
            self.scanner = ObjectScanner()
            out.append(ToolCallDelta(self.next_index, id=new_call_id(), name=name))
        try:
            rest = self.scanner.feed(text)
        except ValueError:  # the arguments are not an object: the call ends here
            out += self.finish()
            return out, self.scanner.text[self.sent:]
        self._arguments(out)
        if not self.scanner.done:
            return out, None
        self.next_index += 1
        return out, rest

    def finish(self) -> list[ToolCallDelta]:
        """The text ended (or left the call): send what is left of it."""
        if self.scanner is None:
            self.leftover = self.head  # no [ARGS]: it was text
            return []
        out: list[ToolCallDelta] = []
        if not self.has_arguments:
            out.append(ToolCallDelta(self.next_index, arguments="{}"))
        self.next_index += 1
        return out

    def _arguments(self, out: list[ToolCallDelta]) -> None:
        text = self.scanner.text
        if not self.has_arguments:  # whitespace before the object is not the arguments'
            self.sent = len(text) - len(text.lstrip())
        end = self.scanner.end if self.scanner.done else len(text)
        piece, self.sent = text[self.sent:end], max(self.sent, end)
        if not piece:
            return
        self.has_arguments = True
        if out and out[-1].index == self.next_index:
            out[-1].arguments += piece
        else:
            out.append(ToolCallDelta(self.next_index, arguments=piece))
