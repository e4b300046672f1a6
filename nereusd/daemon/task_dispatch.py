"""Task dispatch of the control plane: one task to several workers, its results collected.

:class:`TaskDispatch` is the part of :class:`~nereusd.daemon.control_plane.ControlPlane` that
the RL driver and the transition runner call: :meth:`~TaskDispatch.submit` sends one task (typed
args per device, one frame per agent), :meth:`~TaskDispatch.collect` waits for every result while
the control plane's :meth:`poll` keeps the registry current. It uses the control plane's socket,
registry and pending-task table (``_pending``, ``_device_to_agent``, ``agents``,
``exited_workers``, ``_send_frame``, ``poll``); it holds no state of its own.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

from nereusd import protocol as P
from nereusd.errors import ProtocolError, WorkerError
from nereusd.journal import Event

log = logging.getLogger(__name__)


@dataclass
class PendingTask:
    """A submitted task: its kind, the devices it went to, the results received so far."""

    kind: str
    devices: set[int]
    results: dict[int, P.TaskResult] = field(default_factory=dict)
    sent_s: float = field(default_factory=time.monotonic)
    """When it was dispatched (monotonic)."""
    arrived_s: dict[int, float] = field(default_factory=dict)
    """When each result came (monotonic)."""
    half_s: float | None = None
    """Seconds from dispatch until half of its workers had arrived: returned, or waiting on peers
    (the straggler rule; set when it is first judged)."""


STRAGGLER_KINDS = frozenset({"generate", "logprobs", "values", "scores", "train"})
"""Tasks whose workers all do like work (a replica's share of one batch), the ones the straggler
rule judges. Others are uneven by design: a checkpoint is verified by one device of a
model-stage, a build or a transition's finish starts vLLM engines on some devices only."""
WAITING_ARRIVED_S = 5.0
"""A worker that has waited on peers (blocked in a collective, ``Heartbeat.waiting_s``) this long
without a break has arrived at its task as far as the straggler rule goes: it waits for the
ones that have not."""


class TaskDispatch:
    """Mixin of :class:`~nereusd.daemon.control_plane.ControlPlane` (module docstring)."""

    def _raise_if_lost(self, devices: set[int]) -> None:
        dead = sorted(d for d in devices if d in self.exited_workers)
        if dead:
            codes = {d: self.exited_workers[d] for d in dead}
            raise WorkerError(f"worker process of device(s) {dead} exited (exit codes {codes})")

    def submit(self, args_by_device: Mapping[int, P.TaskArgs], shared: Mapping[str, Any] | None = None) -> int:
        """Send one task to several workers (each gets its own typed args, all of one kind);
        returns the task id.

        Every device's agent is checked before anything is sent: a task that reached only some
        of its workers would leave them blocked in its collectives.

        Args:
            shared: args fields every device gets alike (JSON values), encoded once and sent
                once per agent frame (:attr:`~nereusd.protocol.messages.ToWorkers.shared`); the
                agents set them in each worker's args. Checked against the kind here.

        Raises:
            WorkerError: naming the devices that have no live agent (nothing was sent).
            ProtocolError: for args of different kinds in one task, shared fields its args
                do not take, or a device's task over the message limit (its replica's sequences
                too many or too long: :func:`~nereusd.protocol.messages.encode_to_workers`).
        """
        kinds = {a.kind for a in args_by_device.values()}
        if len(kinds) != 1:
            raise ProtocolError(f"one task, one kind: got {sorted(kinds) or 'no args'}")
        kind = kinds.pop()
        shared_member = None
        if shared:
            sample = next(iter(args_by_device.values()))
            P.with_shared(P.Task(task_id=0, args=sample), dict(shared))   # raises for a field the kind lacks
            shared_member = P.encode_shared(shared)
        missing = sorted(d for d in args_by_device
                         if self._device_to_agent.get(d) is None or self._device_to_agent[d] not in self.agents)
        if missing:
            raise WorkerError(f"task {kind}: devices {missing} have no live agent; nothing was sent")
        task_id = self._next_task_id
        self._next_task_id += 1
        by_agent: dict[str, list[tuple[int, P.TaskArgs]]] = {}
        for device, args in args_by_device.items():
            by_agent.setdefault(self._device_to_agent[device], []).append((device, args))
        # one message per agent (unless large), not per device; all encoded before any is sent
        messages = {node_id: P.encode_to_workers(task_id, items, shared=shared_member)
                    for node_id, items in by_agent.items()}
        self._pending[task_id] = PendingTask(kind, set(args_by_device))
        for node_id, encoded in messages.items():
            for message in encoded:
                self._send_frame(self.agents[node_id].identity, "to_workers", message)
        return task_id

    def raise_if_lost(self, task_id: int) -> None:
        """Raise if a worker of pending task ``task_id`` exited (without waiting for results).

        Raises:
            WorkerError: naming the exited devices and their exit codes.
        """
        self._raise_if_lost(self._pending[task_id].devices)

    def done(self, task_id: int) -> bool:
        pending = self._pending[task_id]
        return set(pending.results) == pending.devices

    def collect(self, task_id: int, timeout_s: float | None = None) -> dict[int, P.TaskResult]:
        """Wait for every worker's result of ``task_id``.

        Raises:
            WorkerError: if a worker reports failure (message carries its error), a worker
                of the task exits, or ``timeout_s`` passes.
        """
        pending = self._pending[task_id]
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self.done(task_id):
            failed = [r for r in pending.results.values() if not r.ok]
            if failed:
                break
            self._raise_if_lost(pending.devices - set(pending.results))
            self._kill_stragglers(task_id, pending)
            if deadline is not None and time.monotonic() > deadline:
                missing = sorted(pending.devices - set(pending.results))
                raise WorkerError(f"task {pending.kind} #{task_id}: no result from devices {missing} "
                                  f"within {timeout_s:.0f} s")
            self.poll(0.05, until=lambda: len(pending.results) >= len(pending.devices))
        del self._pending[task_id]
        failed = sorted((r for r in pending.results.values() if not r.ok), key=lambda r: r.device)
        if failed:
            self._abandoned.add(task_id)   # the other workers' results may still come
            first = failed[0]
            raise WorkerError(f"{pending.kind} failed on device {first.device}: {first.error}",
                              error_kind=first.error_kind)
        return pending.results

    def _kill_stragglers(self, task_id: int, pending: PendingTask) -> None:
        """The straggler rule (site ``liveness``): a worker that beats but makes no progress (a
        live-locked loop, a hung vLLM engine process) is stopped by its agent, and its exit makes
        :meth:`collect` raise as for any lost worker, with cause ``worker_stalled``.

        A worker of the task *arrived* when it returned, or when it has been waiting on peers
        (blocked in a collective) for :data:`WAITING_ARRIVED_S` without a break — it waits for
        the ones that have not. It could *start* the task at its dispatch, or at its result of
        the task before it (a worker runs its tasks in order). Stopped, for a worker that has
        neither arrived nor is still on an earlier task:

        - in the :data:`STRAGGLER_KINDS`, once half of the task's workers arrived, after
          ``t_half`` s: ``max(straggler_min_s, straggler_factor × t_half)`` s after it could start;
        - in any task (one-worker tasks, transitions, checkpoints included): ``task_max_s`` s
          after it could start.

        A task whose workers all wait on each other (a deadlock, not a straggler) is left to the
        backend's timeout."""
        now = time.monotonic()
        if now - pending.sent_s <= min(self.straggler_min_s, self.task_max_s):
            return   # cheap until a bound can be reached: this runs at every poll of collect
        waiting = {d: now - self.waiting_s(d, now) for d in pending.devices - set(pending.results)
                   if self.waiting_s(d, now) >= WAITING_ARRIVED_S}
        bound_s = self.task_max_s
        arrivals = sorted([*pending.arrived_s.values(), *waiting.values()])
        if pending.kind in STRAGGLER_KINDS and 2 * len(arrivals) >= len(pending.devices):
            pending.half_s = arrivals[(len(pending.devices) + 1) // 2 - 1] - pending.sent_s
            bound_s = min(bound_s, max(self.straggler_min_s, self.straggler_factor * pending.half_s))
        stalled = []
        for device in sorted(pending.devices - set(pending.results) - set(waiting)):
            if device in self.exited_workers or device in self.stalled_workers:
                continue
            if any(device in other.devices and device not in other.results
                   for other_id, other in self._pending.items() if other_id < task_id):
                continue   # still on an earlier task: this one has not started there
            if now - max(pending.sent_s, self._free_since.get(device, 0.0)) > bound_s:
                stalled.append(device)
        if not stalled:
            return
        elapsed_s = now - pending.sent_s
        log.error("task %s #%d: devices %s have no result %.0f s after dispatch (bound %.1f s; %d of its %d workers "
                  "returned, %d wait on peers): stalled; stopping them", pending.kind, task_id, stalled, elapsed_s,
                  bound_s, len(pending.results), len(pending.devices), len(waiting))
        self._on_event(Event.WORKER_STRAGGLING, {"task": pending.kind, "task_id": task_id, "devices": stalled,
                                                 "elapsed_s": round(elapsed_s, 3),
                                                 "half_s": None if pending.half_s is None else round(pending.half_s, 3),
                                                 "bound_s": round(bound_s, 3), "waiting_on_peers": sorted(waiting)})
        for device in stalled:
            self.stalled_workers[device] = round(elapsed_s, 3)
        self.release_devices(stalled, f"no result of task {pending.kind} #{task_id} within {bound_s:.0f} s",
                             keep_in_pool=True)

    def run(self, args_by_device: Mapping[int, P.TaskArgs], timeout_s: float | None = None,
            shared: Mapping[str, Any] | None = None) -> dict[int, P.TaskResult]:
        """:meth:`submit` then :meth:`collect`."""
        return self.collect(self.submit(args_by_device, shared), timeout_s)
