"""Tokenizer wrapper, chat templates, and incremental detokenization with stop strings."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Used when the model's tokenizer config carries no chat template.
DEFAULT_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@dataclass
class ChatPrompt:
    """One conversation rendered by the chat template: `token_ids` are what a chat request
    runs on; `text`, sent as a plain prompt (encoded with the tokenizer's own special
    tokens, as /v1/completions does), encodes to the same ids."""

    text: str
    token_ids: list[int]


class Tokenizer:
    def __init__(self, path: str) -> None:
        # transformers (and the torch it imports) when a tokenizer loads, not on import:
        # a server's modules import this one before they start the engine
        from transformers import AutoTokenizer

        from engine.loading.model_source import resolve_model_path
        from engine.loading.gguf import is_gguf
        from engine.loading.gguf_tokenizer import gguf_tokenizer

        path = resolve_model_path(path)  # a package: model, Hub ID or .gguf file too
        self.hf: PreTrainedTokenizerBase = (gguf_tokenizer(path) if is_gguf(path) else
                                            AutoTokenizer.from_pretrained(path, local_files_only=True))
        self.eos_token_ids = _eos_ids(path, self.hf)

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text)

    def decode(self, ids: list[int], skip_special_tokens: bool = True,
               keep: frozenset[int] = frozenset()) -> str:
        """`keep`: special token ids written out even when skipping special tokens (the
        markers a tool-call or reasoning parser reads, such as Mistral's [TOOL_CALLS])."""
        if skip_special_tokens and keep and not keep.isdisjoint(ids):
            skipped = self._special_ids
            ids = [i for i in ids if i in keep or i not in skipped]
            skip_special_tokens = False  # what is left to skip is gone already
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def special_token_ids(self, texts) -> frozenset[int]:
        """Ids of those of `texts` that are special tokens of this vocabulary (what
        skip_special_tokens would drop); other texts are left out."""
        by_text = {tok.content: i for i, tok in self.hf.added_tokens_decoder.items()}
        return frozenset(by_text[t] for t in texts if by_text.get(t) in self._special_ids)

    @cached_property
    def _special_ids(self) -> frozenset[int]:
        """The ids skip_special_tokens drops: every added token marked special."""
        return frozenset(i for i, tok in self.hf.added_tokens_decoder.items() if tok.special)

    def token_str(self, token_id: int) -> str:
        return self.hf.decode([token_id])

    def render_chat(self, messages: list[dict], tools: list[dict] | None = None,
                    add_generation_prompt: bool = True, **template_kwargs) -> ChatPrompt:
        """The conversation through the model's chat template (ours when it has none),
        ending with the assistant's turn opening unless `add_generation_prompt` is False.
        Message keys besides role and content (tool_calls, tool_call_id, ...), `tools` and
        `template_kwargs` (e.g. enable_thinking=False) go to the template as HF passes them.

        BOS, the one rule: the template writes any BOS itself, so its text is encoded
        without adding special tokens. `text` drops that leading BOS when plain encoding
        adds one, so the completions route does not double it."""
        flat = [dict(m, content=_flatten_content(m.get("content"))) for m in messages]
        template = None if self.hf.chat_template else DEFAULT_CHAT_TEMPLATE
        rendered = self.hf.apply_chat_template(flat, tools=tools, chat_template=template,
                                               tokenize=False,
                                               add_generation_prompt=add_generation_prompt,
                                               **template_kwargs)
        ids = self.hf.encode(rendered, add_special_tokens=False)
        bos = self.hf.bos_token
        text = rendered
        if bos and rendered.startswith(bos) and self._encode_adds_bos:
            text = rendered[len(bos):]
        return ChatPrompt(text, ids)

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None,
                            **template_kwargs) -> list[int]:
        """Token ids of the conversation, ending with the assistant's turn opening
        (`render_chat`'s ids)."""
        return self.render_chat(messages, tools, **template_kwargs).token_ids

    @cached_property
    def _encode_adds_bos(self) -> bool:
        """Does plain `encode` put a BOS in front (then a BOS already in the text doubles)?"""
        bos_id = self.hf.bos_token_id
        return bos_id is not None and self.hf.encode(self.hf.bos_token)[:2] == [bos_id, bos_id]

    @property
    def vocab_size(self) -> int:
        return len(self.hf)


def _flatten_content(content) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if isinstance(part, dict))


def _eos_ids(path: str, hf: PreTrainedTokenizerBase) -> set[int]:
    from engine.loading.chat_templates import turn_end_tokens
    from engine.loading.gguf import is_gguf, metadata

    ids = {hf.eos_token_id} if hf.eos_token_id is not None else set()
    if is_gguf(path):  # no generation_config.json beside it: the family's turn end
        vocab = hf.get_vocab()
        ids.update(vocab[t] for t in turn_end_tokens(metadata(path, "general.architecture"))
                   if t in vocab)
    gen_config = os.path.join(path, "generation_config.json")
    if os.path.exists(gen_config):
        with open(gen_config) as f:
            eos = json.load(f).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return ids


class IncrementalDetokenizer:
    """Turns a growing list of output tokens into text deltas.

    Decodes a small window of recent tokens and emits only text that is complete (no
    trailing U+FFFD from a cut multi-byte character). Text that could still become the
    start of a stop string is held back until it cannot; a matched stop string ends the
    text and is not part of it.
    """

    _CONTEXT = 5  # prompt tokens decoded along, so leading spaces come out right

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], stop: list[str],
                 skip_special_tokens: bool = True, include_stop: bool = False) -> None:
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids[-self._CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.stop = stop
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.skip_special_tokens = skip_special_tokens
        self.keep: frozenset[int] = frozenset()  # special tokens written out anyway
        self.include_stop = include_stop  # the text ends after the stop string, not before
        self.text = ""
        self.emitted = 0
        self.stopped = False
        self.num_fed = 0  # output tokens added so far
        # Per added token: where its text starts in `text` (logprobs' text_offset). Fixed when
        # the token is added, so it does not depend on how tokens were batched into deltas
        # (streamed chunks and the whole response carry the same offsets).
        self.offsets: list[int] = []

    def add(self, token_id: int) -> None:
        """Append one token; sets `stopped` when a stop string appears."""
        self.offsets.append(len(self.text))
        self._add(token_id)

    def catch_up(self, output_ids: list[int]) -> None:
        """Add the tokens of `output_ids` (all output so far) not added yet."""
        while self.num_fed < len(output_ids):
            self.add(output_ids[self.num_fed])

    def _add(self, token_id: int) -> None:
        self.ids.append(token_id)
        self.num_fed += 1
        def decode(ids: list[int]) -> str:
            return self.tokenizer.decode(ids, self.skip_special_tokens, self.keep)

        prefix = decode(self.ids[self.prefix_offset:self.read_offset])
        full = decode(self.ids[self.prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return
        before = len(self.text)
        self.text += full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        if self.stop:
            self._find_stop(max(0, before - self.holdback))

    def keep_special(self, texts) -> None:
        """Write these special tokens into the text although special tokens are skipped
        (a parser reads them); before the first token is added."""
        self.keep = self.tokenizer.special_token_ids(texts)

    def token_offsets(self, start: int, end: int) -> list[int]:
        """text_offset of output tokens [start, end). Tokens of a stop string the text was
        cut before keep their start, past the text's end (a stream sent them before the cut
        was known); tokens never added (after the stop) sit after the last one added."""
        after = max(len(self.text), self.offsets[-1] if self.offsets else 0)
        return [self.offsets[k] if k < len(self.offsets) else after for k in range(start, end)]

    def _find_stop(self, search_from: int) -> None:
        hits = [(i, s) for s, i in ((s, self.text.find(s, search_from)) for s in self.stop) if i >= 0]
        if hits:
            at, stop = min(hits, key=lambda h: (h[0], len(h[1])))  # earliest; of two there, shorter
            self.text = self.text[:at + len(stop) if self.include_stop else at]
            self.stopped = True

    def take_delta(self, final: bool = False) -> str:
        """Text not yet handed out that is safe to hand out now."""
        end = len(self.text) if (final or self.stopped) else len(self.text) - self.holdback
        if end <= self.emitted:
            return ""
        delta = self.text[self.emitted:end]
        self.emitted = end
        return delta
