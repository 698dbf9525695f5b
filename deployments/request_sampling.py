"""A request's sampling fields as keyword arguments for `engine.SamplingParams`: only the
fields the client set, so the engine's defaults apply otherwise. This module does not import
`engine`: the caller builds `SamplingParams(**kwargs)` (turning its ValueError into a 400)."""
from __future__ import annotations

from typing import Any

from deployments.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields

# Request field name -> SamplingParams field name, copied only when not None.
_PASSTHROUGH = (
    "temperature", "top_p", "seed", "presence_penalty", "frequency_penalty", "top_k",
    "min_p", "repetition_penalty", "ignore_eos", "stop_token_ids", "regex", "json_schema",
    "ebnf", "skip_special_tokens", "logit_bias", "min_tokens", "include_stop_str_in_output",
    "priority", "queue_timeout_s",
)


def _common_sampling_kwargs(req: SamplingFields) -> dict[str, Any]:
    kwargs = {name: getattr(req, name) for name in _PASSTHROUGH if getattr(req, name) is not None}
    if req.stop is not None:
        kwargs["stop"] = [req.stop] if isinstance(req.stop, str) else list(req.stop)
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        kwargs["json_object"] = True
    elif fmt is not None and fmt.type == "json_schema" and fmt.json_schema is not None:
        kwargs["json_schema"] = fmt.json_schema.schema_
    return kwargs





def completion_sampling_kwargs(req: CompletionRequest) -> dict[str, Any]:
    """Keyword arguments for `engine.SamplingParams(**kwargs)`: only the fields the client
    set (engine defaults apply otherwise), and always max_tokens (OpenAI's default is 16)."""
    kwargs = _common_sampling_kwargs(req)
    kwargs["max_tokens"] = req.max_tokens
    if req.logprobs is not None:
        # Completions API: logprobs=k means "sampled token + k alternatives"; 0 is just the sampled one.
        kwargs["logprobs"] = True
        kwargs["top_logprobs"] = req.logprobs
    if req.prompt_logprobs_start is not None:
        kwargs["prompt_logprobs_start"] = req.prompt_logprobs_start
    elif req.echo and req.logprobs is not None:
        kwargs["prompt_logprobs_start"] = 0
    return kwargs


def chat_sampling_kwargs(
    req: ChatCompletionRequest, default_max_tokens: int | None = None
) -> dict[str, Any]:
    """Keyword arguments for `engine.SamplingParams(**kwargs)`, as for completions;
    `default_max_tokens` serves requests that give neither max_tokens nor
    max_completion_tokens (e.g. the context length left over)."""
    kwargs = _common_sampling_kwargs(req)
    max_tokens = req.requested_max_tokens
    if max_tokens is None:
        max_tokens = default_max_tokens
    if max_tokens is not None:  # else SamplingParams' own default applies
        kwargs["max_tokens"] = max_tokens
    if req.logprobs:
        kwargs["logprobs"] = True
        kwargs["top_logprobs"] = req.top_logprobs or 0
    return kwargs


