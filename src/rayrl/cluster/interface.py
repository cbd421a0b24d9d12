"""Which network interface torch.distributed binds to: the one holding the node's Ray address.

Left alone, gloo resolves the machine's hostname and listens on (and tells its peers)
whatever address that gives. On a Debian-style machine `/etc/hosts` maps the hostname
to 127.0.1.1, so a rank advertises a loopback address and the ranks on other machines
cannot connect ("Gloo connectFullMesh failed ... remote=[127.0.1.1]"). NCCL's own
interface guess can pick an interface the other machines do not reach either.

`bind_to_node_address` settles this before a process group forms: the interface is the
one the user named in `GLOO_SOCKET_IFNAME` / `NCCL_SOCKET_IFNAME` (kept as they are),
else the interface that holds this node's Ray address (`ray.util.get_node_ip_address()`,
the address the other nodes already reach this node's raylet by), found with psutil.
Both variables are set in this process, so every backend a process group starts
(gloo for CPU tensors, NCCL for GPU ones) listens on that interface, whatever
`/etc/hosts` says. When no interface holds the address the error says so and what to
set.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass
from typing import cast

__all__ = [
    "IFNAME_VARS",
    "InterfaceError",
    "SocketInterface",
    "bind_to_node_address",
    "interface_holding",
]

# the environment variables that choose the interface of each torch.distributed backend
IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
log = logging.getLogger(__name__)
# the values this module set in this process (a later formation must not take them
# for the user's)
_SET_HERE: dict[str, str] = {}


class InterfaceError(RuntimeError):
    """No network interface of this machine holds the node's Ray address."""


@dataclass(frozen=True)
class SocketInterface:
    """The interface torch.distributed uses in this process, and why it was chosen."""

    gloo: str
    nccl: str
    address: str
    source: str  # "env" (the user's variables) or "node address"

    def describe(self) -> str:
        if self.source == "env":
            return (
                f"torch.distributed binds to GLOO_SOCKET_IFNAME={self.gloo or '(unset)'}, "
                f"NCCL_SOCKET_IFNAME={self.nccl or '(unset)'} (set in the environment)"
            )
        return (
            f"torch.distributed binds to interface {self.gloo}, which holds this node's "
            f"Ray address {self.address}"
        )


def interface_holding(address: str) -> str | None:
    """The name of the network interface that holds IP `address`, or None."""
    import psutil

    wanted = _canonical(address)
    for name, addrs in sorted(psutil.net_if_addrs().items()):
        for addr in addrs:
            ip = addr.family in (socket.AF_INET, socket.AF_INET6)
            if ip and _canonical(addr.address.split("%")[0]) == wanted:
                return cast(str, name)
    return None


def bind_to_node_address(address: str | None = None) -> SocketInterface:
    """Make gloo and NCCL in this process bind to the interface holding `address`
    (this node's Ray address when None), unless the user set `GLOO_SOCKET_IFNAME` or
    `NCCL_SOCKET_IFNAME` (then both are kept as they are: a set one wins). Logs the
    choice at debug level; raises InterfaceError when no interface holds the address."""
    user = {var: os.environ.get(var, "") for var in IFNAME_VARS}
    user = {var: value if value != _SET_HERE.get(var) else "" for var, value in user.items()}
    if any(user.values()):
        chosen = SocketInterface(
            user["GLOO_SOCKET_IFNAME"], user["NCCL_SOCKET_IFNAME"], address or "", "env"
        )
        log.debug(chosen.describe())
        return chosen
    if address is None:
        import ray

        address = ray.util.get_node_ip_address()
    name = interface_holding(address)
    if name is None:
        raise InterfaceError(
            f"no network interface of {socket.gethostname()} holds this node's Ray address "
            f"{address} (interfaces: {_listing()}), so torch.distributed cannot choose where "
            "to listen. Start Ray on this machine with --node-ip-address=<an address of one "
            "of these interfaces that the other machines reach>, or set GLOO_SOCKET_IFNAME "
            "(and NCCL_SOCKET_IFNAME on GPUs) to that interface's name."
        )
    for var in IFNAME_VARS:
        os.environ[var] = _SET_HERE[var] = name
    chosen = SocketInterface(name, name, address, "node address")
    log.debug(chosen.describe())
    return chosen


def _canonical(address: str) -> str:
    """`address` in one spelling (IPv6 has several), for comparing."""
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            return socket.inet_ntop(family, socket.inet_pton(family, address))
        except OSError:
            continue
    return address


def _listing() -> str:
    """`name=addr,addr; ...` of this machine's interfaces, for an error message."""
    import psutil

    parts = []
    for name, addrs in sorted(psutil.net_if_addrs().items()):
        ips = [
            a.address.split("%")[0] for a in addrs if a.family in (socket.AF_INET, socket.AF_INET6)
        ]
        parts.append(f"{name}={','.join(ips) or '-'}")
    return "; ".join(parts) or "none"
