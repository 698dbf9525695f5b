"""Qwen3-Coder XML format: one block per call, parameter values as raw text,

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

A value becomes JSON by the type its function's schema gives the parameter (a string
stays as written, "21" for an integer becomes 21); without one, by what it parses as.
Streaming: the name once its tag is complete, then each parameter's `"key": value` as its
closing tag arrives, so the arguments' text only grows and ends as one JSON object."""
from __future__ import annotations

import json
from typing import Any

from deployments.tool_calls.base import ToolParser
from deployments.tool_calls.call_stream import ToolCallDelta, new_call_id

FUNCTION, PARAMETER = "<function=", "<parameter="
END_FUNCTION, END_PARAMETER, END_CALL = "</function>", "</parameter>", "</tool_call>"


class Qwen3CoderToolParser(ToolParser):
    name = "qwen3_coder"
    markers = ("<tool_call>",)

    def _open_section(self, marker: str) -> _XmlCall:
        return _XmlCall(self.num_calls, self.schemas)


class _XmlCall:
    """One `<function=...>` block up to `</tool_call>`."""

    def __init__(self, index: int, schemas: dict[str, dict]) -> None:
        self.next_index = index
        self.schemas = schemas
        self.buffer = ""
        self.leftover = ""
        self.state = "function"  # function -> parameters -> close
        self.name: str | None = None
        self.num_params = 0

    def feed(self, text: str) -> tuple[list[ToolCallDelta], str | None]:
        self.buffer += text
        out: list[ToolCallDelta] = []
        while self.state != "done" and self._step(out):
            pass
        return out, (self.buffer if self.state == "done" else None)

    def finish(self) -> list[ToolCallDelta]:
        """The text ended inside the call: close what was started."""
        if self.name is None:
            self.leftover, self.buffer = self.buffer.strip(), ""
            return []
        out: list[ToolCallDelta] = []
        if self.state == "parameters":
            self._end_function(out)
        return out

    # -- one step of the block ------------------------------------------------------------

    def _step(self, out: list[ToolCallDelta]) -> bool:
        """Consume one tag (and its contents); False when more text is needed."""
        body = self.buffer.lstrip()
        if self.state == "function":
            return self._function(body, out)
        if self.state == "parameters":
            return self._parameter(body, out)
        return self._close(body)

    def _function(self, body: str, out: list[ToolCallDelta]) -> bool:
        if body.startswith(FUNCTION) and ">" in body:
            end = body.index(">")
            self.name = body[len(FUNCTION):end].strip()
            out.append(ToolCallDelta(self.next_index, id=new_call_id(), name=self.name))
            self.buffer, self.state = body[end + 1:], "parameters"
            return True
        if FUNCTION.startswith(body) or body.startswith(FUNCTION):
            return False  # the tag is still coming
        self.buffer, self.state = body, "done"  # not this format: the text goes on as text
        return True

    def _parameter(self, body: str, out: list[ToolCallDelta]) -> bool:
        if body.startswith(END_FUNCTION):
            self.buffer = body[len(END_FUNCTION):]
            self._end_function(out)
            return True
        if body.startswith(PARAMETER):
            end, close = body.find(">"), body.find(END_PARAMETER)
            if end < 0 or close < 0:
                return False
            key = body[len(PARAMETER):end].strip()
            value = body[end + 1:close].removeprefix("\n").removesuffix("\n")
            piece = json.dumps(key) + ": " + json.dumps(self._typed(key, value))
            self._send(out, ("{" if self.num_params == 0 else ", ") + piece)
            self.num_params += 1
            self.buffer = body[close + len(END_PARAMETER):]
            return True
        if PARAMETER.startswith(body) or END_FUNCTION.startswith(body):
            return False
        self.buffer = body  # an unexpected tag: the call ends here
        self._end_function(out)
        return True

    def _close(self, body: str) -> bool:
        if body.startswith(END_CALL):
            self.buffer, self.state = body[len(END_CALL):], "done"
            return True
        if END_CALL.startswith(body):
            return False
        self.buffer, self.state = body, "done"
        return True

    def _end_function(self, out: list[ToolCallDelta]) -> None:
        self._send(out, "}" if self.num_params else "{}")
        self.next_index += 1
        self.state = "close"

    def _send(self, out: list[ToolCallDelta], piece: str) -> None:
        if out and out[-1].index == self.next_index:
            out[-1].arguments += piece
        else:
            out.append(ToolCallDelta(self.next_index, arguments=piece))

    def _typed(self, key: str, value: str) -> Any:
        """The value as its parameter's schema types it (as written when unsure)."""
        schema = self.schemas.get(self.name or "", {}).get("properties", {}).get(key, {})
        kind = schema.get("type") if isinstance(schema, dict) else None
        if kind == "string" or (kind is None and schema and "enum" in schema
                                and all(isinstance(v, str) for v in schema["enum"])):
            return value
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError:
            return {"True": True, "False": False, "None": None}.get(value, value)
        return parsed
