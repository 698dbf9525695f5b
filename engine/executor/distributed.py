"""Tensor parallelism across processes: the process groups behind TPContext's collectives,
and the step messages with which rank 0 drives the other ranks.

Each rank has two groups:
- `group` (NCCL on GPUs, gloo on CPUs) carries the model's all-reduce and all-gather. It has
  a timeout (`EngineConfig.dist_timeout_s`): a dead or hung rank fails the step instead of
  hanging it.
- `control` (gloo, host memory) carries rank 0's step messages: a fixed-size header, then
  the step's packed int64 batch tensor. Between steps a worker waits on it for as long as
  rank 0 is idle, so its timeout is practically infinite; a dead rank 0 closes its sockets,
  which ends the wait with an error. Sending the batch through host memory also gives the
  workers the host-side lengths the attention backend reads, without a device sync.

At tp=1 none of this is imported or called.
"""
from __future__ import annotations

import functools
import os
import socket
import struct
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, TypeVar

import torch
import torch.distributed as dist

from engine.layers.parallel import TPContext
from engine.executor.step_input import FIELD_NAMES, PackedStep

CMD_FORWARD = 1
CMD_SHUTDOWN = 2

# Header: [command, is_decode, length of each StepInput field...].
HEADER_LEN = 2 + len(FIELD_NAMES)

# The control group's "no timeout": waiting for rank 0's next step may take any time.
_IDLE_WAIT = timedelta(days=365)

# torch 2.13 renamed all_gather_into_tensor; older versions (the GPU machine's) lack the new name.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

F = TypeVar("F", bound=Callable[..., Any])


@dataclass
class Rendezvous:
    """Rank 0's end of the rendezvous: a TCP store on a free port, opened before the other
    ranks start so they can be told where to connect (binding port 0 leaves no race for
    the port)."""

    store: dist.TCPStore
    host: str

    @property
    def init_method(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"tcp://{host}:{self.store.port}"


def open_rendezvous(host: str, size: int, timeout_s: float) -> Rendezvous:
    store = dist.TCPStore(host, 0, size, is_master=True, timeout=timedelta(seconds=timeout_s),
                          wait_for_workers=False)
    return Rendezvous(store, host)


@dataclass
class StepMessage:
    """What a worker receives per step."""

    command: int
    step: PackedStep | None  # with CMD_FORWARD


def _record_failure(fn: F) -> F:
    """The first failed collective leaves the group unusable: remember it for health checks,
    and fail every later collective at once (a peer that stopped listening would otherwise
    block the next step message for good: the control group never times out)."""

    @functools.wraps(fn)
    def wrapper(self: "DistributedTP", *args, **kwargs):
        if self.failure is not None:
            raise RuntimeError(f"tensor-parallel group is unusable after an earlier failure: "
                               f"{self.failure}")
        try:
            return fn(self, *args, **kwargs)
        except BaseException as e:
            if self.failure is None:
                self.failure = e
            raise

    return wrapper  # type: ignore[return-value]


@dataclass
class DistributedTP(TPContext):
    """A TPContext whose collectives run over torch.distributed process groups."""

    control: Any = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    failure: BaseException | None = None
    closed: bool = False

    # -- the model's collectives ------------------------------------------------------------

    @_record_failure
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=self.group)
        return x

    @_record_failure
    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        x = x.contiguous()
        # Gathered along a new leading dim (what NCCL and gloo both do in one call), then
        # that dim is moved next to `dim` and merged into it, keeping rank order.
        out = x.new_empty((self.size * x.shape[0], *x.shape[1:]))
        _all_gather_flat(out, x, group=self.group)
        d = dim % x.dim()
        return out.view(self.size, *x.shape).movedim(0, d).flatten(d, d + 1)

    @_record_failure
    def min_over_ranks(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.long, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())

    # -- step messages (rank 0 -> the others) -----------------------------------------------

    @_record_failure
    def send_step(self, command: int, step: PackedStep | None = None) -> None:
        header = torch.zeros(HEADER_LEN, dtype=torch.long)
        header[0] = command
        if step is not None:
            header[1] = int(step.is_decode)
            header[2:] = torch.tensor(step.lengths, dtype=torch.long)
        dist.broadcast(header, 0, group=self.control)
        if step is not None and step.flat.numel():
            dist.broadcast(step.flat, 0, group=self.control)

    def recv_step(self) -> StepMessage:
        header = torch.empty(HEADER_LEN, dtype=torch.long)
        dist.broadcast(header, 0, group=self.control)
        command, is_decode, *lengths = header.tolist()
        if command != CMD_FORWARD:
            return StepMessage(command, None)
        flat = torch.empty(sum(lengths), dtype=torch.long)
        if flat.numel():
            dist.broadcast(flat, 0, group=self.control)
        return StepMessage(command, PackedStep.received(flat, lengths, bool(is_decode)))

    def mark_failed(self, error: BaseException) -> None:
        """A rank is known to be gone (e.g. its actor died): no collective may start."""
        if self.failure is None:
            self.failure = error

    # -- teardown ---------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Rank 0 tells the others to stop; every rank then leaves its groups. Idempotent,
        and quiet when a peer is already gone."""
        if self.closed:
            return
        self.closed = True
        if self.rank == 0 and self.failure is None:
            try:
                self.send_step(CMD_SHUTDOWN)
            except Exception:  # noqa: BLE001 - a dead peer needs no goodbye
                pass
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass


def init_tp(rank: int, size: int, where: str | Rendezvous, device: torch.device,
            timeout_s: float) -> DistributedTP:
    """Join the ranks' process groups: rank 0 through its open Rendezvous, the others
    through its address ("tcp://host:port"). Blocks until all `size` ranks joined, at most
    `timeout_s`."""
    if dist.is_initialized():
        raise RuntimeError("this process already has a torch.distributed group: "
                           "one tensor-parallel engine per process")
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        if device.index is None:  # "cuda" (a Ray actor's one visible GPU): set_device needs an index
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    timeout = timedelta(seconds=timeout_s)
    _pick_gloo_interface(where.host if isinstance(where, Rendezvous) else _host_of(where))
    if isinstance(where, Rendezvous):
        # init_process_group prefixes its keys like this when it makes the store itself.
        store = dist.PrefixStore("default_pg", where.store)
        dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout)
    else:
        dist.init_process_group(backend, init_method=where, rank=rank, world_size=size,
                                timeout=timeout)
    control = dist.new_group(backend="gloo", timeout=_IDLE_WAIT)
    return DistributedTP(rank=rank, size=size, group=dist.group.WORLD, control=control,
                         device=device)


def _host_of(init_method: str) -> str:
    hostport = init_method.split("://", 1)[-1]
    return hostport.rsplit(":", 1)[0].strip("[]")


def _pick_gloo_interface(rank0_host: str) -> None:
    """Gloo binds to the address its hostname resolves to, which in many containers is
    127.0.1.1 or an interface the other nodes cannot reach: then ranks on different nodes
    never connect. Unless GLOO_SOCKET_IFNAME is set, use the interface this node reaches
    rank 0 through (on rank 0, the one carrying the rendezvous address)."""
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return
    name = interface_towards(rank0_host)
    if name is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = name


def interface_towards(host: str) -> str | None:
    """The name of the local network interface that traffic to `host` leaves through
    (IPv4, Linux); None where that cannot be told."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))  # UDP: picks the route, sends nothing
            local_ip = s.getsockname()[0]
    except OSError:
        return None
    return interface_with_address(local_ip)


def interface_with_address(ip: str) -> str | None:
    try:
        import fcntl
    except ImportError:  # not on Linux
        return None
    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(s.fileno(), siocgifaddr, struct.pack("256s", name[:15].encode()))
            except OSError:  # no IPv4 address
                continue
            if socket.inet_ntoa(packed[20:24]) == ip:
                return name
    return None
