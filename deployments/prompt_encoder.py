"""Tokenization for the ingress, off its event loop.

The Rust tokenizer releases the GIL, so encoding in a worker thread keeps the loop serving
other clients while a large prompt is encoded. A text too long to fit the context whatever
its tokens is refused before encoding: no token decodes to more than `max_token_chars`
characters, so a prompt of more than max_context * max_token_chars characters (with slack
for normalizers that merge characters) cannot fit.
"""
from __future__ import annotations

import asyncio

from engine import ChatPrompt, Tokenizer

NORMALIZER_SLACK = 4  # NFKC and friends merge at most a few characters into one


class PromptEncoder:
    def __init__(self, tokenizer: Tokenizer, max_context: int) -> None:
        self.tokenizer = tokenizer
        self.max_context = max_context
        hf = tokenizer.hf
        pieces = hf.convert_ids_to_tokens(list(range(len(hf))))
        self.max_token_chars = max((len(p) for p in pieces if p), default=1)
        self.max_prompt_chars = max_context * self.max_token_chars * NORMALIZER_SLACK

    def check_length(self, text: str) -> None:
        if len(text) > self.max_prompt_chars:
            raise ValueError(f"prompt of {len(text)} characters cannot fit the model's context "
                             f"length of {self.max_context} tokens")

    async def encode(self, text: str) -> list[int]:
        self.check_length(text)
        return await asyncio.to_thread(self.tokenizer.encode, text)

    async def render_chat(self, messages: list[dict], tools: list[dict] | None = None,
                          add_generation_prompt: bool = True, **template_kwargs) -> ChatPrompt:
        self.check_length("".join(str(m.get("content") or "") for m in messages) + str(tools or ""))
        return await asyncio.to_thread(self.tokenizer.render_chat, messages, tools,
                                       add_generation_prompt, **template_kwargs)
