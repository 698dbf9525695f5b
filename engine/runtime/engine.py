"""The engine (`Engine`: requests in, one step at a time through its stepper, outputs and
stats out); its offline facade `LLM` is in engine/runtime/llm.py."""
from __future__ import annotations

import logging
import time

from engine.core.admission import check_priority
from engine.config import EngineConfig
from engine.runtime.gc_freeze import freeze_after_start
from engine.grammar import Grammars
from engine.layers.parallel import TPContext
from engine.executor.kv_transfer import make_host_tier
from engine.executor.model_runner import ModelRunner
from engine.executor.output_processor import OutputProcessor, feed_detokenizer
from engine.core.token_update import TokenUpdate
from engine.core.outputs import RequestOutput
from engine.runtime.overlap import OverlapStepper
from engine.runtime.prefix_exchange import (
    ExportedPrefix, cached_length, export_prefix, import_prefix,
)
from engine.core.queue_deadlines import QueueFullError, QueueTimeoutError, timeout_error
from engine.core.radix_cache import RadixCache
from engine.core.request import Request, validate_request
from engine.executor.sampler import Sampler
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler
from engine.speculative.draft_model import DraftModelProposer, draft_memory_reserve
from engine.speculative.ngram import NgramProposer
from engine.speculative.speculator import Speculator
from engine.runtime.sync_step import SyncStepper
from engine.loading.tokenizer import IncrementalDetokenizer, Tokenizer
from engine.lora import LoRAError, LoRANotFoundError
from engine.models import load_model
from engine.runtime.warmup import warm_up

logger = logging.getLogger(__name__)


class Engine:
    """Single-threaded core: add requests, call `step()` until they finish."""

    def __init__(self, config: EngineConfig, tp: TPContext | None = None) -> None:
        """At tp_size > 1 this is rank 0: `tp` is its context, already joined with the other
        ranks (engine/runtime/tp_worker.py starts them locally, deployments/tp_workers.py on Ray)."""
        self.config = config
        started = time.perf_counter()
        self.tokenizer = Tokenizer(config.tokenizer or config.model)
        logger.info("tokenizer loaded in %.2fs", time.perf_counter() - started)
        # A draft model's weights and KV pool share the memory the target's pool is sized from.
        reserve = draft_memory_reserve(config) if config.speculative_algorithm == "draft_model" else None
        self.runner = ModelRunner(config, tp=tp, reserve=reserve, load_model=load_model)
        self.max_context = self.runner.max_context
        allocator = self.runner.kv_pool.allocator
        tier = make_host_tier(config, self.runner.kv_pool)
        self.host_tier, self.kv_transfer = tier if tier is not None else (None, None)
        self.cache = RadixCache(allocator, enabled=config.enable_radix_cache,
                                record_events=config.enable_cache_events, host=self.host_tier)
        self.scheduler = Scheduler(config, allocator, self.cache)
        self.sampler = Sampler(self.runner.device, config.seed, self.tokenizer.eos_token_ids,
                               config.kernels.sort_free_cut)
        self.scheduler.release_hooks.append(self.sampler.release)
        self.lora = self.runner.lora  # LoRA adapters (engine/lora/), None when off
        if self.lora is not None:
            self.scheduler.adapter_gate = self.lora
            self.scheduler.release_hooks.append(self.lora.release)
        self.grammars = Grammars(config.grammar_backend, self.tokenizer.hf, self.runner.vocab_size,
                                 self.tokenizer.eos_token_ids, self.runner.device,
                                 jump_forward=config.enable_jump_forward)
        self.processor = OutputProcessor(self.scheduler, self.grammars,
                                         self.tokenizer.eos_token_ids, self.max_context)
        self.requests: dict[str, Request] = {}
        self.speculator = None
        if config.speculative_algorithm:
            self.speculator = Speculator(config, self.sampler, self.grammars,
                                         self._proposer(), target=self.runner)
            self.scheduler.release_hooks.append(self.speculator.release)
        self.stepper: SyncStepper | OverlapStepper = SyncStepper(
            self.scheduler, self.runner, self.sampler, self.processor, self.speculator)
        if overlap_enabled(config, self.runner.device.type, self.runner.tp.size):
            self.stepper = OverlapStepper(self.stepper, config.max_running_requests)
        # Compile every Triton specialization before serving; logs the start-up phases.
        self.startup = warm_up(self)
        freeze_after_start(self, config.freeze_gc_after_start)

    def _proposer(self) -> DraftModelProposer | NgramProposer:
        """The draft model checks its vocabulary against the target's and sizes its own KV
        pool like it; n-gram drafts come from each request's own tokens."""
        config = self.config
        if config.speculative_algorithm == "draft_model":
            return DraftModelProposer(config, self.sampler, self.runner, self.grammars)
        return NgramProposer(config.speculative_ngram_min_match,
                             config.speculative_ngram_max_match)

    def close(self) -> None:
        """At tp > 1: stop the other ranks (call once the step loop has stopped)."""
        self.runner.close()

    # -- requests -----------------------------------------------------------------------

    def tokenize_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def validate(self, prompt_ids: list[int], params: SamplingParams,
                 compile_grammar: bool = True) -> None:
        """Raise ValueError for a request that can never run; touches no engine state.
        A constraint is compiled here (in the caller's thread, or waiting for the pool's
        compile), so a bad regex or schema fails before anything is queued; the compiled
        grammar is cached for `add_request`."""
        validate_request(prompt_ids, params, self.runner.vocab_size, self.max_context,
                         self.runner.kv_pool.num_slots)
        check_priority(params, self.config.priority_scheduling)
        if params.lora is not None:
            self._lora_manager(params.lora).check(params.lora)
        if compile_grammar:
            self.grammars.check(params)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    validated: bool = False) -> Request:
        """Queue a request. `validated`: the caller ran `validate` (or the same checks, as
        ProcessAsyncEngine does in its parent) for exactly these ids and params."""
        prompt_ids = self.tokenize_prompt(prompt)
        if not validated:
            self.validate(prompt_ids, params, compile_grammar=False)
        # Not waited for here (the step loop may be calling): the engine waits only when the
        # request first samples, after its prefill. Callers that validate() first (LLM,
        # AsyncEngine) find it compiled already.
        grammar = self.grammars.submit(params) if params.has_constraint else None
        if grammar is not None and grammar.done() and grammar.exception() is not None:
            raise grammar.exception()
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        limit = self.config.max_queued_requests
        if limit:
            # Requests that arrive between two steps all wait until the next one admits them:
            # the batch's free places count too, so the engine takes what its callers count
            # as its capacity (max_running_requests + max_queued_requests).
            free = max(0, self.config.max_running_requests - len(self.scheduler.running))
            if len(self.scheduler.waiting) >= limit + free:
                raise QueueFullError(f"{len(self.scheduler.waiting)} requests are waiting "
                                     f"(limit {limit} + {free} free places in the batch)")
        req = Request(request_id, prompt_ids, params, grammar=grammar,
                      lora_id=self._lora_id(params))
        req.detok = IncrementalDetokenizer(self.tokenizer, prompt_ids, params.stop,
                                           params.skip_special_tokens, params.include_stop_str_in_output)
        self.requests[request_id] = req
        self.scheduler.add(req)
        return req

    def _lora_id(self, params: SamplingParams) -> int:
        return 0 if params.lora is None else self._lora_manager(params.lora).resolve(params.lora)

    # -- LoRA adapters (the serving layer's load/unload endpoints) -------------------------

    def _lora_manager(self, requested: str | None = None):
        """The LoRA manager; without one, LoRANotFoundError for a request naming an adapter
        (`requested`), LoRAError for an admin call."""
        if self.lora is None:
            if requested is not None:
                raise LoRANotFoundError(f"The model '{requested}' does not exist (this engine "
                                        "serves no LoRA adapters)")
            raise LoRAError("this engine serves no LoRA adapters (set lora_modules, "
                            "enable_lora or lora_dynamic_path)")
        return self.lora

    def load_lora(self, name: str, path: str) -> None:
        """Register a PEFT adapter (LoRAError, naming the tensor, when it cannot serve)."""
        self._lora_manager().load(name, path)

    def unload_lora(self, name: str) -> None:
        """Forget an adapter. Refused (LoRAError) while a request under it is queued or
        runs: its requests finish first, then it can go."""
        manager = self._lora_manager()
        adapter_id = manager.id_of(name)
        users = sum(1 for r in self.requests.values()
                    if r.lora_id == adapter_id and not r.is_finished)
        if users:
            raise LoRAError(f"adapter {name!r} is in use by {users} request(s); unload it "
                            "once they finish")
        manager.unload(name)

    def list_loras(self) -> list[dict]:
        return self.lora.list() if self.lora is not None else []

    def abort(self, request_id: str) -> Request | None:
        req = self.requests.pop(request_id, None)
        if req is not None and not req.is_finished:
            self.scheduler.abort(req)
        return req

    def abort_after_failed_step(self) -> list[Request]:
        """End the requests a failed step leaves in doubt: those running, or, when none
        ran (the step failed before admitting any), the waiting ones, so that a failure
        that recurs on every step cannot spin the loop forever. Returns them."""
        doomed = list(self.scheduler.running) or list(self.scheduler.waiting)
        for req in doomed:
            self.abort(req.request_id)
        return doomed

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or self.stepper.busy

    # -- the loop -----------------------------------------------------------------------

    def step(self) -> list[TokenUpdate]:
        """One step; requests that waited past their queue deadline come first, finished
        with reason "queue_timeout" and no tokens (`queue_timeout_error` says why)."""
        expired = self.scheduler.expire_queued(time.monotonic())
        updates = self.stepper.step()
        return [TokenUpdate(r, [], True) for r in expired] + updates if expired else updates

    def queue_timeout_error(self, req: Request) -> QueueTimeoutError:
        return timeout_error(req, self.config.max_queue_time_s)

    # -- reporting ----------------------------------------------------------------------

    def output_of(self, req: Request) -> RequestOutput:
        feed_detokenizer(req)
        return RequestOutput(
            request_id=req.request_id, prompt_token_ids=req.prompt_ids, token_ids=req.output_ids,
            text=req.detok.text, finish_reason=req.finish_reason, cached_tokens=req.cached_tokens,
            logprobs=req.output_logprobs if req.params.logprobs else None,
            prompt_logprobs=req.prompt_logprobs, prompt_top_logprobs=req.prompt_top_logprobs,
            top_logprobs=req.output_top_logprobs if req.params.top_logprobs else None,
            speculative=req.spec_stats.as_dict() if self.speculator else None)

    @property
    def num_jump_forward_tokens(self) -> int:
        """Output tokens appended by jump-forward (structured output), not decoded."""
        return self.processor.num_jump_forward_tokens

    def stats(self) -> dict:
        s = self.scheduler.stats
        pool = self.runner.kv_pool
        return {
            "prompt_tokens": s.prompt_tokens, "cached_tokens": s.cached_tokens,
            "generated_tokens": s.generated_tokens, "preemptions": s.preemptions,
            "priority_preemptions": s.priority_preemptions, "queue_timeouts": s.queue_timeouts,
            "cache_hit_rate": s.cached_tokens / s.prompt_tokens if s.prompt_tokens else 0.0,
            "free_slots": pool.allocator.num_free, "total_slots": pool.num_slots,
            "cached_slots": self.cache.total_size, "evictable_slots": self.cache.evictable_size,
            "kv_usage": 1.0 - (pool.allocator.num_free + self.cache.evictable_size) / pool.num_slots,
            "running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
            "finished_requests": s.finished_requests, "aborted_requests": s.aborted_requests,
            "steps": s.steps,
            **(self.speculator.stats_dict() if self.speculator else {}),
            **(self.lora.stats_dict() if self.lora else {}),
            **self._host_tier_stats(),
        }

    def _host_tier_stats(self) -> dict:
        """Per-tier hits and the host tier's traffic (counts, and `_seconds` totals, which
        /v1/stats sums over replicas too)."""
        s = self.scheduler.stats
        out = {"device_cached_tokens": s.cached_tokens - s.host_cached_tokens,
               "host_cached_tokens": s.host_cached_tokens}
        if self.host_tier is None:
            return out
        t, tier = self.kv_transfer, self.host_tier
        t.collect_times()
        return {**out, "host_total_slots": tier.num_slots, "host_used_slots": tier.used_slots,
                "host_loaded_tokens": tier.stats.loaded_tokens,
                "host_written_tokens": tier.stats.written_tokens,
                "host_dropped_tokens": tier.stats.dropped_tokens,
                "host_exported_tokens": tier.stats.exported_tokens,
                "host_imported_tokens": tier.stats.imported_tokens,
                "host_load_bytes": t.stats.load_bytes, "host_write_back_bytes": t.stats.write_back_bytes,
                "host_load_seconds": t.stats.load_s, "host_write_back_seconds": t.stats.write_back_s}

    # -- for the serving layer (deployments/ reads the engine only through these) ---------

    def flush_cache(self) -> None:
        """Drop every cached prefix (the radix tree), as SGLang's /flush_cache."""
        self.cache.reset()
        if self.speculator is not None:
            self.speculator.proposer.flush_cache()  # a draft model's own tree

    def drain_cache_events(self) -> list:
        """The radix cache's insert/evict events since the last call, oldest first (with
        `enable_cache_events`; the replica folds them into its routing digest)."""
        return self.cache.drain_events()

    def export_prefix(self, tokens: list[int], skip: int = 0) -> ExportedPrefix | None:
        """The KV of `tokens`' longest cached prefix past its first `skip` tokens (what the
        importer holds), for another replica (host tier only; None without one or without
        a match past `skip`)."""
        return export_prefix(self.cache, self.host_tier, tokens, skip)

    def cached_length(self, tokens: list[int]) -> int:
        """The tokens of `tokens`' longest prefix cached here, on the device or the host."""
        return cached_length(self.cache, tokens)

    def import_prefix(self, prefix: ExportedPrefix) -> int:
        """Take a prefix another replica exported into the host tier; tokens added."""
        return import_prefix(self.cache, self.host_tier, prefix)

    def drain_grammar_compile_times(self) -> list[float]:
        """Seconds each structured-output grammar compile took since the last call."""
        return self.grammars.drain_compile_times()


def overlap_enabled(config: EngineConfig, device_type: str, tp_size: int) -> bool:
    """Overlap scheduling runs on CUDA at tp 1 (the next step reads its in-flight input
    tokens from the device tensor rank 0 sampled; other ranks never see it), and not with
    speculative decoding (a step's drafts come from the previous step's tokens)."""
    return (config.enable_overlap_schedule and device_type == "cuda" and tp_size == 1
            and config.speculative_algorithm is None)
