"""`RuntimeEndpoint`: the HTTP client a program runs against (radixserve's OpenAI API).

Every generation sends the program's whole text so far as a /v1/completions prompt; the
server's radix cache finds the part it has seen before, so the client keeps no KV state.
"""
from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import requests

from frontend.chat_template import ChatMarkers, derive_markers


class ServerError(RuntimeError):
    """The server refused or failed a request; `message` is the server's own."""

    def __init__(self, message: str, status: int | None = None, type: str | None = None) -> None:
        super().__init__(message if status is None else f"[{status}] {message}")
        self.message = message
        self.status = status
        self.type = type


@dataclass
class Usage:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0

    @classmethod
    def of(cls, usage: dict[str, Any] | None) -> Usage:
        usage = usage or {}
        details = usage.get("prompt_tokens_details") or {}
        return cls(usage.get("prompt_tokens", 0), details.get("cached_tokens", 0),
                   usage.get("completion_tokens", 0))


@dataclass
class Completion:
    text: str
    finish_reason: str | None
    usage: Usage


@dataclass
class ChoiceScores:
    """What `select` decided from: per choice, the log-probabilities of its tokens."""

    token_logprobs: list[list[float]]
    usage: Usage
    normalized: list[float] = field(init=False)

    def __post_init__(self) -> None:
        self.normalized = [sum(lps) / len(lps) for lps in self.token_logprobs]

    @property
    def best(self) -> int:
        return max(range(len(self.normalized)), key=self.normalized.__getitem__)


class RuntimeEndpoint:
    """A radixserve server at `base_url` (e.g. "http://127.0.0.1:8000")."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 600.0,
                 lora: str | None = None) -> None:
        """`lora`: a LoRA adapter every request runs under (a gen's own `lora` wins)."""
        self.base_url = base_url.rstrip("/")
        self._model = {"model": lora} if lora else {}
        self.timeout = timeout
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._local = threading.local()  # one requests.Session (connection pool) per thread
        self._markers: ChatMarkers | None = None
        self._markers_lock = threading.Lock()

    # -- generation ------------------------------------------------------------------

    def generate(self, prompt: str, params: dict[str, Any]) -> Completion:
        body = self._post("/v1/completions", {"prompt": prompt, **self._model, **params})
        choice = body["choices"][0]
        return Completion(choice["text"], choice.get("finish_reason"), Usage.of(body.get("usage")))

    def generate_stream(self, prompt: str, params: dict[str, Any]) -> Iterator[str | Completion]:
        """Text deltas as they arrive, then one final `Completion` (text, reason, usage)."""
        body = {"prompt": prompt, **self._model, **params, "stream": True,
                "stream_options": {"include_usage": True}}
        text, reason, usage = [], None, Usage()
        with self._session().post(self.base_url + "/v1/completions", json=body, stream=True,
                                  headers=self._headers, timeout=self.timeout) as r:
            _raise_for_error(r)
            for chunk in _sse_events(r):
                if chunk.get("usage"):
                    usage = Usage.of(chunk["usage"])
                for choice in chunk.get("choices") or []:
                    reason = choice.get("finish_reason") or reason
                    if choice.get("text"):
                        text.append(choice["text"])
                        yield choice["text"]
        yield Completion("".join(text), reason, usage)

    def cache_prefix(self, prompt: str) -> Usage:
        """Have the server prefill `prompt` (one token generated) so later requests reuse it."""
        return self.generate(prompt, {"max_tokens": 1, "temperature": 0}).usage

    def score_choices(self, prefix: str, choices: list[str],
                      scheduling: dict[str, Any] | None = None) -> ChoiceScores:
        """Log-probabilities of each choice's tokens after `prefix`, in one batched request.

        Prompts go as token ids, so the server scores exactly the tokens counted here. Where
        a choice merges with the prefix's last token, that token is scored as the choice's.
        `scheduling`: the request's priority and queue_timeout_s, if set."""
        prefix_ids, *full = self.tokenize([prefix] + [prefix + c for c in choices])
        # token 0 has no logprob
        starts = [max(1, len(os.path.commonprefix([prefix_ids, ids]))) for ids in full]
        body = self._post("/v1/completions", {
            "prompt": full, "max_tokens": 1, "temperature": 0, "echo": True, "logprobs": 0,
            "prompt_logprobs_start": min(starts), **self._model, **(scheduling or {})})
        by_index = sorted(body["choices"], key=lambda c: c["index"])
        scores = [c["logprobs"]["token_logprobs"][start:len(ids)]
                  for c, start, ids in zip(by_index, starts, full)]
        if any(lp is None for lps in scores for lp in lps):
            raise ServerError("the server returned no prompt log-probabilities (echo with "
                              "logprobs unsupported?)")
        return ChoiceScores(scores, Usage.of(body.get("usage")))

    # -- tokens and chat template -----------------------------------------------------

    def tokenize(self, prompts: list[str]) -> list[list[int]]:
        """Token ids as /v1/completions sees each text prompt."""
        return self._post("/tokenize", {"prompt": prompts})["tokens"]

    def render_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The server's chat-template rendering, as text to send as a completions prompt."""
        return self._post("/tokenize", {"messages": messages,
                                        "add_generation_prompt": add_generation_prompt})["prompt"]

    def chat_markers(self) -> ChatMarkers:
        """Role prefixes/suffixes of the served model's chat template (fetched once)."""
        with self._markers_lock:
            if self._markers is None:
                self._markers = derive_markers(self.render_chat)
            return self._markers

    def stats(self) -> dict[str, Any]:
        return self._get("/v1/stats")

    # -- HTTP ---------------------------------------------------------------------------

    def _session(self) -> requests.Session:
        session = getattr(self._local, "session", None)
        if session is None:
            session = self._local.session = requests.Session()
        return session

    def _post(self, path: str, body: dict[str, Any]) -> Any:
        r = self._session().post(self.base_url + path, json=body, headers=self._headers,
                                 timeout=self.timeout)
        _raise_for_error(r)
        return r.json()

    def _get(self, path: str) -> Any:
        r = self._session().get(self.base_url + path, headers=self._headers, timeout=self.timeout)
        _raise_for_error(r)
        return r.json()


def _raise_for_error(r: requests.Response) -> None:
    if r.status_code < 400:
        return
    try:
        err = r.json()["error"]
        raise ServerError(err["message"], r.status_code, err.get("type"))
    except (ValueError, KeyError, TypeError):
        raise ServerError(r.text or r.reason, r.status_code) from None


def _sse_events(r: requests.Response) -> Iterator[dict[str, Any]]:
    # chunk_size=None hands lines over as they arrive instead of waiting to fill a buffer.
    for raw in r.iter_lines(chunk_size=None):
        line = raw.decode("utf-8")
        if not line.startswith("data:"):
            continue
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            return
        event = json.loads(data)
        if "error" in event:  # a failure after the stream started (status was already 200)
            err = event["error"]
            raise ServerError(err.get("message", "stream failed"), None, err.get("type"))
        yield event


_default_backend: RuntimeEndpoint | None = None


def set_default_backend(backend: RuntimeEndpoint) -> None:
    global _default_backend
    _default_backend = backend


def get_default_backend() -> RuntimeEndpoint:
    if _default_backend is None:
        raise RuntimeError("no backend: call set_default_backend(RuntimeEndpoint(url)) or pass backend=")
    return _default_backend
