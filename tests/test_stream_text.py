"""The ingress's side of streaming, without Ray: text decoded from streamed token ids
(ChoiceState), deltas merged per batch (merge_deltas), and the request body checks."""
from __future__ import annotations

import asyncio
import json
import random

import pytest

from deployments.errors import APIError
from deployments.request_body import parse_json
from deployments.prompt_encoder import PromptEncoder
from deployments.streams import ChoiceState, merge_deltas
from engine import WireDelta
from engine.loading.demo_model import ensure_demo_model
from engine.loading.tokenizer import IncrementalDetokenizer, Tokenizer

TEXT = "héllo wörld — 世界 says 🙂🎉 to the naïve café, and stops at STOP here. 日本語もね。"


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(ensure_demo_model())


def _delta(tokens, finished=False, **extra) -> WireDelta:
    return WireDelta("r", list(tokens), finished, "stop" if finished else None, 0,
                     {"prompt_tokens": 3, "cached_tokens": 0, **extra})


def _stream_text(tokenizer, tokens, splits, stop=()) -> tuple[str, list[str]]:
    choice = ChoiceState(0, 0, IncrementalDetokenizer(tokenizer, [1, 2, 3], list(stop)))
    pieces, start = [], 0
    for k, end in enumerate(splits + [len(tokens)]):
        pieces.append(choice.add(_delta(tokens[start:end], finished=end == len(tokens))))
        start = end
    return "".join(choice.text), pieces


def test_multibyte_text_is_exact_under_any_split(tokenizer):
    tokens = tokenizer.encode(TEXT)[1:]  # no BOS
    # Byte-level BPE splits the multi-byte characters over several tokens: some deltas end
    # inside a character and must hold those bytes back, never emit U+FFFD.
    assert any("\ufffd" in tokenizer.decode([t]) for t in tokens)
    expected = tokenizer.decode(tokens)
    rng = random.Random(0)
    for _ in range(30):
        splits = sorted(rng.sample(range(1, len(tokens)), rng.randint(0, len(tokens) - 1)))
        text, pieces = _stream_text(tokenizer, tokens, splits)
        assert text == expected
        assert not any("\ufffd" in p for p in pieces)


def test_include_stop_keeps_the_earliest_stop_string(tokenizer):
    tokens = tokenizer.encode(TEXT)[1:]
    for include, end in ((True, TEXT.index("STOP") + len("STOP")), (False, TEXT.index("STOP"))):
        detok = IncrementalDetokenizer(tokenizer, [1, 2, 3], ["here", "STOP", "ST"], include_stop=include)
        choice = ChoiceState(0, 0, detok)
        for k, t in enumerate(tokens):
            if not detok.stopped:
                choice.add(_delta([t], finished=k == len(tokens) - 1))
        # "ST" and "STOP" start at the same place: the shorter one is what was hit first
        assert "".join(choice.text) == TEXT[:end - (2 if include else 0)]


def test_stop_string_across_chunk_borders(tokenizer):
    tokens = tokenizer.encode(TEXT)[1:]
    expected = TEXT[:TEXT.index("STOP")]
    for splits in ([], list(range(1, len(tokens))), [len(tokens) // 2]):
        text, _ = _stream_text(tokenizer, tokens, splits, stop=["STOP"])
        assert text == expected
    # a stop string made of multi-byte characters, split over tokens
    text, _ = _stream_text(tokenizer, tokens, list(range(1, len(tokens))), stop=["世界"])
    assert text == TEXT[:TEXT.index("世界")]


def _feed_one_by_one(tokenizer, tokens, stop: str, include: bool = False):
    """The engine's use of the detokenizer: add a token, take the delta, until a stop.
    Returns (index of the token after which it stopped or None, the deltas)."""
    detok = IncrementalDetokenizer(tokenizer, [1, 2, 3], [stop], include_stop=include)
    pieces, stopped_at = [], None
    for k, t in enumerate(tokens):
        detok.add(t)
        pieces.append(detok.take_delta())
        emitted = "".join(pieces)
        # hold-back: handed-out text is never taken back by a later stop match, and at
        # most len(stop) - 1 characters of the decoded text are held
        assert detok.text.startswith(emitted)
        assert detok.stopped or len(detok.text) - len(emitted) <= len(stop) - 1
        if detok.stopped:
            stopped_at = k
            break
    pieces.append(detok.take_delta(final=True))
    return stopped_at, pieces


def test_detokenizer_stops_at_the_token_completing_a_stop_string(tokenizer):
    """Stop strings cut at random out of TEXT: most start or end inside a token, many
    inside a multi-byte character spread over several tokens. The detokenizer must stop
    exactly at the first token whose text completes the string, cut the text right
    before it (or after it, with include_stop), and never hand out text it takes back."""
    tokens = tokenizer.encode(TEXT)[1:]
    prefixes = [tokenizer.decode(tokens[:k + 1]) for k in range(len(tokens))]
    rng = random.Random(1)
    spans = 0
    for _ in range(60):
        start = rng.randrange(len(TEXT) - 1)
        stop = TEXT[start:start + rng.randint(1, 6)]
        expected_at = next(k for k, text in enumerate(prefixes) if stop in text)
        at = TEXT.index(stop)  # the first occurrence is the one that stops
        # does the stop string span a token border?
        spans += expected_at > 0 and stop not in prefixes[expected_at][len(prefixes[expected_at - 1]):]
        for include in (False, True):
            stopped_at, pieces = _feed_one_by_one(tokenizer, tokens, stop, include)
            assert stopped_at == expected_at, (stop, include)
            assert "".join(pieces) == TEXT[:at + len(stop) if include else at], (stop, include)
            assert not any("\ufffd" in p for p in pieces)
    assert spans >= 20  # the draw does exercise stops across token borders


def test_detokenizer_without_a_matching_stop_streams_everything(tokenizer):
    tokens = tokenizer.encode(TEXT)[1:]
    for stop in ("never there", "STOPS", "🙂🙂"):  # "STOP" and "🙂" start the last two
        stopped_at, pieces = _feed_one_by_one(tokenizer, tokens, stop)
        assert stopped_at is None and "".join(pieces) == TEXT
        assert not any("\ufffd" in p for p in pieces)


def test_merge_deltas_joins_each_calls_deltas_in_order():
    batch = [(0, _delta([1], logprobs=[-0.1], prompt_logprobs=[None, -1.0])),
             (1, _delta([7])),
             (0, _delta([2, 3], logprobs=[-0.2, -0.3])),
             (1, {"error": "boom", "status": 500}),
             (0, _delta([4], finished=True, logprobs=[-0.4]))]
    merged = merge_deltas(batch)
    assert [i for i, _ in merged] == [0, 1, 1]
    first = merged[0][1]
    assert first.token_ids == [1, 2, 3, 4] and first.finished and first.finish_reason == "stop"
    assert first.extra("logprobs") == [-0.1, -0.2, -0.3, -0.4]
    assert first.extra("prompt_logprobs") == [None, -1.0]
    assert merged[1][1].token_ids == [7] and merged[2][1]["error"] == "boom"


def test_body_with_lone_surrogate_is_a_400():
    with pytest.raises(APIError) as e:
        parse_json(json.dumps({"prompt": "a\ud800b"}).encode())
    assert e.value.status == 400 and "surrogate" in e.value.message
    with pytest.raises(APIError):  # a surrogate as raw (CESU-8) bytes, no escape
        parse_json(b'{"prompt": "a\xed\xa0\x80"}')
    assert parse_json(json.dumps({"prompt": "ok \ud83d\ude42"}).encode())["prompt"] == "ok 🙂"
    with pytest.raises(APIError):
        parse_json(b'{"prompt": "\xff"}')


def test_prompt_encoder_refuses_what_cannot_fit_without_encoding(tokenizer):
    encoder = PromptEncoder(tokenizer, max_context=64)
    assert asyncio.run(encoder.encode("hello world")) == tokenizer.encode("hello world")
    huge = "x" * (encoder.max_prompt_chars + 1)
    with pytest.raises(ValueError, match="cannot fit"):
        asyncio.run(encoder.encode(huge))
    # the bound is safe: a text at the bound that is all of the longest token still
    # needs more tokens than the context holds
    assert encoder.max_prompt_chars // encoder.max_token_chars >= 64


def test_token_offsets_point_into_the_text_and_survive_a_stop(tokenizer):
    """text_offset per token: where the token's text starts in the final text. Multi-byte
    characters split over tokens start where the character does; tokens of the stop string,
    and after it, sit at or past the end of the text."""
    tokens = tokenizer.encode(TEXT)[1:]
    detok = IncrementalDetokenizer(tokenizer, [1, 2, 3], ["STOP"])
    for t in tokens:
        if not detok.stopped:
            detok.add(t)
    text, offsets = detok.text, detok.token_offsets(0, len(tokens))
    assert text == TEXT[:TEXT.index("STOP")]
    assert offsets == sorted(offsets) and offsets[0] == 0 and len(offsets) == len(tokens)
    kept = [k for k, o in enumerate(offsets) if o < len(text)]
    # Rebuilding the text from each token's span: the spans tile the text exactly.
    spans = [text[offsets[k]:offsets[k + 1]] for k in kept[:-1]] + [text[offsets[kept[-1]]:]]
    assert "".join(spans) == text
    for k in kept:  # a token that decodes to whole characters on its own starts with them
        alone = tokenizer.decode([tokens[k]])
        if "\ufffd" not in alone and alone.strip():
            assert text.startswith(alone.strip(), offsets[k] + len(alone) - len(alone.lstrip()))
    assert all(o >= len(text) for o in offsets[kept[-1] + 1:])
