"""nereusd's control-plane endpoint: ZeroMQ ROUTER, messages in and out (agent registry and
heartbeats: registry.py; task dispatch: task_dispatch.py).

One thread owns the socket. The RL driver calls :meth:`ControlPlane.submit` and
:meth:`ControlPlane.collect`; while it waits, :meth:`ControlPlane.poll` handles every other
message (registrations, heartbeats, worker exits) so the registry stays current. A malformed
or unexpected message is answered with an ``ErrorReply`` and logged; it never stops the daemon.

With job keys (:mod:`nereusd.daemon.security`) the socket is a CURVE server that admits only the job's
client key; a refused handshake is logged and journalled (``connection_refused``). Agents may
register at any time (a ``grow`` allocation joining a running job); every registration after
the first world formed, and every agent lost (heartbeat, or :meth:`ControlPlane.remove_node` for
Slurm's node events), is reported to ``on_pool_change`` as a :class:`~nereusd.daemon.pool_events.PoolChange`.
Other threads hand work to the loop through :meth:`ControlPlane.call_soon` (one queue, one consumer).
"""

from __future__ import annotations

import logging
import queue
import time
from typing import Any, Callable

import zmq

from nereusd import protocol as P
from nereusd.errors import ProtocolError, WorkerError
from nereusd.journal import Event
from nereusd.daemon.pool_events import PoolChange
from nereusd.daemon.registry import MAX_DEVICES_PER_AGENT, AgentRecord, AgentRegistry
from nereusd.daemon.security import JobKeys, ServerAuth
from nereusd.daemon.task_dispatch import TaskDispatch, PendingTask

log = logging.getLogger(__name__)


REFUSALS_SHOWN = 10
"""Refusals of one peer logged and journalled per :data:`REFUSAL_WINDOW_S`; the rest are counted."""
REFUSAL_WINDOW_S = 60.0
REFUSED_CONNECTIONS = b"<connections>"
"""The key under which refused handshakes are counted (:meth:`ControlPlane._shown`): they have no peer identity."""


class ControlPlane(AgentRegistry, TaskDispatch):
    """The ROUTER socket agents connect to, with the registry and task bookkeeping.

    Args:
        bind: ZeroMQ endpoint, e.g. ``tcp://127.0.0.1:0`` (port 0 picks a free port; the bound
            endpoint is :attr:`endpoint`).
        heartbeat_timeout_s: an agent silent for longer is declared lost.
        on_event: called with ``(event_name, fields)`` for the journal.
        keys: the job's server keys; with them only CURVE clients holding the job's client key
            can connect (``None``: plain TCP, for loopback-only local mode).
        on_pool_change: called with every :class:`PoolChange` (agents joining or lost).
        status: returns the dict a ``StatusRequest`` is answered with.
        worker_stall_s: a worker whose liveness beat is silent this long is killed by its agent
            and reported lost with cause ``worker_stalled`` (site ``liveness.worker_stall_s``).
        straggler_factor, straggler_min_s, task_max_s: the straggler rule (site ``liveness``,
            :meth:`~nereusd.daemon.task_dispatch.TaskDispatch._kill_stragglers`).
    """

    def __init__(self, bind: str = "tcp://127.0.0.1:0", *, heartbeat_timeout_s: float = 15.0,
                 on_event: Callable[[str, dict[str, Any]], None] | None = None, keys: JobKeys | None = None,
                 on_pool_change: Callable[[PoolChange], None] | None = None,
                 status: Callable[[], dict[str, Any]] | None = None,
                 on_pool_request: Callable[[int], dict[str, Any]] | None = None,
                 max_devices_per_agent: int = MAX_DEVICES_PER_AGENT, worker_stall_s: float = 120.0,
                 max_pool_devices: int | None = None, straggler_factor: float = 10.0,
                 straggler_min_s: float = 600.0, task_max_s: float = 3600.0) -> None:
        self._ctx = zmq.Context.instance()
        self.straggler_factor = straggler_factor
        self.straggler_min_s = straggler_min_s
        self.task_max_s = task_max_s
        """The straggler rule of :meth:`collect` (site ``liveness.straggler_factor``,
        ``straggler_min_s`` and ``task_max_s``, :class:`~nereusd.config.site.LivenessSpec`)."""
        self.worker_stall_s = worker_stall_s
        """Sent with every ``SpawnWorkers``: the agents' stall bound (site ``liveness.worker_stall_s``)."""
        self.max_devices_per_agent = max_devices_per_agent
        """A registration claiming more devices than this is refused (:data:`MAX_DEVICES_PER_AGENT`)."""
        self.max_pool_devices = max_pool_devices
        """A registration that would make the pool hold more devices is refused (the job's
        ``pool.max_devices``; ``None``: no limit)."""
        self.interrupted: Callable[[], None] = lambda: None
        """Called at the start of every :meth:`poll` (nereusd's loop waits there): raises to stop
        the daemon (nereusd: :meth:`nereusd.stop.SignalStop.raise_pending`)."""
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._sock.setsockopt(zmq.MAXMSGSIZE, P.MAX_FRAME_BYTES)
        self._auth = ServerAuth(self._ctx, keys) if keys is not None else None
        events = zmq.EVENT_DISCONNECTED
        if self._auth is not None:
            self._auth.secure(self._sock)
            for event in ServerAuth.REFUSED_EVENTS:
                events |= event
        self._monitor = self._sock.get_monitor_socket(events)
        self._agent_at_fd: dict[int, str] = {}
        self._sock.bind(bind)
        self.endpoint: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.agents: dict[str, AgentRecord] = {}
        self._by_identity: dict[bytes, AgentRecord] = {}
        self.ready_workers: set[int] = set()
        self.exited_workers: dict[int, int | None] = {}
        self.stalled_workers: dict[int, float] = {}
        """Devices whose agent killed their stalled worker: ``{device: seconds silent}``."""
        self._waiting_since: dict[int, float] = {}
        """Since when each device's worker has been waiting on peers (monotonic; from heartbeats)."""
        self._free_since: dict[int, float] = {}
        """When each device's worker last returned a task result (monotonic): it starts its next
        task then at the latest (the straggler rule)."""
        self.lost_agents: list[str] = []
        self.device_losses: dict[int, dict[str, Any]] = {}
        """Devices whose agent was lost (:meth:`remove_node`): ``{device: {node_id, cause, detail}}``."""
        self._abandoned: set[int] = set()
        self._device_to_agent: dict[int, str] = {}
        self._pending: dict[int, PendingTask] = {}
        self._next_task_id = time.time_ns() // 1000
        """Task ids start at the wall clock in microseconds, so a later nereusd's ids are above
        an earlier one's (unless it issued more than a task per microsecond): a late result that
        a kept worker sends for its lost nereusd's task never matches a new one."""
        self.accept_kept_workers = False
        """``nereusd --resume``: an agent may re-register with the workers it kept from the lost
        nereusd (``RegisterAgent.kept_devices``); they count as ready (:attr:`kept_workers`)."""
        self.kept_workers: set[int] = set()
        """Devices whose worker a re-registering agent kept (their EMUs in memory)."""
        self.rejoined = False
        """Whether an agent of a lost nereusd re-registered (``kept_devices``, workers or not)."""
        self._next_global_device = 0
        self._on_event = on_event or (lambda name, fields: None)
        self._on_pool_change = on_pool_change or (lambda change: None)
        self._status = status or (lambda: {})
        self.on_pool_request = on_pool_request
        self.released_devices: set[int] = set()
        self.retired_agents: dict[bytes, str] = {}
        """Agents told to exit because every device of theirs left the pool (:meth:`retire_idle_agents`),
        by identity: what they send until they go is dropped, neither handled nor refused."""
        self._calls: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self.world_formed = False
        self.refused_messages = 0
        self._refusals: dict[bytes, tuple[float, int, int]] = {}
        """Per peer: start of its refusal window, refusals shown and suppressed in it."""
        self.received_messages = 0
        """Frames received (accepted or refused) since start."""
        self.refused_connections = 0
        self._shutting_down = False

    @property
    def pending_tasks(self) -> int:
        """Tasks dispatched whose results have not all arrived (the dispatch queue's depth)."""
        return len(self._pending)

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the control-plane thread at its next :meth:`poll` (thread-safe)."""
        self._calls.put(fn)

    # ------------------------------------------------------------------ socket loop
    def poll(self, timeout_s: float, until: Callable[[], bool] | None = None) -> None:
        """Handle incoming messages for up to ``timeout_s`` seconds, then check heartbeats.

        ``until``: checked after each burst of messages; when true, stop waiting. Without it a
        task's caller (:meth:`collect`) saw a result only when the whole ``timeout_s`` had passed:
        every worker round trip took a multiple of 50 ms (the demo's transitions spent 0.05 s in
        ``transition_prepare``, 0.05–0.25 s in ``transition_finish``, measured from ``phases_s``).
        """
        self.interrupted()
        deadline = time.monotonic() + max(timeout_s, 0.0)
        while True:
            remaining_ms = max(0, int((deadline - time.monotonic()) * 1000))
            if not self._sock.poll(remaining_ms, zmq.POLLIN):
                break
            while True:   # drain what is queued: one poll per burst, not one per message
                try:
                    frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                try:
                    fd = frames[-1].get(zmq.SRCFD)
                except zmq.ZMQError:
                    fd = None
                self._receive([f.bytes for f in frames], fd)
                if time.monotonic() >= deadline:
                    break
            if time.monotonic() >= deadline or until is not None and until():
                break
        self._check_monitor()
        while not self._calls.empty():
            self._calls.get()()
        self._check_heartbeats()

    def _check_monitor(self) -> None:
        """Refused handshakes (journalled) and dropped connections (their agent is marked, and
        lost after :data:`~nereusd.daemon.registry.DISCONNECT_GRACE_S` without a message)."""
        from zmq.utils.monitor import recv_monitor_message

        while self._monitor.poll(0):
            event = recv_monitor_message(self._monitor)
            if event["event"] == zmq.EVENT_DISCONNECTED:
                agent = self.agents.get(self._agent_at_fd.pop(event["value"], ""))
                if agent is not None and agent.fd == event["value"] and agent.disconnected_s is None:
                    agent.disconnected_s = time.monotonic()
                    (log.info if self._shutting_down else log.warning)("agent %s dropped its connection", agent.node_id)
                continue
            reason = ServerAuth.describe(event)
            if reason is not None:
                self.refused_connections += 1
                if self._shown(REFUSED_CONNECTIONS, Event.CONNECTION_REFUSED, "refused connections"):
                    log.warning("refused a connection: %s", reason)
                    self._on_event(Event.CONNECTION_REFUSED, {"reason": reason})

    def _receive(self, frames: list[bytes], fd: int | None = None) -> None:
        """Handle one multipart message (``[identity, payload frame, ...]``: a long payload comes
        in several frames, :func:`~nereusd.protocol.messages.frames_of`) that came on socket ``fd``."""
        self.received_messages += 1
        identity = frames[0]
        try:
            msg = P.decode(P.joined(frames[1:]))
            self._handle(identity, msg, fd)
        except ProtocolError as err:
            self._refuse(identity, str(err))
        except Exception as err:  # noqa: BLE001 - a handler's bug must not take the daemon (and the job) down
            log.exception("handling a message from peer %r failed", identity)
            self._refuse(identity, f"nereusd could not handle the message: {type(err).__name__}: {str(err)[:200]}")

    def _refuse(self, identity: bytes, reason: str) -> None:
        """Answer every refused message; log and journal at most :data:`REFUSALS_SHOWN` per peer
        per :data:`REFUSAL_WINDOW_S` (:meth:`_shown`)."""
        self.refused_messages += 1
        if self._shown(identity if identity in self._refusals or len(self._refusals) < 1024 else b"<other peers>",
                       Event.MESSAGE_REFUSED, "refusals of peer"):
            log.warning("refused a message from peer %r: %s", identity, reason)
            self._on_event(Event.MESSAGE_REFUSED, {"peer": identity.hex(), "reason": reason})
        self._send(identity, P.ErrorReply(reason=reason))

    def _shown(self, key: bytes, event: Event, what: str) -> bool:
        """Whether to log and journal one more refusal of ``key`` (a peer, or
        :data:`REFUSED_CONNECTIONS`): at most :data:`REFUSALS_SHOWN` per :data:`REFUSAL_WINDOW_S`,
        so that a flood cannot fill the disk with ``events.jsonl`` (5,000 refused handshakes
        wrote 5,000 events in 11 s: an adversarial trial, 2026-12-07); the rest are counted, and
        the next refusal after the window journals how many (``event`` with ``suppressed``)."""
        now = time.monotonic()
        start, shown, hidden = self._refusals.get(key, (now, 0, 0))
        if now - start > REFUSAL_WINDOW_S:
            if hidden:
                log.warning("suppressed %d more %s %r in %.0f s", hidden, what, key, now - start)
                self._on_event(event, {"peer": key.hex(), "suppressed": hidden, "window_s": round(now - start, 1)})
            start, shown, hidden = now, 0, 0
        if shown == REFUSALS_SHOWN - 1:
            log.warning("further %s %r are counted, not logged, for a while", what, key)
        shown, hidden = (shown + 1, hidden) if shown < REFUSALS_SHOWN else (shown, hidden + 1)
        self._refusals[key] = (start, shown, hidden)
        return hidden == 0

    def _send(self, identity: bytes, msg: P._Message) -> None:
        self._send_frame(identity, msg.type, P.encode(msg))

    def _send_frame(self, identity: bytes, kind: str, frame: bytes) -> None:
        try:
            self._sock.send_multipart([identity, *P.frames_of(frame)])
        except zmq.ZMQError as err:  # peer gone (ROUTER_MANDATORY): nothing to deliver to
            # after shutdown_agents their connections drop by design: a late heartbeat reply is no news
            (log.info if self._shutting_down else log.warning)("cannot send %s to %r: %s", kind, identity, err)

    def _handle(self, identity: bytes, msg: P._Message, fd: int | None = None) -> None:
        if isinstance(msg, P.RegisterAgent):
            self._register(identity, msg)
            self._seen(identity, fd)
            return
        if isinstance(msg, P.StatusRequest):
            self._send(identity, P.StatusReply(status=self._status()))
            return
        if isinstance(msg, P.PoolRequest):
            if self.on_pool_request is None:
                raise ProtocolError("this nereusd does not change its pool on request")
            self._send(identity, P.StatusReply(status=self.on_pool_request(msg.remove)))
            return
        if identity in self.retired_agents:
            return   # a heartbeat or exit report sent before it read its Shutdown
        agent = self._seen(identity, fd)
        if agent is None:
            raise ProtocolError(f"{msg.type!r} from an unregistered peer")
        if isinstance(msg, P.Heartbeat):
            agent.workers_alive = set(msg.workers_alive)
            now = time.monotonic()
            for device in agent.global_devices:
                waited = msg.waiting_s.get(device)
                if waited is None:
                    self._waiting_since.pop(device, None)
                else:
                    self._waiting_since[device] = now - min(max(waited, 0.0), 1e9)
            if agent.heartbeat_ack is None:
                agent.heartbeat_ack = P.encode(P.Heartbeat(node_id=agent.node_id))
            self._send_frame(identity, "heartbeat", agent.heartbeat_ack)   # the ack tells the agent we live
        elif isinstance(msg, P.WorkerExited):
            self._worker_exited(agent, msg)
        elif isinstance(msg, P.FromWorker):
            self._relayed(agent, [msg])
        elif isinstance(msg, P.FromWorkers):
            self._relayed(agent, msg.items)
        elif isinstance(msg, P.ErrorReply):
            log.error("agent %s reported an error: %s", agent.node_id, msg.reason)
        else:
            raise ProtocolError(f"nereusd does not accept {msg.type!r} messages")

    def _relayed(self, agent: AgentRecord, items: list[P.FromWorker]) -> None:
        """Accept what ``agent`` relayed from its workers, item by item: a bad item (a device the
        agent does not own, a result nobody asked for) is refused after the good ones are taken.

        Raises:
            ProtocolError: naming the first bad item and how many there were.
        """
        bad: list[str] = []
        for item in items:
            try:
                if item.device not in agent.global_devices:
                    raise ProtocolError(f"agent {agent.node_id} relayed for device {item.device} it does not own")
                self._from_worker(item.device, item.payload)
            except ProtocolError as err:
                bad.append(str(err))
        if bad:
            raise ProtocolError(bad[0] + (f" (and {len(bad) - 1} more of {len(items)} items)" if len(bad) > 1 else ""))

    def _from_worker(self, device: int, payload: P.WorkerReady | P.TaskResult) -> None:
        if isinstance(payload, P.WorkerReady):
            self.ready_workers.add(device)
            self.exited_workers.pop(device, None)
            self.stalled_workers.pop(device, None)
            return
        self._free_since[device] = time.monotonic()
        if payload.task_id in self._abandoned:   # a failed task's straggler: nobody waits for it
            log.debug("dropped a late result of abandoned task %d from device %d", payload.task_id, device)
            return
        pending = self._pending.get(payload.task_id)
        if pending is None or device not in pending.devices:
            raise ProtocolError(f"result for unknown task {payload.task_id} from device {device}")
        pending.results[device] = payload
        pending.arrived_s[device] = self._free_since[device]

    def release_devices(self, devices: list[int], reason: str, keep_in_pool: bool = False) -> None:
        """Stop the workers of ``devices``; unless ``keep_in_pool`` (a restart), take the devices
        out of the pool (their agents stay).

        Used at a safe boundary after the plan moved off them, or to restart workers; the exits
        the agents report are journalled as ``worker_exited``.
        """
        by_agent: dict[str, list[int]] = {}
        for dev in devices:
            node_id = self._device_to_agent.get(dev) if keep_in_pool else self._device_to_agent.pop(dev, None)
            if node_id is not None:
                by_agent.setdefault(node_id, []).append(dev)
            if not keep_in_pool:
                self.released_devices.add(dev)
            self.ready_workers.discard(dev)
        for node_id, devs in by_agent.items():
            self._send(self.agents[node_id].identity, P.StopWorkers(devices=devs, reason=reason))
        self._on_event(Event.WORKERS_STOPPED if keep_in_pool else "devices_released",
                       {"devices": sorted(devices), "reason": reason})

    def wait_exited(self, devices: list[int], timeout_s: float = 15.0) -> bool:
        """Poll until the workers of ``devices`` are reported exited; False on timeout."""
        deadline = time.monotonic() + timeout_s
        while not all(d in self.exited_workers for d in devices):
            if time.monotonic() > deadline:
                return False
            self.poll(0.05)
        return True

    def abandon_task(self, task_id: int) -> None:
        """Forget pending task ``task_id`` (its workers are being stopped); late results are dropped."""
        if self._pending.pop(task_id, None) is not None:
            self._abandoned.add(task_id)

    def abandon_tasks(self) -> list[int]:
        """Forget every pending task (their workers are being stopped for a restart); late
        results of them are dropped instead of refused. Returns the task ids."""
        ids = sorted(self._pending)
        self._abandoned.update(ids)
        self._pending.clear()
        return ids

    def spawn_workers(self, *, generation: int, world: list[int], store_host: str, store_port: int,
                      memory_capacity_bytes: int, run_dir: str, timeout_s: float = 120.0, wait: bool = True) -> None:
        """Ask each agent to start the workers of ``world`` (rank = position in ``world``) and,
        with ``wait``, wait until all are ready (else ``ready_workers`` tells when they are).

        Raises:
            WorkerError: if a worker exits or does not report ready within ``timeout_s``.
        """
        for device in world:   # a restart: the previous workers' exits are history
            self.exited_workers.pop(device, None)
            self.stalled_workers.pop(device, None)
        by_agent: dict[str, list[P.WorkerSpec]] = {}
        for rank, device in enumerate(world):
            node_id = self._device_to_agent[device]
            local_index = self.agents[node_id].global_devices.index(device)
            by_agent.setdefault(node_id, []).append(
                P.WorkerSpec(device=device, local_index=local_index, memory_capacity_bytes=memory_capacity_bytes,
                             rank=rank)
            )
        for node_id, workers in by_agent.items():
            self._send(self.agents[node_id].identity, P.SpawnWorkers(
                generation=generation, world_size=len(world), store_host=store_host, store_port=store_port,
                workers=workers, run_dir=run_dir, worker_stall_s=self.worker_stall_s,
            ))
        deadline = time.monotonic() + timeout_s
        while wait and not set(world) <= self.ready_workers:
            self._raise_if_lost(set(world))
            if time.monotonic() > deadline:
                missing = sorted(set(world) - self.ready_workers)
                raise WorkerError(f"workers of devices {missing} did not start within {timeout_s:.0f} s")
            self.poll(0.1)

    # ------------------------------------------------------------------ teardown
    def shutdown_agents(self, reason: str, wait_s: float = 10.0) -> None:
        """Tell every agent to stop its workers and exit; wait up to ``wait_s`` for them to go."""
        self._shutting_down = True   # their connections drop now: expected, not a loss worth a warning
        for agent in self.agents.values():
            self._send(agent.identity, P.Shutdown(reason=reason))
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and any(a.workers_alive for a in self.agents.values()):
            self.poll(0.1)

    def close(self) -> None:
        try:
            self._sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self._monitor.close(linger=0)
        self._sock.close(linger=0)
        if self._auth is not None:
            self._auth.close()
