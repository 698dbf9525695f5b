"""Per-request sampling settings, validated before anything is allocated."""
from __future__ import annotations

import json
import math
import numbers
from dataclasses import dataclass, field

_MAX_TOP_LOGPROBS = 20


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: no top-k
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False  # the output text keeps the stop string it hit
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0  # EOS and stop_token_ids cannot be sampled before this many tokens
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit (OpenAI's)
    skip_special_tokens: bool = True
    logprobs: bool = False
    top_logprobs: int = 0
    # Return the log-probability of every prompt token from this index on (the first
    # token has none). Cached prefix tokens before it are reused; from it on, recomputed.
    prompt_logprobs_start: int | None = None
    # Structured output (at most one of these)
    regex: str | None = None
    json_schema: dict | str | None = None
    ebnf: str | None = None
    json_object: bool = False
    # The constraint starts once the output has written this text (e.g. "</think>": the
    # model reasons freely, its answer is constrained); None: from the first token.
    grammar_after: str | None = None
    # Scheduling, not sampling; they travel with the request's other settings.
    # Lower values are admitted first (as vLLM's); engine/core/admission.py.
    priority: int = 0
    # Seconds the request may wait for its first admission (engine/core/queue_deadlines.py).
    queue_timeout_s: float | None = None
    # The LoRA adapter (its registered name) the request runs under; None: the base model.
    lora: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == 0:
            self.top_k = -1
        if self.logit_bias:  # JSON object keys are strings
            try:
                self.logit_bias = {int(t): float(b) for t, b in self.logit_bias.items()}
            except (TypeError, ValueError):
                raise ValueError("logit_bias maps token ids to numbers") from None
        self.validate()

    def validate(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ValueError(msg)

        need(isinstance(self.max_tokens, int) and self.max_tokens >= 1,
             f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        need(0.0 <= self.temperature <= 100.0, f"temperature must be in [0, 100], got {self.temperature}")
        need(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")
        need(isinstance(self.top_k, int) and (self.top_k == -1 or self.top_k >= 1),
             f"top_k must be -1 (disabled) or >= 1, got {self.top_k!r}")
        need(0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}")
        need(0.0 < self.repetition_penalty <= 10.0,
             f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}")
        need(-2.0 <= self.frequency_penalty <= 2.0,
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        need(-2.0 <= self.presence_penalty <= 2.0,
             f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        need(self.seed is None or (isinstance(self.seed, int) and 0 <= self.seed < 2**63),
             f"seed must be a non-negative integer, got {self.seed!r}")
        need(all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty strings")
        need(len(self.stop) <= 16, "at most 16 stop strings")
        need(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
             "stop_token_ids must be non-negative integers")
        need(isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens,
             f"min_tokens must be an integer in [0, max_tokens], got {self.min_tokens!r}")
        need(all(t >= 0 and -100.0 <= b <= 100.0 for t, b in (self.logit_bias or {}).items()),
             "logit_bias maps token ids >= 0 to biases in [-100, 100]")
        need(isinstance(self.top_logprobs, int) and 0 <= self.top_logprobs <= _MAX_TOP_LOGPROBS,
             f"top_logprobs must be in [0, {_MAX_TOP_LOGPROBS}], got {self.top_logprobs!r}")
        need(self.prompt_logprobs_start is None
             or (isinstance(self.prompt_logprobs_start, int) and self.prompt_logprobs_start >= 0),
             f"prompt_logprobs_start must be a non-negative integer, got {self.prompt_logprobs_start!r}")
        need(isinstance(self.priority, numbers.Integral) and not isinstance(self.priority, bool),
             f"priority must be an integer, got {self.priority!r}")
        timeout = self.queue_timeout_s
        need(timeout is None or (isinstance(timeout, numbers.Real) and not isinstance(timeout, bool)
                                 and math.isfinite(timeout) and timeout > 0),
             f"queue_timeout_s must be a positive number of seconds, got {timeout!r}")
        need(self.lora is None or (isinstance(self.lora, str) and self.lora),
             f"lora must be an adapter name, got {self.lora!r}")
        constraints = [c for c in (self.regex, self.json_schema, self.ebnf) if c is not None]
        need(len(constraints) + int(self.json_object) <= 1,
             "at most one of regex, json_schema, ebnf, json_object may be set")
        need(self.grammar_after is None or (isinstance(self.grammar_after, str)
                                            and self.grammar_after and self.has_constraint),
             "grammar_after must be a non-empty string, with a constraint to start")
        if isinstance(self.json_schema, str):
            try:
                self.json_schema = json.loads(self.json_schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"json_schema is not valid JSON: {e}") from None
        need(self.json_schema is None or isinstance(self.json_schema, (dict, bool)),
             "json_schema must be a JSON object")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def has_constraint(self) -> bool:
        return self.json_object or any(c is not None for c in (self.regex, self.json_schema, self.ebnf))

    @property
    def reads_token_counts(self) -> bool:
        """Penalties that read the request's token counts (repetition, frequency, presence)."""
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0
                or self.presence_penalty != 0.0)

    @property
    def has_penalties(self) -> bool:
        """Anything that edits the logits from the request's own tokens (counted on the
        device by the sampler, engine/executor/penalties.py)."""
        return self.reads_token_counts or bool(self.logit_bias) or self.min_tokens > 0
