"""Chat templates the engine knows by model family, for GGUF files that carry none (as
llama.cpp falls back to its built-in templates), and the turn-end tokens those templates
close a reply with (llama.cpp's end-of-generation tokens, transformers' generation_config)."""
from __future__ import annotations

# Gemma's turn format: the system prompt joins the first user turn, the assistant is "model",
# roles alternate strictly (the template raises otherwise, as Google's does).
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = '' -%}"
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}"
    "{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)

_TEMPLATES = {"gemma3": GEMMA_CHAT_TEMPLATE}
_TURN_END_TOKENS = {"gemma3": ("<end_of_turn>",)}


def builtin_chat_template(arch: str | None) -> str | None:
    """The template of a GGUF architecture's family; None for families without one here."""
    return _TEMPLATES.get(arch or "")


def turn_end_tokens(arch: str | None) -> tuple[str, ...]:
    """Tokens that end the model's turn besides EOS (generation stops at them)."""
    return _TURN_END_TOKENS.get(arch or "", ())
