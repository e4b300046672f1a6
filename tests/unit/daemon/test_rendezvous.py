"""nereusd's rendezvous store listens on the address it is given, never on every interface.

torch's ``TCPStore`` master binds ``*`` whatever host it is given (the store has no
authentication), so these check the listening socket itself: reachable on 127.0.0.1, refused
on 127.0.0.2, another loopback address that a ``*`` listener would accept.
"""

from __future__ import annotations

import socket
from datetime import timedelta

import pytest

from nereusd.daemon.rendezvous import RendezvousStore


def _connects(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=2):
            return True
    except OSError:
        return False


def test_store_listens_on_its_host_only():
    import torch.distributed as dist

    store = RendezvousStore("127.0.0.1", timeout_s=5)
    assert _connects("127.0.0.1", store.port)
    assert not _connects("127.0.0.2", store.port), "the store answers on another address"
    client = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=5))
    client.set("nereus/gen0/k", "v")
    assert store._store.get("nereus/gen0/k") == b"v"


def test_store_resolves_a_host_name():
    store = RendezvousStore("localhost", timeout_s=5)
    assert store.host == "localhost" and store.port > 0
    assert _connects("127.0.0.1", store.port) or _connects("::1", store.port)


def test_an_address_of_another_machine_is_refused():
    with pytest.raises(OSError):
        RendezvousStore("192.0.2.1", timeout_s=5)   # TEST-NET-1: never an address of this machine
