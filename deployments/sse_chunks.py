"""SSE events of a plain text stream written as JSON text directly.

A streamed chunk is built per choice per batch of deltas; through the pydantic chunk
models (responses.py) that was ~10% of an ingress's CPU under W2 on the H200 (py-spy).
A stream that asks for no logprobs, echo, tool calls or reasoning needs only the text and
the finish reason per chunk, so its events are the fixed head of the stream's chunk (id,
object, created, model) with those two spliced in: byte for byte what the models dump
(tests/test_protocol.py checks it against them)."""
from __future__ import annotations

import json

from pydantic import BaseModel

_CHOICES = '"choices":['


class PlainChunks:
    """Events of one stream; `empty` is its chunk model with no choices (the id, created and
    model every chunk repeats)."""

    def __init__(self, empty: BaseModel, chat: bool) -> None:
        head = empty.model_dump_json(by_alias=True)
        cut = head.index(_CHOICES) + len(_CHOICES)
        self.prefix = "data: " + head[:cut]
        self.suffix = head[cut:] + "\n\n"  # '],"usage":null}': the choices list was empty
        self.chat = chat

    def event(self, index: int, text: str, finish_reason: str | None, first: bool) -> str:
        reason = "null" if finish_reason is None else f'"{finish_reason}"'
        if self.chat:
            fields = []
            if first:
                fields.append('"role":"assistant"')
            if text:
                fields.append('"content":' + json.dumps(text, ensure_ascii=False))
            body = '"delta":{' + ",".join(fields) + "}"
        else:
            body = '"text":' + json.dumps(text, ensure_ascii=False)
        choice = f'{{"index":{index},{body},"logprobs":null,"finish_reason":{reason}}}'
        return self.prefix + choice + self.suffix
