"""`ToolParser`: splits a model's output text into content and tool calls, as it streams.

Outside a tool-call section, text is content, except that text which could be the start
of a section marker is held back until it cannot, and whitespace next to tool calls is
dropped (templates put newlines around them). Each format says what opens a section and
how calls are delimited inside it (`_open_section`).
"""
from __future__ import annotations

from deployments.tool_calls.call_stream import CallSection, ParsedDelta


class ToolParser:
    name = ""
    markers: tuple[str, ...] = ()  # texts that open a tool-call section
    # Special tokens the format's markers are; the ingress keeps them in the decoded text
    # (ChatPlan.special_tokens -> IncrementalDetokenizer.keep_special).
    special_markers: tuple[str, ...] = ()

    def __init__(self, tools: list[dict] | None = None) -> None:
        # Function name -> its parameters' JSON schema (formats that type raw text need it).
        self.schemas = {f["name"]: f.get("parameters") or {} for f in tools or []}
        self.buffer = ""  # text not yet classified
        self.held_space = ""  # trailing whitespace of the content, sent once more content follows
        self.section: CallSection | None = None
        self.num_calls = 0
        self.emitted_content = False
        self.after_section = False  # drop the whitespace right after a section

    # -- what formats define ----------------------------------------------------------

    def _open_section(self, marker: str) -> CallSection:
        raise NotImplementedError

    def _starts_section_bare(self, text: str) -> bool:
        """A section that opens without a marker (Llama 3's JSON at the start)."""
        return False

    # -- streaming ----------------------------------------------------------------------

    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        self.buffer += text
        while self.buffer:
            if self.section is not None:
                if not self._feed_section(out):
                    break
            elif not self._feed_text(out):
                break
        return out

    def finish(self) -> ParsedDelta:
        """The output ended: everything still held is decided now."""
        out = ParsedDelta()
        if self.section is not None:
            out.tool_calls += self.section.finish()
            self._close_section(out)
        else:
            out.extend(self._content(self.buffer))
        self.buffer = ""
        if self.num_calls == 0:
            out.content += self.held_space
        self.held_space = ""
        return out

    def _feed_section(self, out: ParsedDelta) -> bool:
        text, self.buffer = self.buffer, ""
        deltas, rest = self.section.feed(text)
        out.tool_calls += deltas
        if rest is None:
            return False
        self._close_section(out)
        self.buffer = rest
        return True

    def _close_section(self, out: ParsedDelta) -> None:
        self.num_calls = self.section.next_index
        if self.section.leftover:
            out.extend(self._content(self.section.leftover))
        self.section = None
        self.after_section = True

    def _feed_text(self, out: ParsedDelta) -> bool:
        """Classify buffered text; False when the rest must wait for more."""
        if not self.emitted_content and self.num_calls == 0 and self._starts_section_bare(self.buffer):
            self.section = self._open_section("")
            self.buffer = self.buffer.lstrip()
            return True
        hit = min(((i, m) for m in self.markers if (i := self.buffer.find(m)) >= 0), default=None)
        if hit is not None:
            at, marker = hit
            out.extend(self._content(self.buffer[:at]))
            self.held_space = ""  # whitespace before a call is the template's, not content
            self.buffer = self.buffer[at + len(marker):]
            self.section = self._open_section(marker)
            return True
        keep = self._held_back(self.buffer)
        out.extend(self._content(self.buffer[:len(self.buffer) - keep]))
        self.buffer = self.buffer[len(self.buffer) - keep:]
        return False

    def _held_back(self, text: str) -> int:
        """Length of the longest end of `text` that could begin a marker (or a bare section)."""
        if not self.emitted_content and self.num_calls == 0 and not text.strip():
            return len(text)  # only whitespace yet: a bare section may still start
        longest = 0
        for m in self.markers:
            for n in range(min(len(m) - 1, len(text)), longest, -1):
                if text.endswith(m[:n]):
                    longest = n
                    break
        return longest

    def _content(self, text: str) -> ParsedDelta:
        if self.after_section:
            text = text.lstrip()
            self.after_section = not text
        text = self.held_space + text
        body = text.rstrip()
        self.held_space = text[len(body):]
        if body:
            self.emitted_content = True
        return ParsedDelta(content=body)
