"""What an ingress replica must hold before it can read a request: the tokenizer, the
model's limits, the prompt encoder and the chat features.

Loading them takes seconds (transformers and torch imports, the tokenizer's files; ~14 s on
a GPU host while the engine process imports the same libraries). Serve routes nothing to an
ingress replica before its constructor returns, and until one replica is routable Serve's
proxy holds every request, probes included. So an ingress behind Serve loads these parts on
a thread after its constructor: it answers at once, with the readiness middleware's 503
`engine_starting` until both the parts and an engine replica are ready
(deployments/readiness.py). What can fail cheaply (a model path that is not there) is
checked in the constructor, so a bad config still fails the deploy.

Only while no replica of the ingress runs: a replica added later (autoscaling, a replaced
one, an update) loads them in its constructor as before, since Serve would otherwise route
live requests to it that then wait for its tokenizer while the others could serve them.
"""
from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from deployments.chat_request import ChatFeatures
from deployments.prompt_encoder import PromptEncoder
from deployments.responses import TokenNamer
from engine import Tokenizer, resolve_model_path

logger = logging.getLogger(__name__)

WAIT_POLL_S = 0.02


@dataclass
class IngressParts:
    tokenizer: Tokenizer
    vocab_size: int
    max_context: int
    name_token: TokenNamer
    encoder: PromptEncoder
    chat_features: ChatFeatures


@dataclass(frozen=True)
class PartsSource:
    """Where the parts come from: the app's settings that name them."""

    model_path: str
    tokenizer_path: str
    max_model_len: int | None = None
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None

    def check(self) -> None:
        """FileNotFoundError now for a model or tokenizer that is not there."""
        for what, path in (("model", self.model_path), ("tokenizer", self.tokenizer_path)):
            local = resolve_model_path(path)
            if not os.path.exists(local):
                raise FileNotFoundError(f"the ingress's {what} {path!r} is not there "
                                        f"(looked for {local!r})")


def another_replica_serves() -> bool:
    """Does Serve run another replica of this one's deployment already? False outside a
    Serve replica."""
    from ray import serve

    try:
        context = serve.get_replica_context()
        app = serve.status().applications.get(context.app_name)
    except Exception:  # noqa: BLE001 - not in a replica, or no controller to ask
        return False
    deployment = app.deployments.get(context.deployment) if app is not None else None
    return deployment is not None and deployment.replica_states.get("RUNNING", 0) > 0


def load_parts(source: PartsSource) -> IngressParts:
    from engine import load_hf_config  # torch and transformers: not on the module's import

    tokenizer = Tokenizer(source.tokenizer_path)  # the engine's `tokenizer` setting wins
    hf_config = load_hf_config(source.model_path)
    max_context = source.max_model_len or hf_config.max_position_embeddings
    # Tools in the template, tool_choice grammars, tool-call and reasoning parsing.
    features = ChatFeatures(tokenizer.hf, hf_config.model_type, source.tool_call_parser,
                            source.reasoning_parser)
    return IngressParts(tokenizer, hf_config.vocab_size, max_context, TokenNamer(tokenizer),
                        PromptEncoder(tokenizer, max_context), features)


class PartsLoader:
    """Loads the parts on a thread; `loaded` and `error` are read by the readiness
    middleware, `on_loaded(parts)` runs on the thread once they are in."""

    def __init__(self) -> None:
        self.loaded = True  # nothing to wait for until `start`
        self.error: str | None = None

    def load(self, source: PartsSource, on_loaded: Callable[[IngressParts], None],
             on_thread: bool = True) -> None:
        """`on_loaded(parts)`: now, or on a thread when `on_thread` and no other replica of
        this deployment runs yet (then a missing path still raises here)."""
        if not on_thread or another_replica_serves():
            on_loaded(load_parts(source))
            return
        source.check()
        self.start(source, on_loaded)

    def start(self, source: PartsSource, on_loaded: Callable[[IngressParts], None]) -> None:
        self.loaded = False
        threading.Thread(target=self._load, args=(source, on_loaded), daemon=True,
                         name="ingress-parts").start()

    async def wait(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.loaded and self.error is None and time.monotonic() < deadline:
            await asyncio.sleep(WAIT_POLL_S)

    def _load(self, source: PartsSource, on_loaded: Callable[[IngressParts], None]) -> None:
        try:
            on_loaded(load_parts(source))
        except Exception as e:  # noqa: BLE001 - reported by /health and the health check
            logger.exception("the ingress could not load its tokenizer and model config")
            self.error = f"{type(e).__name__}: {e}"
        else:
            self.loaded = True
