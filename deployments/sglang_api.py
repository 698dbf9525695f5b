"""SGLang's native HTTP API (`POST /generate` and friends), next to the OpenAI one.

SGLang's own clients (`sgl.RuntimeEndpoint`, `python -m sglang.bench_serving --backend
sglang`) speak this: `text` or `input_ids` (one or a batch), `sampling_params` with SGLang's
names (`max_new_tokens`, ...), logprobs as (logprob, token id, text) triples, and a
`meta_info` per output. Requests go through the same fan-out as /v1/completions
(deployments/streams.py); this module only translates the two shapes.

No silent drops: a field SGLang knows and radixserve does not honour is a 400 when it is
set to anything but its "off" value (None, False, 0, empty), so clients that always send
e.g. `return_hidden_states: false` still work.
"""
from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from deployments.protocol_responses import SSE_DONE
from deployments.streams import ChoiceState, error_of, merge_deltas

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default when sampling_params leaves it out

# SGLang sampling_params names that differ from SamplingParams' (the rest are the same).
_RENAMED = {"max_new_tokens": "max_tokens", "sampling_seed": "seed", "min_new_tokens": "min_tokens",
            "no_stop_trim": "include_stop_str_in_output"}


class _Lenient(BaseModel):
    """Wrong types fail; unknown fields are kept so that `refuse_set_extras` can judge them."""

    model_config = ConfigDict(strict=True, extra="allow")

    def refuse_set_extras(self, where: str) -> None:
        for name, value in (self.model_extra or {}).items():
            if value not in (None, False, 0, "", [], {}):
                raise ValueError(f"{where}{name} is not supported by this server")


class SGLSamplingParams(_Lenient):
    """SGLang's sampling_params. None = the engine's default."""

    max_new_tokens: int = Field(default=DEFAULT_MAX_NEW_TOKENS, ge=0)
    n: int = Field(default=1, ge=1, le=16)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    regex: str | None = None
    json_schema: str | dict | None = None
    ebnf: str | None = None
    sampling_seed: int | None = None
    min_new_tokens: int | None = None
    logit_bias: dict[str, float] | None = None
    no_stop_trim: bool | None = None  # keep the stop string in the text
    # Accepted at their "off" values (SGLang's clients send them), refused otherwise.
    stop_regex: str | list[str] | None = None
    spaces_between_special_tokens: bool = True

    @model_validator(mode="after")
    def _refuse_unsupported(self) -> SGLSamplingParams:
        self.refuse_set_extras("sampling_params.")
        if self.stop_regex:
            raise ValueError("sampling_params.stop_regex is not supported; use stop or regex")
        if not self.spaces_between_special_tokens:
            raise ValueError("sampling_params.spaces_between_special_tokens=false is not supported")
        return self

    def to_kwargs(self) -> dict[str, Any]:
        """SamplingParams keyword arguments (only what the request set)."""
        names = ("max_new_tokens", "temperature", "top_p", "top_k", "min_p", "frequency_penalty",
                 "presence_penalty", "repetition_penalty", "stop_token_ids", "ignore_eos",
                 "skip_special_tokens", "regex", "json_schema", "ebnf", "sampling_seed",
                 "min_new_tokens", "logit_bias", "no_stop_trim")
        kwargs = {_RENAMED.get(n, n): getattr(self, n) for n in names if getattr(self, n) is not None}
        if self.stop:
            kwargs["stop"] = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        return kwargs


class GenerateRequest(_Lenient):
    """SGLang's GenerateReqInput, the part radixserve serves."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict | list[dict] | None = None
    return_logprob: bool | list[bool] | None = None
    logprob_start_len: int | list[int] | None = None
    top_logprobs_num: int | list[int] | None = None
    return_text_in_logprobs: bool = False
    stream: bool = False
    rid: str | list[str] | None = None
    model: str | None = None
    # SGLang's request priority, served LOWER first as everywhere in radixserve (vLLM's
    # order; SGLang's with --schedule-low-priority-values-first), and radixserve's queue
    # deadline in seconds; each one value for all prompts or one per prompt.
    priority: int | list[int] | None = None
    queue_timeout_s: float | list[float] | None = None
    # the LoRA adapter (a loaded adapter's name or path), one for all prompts or one each
    lora_path: str | None | list[str | None] = None

    @model_validator(mode="after")
    def _one_input(self) -> GenerateRequest:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of 'text' and 'input_ids'")
        self.refuse_set_extras("")
        return self

    @property
    def is_batch(self) -> bool:
        if self.text is not None:
            return isinstance(self.text, list)
        return bool(self.input_ids) and isinstance(self.input_ids[0], list)

    def prompts(self) -> list[str | list[int]]:
        if not self.is_batch:
            return [self.text if self.text is not None else self.input_ids]
        return list(self.text if self.text is not None else self.input_ids)

    def per_prompt(self, name: str, i: int) -> Any:
        """A field that may be one value for all prompts or a list with one per prompt."""
        value = getattr(self, name)
        if isinstance(value, list):
            if len(value) != len(self.prompts()):
                raise ValueError(f"{name} has {len(value)} entries for {len(self.prompts())} prompts")
            return value[i]
        return value


class PromptPlan(BaseModel):
    """How one prompt of a /generate request is run and reported."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    kwargs: dict[str, Any]
    n: int
    score_only: bool  # max_new_tokens=0: the prompt is scored, no token is kept
    return_logprob: bool
    logprob_start_len: int
    top_logprobs_num: int
    rid: str | None  # the client's id for this prompt's outputs (meta_info.id)


def plan_prompt(req: GenerateRequest, i: int, prompt_len: int) -> PromptPlan:
    """SamplingParams kwargs and reporting choices for prompt `i` (of `prompt_len` tokens)."""
    params = SGLSamplingParams.model_validate(req.per_prompt("sampling_params", i) or {})
    kwargs = params.to_kwargs()
    for name, key in (("priority", "priority"), ("queue_timeout_s", "queue_timeout_s"),
                      ("lora_path", "lora")):
        if (value := req.per_prompt(name, i)) is not None:
            kwargs[key] = value
    score_only = kwargs["max_tokens"] == 0
    if score_only:  # the engine always samples one token: run one, report none
        kwargs.update(max_tokens=1, ignore_eos=True)
    want = bool(req.per_prompt("return_logprob", i))
    start = req.per_prompt("logprob_start_len", i)
    start = -1 if start is None else start
    top = req.per_prompt("top_logprobs_num", i) or 0
    if want:
        kwargs.update(logprobs=True, top_logprobs=top)
        if 0 <= start < prompt_len:
            kwargs["prompt_logprobs_start"] = start
    return PromptPlan(kwargs=kwargs, n=params.n, score_only=score_only, return_logprob=want,
                      logprob_start_len=start if 0 <= start < prompt_len else prompt_len,
                      top_logprobs_num=top, rid=req.per_prompt("rid", i))


class OutputBuilder:
    """ChoiceState -> SGLang's output object ({"text", "output_ids", "meta_info"})."""

    def __init__(self, tokenizer, eos_ids: set[int], with_text: bool) -> None:
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.with_text = with_text
        self.started = time.perf_counter()

    def output(self, c: ChoiceState, plan: PromptPlan, prompt_ids: list[int], rid: str) -> dict:
        kept = 0 if plan.score_only else len(c.token_ids)
        meta = {"id": rid, "finish_reason": self._finish(c, plan, kept),
                "prompt_tokens": c.prompt_tokens or len(prompt_ids),
                "completion_tokens": min(c.completion_tokens, kept), "cached_tokens": c.cached_tokens,
                "e2e_latency": time.perf_counter() - self.started}
        if plan.return_logprob:
            meta.update(self._logprobs(c, plan, prompt_ids, kept))
        text = "" if plan.score_only else "".join(c.text)
        return {"text": text, "output_ids": c.token_ids[:kept], "meta_info": meta}

    def _finish(self, c: ChoiceState, plan: PromptPlan, kept: int) -> dict | None:
        if c.finish_reason is None:
            return None
        if plan.score_only or c.finish_reason == "length":
            return {"type": "length", "length": kept}
        if c.finish_reason == "abort":
            return {"type": "abort", "message": "aborted"}
        last = c.token_ids[-1] if c.token_ids else None
        stop_ids = self.eos_ids | set(plan.kwargs.get("stop_token_ids", ()))
        return {"type": "stop", "matched": last if last in stop_ids else None}

    def _triple(self, lp: float | None, token: int) -> list:
        return [lp, token, self.tokenizer.token_str(token) if self.with_text else None]

    def _logprobs(self, c: ChoiceState, plan: PromptPlan, prompt_ids: list[int], kept: int) -> dict:
        start = plan.logprob_start_len
        scores = c.prompt_logprobs or [None] * len(prompt_ids)
        inputs = [self._triple(scores[j], prompt_ids[j]) for j in range(start, len(prompt_ids))]
        outputs = [self._triple(lp, t) for lp, t in zip(c.logprobs[:kept], c.token_ids[:kept])]
        meta = {"input_token_logprobs": inputs, "output_token_logprobs": outputs}
        if plan.top_logprobs_num:
            tops = c.prompt_top_logprobs or [None] * len(prompt_ids)
            meta["input_top_logprobs"] = [None if tops[j] is None else
                                          [self._triple(lp, t) for t, lp in tops[j]]
                                          for j in range(start, len(prompt_ids))]
            meta["output_top_logprobs"] = [[self._triple(lp, t) for t, lp in alts]
                                           for alts in c.top_logprobs[:kept]]
        return meta


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


async def sse_outputs(batches, stream, choices: list[ChoiceState], render) -> AsyncIterator[str]:
    """SGLang's stream: after each delta, the choice's whole output so far (`render(choice)`:
    cumulative text, as SGLang sends it), then `data: [DONE]`."""
    try:
        async for batch in batches:
            events = []
            for i, item in merge_deltas(batch):
                if (error := error_of(item)) is not None:
                    events.append(error.sse_event())
                    yield "".join(events)
                    return
                choices[i].add(item)
                events.append(sse(render(choices[i])))
            yield "".join(events)
        yield SSE_DONE
    finally:
        await stream.aclose()


def model_info(model_path: str, tokenizer_path: str, served_model_name: str,
               preferred_sampling_params: dict | None) -> dict:
    """GET /get_model_info (and /model_info): what `sgl.RuntimeEndpoint` reads first."""
    return {"model_path": model_path, "tokenizer_path": tokenizer_path,
            "served_model_name": served_model_name, "is_generation": True,
            "preferred_sampling_params": preferred_sampling_params,
            "weight_version": "default", "has_image_understanding": False,
            "has_audio_understanding": False}


def server_info(info: dict, stats: dict) -> dict:
    """GET /get_server_info (and /server_info): settings, and the engines' counters as
    `internal_states` (bench_serving reads avg_spec_accept_length there)."""
    totals = {k: v for k, v in stats.items() if k not in ("replicas", "router")}
    if totals.get("spec_steps"):  # summed over replicas: recompute the mean from the sums
        totals["avg_spec_accept_length"] = (
            (totals["spec_accepted_tokens"] + totals["spec_steps"]) / totals["spec_steps"])
    return {**info, "internal_states": [totals], "version": "radixserve", "frontend": "python"}
