"""The control plane's agent registry: which agents and devices form the pool, and which are lost.

:class:`AgentRegistry` is the part of :class:`~nereusd.daemon.control_plane.ControlPlane` that
admits registrations (fresh agents, and agents that kept their workers for a resumed nereusd),
tracks every agent's heartbeat and connection, and answers which devices are lost and why (an
agent removed by heartbeat, disconnection or Slurm, a worker that exited or stalled), and tells
agents whose devices have all left the pool to exit (:meth:`AgentRegistry.retire_idle_agents`). Like
:class:`~nereusd.daemon.task_dispatch.TaskDispatch` it holds no state of its own: it works on the
control plane's tables (``agents``, ``retired_agents``, ``_by_identity``, ``_device_to_agent``, ``_agent_at_fd``,
``ready_workers``, ``exited_workers``, ``stalled_workers``, ``device_losses``) and sends with its
``_send``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from nereusd import protocol as P
from nereusd.daemon.pool_events import PoolChange, PoolChangeKind
from nereusd.errors import NereusError, ProtocolError
from nereusd.journal import Event
from nereusd.plan import MAX_DEVICES

log = logging.getLogger(__name__)


@dataclass
class AgentRecord:
    """What nereusd knows of one node's agent."""

    node_id: str
    identity: bytes
    hostname: str
    pid: int
    devices: list[P.DeviceInfo]
    global_devices: list[int]
    last_seen_s: float
    workers_alive: set[int] = field(default_factory=set)
    slurm_job_id: str | None = None
    fd: int | None = None
    """The socket descriptor its last message came on (the monitor reports disconnects by it)."""
    disconnected_s: float | None = None
    """When its connection dropped (monotonic), until a message arrives again."""
    heartbeat_ack: bytes | None = None
    """The encoded reply to its heartbeats (the same frame every second: encoded once)."""


MAX_DEVICES_PER_AGENT = 64
"""Most devices one agent (one node) may register. Not the job's site's node size: an agent
reports the node it runs on, which may be another site's (a job file's ``site: local`` rendered
for an 8-GPU cluster, ``--gpus`` on a larger box). 64 is above every node built (8–16 GPUs) and far
below the 1,000 and 1 M-device claims that once made nereusd re-plan onto them or stall."""


DISCONNECT_GRACE_S = 3.0
"""An agent whose connection dropped and that sent nothing since for this long is lost (cause
``disconnected``): a killed agent process (its node's kernel closes the socket) is noticed in
seconds instead of the heartbeat timeout. Agents heartbeat every second and ZeroMQ reconnects a
live one at once, so a transient drop does not get that far."""


class AgentRegistry:
    """Registrations, heartbeats and losses of the control plane's agents (module docstring)."""

    _shutting_down = False
    """Set by ``ControlPlane.shutdown_agents``: agents told to exit that drop their connection
    are gone, not lost."""

    def _register(self, identity: bytes, msg: P.RegisterAgent) -> None:
        if msg.node_id in self.agents:
            raise ProtocolError(f"node {msg.node_id!r} is already registered")
        if len(msg.devices) > self.max_devices_per_agent:
            raise ProtocolError(f"agent {msg.node_id!r} claims {len(msg.devices)} devices; an agent may register at "
                                f"most {self.max_devices_per_agent}")
        if self._agent_by_identity(identity) is not None:
            raise ProtocolError(f"peer already registered as agent {self._agent_by_identity(identity).node_id!r}")
        if self.max_pool_devices is not None and len(self._device_to_agent) + len(msg.devices) > self.max_pool_devices:
            raise ProtocolError(f"agent {msg.node_id!r} would bring the pool to {len(self._device_to_agent) + len(msg.devices)} "
                                f"devices; the job allows {self.max_pool_devices} (pool.max_devices)")
        kept = list(msg.kept_devices)
        if kept:
            self._check_kept(msg, kept)
            global_devices = kept
            self._next_global_device = max(self._next_global_device, max(kept) + 1)
        else:
            global_devices = list(range(self._next_global_device, self._next_global_device + len(msg.devices)))
            self._next_global_device += len(msg.devices)
        record = AgentRecord(msg.node_id, identity, msg.hostname, msg.pid, list(msg.devices),
                             global_devices, time.monotonic(), slurm_job_id=msg.slurm_job_id)
        self.agents[msg.node_id] = record
        self._by_identity[identity] = record
        for dev in global_devices:
            self._device_to_agent[dev] = msg.node_id
        log.info("agent %s (%s) registered %d devices as %s", msg.node_id, msg.hostname,
                 len(msg.devices), global_devices)
        if kept:
            self.rejoined = True
            self.kept_workers.update(msg.kept_workers)
            self.ready_workers.update(msg.kept_workers)
        self._on_event(Event.AGENT_REGISTERED, {"node_id": msg.node_id, "hostname": msg.hostname,
                                            "devices": global_devices, "slurm_job_id": msg.slurm_job_id,
                                            **({"kept_workers": sorted(msg.kept_workers)} if kept else {})})
        self._send(identity, P.Welcome(node_id=msg.node_id, global_devices=global_devices))
        if self.world_formed:
            self._on_pool_change(PoolChange(PoolChangeKind.JOINED, "registration", msg.node_id,
                                            tuple(global_devices), f"node {msg.node_id} joined"))

    def _check_kept(self, msg: P.RegisterAgent, kept: list[int]) -> None:
        """A re-registration's kept workers: only a resumed nereusd takes them, one global index
        per device, none registered already, each below :data:`~nereusd.plan.MAX_DEVICES` (the
        pool's size bounds their count, :meth:`_register`: a device that joined after others
        left has an index past it, and one kept so was refused, an adversarial trial).

        Raises:
            ProtocolError: naming what is wrong (the agent then stops those workers).
        """
        if not self.accept_kept_workers:
            raise ProtocolError(f"agent {msg.node_id!r} offers workers kept from a lost nereusd; this nereusd was "
                                "not started with --resume and does not take them")
        if len(kept) != len(msg.devices) or len(set(kept)) != len(kept) or min(kept) < 0:
            raise ProtocolError(f"agent {msg.node_id!r}: kept_devices {kept[:16]} must name one distinct global "
                                f"index ≥ 0 for each of its {len(msg.devices)} devices")
        if not set(msg.kept_workers) <= set(kept):
            raise ProtocolError(f"agent {msg.node_id!r}: kept workers {sorted(set(msg.kept_workers) - set(kept))[:16]} "
                                "are not among its kept devices")
        if max(kept) >= MAX_DEVICES:   # an index, not a count: devices that joined after others left number past the pool's size
            raise ProtocolError(f"agent {msg.node_id!r}: kept device {max(kept)} is beyond the largest device index "
                                f"{MAX_DEVICES - 1}")
        taken = sorted(set(kept) & set(self._device_to_agent))
        if taken:
            raise ProtocolError(f"agent {msg.node_id!r}: kept devices {taken} are registered already")

    def _seen(self, identity: bytes, fd: int | None) -> AgentRecord | None:
        """The registered agent of ``identity``, now heard from on socket ``fd`` (``None``: not
        an agent)."""
        agent = self._agent_by_identity(identity)
        if agent is not None:
            agent.last_seen_s = time.monotonic()
            agent.disconnected_s = None
            if fd is not None and fd != agent.fd:
                if self._agent_at_fd.get(agent.fd) == agent.node_id:
                    del self._agent_at_fd[agent.fd]
                agent.fd = fd
                self._agent_at_fd[fd] = agent.node_id
        return agent

    def waiting_s(self, device: int, now_s: float | None = None) -> float:
        """Seconds the worker of ``device`` has been waiting on peers without a break, as its
        agent's last heartbeat said (0: not waiting, or no word)."""
        since = self._waiting_since.get(device)
        if since is None:
            return 0.0
        return (time.monotonic() if now_s is None else now_s) - since

    def _agent_by_identity(self, identity: bytes) -> AgentRecord | None:
        return self._by_identity.get(identity)   # a dict: 8,192 results from 1,024 agents per boundary

    def _worker_exited(self, agent: AgentRecord, msg: P.WorkerExited) -> None:
        if msg.device not in agent.global_devices:   # only the owner may report its worker's exit
            raise ProtocolError(f"agent {agent.node_id} reported the exit of device {msg.device} it does not own")
        self.exited_workers[msg.device] = msg.exitcode
        self.ready_workers.discard(msg.device)
        fields: dict[str, Any] = {"device": msg.device, "node_id": agent.node_id, "exitcode": msg.exitcode}
        if msg.stalled_s is not None:
            self.stalled_workers[msg.device] = msg.stalled_s
            fields["stalled_s"] = msg.stalled_s
            log.error("worker of device %d on %s stalled (no liveness beat for %.1f s): its agent killed it",
                      msg.device, agent.node_id, msg.stalled_s)
        else:
            log.warning("worker of device %d on %s exited with %s", msg.device, agent.node_id, msg.exitcode)
        self._on_event(Event.WORKER_EXITED, fields)

    def _check_heartbeats(self) -> None:
        now = time.monotonic()
        for node_id, agent in list(self.agents.items()):
            if agent.disconnected_s is not None and self._shutting_down:   # told to exit: gone, not lost
                del self.agents[node_id]   # (a join's workers still starting can keep another agent a while)
                log.info("agent %s exited at the job's end", node_id)
            elif agent.disconnected_s is not None and now - agent.disconnected_s > DISCONNECT_GRACE_S:
                self.remove_node(node_id, "disconnected",
                                 f"agent on node {node_id} dropped its connection and sent nothing for "
                                 f"{now - agent.disconnected_s:.1f} s")
            elif now - agent.last_seen_s > self.heartbeat_timeout_s:
                self.remove_node(node_id, "heartbeat",
                                 f"agent on node {node_id} missed heartbeats for {now - agent.last_seen_s:.1f} s")

    def remove_node(self, node_id: str, cause: str, detail: str) -> bool:
        """Take a node's agent and devices out of the pool (lost heartbeat, Slurm DOWN/DRAIN/shrink).

        Its workers count as exited, so a task waiting on them fails instead of hanging.
        Returns False when no agent of that node is registered.
        """
        agent = self._unlink(node_id)
        if agent is None:
            return False
        # the devices it still held: those that left the pool before (a removal) are no loss
        held = [d for d in agent.global_devices if self._device_to_agent.get(d) == node_id]
        log.error("%s: node %s leaves the pool (devices %s)", detail, node_id, held)
        self._on_event(Event.AGENT_LOST, {"node_id": node_id, "devices": held, "cause": cause, "detail": detail})
        self.lost_agents.append(node_id)
        for dev in agent.global_devices:
            if dev in held:
                self.device_losses[dev] = {"node_id": node_id, "cause": cause, "detail": detail}
            self.exited_workers.setdefault(dev, None)
            self.ready_workers.discard(dev)
            self._device_to_agent.pop(dev, None)
        self._send(agent.identity, P.Shutdown(reason=f"removed from the pool: {detail}"))
        self._on_pool_change(PoolChange(PoolChangeKind.LOST, cause, node_id, tuple(held), detail))
        return True

    def retire_idle_agents(self) -> list[str]:
        """Tell each agent whose devices have all left the pool (removed, lost as spares, failed
        while joining), and whose workers have exited, to exit; journal ``agent_retired``.
        Returns their node ids. An agent that added devices (``pool --add``, a ``grow``
        allocation) otherwise ran idle until the job ended, holding its Slurm allocation."""
        out = []
        for node_id, agent in list(self.agents.items()):
            if (not agent.global_devices or agent.workers_alive
                    or any(self._device_to_agent.get(d) == node_id for d in agent.global_devices)):
                continue
            self._unlink(node_id)
            self.retired_agents[agent.identity] = node_id
            self._send(agent.identity, P.Shutdown(reason="every device of this agent left the pool"))
            self._on_event(Event.AGENT_RETIRED, {"node_id": node_id, "devices": agent.global_devices,
                                                 "slurm_job_id": agent.slurm_job_id})
            log.info("agent %s retired: its devices %s left the pool", node_id, agent.global_devices)
            out.append(node_id)
        return out

    def _unlink(self, node_id: str) -> AgentRecord | None:
        """Forget agent ``node_id`` (its record, identity and socket); returns it, ``None`` if unknown."""
        agent = self.agents.pop(node_id, None)
        if agent is not None:
            self._by_identity.pop(agent.identity, None)
            if self._agent_at_fd.get(agent.fd) == node_id:
                del self._agent_at_fd[agent.fd]
        return agent

    def lost_devices(self, devices: list[int]) -> dict[int, dict[str, Any]]:
        """Which of ``devices`` are lost, from the registry (never from error messages): a device
        whose agent was removed (heartbeat, Slurm) or whose worker process exited unasked.

        Returns ``{device: {"cause", "node_id", ...}}``: cause ``worker_exited`` (with
        ``exitcode``), ``worker_stalled`` (killed by its agent's watchdog, with ``stalled_s``) or the agent's removal cause (``heartbeat``, ``slurm:node_down`` ...).
        """
        out: dict[int, dict[str, Any]] = {}
        for dev in devices:
            if dev in self.device_losses:
                out[dev] = dict(self.device_losses[dev])
            elif dev in self.stalled_workers and dev in self.exited_workers:
                out[dev] = {"cause": "worker_stalled", "node_id": self._device_to_agent.get(dev),
                            "exitcode": self.exited_workers[dev], "stalled_s": self.stalled_workers[dev]}
            elif dev in self.exited_workers:
                out[dev] = {"cause": "worker_exited", "node_id": self._device_to_agent.get(dev),
                            "exitcode": self.exited_workers[dev]}
        return out

    def silent_agents(self, devices: list[int], silent_s: float) -> list[str]:
        """Agents of ``devices`` not heard from for more than ``silent_s`` (not yet declared lost)."""
        now = time.monotonic()
        nodes = {self._device_to_agent[d] for d in devices if d in self._device_to_agent}
        return sorted(n for n in nodes if n in self.agents and now - self.agents[n].last_seen_s > silent_s)

    def devices(self) -> list[int]:
        """Global indices of all devices of registered agents."""
        return sorted(self._device_to_agent)

    def wait_for_devices(self, count: int, timeout_s: float) -> list[int]:
        """Wait until agents with at least ``count`` devices have registered.

        Raises:
            NereusError: on timeout, with what did register.
        """
        deadline = time.monotonic() + timeout_s
        while len(self._device_to_agent) < count:
            if time.monotonic() > deadline:
                raise NereusError(
                    f"only {len(self._device_to_agent)} of {count} devices registered within {timeout_s:.0f} s "
                    f"(agents: {sorted(self.agents)})"
                )
            self.poll(0.2)
        return self.devices()[:count]
