"""A chat request as the model's chat template takes it: messages, tools, template kwargs.

Templates written for tool use (Qwen2.5/3, Llama 3.1+, Mistral, Hermes) take `tools` and
render assistant `tool_calls` and `tool` results themselves. Templates that never mention
tools (the demo model's ChatML, SmolLM2's) would silently drop them, so for those the tools
are described in a system message and earlier calls are written into the assistant's
content, in the Hermes format.
"""
from __future__ import annotations

import json
from typing import Any

from deployments.protocol import ChatCompletionRequest

# apply_chat_template's own arguments: a client may not set these through chat_template_kwargs.
RESERVED_KWARGS = {"conversation", "messages", "tools", "documents", "chat_template", "tokenize",
                   "add_generation_prompt", "continue_final_message", "return_dict",
                   "return_tensors", "tokenizer_kwargs", "padding", "truncation", "max_length"}


def template_source(hf_tokenizer) -> str:
    """All of the tokenizer's chat template text (HF allows a dict of named templates)."""
    t = hf_tokenizer.chat_template
    return "\n".join(t.values()) if isinstance(t, dict) else (t or "")


def template_kwargs(req: ChatCompletionRequest) -> dict[str, Any]:
    kwargs = dict(req.chat_template_kwargs or {})
    clash = sorted(RESERVED_KWARGS & set(kwargs))
    if clash:
        raise ValueError(f"chat_template_kwargs may not set {clash}")
    return kwargs


def template_inputs(req: ChatCompletionRequest, source: str) -> tuple[list[dict], list[dict] | None]:
    """(messages, tools) for apply_chat_template; tools None when there are none to show."""
    messages = [m.as_template_dict() for m in req.messages]
    tools = [t.model_dump(exclude_none=True) for t in req.active_tools] or None
    if "tool_calls" not in source:
        messages = [_calls_as_content(m) for m in messages]
    if tools and "tools" not in source:
        messages, tools = _tools_in_system(messages, tools), None
    return messages, tools


def _calls_as_content(message: dict) -> dict:
    calls = message.get("tool_calls")
    if not calls:
        return message
    text = "".join(f"<tool_call>\n{json.dumps(c['function'])}\n</tool_call>" for c in calls)
    out = {k: v for k, v in message.items() if k != "tool_calls"}
    out["content"] = (message["content"] + "\n" if message["content"] else "") + text
    return out


def _tools_in_system(messages: list[dict], tools: list[dict]) -> list[dict]:
    listing = "\n".join(json.dumps(t["function"]) for t in tools)
    text = ("You may call these functions. To call one, write <tool_call>{\"name\": ..., "
            f"\"arguments\": {{...}}}}</tool_call>.\n<tools>\n{listing}\n</tools>")
    if messages and messages[0]["role"] == "system":
        return [dict(messages[0], content=messages[0]["content"] + "\n\n" + text)] + messages[1:]
    return [{"role": "system", "content": text}] + messages
