"""`@function`: turns `def prog(s, ...)` into a program with `run` and `run_batch`."""
from __future__ import annotations

import inspect
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from frontend.backend import RuntimeEndpoint, get_default_backend
from frontend.ir import SAMPLING_FIELDS, sampling_kwargs
from frontend.state import ProgramState

_RUN_SAMPLING = set(SAMPLING_FIELDS) | {"max_new_tokens"}
_MAX_AUTO_THREADS = 64


class Program:
    """A frontend program. Call it with a state to use it inside another program."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.signature = inspect.signature(fn)
        if not self.signature.parameters:
            raise TypeError(f"{fn.__name__} must take the program state as its first argument")
        self.__name__ = fn.__name__
        self.__doc__ = fn.__doc__

    def __call__(self, s: ProgramState, *args: Any, **kwargs: Any) -> Any:
        return self.fn(s, *args, **kwargs)

    def run(self, *args: Any, stream: bool = False, backend: RuntimeEndpoint | None = None,
            **kwargs: Any) -> ProgramState:
        """Run once. Keyword arguments named like sampling fields (max_tokens/max_new_tokens,
        temperature, stop, ...) are defaults for every gen; the rest go to the function.

        Returns when the program has finished; with stream=True it returns at once and the
        program runs in the background (read it with `state.text_iter()`). A failure is
        kept in the state and raised when the state is read."""
        run_kwargs = {k: kwargs.pop(k) for k in list(kwargs) if k in _RUN_SAMPLING}
        state = ProgramState(backend or get_default_backend(), sampling_kwargs(**run_kwargs), stream)
        call_args = self._bind(state, args, kwargs)
        if stream:
            state.run_body_in_background(lambda: self._execute(state, call_args))
        else:
            self._execute(state, call_args)
        return state

    def run_batch(self, batch_kwargs: list[dict[str, Any]], *, num_threads: int | str = "auto",
                  backend: RuntimeEndpoint | None = None, **sampling: Any) -> list[ProgramState]:
        """Run once per argument dict, up to `num_threads` at a time; states in input order.
        Programs run concurrently, so the server batches their requests."""
        if num_threads == "auto":
            num_threads = max(1, min(len(batch_kwargs), _MAX_AUTO_THREADS))
        if not isinstance(num_threads, int) or num_threads < 1:
            raise ValueError(f"num_threads must be a positive integer or 'auto', got {num_threads!r}")
        backend = backend or get_default_backend()
        for kwargs in batch_kwargs:  # argument mistakes surface here, before anything runs
            self._bind(None, (), {k: v for k, v in kwargs.items() if k not in _RUN_SAMPLING})
        with ThreadPoolExecutor(num_threads) as pool:
            return list(pool.map(lambda kw: self.run(backend=backend, **sampling, **kw), batch_kwargs))

    def _bind(self, state: ProgramState | None, args: tuple[Any, ...],
              kwargs: dict[str, Any]) -> inspect.BoundArguments:
        try:
            return self.signature.bind(state, *args, **kwargs)
        except TypeError as e:
            raise TypeError(f"{self.__name__}: {e}") from None

    def _execute(self, state: ProgramState, call_args: inspect.BoundArguments) -> None:
        try:
            state.ret_value = self.fn(*call_args.args, **call_args.kwargs)
        except Exception as e:  # noqa: BLE001 - a failed program is reported through its state
            state.fail(e)
        finally:
            state.close()


def function(fn: Callable[..., Any] | None = None) -> Any:
    """Decorator: `@function` or `@function()`."""
    if fn is None:
        return Program
    return Program(fn)
