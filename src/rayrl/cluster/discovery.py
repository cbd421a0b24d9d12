"""Service discovery through the KVStore: how the ranks of a group find their master.

Every rank announces itself under `<group>/gen<generation>/ranks/<rank>` (KV namespace
"discovery"). Rank 0 waits until all ranks have arrived, then publishes its address and
port under `<group>/gen<generation>/master`; the other ranks wait for that key. So a
missing rank is named by rank 0 within `timeout` (instead of torch.distributed hanging
until its own, much longer, timeout), and every wait is bounded.

`init_process_group` builds `torch.distributed` on top with no MASTER_ADDR/MASTER_PORT
environment variables: rank 0 opens the rendezvous TCPStore itself on port 0 (the OS
picks a free port, so no other process can take it between choosing and binding),
publishes the port it got, and every rank passes the store to
`torch.distributed.init_process_group(store=...)`.

Before any socket opens, gloo and NCCL are bound to the interface holding this node's
Ray address (`rayrl.cluster.interface`): a hostname that resolves to a loopback address
(Debian's 127.0.1.1) would otherwise be what a rank tells the others to connect to.

Each formation of a group uses a new `generation` (a replaced worker re-forms the group
as generation + 1), so ranks never pick up the master of an earlier formation.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from datetime import timedelta
from typing import Any, cast

import ray

from rayrl.cluster.interface import InterfaceError, bind_to_node_address
from rayrl.cluster.kv import KVStore
from rayrl.cluster.kv_errors import KVTimeoutError, describe_writer

__all__ = [
    "DISCOVERY_NAMESPACE",
    "DiscoveryError",
    "RendezvousTimeoutError",
    "arrival_key",
    "free_port",
    "init_process_group",
    "master_key",
    "node_ip",
    "rendezvous",
]

DISCOVERY_NAMESPACE = "discovery"
log = logging.getLogger(__name__)

# The rank-0 TCPStore behind this process's default process group; it must live as long
# as the group does.
_MASTER_STORE: dict[str, Any] = {}


class DiscoveryError(RuntimeError):
    """A group could not form: bad rank/world size, or torch.distributed failed to start."""


class RendezvousTimeoutError(DiscoveryError, TimeoutError):
    """Rank 0 gave up waiting: some ranks of the group never arrived."""


def free_port() -> int:
    """A TCP port that was free when asked (another process may take it before you bind)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return cast(int, sock.getsockname()[1])


def node_ip() -> str:
    """This node's IP address as Ray sees it (reachable from the other nodes)."""
    return cast(str, ray.util.get_node_ip_address())


def master_key(group: str, generation: int = 0) -> str:
    """The KV key under which rank 0 of `group` publishes (addr, port) for `generation`."""
    return f"{group}/gen{generation}/master"


def arrival_key(group: str, generation: int, rank: int) -> str:
    """The KV key under which `rank` announces that it has joined `generation`."""
    return f"{group}/gen{generation}/ranks/{rank}"


def rendezvous(
    kv: KVStore,
    group: str,
    rank: int,
    world_size: int,
    *,
    generation: int = 0,
    timeout: float = 60.0,
    port: int | None = None,
) -> tuple[str, int]:
    """Agree on the master (addr, port) of `group`; every rank returns the same pair.

    Each rank announces itself; rank 0 waits for all `world_size` ranks, then publishes
    this node's IP and `port` (a free port when None). Rank 0 raises
    RendezvousTimeoutError naming the ranks that never arrived; the others raise
    KVTimeoutError if no master is published within `timeout` seconds.
    """
    _check_rank(group, rank, world_size)
    deadline = time.monotonic() + timeout
    ip = node_ip()
    me = {"node_ip": ip, "pid": os.getpid(), "time": time.time()}
    key = arrival_key(group, generation, rank)
    kv.put(key, me, namespace=DISCOVERY_NAMESPACE, writer=f"{group} rank {rank}")
    if rank != 0:
        remaining = max(0.0, deadline - time.monotonic())
        addr, master_port = kv.wait(
            master_key(group, generation), remaining, namespace=DISCOVERY_NAMESPACE
        )
        return addr, int(master_port)
    _wait_for_ranks(kv, group, world_size, generation, deadline, timeout)
    addr, port = ip, free_port() if port is None else int(port)
    _publish_master(kv, group, generation, addr, port)
    return addr, port


def _wait_for_ranks(
    kv: KVStore, group: str, world_size: int, generation: int, deadline: float, timeout: float
) -> None:
    """Rank 0: block until every rank has announced itself, or name the missing ones."""
    try:
        for rank in range(1, world_size):
            key = arrival_key(group, generation, rank)
            kv.wait(key, max(0.0, deadline - time.monotonic()), namespace=DISCOVERY_NAMESPACE)
    except KVTimeoutError as err:
        prefix = arrival_key(group, generation, 0)[:-1]
        arrived = sorted(
            int(k[len(prefix) :]) for k in kv.list(prefix, namespace=DISCOVERY_NAMESPACE)
        )
        missing = [r for r in range(world_size) if r not in arrived]
        raise RendezvousTimeoutError(
            f"group {group!r} generation {generation}: rank 0 waited {timeout:g} s but ranks "
            f"{missing} of world size {world_size} never arrived (arrived: {arrived}). Check "
            "that those workers were started, are alive and reach the same KV store (run "
            f"{kv.run!r}); read their logs; then re-form the group with a new generation."
        ) from err


def _publish_master(kv: KVStore, group: str, generation: int, addr: str, port: int) -> None:
    """Rank 0: publish (addr, port); warn when this generation already had a master."""
    key = master_key(group, generation)
    old = kv.info(key, namespace=DISCOVERY_NAMESPACE)
    if old is not None:
        log.warning(
            "group %r generation %d already had a master published by %s; overwriting it. "
            "Re-forming a group should use a new generation.",
            group,
            generation,
            describe_writer(old.get("writer")),
        )
    kv.put(key, (addr, int(port)), namespace=DISCOVERY_NAMESPACE, writer=f"{group} rank 0")


def init_process_group(
    kv: KVStore,
    group: str,
    rank: int,
    world_size: int,
    *,
    backend: str = "gloo",
    generation: int = 0,
    timeout: float = 60.0,
    pg_timeout: float | None = None,
) -> None:
    """Start the default `torch.distributed` process group of this rank via KV discovery.

    Destroys an existing default group first (re-forming after a worker was replaced).
    `timeout` bounds the rendezvous (every rank arrived, master published) and store
    operations; the backend handshake that follows, among ranks known to be alive, and
    later collectives run under `pg_timeout` (torch's default when None: 30 min for gloo,
    10 min for nccl). Raises RendezvousTimeoutError (rank 0) / KVTimeoutError (others)
    when ranks or the master do not show up, DiscoveryError when torch.distributed does
    not start.
    """
    import torch.distributed as dist

    _check_rank(group, rank, world_size)
    if dist.is_initialized():
        dist.destroy_process_group()
    _MASTER_STORE.clear()
    try:
        bind_to_node_address(node_ip())
    except InterfaceError as err:
        raise DiscoveryError(f"group {group!r} rank {rank}/{world_size}: {err}") from err
    wait = timedelta(seconds=timeout)
    store = None
    if rank == 0:
        store = dist.TCPStore(node_ip(), 0, world_size, True, timeout=wait, wait_for_workers=False)
        _MASTER_STORE["store"] = store
    own_port = store.port if store is not None else None
    addr, port = rendezvous(
        kv, group, rank, world_size, generation=generation, timeout=timeout, port=own_port
    )
    try:
        if store is None:
            store = dist.TCPStore(addr, port, world_size, False, timeout=wait)
        options = {} if pg_timeout is None else {"timeout": timedelta(seconds=pg_timeout)}
        dist.init_process_group(
            backend=backend, store=store, rank=rank, world_size=world_size, **options
        )
    except Exception as err:
        raise DiscoveryError(
            f"group {group!r} generation {generation}: rank {rank}/{world_size} found its "
            f"master at {addr}:{port} but torch.distributed ({backend}) did not start: {err}. "
            f"Check that all {world_size} ranks call init_process_group with the same group, "
            f"generation and world size, that rank 0 is alive, and that port {port} on {addr} "
            "is reachable from this node."
        ) from err


def _check_rank(group: str, rank: int, world_size: int) -> None:
    if world_size < 1 or not 0 <= rank < world_size:
        raise DiscoveryError(
            f"group {group!r}: rank {rank} is not in [0, world_size={world_size}); "
            "pass 0 <= rank < world_size."
        )
