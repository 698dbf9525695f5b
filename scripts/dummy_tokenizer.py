"""A word-level tokenizer covering every id of a dummy-weight model's vocabulary.

    python scripts/dummy_tokenizer.py MODEL_DIR

A dummy model directory holds only config.json; the GPU benchmarks serve it with random
weights, whose sampled ids span the whole vocabulary. A tokenizer with fewer ids decodes
most of them to nothing and streams would carry no text. This one maps id i to the word
"w<i>" (plus a space), so every token has text, and saves it into MODEL_DIR.
"""
from __future__ import annotations

import json
import os
import sys

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast


def write_word_tokenizer(model_dir: str) -> None:
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    vocab = {f"w{i}": i for i in range(config["vocab_size"])}
    bos, eos = vocab_name(config.get("bos_token_id", 0)), vocab_name(config.get("eos_token_id", 1))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="never")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos, unk_token="w0")
    fast.save_pretrained(model_dir)


def vocab_name(token_id) -> str:
    return f"w{token_id[0] if isinstance(token_id, list) else token_id}"


if __name__ == "__main__":
    write_word_tokenizer(sys.argv[1])
