"""Per-request state as the scheduler sees it."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from engine.core.sampling_params import SamplingParams
from engine.core.spec_stats import SpecStats

if TYPE_CHECKING:
    from engine.core.tree_node import TreeNode


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class KVRecord:
    """Where a running request's KV lives: one record per request, written only by the
    scheduler (the runner reads it to build each step).

    `slots[i]` holds the KV of token i. The first `locked_len` belong to the radix tree,
    under `node`, which the request keeps locked (so they are not evicted); the rest are
    the request's own. `row` is its row of the device req_to_token table, whose first
    `row_valid` entries already equal `slots`."""

    row: int
    slots: list[int]
    locked_len: int
    node: TreeNode
    row_valid: int = 0


@dataclass(eq=False)
class Request:
    """A request's tokens, its KV, and where it stands.

    `token_ids` is prompt + generated, as far as the host knows them; with overlap scheduling
    `inflight` more were sampled by launched steps and are still on the device (their KV is
    computed by the next step, which reads them there). KV exists for the first `kv_len`
    tokens; while the request runs, `kv` (owned by the scheduler) says where it lives.
    Every step computes KV for some of `token_ids[kv_len:]`; when that reaches the end, the
    logits of the last token are sampled. Decoding is the case of one new token.
    """

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: float = field(default_factory=time.monotonic)
    scheduled_at: float | None = None  # first admission: queue time = scheduled_at - arrival
    token_ids: list[int] = field(default_factory=list)
    inflight: int = 0  # tokens sampled on the device, not yet appended to token_ids
    kv: KVRecord | None = None  # while running
    status: Status = Status.WAITING
    finish_reason: str | None = None
    cached_tokens: int = 0  # prompt tokens served from the cache at first admission
    host_loaded: int = 0  # of its prefix, tokens loaded back from the host tier for it
    admitted_once: bool = False
    num_preemptions: int = 0
    prompt_logprobs: list[float | None] | None = None  # when params.prompt_logprobs_start is set
    prompt_logprobs_next: int = 0  # prompt_logprobs are filled in order up to here
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None  # and top_logprobs > 0
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    grammar: Any = None  # structured output: grammar.Matcher (a Future while compiling)
    detok: Any = None  # IncrementalDetokenizer, fed lazily
    sampler_state: Any = None  # per-request RNG etc., owned by the sampler
    spec_stats: SpecStats = field(default_factory=SpecStats)  # speculative decoding counters
    # LoRA (engine/lora/): the adapter's id (0: the base model; it also keys the radix
    # cache) and, while running, its slot in the GPU pool (-1: none).
    lora_id: int = 0
    lora_slot: int = -1

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_ids)
        if self.params.prompt_logprobs_start is not None:
            self.prompt_logprobs = [None] * len(self.prompt_ids)
            if self.params.top_logprobs:
                self.prompt_top_logprobs = [None] * len(self.prompt_ids)
            self.prompt_logprobs_next = max(self.params.prompt_logprobs_start, 1)

    @property
    def prompt_logprobs_from(self) -> int | None:
        """First prompt position whose logprob is still missing (None: none wanted/left)."""
        if self.prompt_logprobs is None or self.prompt_logprobs_next >= len(self.prompt_ids):
            return None
        return self.prompt_logprobs_next

    @property
    def kv_len(self) -> int:
        return len(self.kv.slots) if self.kv is not None else 0

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_ids):]

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        """Known tokens and those in flight."""
        return len(self.token_ids) + self.inflight

    @property
    def pending_len(self) -> int:
        """Tokens still without KV before the next sample."""
        return len(self.token_ids) + self.inflight - self.kv_len

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED


def validate_request(prompt_ids: list[int], params: SamplingParams, vocab_size: int,
                     max_context: int, pool_slots: int | None = None) -> None:
    """Raise ValueError, with what is wrong, for a request that can never run."""
    if not prompt_ids:
        raise ValueError("prompt is empty")
    bad = next((t for t in prompt_ids if not isinstance(t, int) or not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"prompt token id {bad!r} is outside the vocabulary [0, {vocab_size})")
    bad = next((t for t in params.stop_token_ids if t >= vocab_size), None)
    if bad is not None:  # it could never be generated: the stop would silently never happen
        raise ValueError(f"stop_token_ids: {bad} is outside the vocabulary [0, {vocab_size})")
    bad = next((t for t in params.logit_bias or () if t >= vocab_size), None)
    if bad is not None:
        raise ValueError(f"logit_bias: token {bad} is outside the vocabulary [0, {vocab_size})")
    total = len(prompt_ids) + params.max_tokens
    if total > max_context:
        raise ValueError(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) "
                         f"= {total} exceeds the model's context length of {max_context}")
    if pool_slots is not None and total > pool_slots:
        raise ValueError(f"prompt + max_tokens = {total} tokens exceeds the KV pool "
                         f"({pool_slots} tokens)")
