"""Reasoning parser: a thinking model's `<think> ... </think>` becomes `reasoning_content`,
the rest `content`, as the text streams.

Qwen3 writes `<think>` itself; DeepSeek-R1 and Qwen3 "thinking" models get it from the chat
template at the end of the prompt, so their output starts inside the reasoning: the ingress
says which (`starts_in_reasoning`, from the prompt's last tokens). With
`enable_thinking: false` Qwen3's template closes an empty think block in the prompt, so the
output is all content.
"""
from __future__ import annotations

from dataclasses import dataclass

THINK_START, THINK_END = "<think>", "</think>"
PARSERS = ("qwen3", "deepseek-r1")  # same tags; names as vLLM and SGLang spell them


@dataclass
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


def detect_reasoning_parser(chat_template: str | None) -> str | None:
    """A template that writes think tags belongs to a thinking model."""
    return "qwen3" if chat_template and THINK_END in chat_template else None


def prompt_opens_reasoning(prompt_tail: str) -> bool:
    """The prompt (its last few tokens, decoded) ends inside a think block."""
    return prompt_tail.rstrip().endswith(THINK_START)


class ReasoningParser:
    def __init__(self, starts_in_reasoning: bool, reasoning_first: bool = False) -> None:
        """`reasoning_first`: the output reasons up to </think> whether or not it writes
        <think> first (its answer's grammar starts after </think>)."""
        # "maybe": no text yet; "reasoning"; "content".
        self.state = "reasoning" if starts_in_reasoning else "maybe"
        self.reasoning_first = reasoning_first
        self.buffer = ""
        self.strip_content = False  # the blank line after </think> is the template's

    def feed(self, text: str) -> ReasoningDelta:
        self.buffer += text
        out = ReasoningDelta()
        if self.state == "maybe":
            self._opening()
        if self.state == "reasoning":
            self._reasoning(out)
        if self.state == "content":
            out.content += self._content(self.buffer)
            self.buffer = ""
        return out

    def finish(self) -> ReasoningDelta:
        """The output ended: held text is what it looked like."""
        out = ReasoningDelta()
        if self.state == "reasoning":
            out.reasoning, self.buffer = self.buffer, ""
        else:
            out.content, self.buffer = self._content(self.buffer), ""
        return out

    def _opening(self) -> None:
        head = self.buffer.lstrip()
        if head.startswith(THINK_START):
            self.state, self.buffer = "reasoning", head[len(THINK_START):]
        elif not THINK_START.startswith(head) or not head and len(self.buffer) > 64:
            self.state = "reasoning" if self.reasoning_first else "content"
        # else: all of it could still be the start of <think>: wait

    def _reasoning(self, out: ReasoningDelta) -> None:
        at = self.buffer.find(THINK_END)
        if at >= 0:
            out.reasoning += self.buffer[:at]
            self.buffer = self.buffer[at + len(THINK_END):]
            self.state, self.strip_content = "content", True
            return
        keep = next((n for n in range(len(THINK_END) - 1, 0, -1)
                     if self.buffer.endswith(THINK_END[:n])), 0)
        out.reasoning += self.buffer[:len(self.buffer) - keep]
        self.buffer = self.buffer[len(self.buffer) - keep:]

    def _content(self, text: str) -> str:
        if self.strip_content:
            text = text.lstrip()
            self.strip_content = not text
        return text
