"""Incremental scanning of one JSON object as its text arrives.

A tool call is written as `{"name": ..., "arguments": {...}}`. To stream it, we need to know,
after every delta, where each top-level value starts and whether it has ended, without
re-parsing the whole object each time. `ObjectScanner` walks each new character once and
records the raw text span of every top-level value; the arguments are then streamed as
their raw text, which only ever grows, so streamed pieces concatenate to the final text.
"""
from __future__ import annotations

import json

_WS = " \t\r\n"


class ObjectScanner:
    """Scans one JSON object (leading whitespace allowed). `spans[key] = [start, end]`
    over `text`; `end` is None while the value is still being written."""

    def __init__(self) -> None:
        self.text = ""
        self.spans: dict[str, list[int | None]] = {}
        self.done = False  # the object's closing brace was seen
        self.end = 0  # index just after the closing brace, once done
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.expect = "open"  # open | key | colon | value | after_value
        self.token_start = 0  # where the key or value being read started
        self.key: str | None = None
        self.scalar = False  # the current depth-1 value is a bare number/true/false/null

    def feed(self, text: str) -> str:
        """Scan `text`; returns what follows the object's end (empty unless it ended)."""
        start = len(self.text)
        self.text += text
        for pos in range(start, len(self.text)):
            if self.done:
                return self.text[pos:]
            self._step(self.text[pos], pos)
        return ""

    def value(self, key: str) -> str | None:
        """The raw text of a top-level value so far (None when the key has not appeared)."""
        span = self.spans.get(key)
        if span is None:
            return None
        return self.text[span[0]:span[1] if span[1] is not None else len(self.text)]

    def complete(self, key: str) -> bool:
        span = self.spans.get(key)
        return span is not None and span[1] is not None

    # -- the state machine ------------------------------------------------------------

    def _step(self, ch: str, pos: int) -> None:
        if self.in_string:
            self._string_char(ch, pos)
        elif self.depth == 0:
            self._outside(ch, pos)
        elif self.depth == 1:
            self._top_level(ch, pos)
        else:
            self._nested(ch, pos)

    def _string_char(self, ch: str, pos: int) -> None:
        if self.escaped:
            self.escaped = False
        elif ch == "\\":
            self.escaped = True
        elif ch == '"':
            self.in_string = False
            if self.depth == 1 and self.expect == "key":
                self.key = _loads_str(self.text[self.token_start:pos + 1])
                self.expect = "colon"
            elif self.depth == 1:  # a string value at the top level ended
                self._end_value(pos + 1)

    def _outside(self, ch: str, pos: int) -> None:
        if ch == "{":
            self.depth, self.expect = 1, "key"
        elif ch not in _WS:
            raise ValueError(f"expected a JSON object, got {ch!r}")

    def _top_level(self, ch: str, pos: int) -> None:
        if self.scalar:
            if ch not in ",}" and ch not in _WS:
                return  # still inside a number, true, false or null
            self.scalar = False
            self._end_value(pos)
        if ch in _WS:
            return
        if self.expect == "key" and ch == '"':
            self.in_string, self.token_start = True, pos
        elif self.expect == "colon" and ch == ":":
            self.expect = "value"
        elif self.expect == "value":
            self._start_value(ch, pos)
        elif ch == "," and self.expect == "after_value":
            self.expect = "key"
        elif ch == "}" and self.expect in ("key", "after_value"):
            self.depth, self.done, self.end = 0, True, pos + 1
        else:
            raise ValueError(f"unexpected {ch!r} in a JSON object")

    def _start_value(self, ch: str, pos: int) -> None:
        self.spans[self.key] = [pos, None]
        self.expect = "in_value"
        if ch == '"':
            self.in_string = True
        elif ch in "{[":
            self.depth += 1
        else:
            self.scalar = True

    def _nested(self, ch: str, pos: int) -> None:
        if ch == '"':
            self.in_string = True
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1
            if self.depth == 1:
                self._end_value(pos + 1)

    def _end_value(self, end: int) -> None:
        self.spans[self.key][1] = end
        self.expect = "after_value"


def _loads_str(raw: str) -> str:
    return json.loads(raw)
