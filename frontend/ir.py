"""The expressions a program adds to its state: text, `gen`, `select`, and chat roles.

Expressions are plain data; `ProgramState` interprets them. `+` joins expressions (and
strings) into a `Concat`, so `"Answer: " + gen("a")` is one expression.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Union

ROLES = ("system", "user", "assistant")

# Sampling fields a gen (or a program run) may set, as /v1/completions names them.
SAMPLING_FIELDS = (
    "max_tokens", "temperature", "top_p", "top_k", "min_p", "frequency_penalty",
    "presence_penalty", "repetition_penalty", "stop", "stop_token_ids", "ignore_eos", "seed",
    "priority", "queue_timeout_s",
)
# Scheduling, not sampling (a lower priority value is served first; the most seconds the
# request may wait in the server's queue): a select's scoring request takes them from the run.
SCHEDULING_FIELDS = ("priority", "queue_timeout_s")
DEFAULT_MAX_TOKENS = 128  # what a gen gets when neither it nor the run says (as in SGLang)


class Expr:
    """Base of everything `s += ...` accepts besides plain strings."""

    def __add__(self, other: Item) -> Concat:
        return Concat.of(self, other)

    def __radd__(self, other: Item) -> Concat:
        return Concat.of(other, self)


Item = Union[str, Expr]


@dataclass(eq=False)
class Concat(Expr):
    parts: list[Item]

    @classmethod
    def of(cls, *items: Item) -> Concat:
        parts: list[Item] = []
        for item in items:
            check_item(item)
            parts.extend(item.parts if isinstance(item, Concat) else [item])
        return cls(parts)


@dataclass(eq=False)
class Gen(Expr):
    """Generate text into variable `name`; `params` are /v1/completions fields."""

    name: str | None
    params: dict[str, Any] = field(default_factory=dict)


@dataclass(eq=False)
class Select(Expr):
    """Pick the choice the model finds most likely (length-normalized log-probability)."""

    name: str | None
    choices: list[str]


@dataclass(eq=False)
class RoleBegin(Expr):
    role: str


@dataclass(eq=False)
class RoleEnd(Expr):
    role: str


def check_item(item: object) -> None:
    if not isinstance(item, (str, Expr)):
        raise TypeError(f"a program can add text or frontend expressions, not {type(item).__name__}")


def sampling_kwargs(max_new_tokens: int | None = None, **fields: Any) -> dict[str, Any]:
    """The fields that were actually set; `max_new_tokens` is SGLang's name for max_tokens."""
    unknown = set(fields) - set(SAMPLING_FIELDS)
    if unknown:
        raise TypeError(f"unknown sampling argument(s): {', '.join(sorted(unknown))}")
    if max_new_tokens is not None:
        if fields.get("max_tokens") is not None:
            raise TypeError("give max_tokens or max_new_tokens, not both")
        fields["max_tokens"] = max_new_tokens
    return {k: v for k, v in fields.items() if v is not None}


def gen(
    name: str | None = None,
    max_tokens: int | None = None,
    *,
    stop: str | list[str] | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    repetition_penalty: float | None = None,
    stop_token_ids: list[int] | None = None,
    ignore_eos: bool | None = None,
    seed: int | None = None,
    priority: int | None = None,
    queue_timeout_s: float | None = None,
    regex: str | None = None,
    json_schema: str | dict[str, Any] | None = None,
    choices: list[str] | None = None,
    max_new_tokens: int | None = None,
    lora: str | None = None,
) -> Gen | Select:
    """Generate text (stored as `s[name]`). Unset sampling fields fall back to the run's
    defaults, then the server's. `choices=` makes it a `select`. `lora`: the LoRA adapter
    this generation runs under (the backend's, if it names one, otherwise)."""
    if choices is not None:
        return select(name, choices)
    params = sampling_kwargs(
        max_new_tokens, max_tokens=max_tokens, stop=stop, temperature=temperature, top_p=top_p,
        top_k=top_k, min_p=min_p, frequency_penalty=frequency_penalty,
        presence_penalty=presence_penalty, repetition_penalty=repetition_penalty,
        stop_token_ids=stop_token_ids, ignore_eos=ignore_eos, seed=seed, priority=priority,
        queue_timeout_s=queue_timeout_s)
    if lora is not None:
        params["model"] = lora  # an adapter is a model of the OpenAI API
    if regex is not None and json_schema is not None:
        raise ValueError("give regex or json_schema, not both")
    if regex is not None:
        params["regex"] = regex
    if json_schema is not None:
        params["json_schema"] = json_schema
    return Gen(name, params)


def select(name: str | None = None, choices: list[str] | None = None) -> Select:
    """Choose one of `choices` by the model's log-probabilities (stored as `s[name]`)."""
    if not choices or not all(isinstance(c, str) and c for c in choices):
        raise ValueError("select needs a non-empty list of non-empty strings")
    return Select(name, list(choices))


def _role(role: str, content: Item) -> Concat:
    return Concat.of(RoleBegin(role), content, RoleEnd(role))


def system(content: Item) -> Concat:
    return _role("system", content)


def user(content: Item) -> Concat:
    return _role("user", content)


def assistant(content: Item) -> Concat:
    return _role("assistant", content)


def system_begin() -> RoleBegin:
    return RoleBegin("system")


def system_end() -> RoleEnd:
    return RoleEnd("system")


def user_begin() -> RoleBegin:
    return RoleBegin("user")


def user_end() -> RoleEnd:
    return RoleEnd("user")


def assistant_begin() -> RoleBegin:
    return RoleBegin("assistant")


def assistant_end() -> RoleEnd:
    return RoleEnd("assistant")
