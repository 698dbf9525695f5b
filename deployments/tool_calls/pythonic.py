"""Pythonic format (Llama 3.2 with its pythonic template, Llama 4): the answer is a Python
list of calls with keyword arguments, optionally between `<|python_start|>` and
`<|python_end|>`:

    [get_weather(city="Paris", unit="celsius"), get_time(tz="UTC")]

Only output that starts with `[name(` (or the tag) is taken as calls. Each call is sent,
name and JSON arguments, once its closing parenthesis arrives; a list that does not parse
as calls is content."""
from __future__ import annotations

import ast
import json
import re
from typing import Any

from deployments.tool_calls.base import ToolParser
from deployments.tool_calls.call_stream import ToolCallDelta, new_call_id

START, END = "<|python_start|>", "<|python_end|>"
_OPENING = re.compile(r"\[\s*[A-Za-z_][\w.]*\s*\(")
_OPENING_SO_FAR = re.compile(r"(\[\s*([A-Za-z_][\w.]*\s*)?)?")  # what may still become one
_JSON_NAMES = {"true": True, "false": False, "null": None}
_PAIRS = {"(": ")", "[": "]", "{": "}"}


class PythonicToolParser(ToolParser):
    name = "pythonic"
    markers = (START,)
    special_markers = (START, END)

    def _open_section(self, marker: str) -> _CallList:
        return _CallList(self.num_calls)

    def _starts_section_bare(self, text: str) -> bool:
        return bool(_OPENING.match(text.lstrip()))

    def _held_back(self, text: str) -> int:
        if (not self.emitted_content and self.num_calls == 0
                and _OPENING_SO_FAR.fullmatch(text.lstrip())):
            return len(text)  # "[get_we" may still open a list of calls
        return super()._held_back(text)


class _CallList:
    """`[call(...), call(...)]`: brackets and strings tracked character by character."""

    def __init__(self, index: int) -> None:
        self.next_index = index
        self.text = ""
        self.pos = 0  # next character to scan
        self.stack: list[str] = []  # open brackets
        self.quote = ""  # the open string's quote
        self.escaped = False
        self.call_start: int | None = None
        self.consumed = 0  # text up to here went out as calls
        self.closed_at: int | None = None  # just after the list's "]"
        self.leftover = ""

    def feed(self, text: str) -> tuple[list[ToolCallDelta], str | None]:
        self.text += text
        out: list[ToolCallDelta] = []
        while self.closed_at is None and self.pos < len(self.text):
            ch, at = self.text[self.pos], self.pos
            self.pos += 1
            if self.quote:
                self._in_string(ch)
            elif ch in "\"'":
                self.quote = ch
            elif ch in _PAIRS:
                self._open(ch, at)
            elif ch in ")]}":
                rest = self._close(ch, at, out)
                if rest is not None:
                    return out, rest
        return out, self._after_list() if self.closed_at is not None else None

    def finish(self) -> list[ToolCallDelta]:
        """The text ended: inside the list, what did not go out as calls is text."""
        if self.closed_at is None:
            self.leftover = self.text[self.consumed:].strip(" ,\n")
        elif not END.startswith(rest := self.text[self.closed_at:].lstrip()):
            self.leftover = rest
        return []

    def _after_list(self) -> str | None:
        """The text after the list and its optional <|python_end|> (None: still unsure)."""
        rest = self.text[self.closed_at:].lstrip()
        if rest.startswith(END):
            return rest[len(END):]
        return None if END.startswith(rest) else rest

    def _in_string(self, ch: str) -> None:
        if self.escaped:
            self.escaped = False
        elif ch == "\\":
            self.escaped = True
        elif ch == self.quote:
            self.quote = ""

    def _open(self, ch: str, at: int) -> None:
        if ch == "(" and self.stack == ["["]:
            start = max(self.text.rfind(",", 0, at), self.text.rfind("[", 0, at)) + 1
            self.call_start = start
        self.stack.append(ch)

    def _close(self, ch: str, at: int, out: list[ToolCallDelta]) -> str | None:
        """The text after the list once it closed (or stopped being calls), else None."""
        if not self.stack or _PAIRS[self.stack.pop()] != ch:
            return self._give_up()
        if ch == ")" and self.stack == ["["]:
            call = _parse_call(self.text[self.call_start:at + 1])
            if call is None:
                return self._give_up()
            name, arguments = call
            out.append(ToolCallDelta(self.next_index, id=new_call_id(), name=name,
                                     arguments=json.dumps(arguments)))
            self.next_index += 1
            self.call_start, self.consumed = None, at + 1
        elif not self.stack:  # the list closed
            self.closed_at = at + 1
        return None

    def _give_up(self) -> str:
        """Not a list of calls after all: what did not go out as calls is text."""
        return self.text[self.consumed:]


def _parse_call(source: str) -> tuple[str, dict[str, Any]] | None:
    try:
        node = ast.parse(source.strip(), mode="eval").body
    except SyntaxError:
        return None
    if not isinstance(node, ast.Call) or node.args:
        return None
    try:
        return ast.unparse(node.func), {kw.arg: _value(kw.value) for kw in node.keywords}
    except ValueError:
        return None


def _value(node: ast.expr) -> Any:
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]  # JSON spellings a model may use
    if isinstance(node, ast.List):
        return [_value(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        return {_value(k): _value(v) for k, v in zip(node.keys, node.values)}
    return ast.literal_eval(node)
