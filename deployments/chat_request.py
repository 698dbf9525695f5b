"""What a chat request asks for beyond sampling: the template's inputs (messages, tools,
chat_template_kwargs), the grammar of a forced tool call, and how each choice's output is
read back (reasoning, tool calls). `ChatFeatures` is set up once per ingress from the
model's chat template and type; `plan` and `outputs` run per request."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from deployments.chat_output import ChatOutput
from deployments.chat_render import template_inputs, template_kwargs, template_source
from deployments.protocol import ChatCompletionRequest, NamedToolChoice
from deployments.reasoning import (
    THINK_END, THINK_START, ReasoningParser, detect_reasoning_parser, prompt_opens_reasoning,
)
from deployments.tool_calls import (
    PARSERS, NamedToolParser, RequiredToolParser, detect_tool_parser, tool_parser,
)
from deployments.tool_calls.grammar import named_schema, required_schema


@dataclass
class ChatPlan:
    messages: list[dict]
    tools: list[dict] | None
    template_kwargs: dict[str, Any]
    sampling: dict[str, Any] = field(default_factory=dict)  # added to the sampling kwargs
    # Markers the output's parsers read: kept in the text if they are special tokens
    # (Mistral's [TOOL_CALLS] is one, and skip_special_tokens would drop it).
    special_tokens: tuple[str, ...] = ()


class ChatFeatures:
    def __init__(self, hf_tokenizer, model_type: str, tool_call_parser: str | None,
                 reasoning_parser: str | None) -> None:
        self.source = template_source(hf_tokenizer)
        self.tool_parser = _chosen(tool_call_parser, lambda: detect_tool_parser(model_type, self.source))
        self.reasoning_parser = _chosen(reasoning_parser, lambda: detect_reasoning_parser(self.source))

    def plan(self, req: ChatCompletionRequest) -> ChatPlan:
        """ValueError (a 400) for what cannot be served."""
        messages, tools = template_inputs(req, self.source)
        plan = ChatPlan(messages, tools, template_kwargs(req))
        functions = [t.function.model_dump(exclude_none=True) for t in req.active_tools]
        if isinstance(req.tool_choice, NamedToolChoice):
            chosen = next(f for f in functions if f["name"] == req.tool_choice.function.name)
            plan.sampling["json_schema"] = named_schema(chosen)
        elif req.tool_choice == "required":
            plan.sampling["json_schema"] = required_schema(functions, req.parallel_tool_calls)
        elif functions and self.tool_parser is None:
            raise ValueError("no tool-call parser is known for this model: set the app's "
                             "tool_call_parser, or use tool_choice 'required' or a named function")
        plan.special_tokens = self._markers(req)
        return plan

    def _markers(self, req: ChatCompletionRequest) -> tuple[str, ...]:
        markers = (THINK_START, THINK_END) if self.reasoning_parser is not None else ()
        if req.active_tools and not req.forced_tool_call and self.tool_parser in PARSERS:
            markers += PARSERS[self.tool_parser].special_markers
        return markers

    def outputs(self, req: ChatCompletionRequest, prompt_tail: str,
                n: int) -> list[ChatOutput] | None:
        """One output reader per choice (None: the output is plain content). `prompt_tail`:
        the prompt's last tokens as text."""
        outputs = [ChatOutput(self._reasoning(req, prompt_tail), self._tools(req), req.echoed_text)
                   for _ in range(n)]
        first = outputs[0]
        plain = first.reasoning_parser is None and first.tool_parser is None and not first.echo
        return None if plain else outputs

    def answer_sampling(self, req: ChatCompletionRequest, prompt_tail: str) -> dict[str, Any]:
        """Sampling kwargs that depend on the rendered prompt: a constraint (response_format,
        regex, ..., or a forced tool call's grammar) starts after `</think>` when the model
        is known to reason first, so it reasons freely and its answer is constrained."""
        if self._reasoning_first(req, prompt_tail):
            return {"grammar_after": THINK_END}
        return {}

    def _reasoning_first(self, req: ChatCompletionRequest, prompt_tail: str) -> bool:
        """Known to reason first: the prompt opens a think block (DeepSeek-R1 style), or the
        request asks for thinking (enable_thinking: true, Qwen3 style: the model writes
        <think> itself) and the prompt has not closed one. Otherwise a constraint holds from
        the first token: a model that may not think at all would never leave the free part."""
        if self.reasoning_parser is None or not (req.forced_tool_call or _constrained(req)):
            return False
        asked = (req.chat_template_kwargs or {}).get("enable_thinking") is True
        return prompt_opens_reasoning(prompt_tail) or (
            asked and not prompt_tail.rstrip().endswith(THINK_END))

    def _reasoning(self, req: ChatCompletionRequest, prompt_tail: str) -> ReasoningParser | None:
        if self.reasoning_parser is None:
            return None
        first = self._reasoning_first(req, prompt_tail)
        if req.forced_tool_call and not first:
            return None  # the call's grammar starts at the first token: nothing to think
        return ReasoningParser(prompt_opens_reasoning(prompt_tail), reasoning_first=first)

    def _tools(self, req: ChatCompletionRequest):
        if isinstance(req.tool_choice, NamedToolChoice):
            return NamedToolParser(req.tool_choice.function.name)
        if req.tool_choice == "required":
            return RequiredToolParser()
        if req.active_tools:
            return tool_parser(self.tool_parser, [t.function.model_dump(exclude_none=True)
                                                  for t in req.active_tools])
        return None


def _chosen(setting: str | None, detect) -> str | None:
    if setting == "none":
        return None
    return setting if setting is not None else detect()


def _constrained(req: ChatCompletionRequest) -> bool:
    fmt = req.response_format
    return any(c is not None for c in (req.regex, req.json_schema, req.ebnf)) or (
        fmt is not None and fmt.type != "text")
