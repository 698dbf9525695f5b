"""The engine process's side of ProcessAsyncEngine (engine/runtime/process_engine.py): build the
Engine, run its step loop, and after each step send the parent ONE message with every
stream's deltas of that step. Also how the parent starts it (`start`, `wait_ready`, `kill`).
The parent names the engine class to build (`start`'s `make_engine`), so this side needs only
the engine's interface, not its module.

Protocol (both pipes carry pickled objects; the parent's sender thread batches commands):
- parent -> child: lists of commands, `Add`, `Abort`, `Call`, `STOP`.
- child -> parent: first `Ready` (or `StartupFailed`), then `StepMessage`s.
The child exits when the command pipe reaches EOF: the parent died, so no orphan is left
holding the GPU (an idle child also checks its parent's pid every IDLE_POLL_S).
"""
from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

from engine.config import EngineConfig
from engine.core.queue_deadlines import QueueFullError
from engine.core.outputs import WireBatch
from engine.core.sampling_params import SamplingParams
from engine.runtime.step_report import (EngineStepError, ServedEngine, StepReport, step_for_streams,
                                        step_report)
from engine.runtime.stream_deltas import wire_update
from engine.executor.startup_timer import process_age_s

logger = logging.getLogger(__name__)

IDLE_POLL_S = 0.5  # an idle child wakes this often to check that its parent still lives
STARTUP_POLL_S = 1.0
STOP = "stop"


class EngineProcessError(RuntimeError):
    """The engine process is gone (it died, or the engine was shut down)."""


@dataclass
class Add:
    request_id: str
    seq: int  # the parent's number for this stream: stale deltas of a reused id are dropped
    prompt_ids: list[int]
    params: SamplingParams


@dataclass
class Abort:
    request_id: str
    seq: int
    reply: int | None = None  # set: send the abort delta and a reply once KV is freed


@dataclass
class Call:
    name: str  # one of CALLS
    reply: int
    args: tuple = ()


# the Engine methods a Call may run
CALLS = frozenset({"stats", "flush_cache", "load_lora", "unload_lora", "list_loras",
                   "export_prefix", "import_prefix", "cached_length"})


@dataclass
class Ready:
    """The child's limits, which the parent validates requests against without asking."""

    vocab_size: int
    max_context: int
    kv_slots: int


@dataclass
class StartupFailed:
    error: BaseException
    traceback: str


@dataclass
class StepMessage:
    deltas: WireBatch = field(default_factory=WireBatch)
    delta_seqs: list[int] = field(default_factory=list)  # each delta's stream number
    errors: list[tuple[int, BaseException]] = field(default_factory=list)  # (seq, error)
    replies: list[tuple[int, bool, object]] = field(default_factory=list)  # (reply, ok, value)
    report: StepReport | None = None


def start(config: EngineConfig, make_engine: Callable[[EngineConfig], ServedEngine]
          ) -> tuple[BaseProcess, Connection, Connection]:
    """Spawn the engine process, which builds `make_engine(config)` (a class or top-level
    function: it crosses to the child by name); returns the process, the commands' sending
    end, the messages' receiving end."""
    ctx = multiprocessing.get_context("spawn")  # never fork a process that may hold CUDA
    child_commands, commands = ctx.Pipe(duplex=False)
    out, child_out = ctx.Pipe(duplex=False)
    process = ctx.Process(target=run, name="radixserve-engine", daemon=True,
                          args=(make_engine, config, child_commands, child_out, os.getpid(),
                                process_age_s()))
    process.start()
    # Only the child holds these ends now: its death is EOF for the parent, and the
    # parent's is EOF for it.
    child_commands.close()
    child_out.close()
    return process, commands, out


def wait_ready(process: BaseProcess, out: Connection) -> Ready:
    """The child's limits, or its start-up exception raised here (with its traceback)."""
    while not out.poll(STARTUP_POLL_S):
        if not process.is_alive():
            break
    try:
        message = out.recv()
    except (EOFError, OSError):
        process.join(5)
        raise EngineProcessError(f"the engine process exited during start-up "
                                 f"(exit code {process.exitcode})") from None
    if isinstance(message, StartupFailed):
        message.error.add_note(f"in the engine process:\n{message.traceback}")
        raise message.error
    return message


def kill(process: BaseProcess) -> None:
    if process.is_alive():
        process.kill()
        process.join(5)


def run(make_engine: Callable[[EngineConfig], ServedEngine], config: EngineConfig, commands: Connection,
        out: Connection, parent_pid: int, parent_age_s: float = 0.0) -> None:
    """The child's entry point (multiprocessing "spawn")."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C of `serve run` reaches the parent
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine-process %(levelname)s %(message)s")
    logger.info("engine process up %.1fs after it started; its parent was %.1fs old when it "
                "started it", process_age_s(), parent_age_s)
    try:
        engine = make_engine(config)
        logger.info("engine process: the engine built, %.1fs after it started", process_age_s())
    except BaseException as e:  # noqa: BLE001 - the parent re-raises it
        out.send(StartupFailed(portable(e), traceback.format_exc()))
        return
    out.send(Ready(engine.runner.vocab_size, engine.max_context, engine.runner.kv_pool.num_slots))
    EngineProcess(engine, commands, out, parent_pid).loop()


class EngineProcess:
    """The step loop: commands between steps, block when idle, one message per step."""

    def __init__(self, engine: ServedEngine, commands: Connection, out: Connection, parent_pid: int) -> None:
        self.engine = engine
        self.commands = commands
        self.out = out
        self.parent_pid = parent_pid
        self.seqs: dict[str, int] = {}  # live requests' stream numbers
        self.message = StepMessage()
        self.last_stats: dict | None = None

    def loop(self) -> None:
        try:
            while self._take_commands(block=not self.engine.has_work):
                if self.engine.has_work:
                    self._step()
                self._send()
        except (EOFError, OSError):
            pass  # the parent is gone
        finally:
            self.engine.close()

    def _take_commands(self, block: bool) -> bool:
        """Apply every command waiting; False once told to stop or the parent is gone."""
        if block:
            while not self.commands.poll(IDLE_POLL_S):
                if os.getppid() != self.parent_pid:
                    return False
        while self.commands.poll(0):
            for command in self.commands.recv():
                if command == STOP:
                    return False
                self._apply(command)
        return True

    def _apply(self, command: Add | Abort | Call) -> None:
        try:
            if isinstance(command, Add):
                self._add(command)
            elif isinstance(command, Abort):
                self._abort(command)
            else:
                self._call(command)
        except Exception:  # noqa: BLE001 - one bad command must not end the loop
            logger.exception("engine command failed")

    def _add(self, add: Add) -> None:
        try:
            # the parent validated it against this engine's limits (ProcessAsyncEngine._open)
            self.engine.add_request(add.request_id, add.prompt_ids, add.params, validated=True)
        except (ValueError, QueueFullError) as e:
            self.message.errors.append((add.seq, portable(e)))
            return
        self.seqs[add.request_id] = add.seq

    def _abort(self, abort: Abort) -> None:
        if self.seqs.get(abort.request_id) == abort.seq:
            del self.seqs[abort.request_id]
            req = self.engine.abort(abort.request_id)
            if req is not None and abort.reply is not None:
                self.message.deltas.append(wire_update(req, [], True))
                self.message.delta_seqs.append(abort.seq)
        if abort.reply is not None:
            self.message.replies.append((abort.reply, True, None))

    def _call(self, call: Call) -> None:
        try:
            if call.name not in CALLS:
                raise ValueError(f"unknown engine call {call.name!r}")
            value = getattr(self.engine, call.name)(*call.args)
            self.message.replies.append((call.reply, True, value))
        except Exception as e:  # noqa: BLE001 - handed to the caller
            self.message.replies.append((call.reply, False, portable(e)))

    def _step(self) -> None:
        updates, failed = step_for_streams(self.engine)
        for req, error in failed:
            seq = self.seqs.pop(req.request_id, None)
            if seq is not None:
                self.message.errors.append((seq, error))
        deltas, delta_seqs = self.message.deltas, self.message.delta_seqs
        for update in updates:
            req = update.req
            rid = req.request_id
            seq = self.seqs.pop(rid, None) if update.finished else self.seqs.get(rid)
            if seq is not None:
                deltas.append(wire_update(req, update.new_tokens, update.finished))
                delta_seqs.append(seq)

    def _send(self) -> None:
        """One message with everything since the last: deltas, errors, replies, and the
        step report when it has news (stats are sent only when they changed)."""
        report = step_report(self.engine, self.last_stats)
        if report.stats is not None:
            self.last_stats = report.stats
        message = self.message
        if report.stats is not None or report.cache_events or report.grammar_compile_times:
            message.report = report
        if message.deltas or message.errors or message.replies or message.report:
            self.out.send(message)
            self.message = StepMessage()


def portable(error: BaseException) -> BaseException:
    """An exception the parent can unpickle and the server maps as today (ValueError: 400,
    QueueFullError: 503); anything else as a RuntimeError naming its type."""
    from engine.lora import LoRAError, LoRANotFoundError

    for kind in (QueueFullError, EngineStepError, LoRANotFoundError, LoRAError, ValueError,
                 FileNotFoundError, OSError):
        if isinstance(error, kind):
            return kind(str(error))
    return RuntimeError(f"{type(error).__name__}: {error}")
