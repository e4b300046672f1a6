"""A peer that speaks the agent side of the control-plane protocol, for tests of nereusd's
registry and dispatch without agent processes."""

from __future__ import annotations

import zmq

from nereusd import protocol as P
from nereusd.daemon.control_plane import ControlPlane


def fake_agent(control: ControlPlane, node_id: str, count: int) -> zmq.Socket:
    """A DEALER socket registered with ``control`` as agent ``node_id`` of ``count`` virtual devices
    (the registration is real; nothing behind it runs workers)."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(control.endpoint)
    sock.send(P.encode(P.RegisterAgent(node_id=node_id, hostname="h", pid=1, devices=[
        P.DeviceInfo(local_index=i, kind="cpu", name="virtual-cpu", memory_bytes=1) for i in range(count)])))
    for _ in range(100):
        control.poll(0.02)
        if sock.poll(10):
            assert isinstance(P.decode(sock.recv()), P.Welcome)
            return sock
    raise AssertionError("no welcome")
