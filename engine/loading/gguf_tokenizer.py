"""A GGUF file's tokenizer: transformers' fast tokenizer rebuilt from the file's vocabulary,
merges, special tokens and chat template (the conversion `from_pretrained(..., gguf_file=)`
does), kept in the cache directory after the first start. The conversion parses every
vocabulary entry of the file through gguf's reader, minutes on a loaded CPU for Gemma's 262k
tokens, and each process that tokenizes (ingress, engine) would pay it at every start; the
saved tokenizer loads in about a second."""
from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from typing import Any


def gguf_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    from engine.loading.chat_templates import builtin_chat_template
    from engine.loading.gguf import metadata

    saved = _saved_dir(path)
    if (saved / "tokenizer_config.json").exists():
        tokenizer = AutoTokenizer.from_pretrained(str(saved), local_files_only=True)
    else:
        tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(path)),
                                                  gguf_file=os.path.basename(path),
                                                  local_files_only=True)
        _save(tokenizer, saved)
    if not tokenizer.chat_template:  # as llama.cpp: the family's template when the file has none
        tokenizer.chat_template = builtin_chat_template(metadata(path, "general.architecture"))
    return tokenizer


def _saved_dir(path: str):
    from engine.config import default_cache_root

    stat = os.stat(path)  # a replaced or rewritten file gets a new entry
    key = f"{os.path.realpath(path)}|{stat.st_size}|{stat.st_mtime_ns}"
    return default_cache_root() / "gguf-tokenizers" / hashlib.sha256(key.encode()).hexdigest()[:24]


def _save(tokenizer: Any, saved) -> None:
    """Written beside its place and renamed in, so a concurrent start never reads half of it."""
    saved.parent.mkdir(parents=True, exist_ok=True)
    partial = tempfile.mkdtemp(dir=saved.parent, prefix=".partial-")
    try:
        tokenizer.save_pretrained(partial)
        os.rename(partial, saved)
    except OSError:
        pass  # another process saved it first, or the cache is read-only: use the one in memory
    finally:
        shutil.rmtree(partial, ignore_errors=True)
