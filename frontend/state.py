"""`ProgramState`: the `s` a program writes to, and the worker that carries out its steps.

`s += expr` only queues the step and returns; a worker thread per state runs the queue in
order. Reading a result (`s["name"]`, `s.text()`) waits for it. That is what lets the
branches of `s.fork(n)` generate in parallel while the program body is plain sequential
Python. A failed step stops the state's queue; every later read raises the failure.
"""
from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import Any

from frontend.backend import Completion, RuntimeEndpoint, Usage
from frontend.ir import (
    DEFAULT_MAX_TOKENS, SCHEDULING_FIELDS, Concat, Gen, Item, RoleBegin, RoleEnd, Select, check_item,
)


class ProgramState:
    def __init__(self, backend: RuntimeEndpoint, defaults: dict[str, Any] | None = None,
                 stream: bool = False) -> None:
        self.backend = backend
        self.ret_value: Any = None  # what the program function returned (set by `run`)
        self._defaults = dict(defaults or {})  # the run's sampling settings for every gen
        self._stream = stream
        self._text = ""
        self._vars: dict[str, Any] = {}
        self._meta: dict[str, dict[str, Any]] = {}
        self._messages: list[dict[str, str]] = []
        self._open_role: tuple[str, int] | None = None  # (role, where its content starts)
        self._unsent = False  # text added since the server last saw this state's text
        self._usage = Usage()
        self._events: list[tuple[str | None, str]] = []  # (variable or None, text) as appended
        self._children: list[ProgramState] = []
        self._error: BaseException | None = None
        self._pending: deque[Item] = deque()
        self._running = False
        self._closed = False
        # With stream=True the program body runs on this thread while others read the state.
        self._body_thread: threading.Thread | None = None
        self._cond = threading.Condition()

    # -- writing ------------------------------------------------------------------------

    def __iadd__(self, item: Item) -> ProgramState:
        check_item(item)
        with self._cond:
            self._pending.append(item)
            if not self._running:
                self._running = True
                threading.Thread(target=self._drain, daemon=True).start()
        return self

    def fork(self, size: int = 1) -> ForkGroup:
        """`size` states that continue from this one's text; they run in parallel."""
        if size < 1:
            raise ValueError(f"fork size must be >= 1, got {size}")
        self.sync()
        if size > 1 and self._unsent and self._text:
            # Prefill the shared prefix once, so every branch finds it in the server's cache
            # (branches admitted in the same scheduler step could not share it otherwise).
            self._add_usage(self.backend.cache_prefix(self._text))
            self._unsent = False
        children = [self._child() for _ in range(size)]
        with self._cond:
            self._children += children
        return ForkGroup(children)

    # -- reading ------------------------------------------------------------------------

    def __getitem__(self, name: str) -> Any:
        """The value of a gen/select variable; waits until it is produced."""
        with self._cond:
            self._cond.wait_for(lambda: name in self._vars or self._settled())
            if name in self._vars:
                return self._vars[name]
            if self._error is not None:
                raise self._error
        raise KeyError(f"no variable {name!r} in this program state")

    def get_meta_info(self, name: str) -> dict[str, Any]:
        """Details of how a variable was produced (usage, finish reason, choice scores)."""
        self[name]
        return dict(self._meta[name])

    def sync(self) -> None:
        """Wait until every queued step has run; raise the failure if one failed."""
        with self._cond:
            self._cond.wait_for(self._settled)
            if self._error is not None:
                raise self._error

    def text(self) -> str:
        self.sync()
        return self._text

    def messages(self) -> list[dict[str, str]]:
        """The chat messages written so far, as {"role", "content"} dicts."""
        self.sync()
        return [dict(m) for m in self._messages]

    def usage(self) -> Usage:
        """Token counts summed over this state's requests (not its forks')."""
        self.sync()
        return replace(self._usage)

    def error(self) -> BaseException | None:
        """The failure that stopped this state, if any (waits for queued steps)."""
        with self._cond:
            self._cond.wait_for(self._settled)
            return self._error

    def text_iter(self, var_name: str | None = None) -> Iterator[str]:
        """Text as it is appended (gen output token by token when run with stream=True);
        only the given variable's text when `var_name` is set. Ends when the program does."""
        seen = 0
        while True:
            with self._cond:
                self._cond.wait_for(lambda: len(self._events) > seen or self._closed)
                new, seen = self._events[seen:], len(self._events)
                done = self._closed and seen == len(self._events)
            yield from (text for var, text in new if var_name is None or var == var_name)
            if done:
                break
        if self._error is not None:
            raise self._error

    def __repr__(self) -> str:
        return f"ProgramState(text={self._text[-60:]!r}, vars={list(self._vars)})"

    # -- used by the program runner -----------------------------------------------------

    def run_body_in_background(self, body: Callable[[], None]) -> None:
        """Run the program body on its own thread (stream=True); readers on other threads
        then wait for the body too, since it may still add the steps they wait for."""
        thread = threading.Thread(target=body, daemon=True)
        self._body_thread = thread
        thread.start()

    def fail(self, error: BaseException) -> None:
        with self._cond:
            if self._error is None:
                self._error = error
            self._cond.notify_all()

    def close(self) -> None:
        """The program body has returned: finish queued steps and end text iterators."""
        with self._cond:
            self._cond.wait_for(lambda: not self._running)
            self._closed = True
            self._body_thread = None
            children = list(self._children)
            self._cond.notify_all()
        for child in children:
            child.close()

    # -- the worker -----------------------------------------------------------------------

    def _settled(self) -> bool:
        """No step runs, and no program body on another thread can still queue one."""
        body = self._body_thread
        return not self._running and (body is None or body is threading.current_thread())

    def _drain(self) -> None:
        while True:
            with self._cond:
                if not self._pending or self._error is not None:
                    self._pending.clear()  # after a failure, later steps would build on it
                    self._running = False
                    self._cond.notify_all()
                    return
                item = self._pending.popleft()
            try:
                self._run(item)
            except Exception as e:  # noqa: BLE001 - kept for the reader, who gets it raised
                self.fail(e)

    def _run(self, item: Item) -> None:
        match item:
            case str():
                self._append(item)
            case Concat(parts=parts):
                for part in parts:
                    self._run(part)
            case RoleBegin(role=role):
                self._begin_role(role)
            case RoleEnd(role=role):
                self._end_role(role)
            case Gen():
                self._gen(item)
            case Select():
                self._select(item)

    def _append(self, text: str, var: str | None = None) -> None:
        with self._cond:
            self._text += text
            self._unsent = self._unsent or bool(text)
            self._events.append((var, text))
            self._cond.notify_all()

    def _set_var(self, name: str | None, value: Any, meta: dict[str, Any]) -> None:
        if name is None:
            return
        with self._cond:
            self._vars[name] = value
            self._meta[name] = meta
            self._cond.notify_all()

    def _add_usage(self, usage: Usage) -> None:
        self._usage.prompt_tokens += usage.prompt_tokens
        self._usage.cached_tokens += usage.cached_tokens
        self._usage.completion_tokens += usage.completion_tokens

    def _begin_role(self, role: str) -> None:
        if self._open_role is not None:
            raise ValueError(f"{role!r} message begins inside an open {self._open_role[0]!r} message")
        markers = self.backend.chat_markers()
        self._append(markers.begin(role, first=not self._messages))
        self._open_role = (role, len(self._text))

    def _end_role(self, role: str) -> None:
        if self._open_role is None or self._open_role[0] != role:
            raise ValueError(f"{role!r} message ends but none is open")
        content = self._text[self._open_role[1]:]
        self._append(self.backend.chat_markers().end(role))
        self._messages.append({"role": role, "content": content})
        self._open_role = None

    def _gen(self, g: Gen) -> None:
        params = {"max_tokens": DEFAULT_MAX_TOKENS, **self._defaults, **g.params}
        if self._stream:
            done = self._gen_streamed(params, g.name)
        else:
            done = self.backend.generate(self._text, params)
            self._append(done.text, g.name)
        self._unsent = False  # the server just saw the prompt and generated the rest
        self._add_usage(done.usage)
        self._set_var(g.name, done.text, {"finish_reason": done.finish_reason, **vars(done.usage)})

    def _gen_streamed(self, params: dict[str, Any], name: str | None) -> Completion:
        for piece in self.backend.generate_stream(self._text, params):
            if isinstance(piece, Completion):
                return piece
            self._append(piece, name)
        raise RuntimeError("the stream ended without a final result")

    def _select(self, sel: Select) -> None:
        scheduling = {k: v for k, v in self._defaults.items() if k in SCHEDULING_FIELDS}
        scores = self.backend.score_choices(self._text, sel.choices, scheduling)
        self._add_usage(scores.usage)
        choice = sel.choices[scores.best]
        self._append(choice, sel.name)
        self._set_var(sel.name, choice, {"choices": list(sel.choices),
                                         "normalized_logprobs": scores.normalized,
                                         "token_logprobs": scores.token_logprobs})

    def _child(self) -> ProgramState:
        child = ProgramState(self.backend, self._defaults, self._stream)
        child._text, child._vars, child._meta = self._text, dict(self._vars), dict(self._meta)
        child._messages = [dict(m) for m in self._messages]
        child._open_role, child._unsent = self._open_role, self._unsent
        child._body_thread = self._body_thread  # the parent's body writes the branches too
        return child


class ForkGroup(Sequence[ProgramState]):
    """The branches of `s.fork(n)`: index them, iterate them, or `+=` to all at once."""

    def __init__(self, states: list[ProgramState]) -> None:
        self._states = states

    def __getitem__(self, i):  # type: ignore[override]
        return self._states[i]

    def __setitem__(self, i: int, state: ProgramState) -> None:
        # `forks[i] += x` stores the (same) state back after ProgramState.__iadd__.
        self._states[i] = state

    def __len__(self) -> int:
        return len(self._states)

    def __iadd__(self, item: Item) -> ForkGroup:
        for state in self._states:
            state += item
        return self

    def join(self) -> None:
        """Wait for every branch; raise the first failure."""
        for state in self._states:
            state.sync()
