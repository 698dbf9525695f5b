"""Role markers (the text around each message) derived from a model's chat template.

A program writes its conversation as text: `user("Hi")` appends the user prefix, "Hi" and
the user suffix. The markers are found by asking the server to render sample
conversations whose contents are unique slot strings, then cutting the text at the slots.
The server renders with the very template /v1/chat/completions uses, so a program's text
tokenizes exactly like the same conversation sent to the chat endpoint (checked here by
re-rendering the sample from the markers).

Templates that are not "prefix + content + suffix" per message (Llama 2 folds the system
prompt into the first user turn) raise `ChatTemplateError`.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

# (messages, add_generation_prompt) -> rendered text, ready to send as a completions prompt.
Render = Callable[[list[dict[str, str]], bool], str]

# Slot contents: plain letters and digits so templates that `trim` content leave them intact.
_SLOTS = [f"RSXSLOT{i}RSX" for i in range(5)]


class ChatTemplateError(ValueError):
    """The chat template cannot be expressed as per-role prefixes and suffixes."""


@dataclass(frozen=True)
class ChatMarkers:
    prefixes: dict[str, str]
    suffixes: dict[str, str]
    # A role's prefix when it opens the conversation: may carry a default system prompt.
    opening: dict[str, str]

    def begin(self, role: str, first: bool) -> str:
        self._check(role)
        return self.opening.get(role, self.prefixes[role]) if first else self.prefixes[role]

    def end(self, role: str) -> str:
        self._check(role)
        return self.suffixes[role]

    def render(self, messages: list[dict[str, str]]) -> str:
        """A conversation as a program would write it."""
        return "".join(self.begin(m["role"], i == 0) + m["content"] + self.end(m["role"])
                       for i, m in enumerate(messages))

    def _check(self, role: str) -> None:
        if role not in self.prefixes:
            raise ChatTemplateError(f"this model's chat template has no {role!r} role")


def derive_markers(render: Render) -> ChatMarkers:
    """Markers for the template behind `render`; templates without a system role still work
    for user and assistant turns."""
    try:
        return _derive(render, with_system=True)
    except Exception as first_error:  # noqa: BLE001 - any failure: retry without a system turn
        try:
            return _derive(render, with_system=False)
        except ChatTemplateError:
            raise first_error from None


def _derive(render: Render, with_system: bool) -> ChatMarkers:
    roles = (["system"] if with_system else []) + ["user", "assistant", "user", "assistant"]
    convo = [{"role": r, "content": s} for r, s in zip(roles, _SLOTS)]
    full = render(convo, False)
    gaps = _gaps(full, _SLOTS[:len(convo)])  # gaps[i] is the text before slot i; gaps[-1] after all
    k = 1 if with_system else 0
    assistant_prefix = _strip_head(render(convo[:-1], False), render(convo[:-1], True), "generation prompt")
    assistant_suffix = gaps[-1]
    user_prefix = _strip_head(assistant_suffix, gaps[k + 2], "user prefix")
    user_suffix = _strip_tail(gaps[k + 1], assistant_prefix, "user suffix")
    prefixes = {"user": user_prefix, "assistant": assistant_prefix}
    suffixes = {"user": user_suffix, "assistant": assistant_suffix}
    opening = {"user": _before_slot(render([{"role": "user", "content": _SLOTS[0]}], False))}
    if with_system:
        prefixes["system"] = opening["system"] = gaps[0]
        suffixes["system"] = _strip_tail(gaps[1], user_prefix, "system suffix")
    markers = ChatMarkers(prefixes, suffixes, opening)
    if markers.render(convo) != full:
        raise ChatTemplateError("the chat template does not render each message as "
                                "prefix + content + suffix")
    return markers


def _gaps(text: str, slots: list[str]) -> list[str]:
    gaps, pos = [], 0
    for slot in slots:
        at = text.find(slot, pos)
        if at < 0 or text.count(slot) != 1:
            raise ChatTemplateError("the chat template does not show each message's content once")
        gaps.append(text[pos:at])
        pos = at + len(slot)
    return gaps + [text[pos:]]


def _before_slot(text: str) -> str:
    at = text.find(_SLOTS[0])
    if at < 0:
        raise ChatTemplateError("the chat template drops the message content")
    return text[:at]


def _strip_head(head: str, text: str, what: str) -> str:
    if not text.startswith(head):
        raise ChatTemplateError(f"cannot isolate the {what} in the chat template")
    return text[len(head):]


def _strip_tail(text: str, tail: str, what: str) -> str:
    if not text.endswith(tail):
        raise ChatTemplateError(f"cannot isolate the {what} in the chat template")
    return text[:len(text) - len(tail)]
