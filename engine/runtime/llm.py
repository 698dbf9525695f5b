"""The offline facade: `LLM(model=...).generate(prompts, params)` over an `Engine` (with its
tensor-parallel ranks as local processes), or over a `PoolingEngine` for task embed / score."""
from __future__ import annotations

from engine.config import EngineConfig
from engine.core.outputs import RequestOutput
from engine.core.sampling_params import SamplingParams
from engine.loading.tokenizer import Tokenizer
from engine.runtime.engine import Engine
from engine.runtime.pooling_engine import PoolingEngine
from engine.runtime.pooling_requests import OfflinePooling


class LLM:
    """Offline batch generation: `LLM(model=...).generate(prompts, params)`; with
    `task="embed"` or `"score"`, `.embed(texts)` and `.score(query, documents)` instead."""

    def __init__(self, model: str = "", **kwargs) -> None:
        config = EngineConfig.from_kwargs(model=model, **kwargs)
        self._workers = None
        self.pooling = None
        if config.task != "generate":
            self.pooling = OfflinePooling(PoolingEngine(config))
            return
        if config.tp_size > 1:  # ranks 1..tp-1 as local processes; this process is rank 0
            from engine.runtime.tp_worker import LocalWorkers, rank_config

            self._workers = LocalWorkers(config)
            config = rank_config(config, 0)
        try:
            self.engine = Engine(config, tp=self._workers.tp if self._workers else None)
        except BaseException:
            self.close()
            raise
        self._next_id = 0

    def close(self) -> None:
        """Stop the tensor-parallel worker processes (also at exit and on garbage collection)."""
        workers, self._workers = getattr(self, "_workers", None), None
        if workers is not None:
            workers.close()

    def __del__(self) -> None:
        self.close()

    def generate(self, prompts: list[str] | list[list[int]] | str,
                 params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        if self.pooling is not None:
            raise ValueError(f"this model serves task {self.pooling.engine.task!r}, not generation")
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params or SamplingParams()
        all_params = params if isinstance(params, list) else [params] * len(prompts)
        if len(all_params) != len(prompts):
            raise ValueError("need one SamplingParams per prompt")
        ids = [self._tokenize_and_check(p, sp) for p, sp in zip(prompts, all_params)]
        reqs = []
        for prompt_ids, sp in zip(ids, all_params):
            self._next_id += 1
            reqs.append(self.engine.add_request(f"offline-{self._next_id}", prompt_ids, sp))
        while self.engine.has_work:
            self.engine.step()
        outputs = [self.engine.output_of(r) for r in reqs]
        for r in reqs:
            self.engine.requests.pop(r.request_id, None)
        return outputs

    def _tokenize_and_check(self, prompt, params: SamplingParams) -> list[int]:
        # Validate the whole batch before queueing any of it.
        ids = self.engine.tokenize_prompt(prompt)
        self.engine.validate(ids, params)
        return ids

    def embed(self, inputs, dimensions: int | None = None,
              truncate_prompt_tokens: int | None = None) -> list[list[float]]:
        """One vector per input (texts or token ids, one or a list); task 'embed'."""
        return self._pooling("embed").embed(inputs, dimensions, truncate_prompt_tokens)

    def score(self, query: str, documents: list[str],
              truncate_prompt_tokens: int | None = None) -> list[float]:
        """The cross-encoder's logit for each (query, document); task 'score'."""
        return self._pooling("score").score(query, documents, truncate_prompt_tokens)

    def _pooling(self, task: str) -> OfflinePooling:
        if self.pooling is None:
            raise ValueError(f"{task}() needs task='{task}'; this model serves 'generate'")
        return self.pooling

    def stats(self) -> dict:
        return self.pooling.engine.stats_dict() if self.pooling else self.engine.stats()

    @property
    def tokenizer(self) -> Tokenizer:
        return self.pooling.engine.tokenizer if self.pooling else self.engine.tokenizer
