"""Which interface torch.distributed binds to (`rayrl.cluster.interface`): the one that
holds the node's address, a user's GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME kept, and a
clear error when no interface holds the address. Real interfaces of this machine."""

from __future__ import annotations

import socket

import psutil
import pytest

from rayrl.cluster import interface
from rayrl.cluster.interface import (
    IFNAME_VARS,
    InterfaceError,
    bind_to_node_address,
    interface_holding,
)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    """No interface variables from the environment; none left behind."""
    for var in IFNAME_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(interface, "_SET_HERE", {})


def _addresses() -> dict[str, list[str]]:
    return {
        name: [a.address for a in addrs if a.family == socket.AF_INET]
        for name, addrs in psutil.net_if_addrs().items()
    }


def test_the_interface_holding_an_address_is_found():
    held = {ip: name for name, ips in _addresses().items() for ip in ips}
    assert held, "this machine has no IPv4 address"
    for ip, name in held.items():
        assert interface_holding(ip) == name


def test_both_backends_bind_to_the_node_address_interface(monkeypatch):
    for var in IFNAME_VARS:  # what the binding sets here is undone after the test
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(interface, "_SET_HERE", {})
    ip, name = next((ip, name) for name, ips in sorted(_addresses().items()) for ip in ips)
    chosen = bind_to_node_address(ip)
    assert (chosen.gloo, chosen.nccl, chosen.source) == (name, name, "node address")
    assert [interface.os.environ[v] for v in IFNAME_VARS] == [name, name]
    assert name in chosen.describe() and ip in chosen.describe()
    # a second formation in the same process finds its own choice, not the user's
    assert bind_to_node_address(ip).source == "node address"


def test_a_users_interface_wins(monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth7")
    chosen = bind_to_node_address("203.0.113.77")  # held by none: not looked at
    assert (chosen.gloo, chosen.nccl, chosen.source) == ("eth7", "", "env")
    assert "NCCL_SOCKET_IFNAME" not in interface.os.environ
    assert "GLOO_SOCKET_IFNAME=eth7" in chosen.describe()


def test_no_interface_holding_the_address_is_a_clear_error():
    if interface_holding("203.0.113.77") is not None:
        pytest.skip("this machine holds 203.0.113.77")
    with pytest.raises(InterfaceError) as err:
        bind_to_node_address("203.0.113.77")
    text = str(err.value)
    assert "203.0.113.77" in text and "--node-ip-address" in text
    assert "GLOO_SOCKET_IFNAME" in text and "lo=127.0.0.1" in text
    assert not any(v in interface.os.environ for v in IFNAME_VARS)
