"""Fuzzing nereusd's control plane (issue 17, item 1): frames built by ``hypothesis`` — random
bytes, JSON of every shape, and valid messages with fields replaced — fed to the real decoder
and handlers (:meth:`ControlPlane._receive`, behind the ROUTER socket) of a control plane with a
registered agent, a formed world, a pending task and the real pool controller and journal.

The property: no frame raises out of the handlers (a refusal is an ``ErrorReply``), and the
registry keeps its bounds (no agent above :attr:`ControlPlane.max_devices_per_agent`, the real
agent keeps its devices unless its own identity reports them). Used by
``tests/unit/daemon/test_protocol_fuzz.py`` (a short run in CI) and ``scripts/fuzz_protocol.py``
(100,000 cases).
"""

from __future__ import annotations

import base64
import json
import logging
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hypothesis import strategies as st

from nereusd import protocol as P
from nereusd.daemon.control_plane import ControlPlane
from nereusd.daemon.pool import PoolController
from nereusd.journal import Journal

AGENT = b"agent-n0"
"""The identity of the one real registered agent (devices 0 and 1)."""

_json_leaf = (st.none() | st.booleans() | st.integers(min_value=-2**70, max_value=2**70)
              | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=16))
json_values = st.recursive(
    _json_leaf,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=5),
    max_leaves=10,
)


def _device(local_index: int) -> P.DeviceInfo:
    return P.DeviceInfo(local_index=local_index, kind="cpu", name="virtual-cpu", memory_bytes=1)


@st.composite
def valid_messages(draw) -> P._Message:
    """Messages a peer could send that decode: the handlers' own paths."""
    kind = draw(st.integers(0, 11))
    node = draw(st.sampled_from(["n0", "n1", "ghost", ""]))
    device = draw(st.integers(min_value=-2, max_value=80))
    if kind == 0:
        return P.RegisterAgent(node_id=node, hostname="h", pid=draw(st.integers(0, 2**31)),
                               devices=[_device(i) for i in range(draw(st.integers(0, 70)))])
    if kind == 1:
        return P.Heartbeat(node_id=node, workers_alive=draw(st.lists(st.integers(-2, 80), max_size=4)))
    if kind == 2:
        return P.WorkerExited(node_id=node, device=device, exitcode=draw(st.none() | st.integers(-64, 255)),
                              stalled_s=draw(st.none() | st.floats(0, 1e6)))
    if kind == 3:
        return P.FromWorker(device=device, payload=P.WorkerReady(device=device, pid=1))
    if kind == 4:
        return P.FromWorker(device=device, payload=P.TaskResult(
            task_id=draw(st.integers(0, 5)), device=device, ok=draw(st.booleans()),
            result=draw(st.none() | st.just({"x": 1.0}))))
    if kind == 5:
        return P.PoolRequest(remove=draw(st.integers(1, 10)))
    if kind == 11:   # a relayed batch: results and readiness of several devices, owned or not
        return P.FromWorkers(items=[P.FromWorker(device=d, payload=P.TaskResult(
            task_id=draw(st.integers(0, 5)), device=d, ok=draw(st.booleans())))
            for d in draw(st.lists(st.integers(-2, 80), min_size=1, max_size=6))])
    return [P.StatusRequest(), P.ErrorReply(reason="r"), P.Welcome(node_id=node, global_devices=[device]),
            P.Shutdown(reason="r"), P.StopWorkers(devices=[device])][kind - 6]


@st.composite
def frames(draw) -> list[bytes]:
    """One multipart message as the ROUTER socket delivers it: ``[identity, payload...]``."""
    identity = draw(st.sampled_from([AGENT, b"peer-x", b"", b"\x00" * 8]))
    kind = draw(st.integers(0, 5))
    if kind == 0:
        payload = draw(st.binary(max_size=200))
    elif kind == 1:
        payload = json.dumps(draw(json_values)).encode()
    elif kind == 2:   # a known envelope with random fields
        data = {"v": draw(st.sampled_from([1, 1, 1, 0, 2, "1", None, 1.0])),
                "type": draw(st.sampled_from(sorted(P.messages._KNOWN_TYPES) + ["bogus"]))}
        data.update(draw(st.dictionaries(st.sampled_from(_FIELD_NAMES), json_values, max_size=5)))
        payload = json.dumps(data).encode()
    elif kind == 3:   # a valid message with one field replaced
        data = json.loads(P.encode(draw(valid_messages())))
        key = draw(st.sampled_from(sorted(data)))
        data[key] = draw(json_values)
        payload = json.dumps(data).encode()
    elif kind == 4:   # nested too deep, a huge number, or compressed shared fields that inflate to either
        depth = draw(st.integers(100, 5000))
        inflated = draw(st.sampled_from([b"[" * depth, b"{}" + b" " * depth * 1000, b'{"plans":' + b"1" * depth + b"}"]))
        payload = draw(st.sampled_from([b"[" * depth + b"]" * depth, b'{"v":1,"type":"heartbeat","node_id":' +
                                        b"[" * depth + b"]" * depth + b"}", b"1" + b"0" * depth,
                                        b'{"v":1,"type":"to_workers","items":[],"shared_zlib":"' +
                                        base64.b64encode(zlib.compress(inflated)) + b'"}']))
    else:
        payload = P.encode(draw(valid_messages()))
    extra = draw(st.sampled_from([[], [], [], [b"x"]]))
    return [identity, payload, *extra]


_FIELD_NAMES = sorted({name for cls in P.messages._Message.__subclasses__() for name in cls.model_fields}
                      | {"shared_zlib"})   # the wire name of compressed ToWorkers.shared (inflated at decode)


@dataclass
class Target:
    """A control plane in mid-job, its pool controller and what it journalled."""

    control: ControlPlane
    pool: PoolController
    task_id: int
    log_level: int = logging.NOTSET
    """The ``nereusd`` logger's level before the run (restored by :meth:`close`)."""

    def feed(self, frame: list[bytes]) -> None:
        """Hand ``frame`` to the control plane as its socket would, then check its bounds.

        Raises:
            AssertionError: a bound broken (an exception from the handlers propagates as is).
        """
        self.control._receive(frame)
        for agent in self.control.agents.values():
            assert len(agent.global_devices) <= self.control.max_devices_per_agent, agent
        if frame[0] != AGENT and "n0" in self.control.agents:
            assert self.control.agents["n0"].global_devices == [0, 1]

    def close(self) -> None:
        self.control.close()
        self.pool.journal.close()
        logging.getLogger("nereusd").setLevel(self.log_level)


def make_target(run_dir: Path) -> Target:
    """A control plane with agent ``n0`` (devices 0 and 1) registered, the world formed, live
    adaptation on and one task pending on both devices."""
    logger = logging.getLogger("nereusd")
    log_level = logger.level
    logger.setLevel(logging.CRITICAL)   # each refusal is logged: 100,000 lines
    journal = Journal(run_dir)
    pool = PoolController(journal, run_dir, "fuzz", steps=10)
    pool.live = True
    control = ControlPlane(on_event=journal.event, on_pool_change=pool.on_pool_change, status=pool.status,
                           on_pool_request=pool.request_remove)
    pool.control = control
    control._receive([AGENT, P.encode(P.RegisterAgent(node_id="n0", hostname="h", pid=1,
                                                      devices=[_device(0), _device(1)]))])
    assert control.devices() == [0, 1]
    control.world_formed = True
    pool.world_formed({}, [0, 1])
    task_id = control.submit({0: P.MemoryReportArgs(), 1: P.MemoryReportArgs()})
    return Target(control, pool, task_id, log_level)


def summary(target: Target, cases: int) -> dict[str, Any]:
    return {"cases": cases, "refused": target.control.refused_messages, "agents": len(target.control.agents),
            "devices": len(target.control.devices())}
