"""Broadcast groups between processes that share no default process group.

A `BroadcastHost` (in the process that decides who takes part) opens a TCPStore on
port 0 (the OS picks a free port) on this node's Ray address and hands out a
`BroadcastSpec` per formation: the store's address, a prefix of its own
(``<name>/gen<generation>``), the member count, the backend and a time bound. Every
member builds a `torch.distributed` process group object directly on that store
(`ProcessGroupGloo` / `ProcessGroupNCCL` on a `PrefixStore`): it is not the process's
default group and not made by ``new_group``, so processes that belong to different
default groups (or to none) can form it, and it can be dropped and formed again.

Member 0 sends: it writes a header under a key of its choosing (each tensor's dtype and
element count, and the caller's own metadata) and broadcasts the flat tensors one after
another; the other members read the header, allocate, and receive. Every wait (the
store, the group's handshake, each broadcast) is bounded by the spec's ``timeout_s``;
a member whose send or receive failed drops the group (`BroadcastMember.drop`), and the
caller forms a new generation for the next use.

A member that dies, or never comes, would hold the others for that whole bound (they
wait in the handshake for it, or in a broadcast it never answers). So every member
first says it is ready in the store and waits for the others' word before the
handshake, and every wait (for the others, for each broadcast) looks every
`POLL_S` for the formation's ``abandon`` key: the host sets it (`BroadcastHost.abandon`)
the moment it learns a member is gone, and every member then fails at once with
`BroadcastAbandoned` (a broadcast in flight is left to gloo's or NCCL's own thread).
"""

from __future__ import annotations

import logging
import pickle
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from rayrl.cluster.discovery import node_ip
from rayrl.cluster.interface import bind_to_node_address

__all__ = [
    "BroadcastAbandoned",
    "BroadcastError",
    "BroadcastHost",
    "BroadcastMember",
    "BroadcastSpec",
]

log = logging.getLogger(__name__)
BACKENDS = ("gloo", "nccl")


class BroadcastError(RuntimeError):
    """A broadcast group could not form, send or receive within its bound."""


class BroadcastAbandoned(BroadcastError):
    """The host abandoned the formation (a member is gone): every wait on it ends."""


POLL_S = 0.05  # how often a waiting member looks for the others' word and for `abandon`
ABANDON = "abandon"


@dataclass(frozen=True)
class BroadcastSpec:
    """One formation of a broadcast group: where its store is and who takes part."""

    addr: str
    port: int
    prefix: str  # <name>/gen<generation>: the formation's keys in the store
    world_size: int  # member 0 sends, members 1..world_size-1 receive
    backend: str  # gloo (CPU tensors) or nccl (CUDA tensors)
    timeout_s: float


class BroadcastHost:
    """The store of a family of broadcast groups, held by the process that forms them.

    Each `form` is a new generation with a prefix of its own, so members of an earlier
    formation never read a later one's keys.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.addr = node_ip()
        self.store = dist.TCPStore(
            self.addr, 0, None, True, timeout=timedelta(seconds=60), wait_for_workers=False
        )
        self.generation = 0

    def form(self, world_size: int, backend: str, timeout_s: float) -> BroadcastSpec:
        """A new generation of the group: `world_size` members, member 0 the sender."""
        if backend not in BACKENDS:
            raise BroadcastError(
                f"broadcast group {self.name!r}: backend {backend!r} is not one of {BACKENDS}"
            )
        if world_size < 2:
            raise BroadcastError(
                f"broadcast group {self.name!r}: {world_size} member(s); a broadcast needs a "
                "sender and at least one receiver"
            )
        self.generation += 1
        prefix = f"{self.name}/gen{self.generation}"
        return BroadcastSpec(self.addr, self.store.port, prefix, world_size, backend, timeout_s)

    def abandon(self, spec: BroadcastSpec) -> None:
        """End every wait on formation `spec` now (a member is gone): its members fail
        with `BroadcastAbandoned` within `POLL_S`, and the caller forms a new one."""
        self.store.set(f"{spec.prefix}/{ABANDON}", b"1")


@dataclass
class BroadcastMember:
    """This process's place in a broadcast group: one formation at a time, joined at
    first use and kept until a newer formation (another prefix) or a failure."""

    spec: BroadcastSpec | None = None
    rank: int = -1
    store: Any = None
    group: Any = None
    sent_bytes: int = 0
    received_bytes: int = 0
    _keep: list[Any] = field(default_factory=list)

    def join(self, spec: BroadcastSpec, rank: int) -> None:
        """Be member `rank` of `spec` (a no-op when already); an older formation is dropped."""
        if self.spec == spec and self.rank == rank:
            return
        self.drop()
        if not 0 <= rank < spec.world_size:
            raise BroadcastError(
                f"broadcast group {spec.prefix}: rank {rank} is not in [0, {spec.world_size})"
            )
        bind_to_node_address(node_ip())
        wait = timedelta(seconds=spec.timeout_s)
        try:
            client = dist.TCPStore(spec.addr, spec.port, None, False, timeout=wait)
            store = dist.PrefixStore(spec.prefix, client)
            _all_ready(store, spec, rank)  # a member that never comes holds no handshake
            group = _process_group(spec, store, rank, wait)
        except BroadcastAbandoned:
            raise
        except Exception as err:
            raise BroadcastError(
                f"broadcast group {spec.prefix}: rank {rank}/{spec.world_size} could not "
                f"form it ({spec.backend}, store {spec.addr}:{spec.port}) within "
                f"{spec.timeout_s:g} s: {_one_line(err)}. Check that every member was asked "
                "to join and is alive, and that the port is reachable from this node."
            ) from err
        self.spec, self.rank, self.store, self.group = spec, rank, store, group
        self._keep = [client]

    def drop(self) -> None:
        """Leave the current formation (after a failure, or for a newer one)."""
        self.spec, self.rank, self.store, self.group, self._keep = None, -1, None, None, []

    def send(self, key: str, tensors: list[torch.Tensor], meta: Any = None) -> None:
        """Member 0: the header under `key`, then each flat tensor, broadcast in order."""
        spec = self._joined(0)
        header = {"meta": meta, "tensors": [(t.dtype, t.numel()) for t in tensors]}
        self.store.set(key, pickle.dumps(header))
        for tensor in tensors:
            self._broadcast(tensor.contiguous(), spec)
            self.sent_bytes += tensor.numel() * tensor.element_size()
        _settle(tensors)

    def receive(self, key: str, device: torch.device | str = "cpu") -> tuple[Any, list[Any]]:
        """Members 1..: the sender's metadata and its tensors under `key`, on `device`."""
        spec = self._joined(self.rank)
        try:
            _wait_for_key(self.store, key, spec)
            header = pickle.loads(self.store.get(key))
        except BroadcastAbandoned:
            raise
        except Exception as err:
            raise BroadcastError(
                f"broadcast group {spec.prefix}: rank {self.rank} got no header {key!r} "
                f"within {spec.timeout_s:g} s: {_one_line(err)} (is member 0 alive?)"
            ) from err
        out = []
        for dtype, numel in header["tensors"]:
            buffer = torch.empty(numel, dtype=dtype, device=device)
            self._broadcast(buffer, spec)
            self.received_bytes += buffer.numel() * buffer.element_size()
            out.append(buffer)
        _settle(out)
        return header["meta"], out

    def _joined(self, rank: int) -> BroadcastSpec:
        if self.spec is None or self.rank != rank:
            raise BroadcastError(f"not member {rank} of a broadcast group: call join first")
        return self.spec

    def _broadcast(self, tensor: torch.Tensor, spec: BroadcastSpec) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.timeout = timedelta(seconds=spec.timeout_s)
        try:
            _wait(self.group.broadcast([tensor], opts), self.store, spec)
        except BroadcastAbandoned:
            raise
        except Exception as err:
            raise BroadcastError(
                f"broadcast group {spec.prefix}: rank {self.rank} failed a broadcast of "
                f"{tensor.numel()} {tensor.dtype} elements: {_one_line(err)}"
            ) from err


def _all_ready(store: Any, spec: BroadcastSpec, rank: int) -> None:
    """Say this member is ready; wait (bounded, abandonable) for every other's word."""
    store.set(f"ready/{rank}", b"1")
    others = [f"ready/{r}" for r in range(spec.world_size) if r != rank]
    deadline = time.monotonic() + spec.timeout_s
    while not store.check(others):
        _check_abandoned(store, spec)
        if time.monotonic() > deadline:
            raise BroadcastError(
                f"broadcast group {spec.prefix}: rank {rank}: not every member was ready "
                f"within {spec.timeout_s:g} s"
            )
        time.sleep(POLL_S)


def _wait_for_key(store: Any, key: str, spec: BroadcastSpec) -> None:
    """Wait (bounded, abandonable) until `key` is in the store."""
    deadline = time.monotonic() + spec.timeout_s
    while not store.check([key]):
        _check_abandoned(store, spec)
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {key!r} in the store after {spec.timeout_s:g} s")
        time.sleep(POLL_S)


def _wait(work: Any, store: Any, spec: BroadcastSpec) -> None:
    """Wait for a collective's `work`, looking for `abandon` every `POLL_S`. The naps
    start at 0.1 ms and double: a bucket that lands at once costs no poll's delay."""
    nap, looked = 1e-4, time.monotonic()
    while not work.is_completed():
        if time.monotonic() - looked >= POLL_S:
            _check_abandoned(store, spec)
            looked = time.monotonic()
        time.sleep(nap)
        nap = min(nap * 2, POLL_S / 10)
    work.wait()  # raises the collective's own error, if it failed


def _check_abandoned(store: Any, spec: BroadcastSpec) -> None:
    if store.check([ABANDON]):
        raise BroadcastAbandoned(
            f"broadcast group {spec.prefix}: abandoned by its host (a member is gone); the "
            "version goes by the object store, and a new group forms next time"
        )


def _settle(tensors: list[torch.Tensor]) -> None:
    """Wait for NCCL's streams: the tensors are whole (or free to reuse) on return."""
    for device in {t.device for t in tensors if t.is_cuda}:
        torch.cuda.synchronize(device)


def _process_group(spec: BroadcastSpec, store: Any, rank: int, wait: timedelta) -> Any:
    if spec.backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, spec.world_size, wait)
    nccl = getattr(dist, "ProcessGroupNCCL", None)
    if nccl is None or not torch.cuda.is_available():
        raise BroadcastError(
            "the nccl backend needs a CUDA build of torch and a visible GPU in every member"
        )
    options = nccl.Options()
    options._timeout = wait
    return nccl(store, rank, spec.world_size, options)


def _one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__
