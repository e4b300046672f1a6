"""Checkpoint/restart after a failed step or transition (DESIGN.md urgent path): lost devices
leave the world and the pool, out-of-memory restarts every device, and the survivors start again
from the latest checkpoint (:meth:`FailureRecovery.recover`).

:class:`FailureRecovery` is a part of :class:`nereusd.daemon.live.LiveAdaptation` (its attributes
are the shell's: the controller, driver, control plane, store, journal and pool), in a module of
its own so that the boundary's execution stays readable, as
:mod:`nereusd.control.restarts` is for the controller.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from nereusd.errors import NereusError, WorkerError
from nereusd.journal import Event
from nereusd.planner.search import Infeasible
from nereusd.transition.runner import TransitionInterrupted

log = logging.getLogger(__name__)

MAX_RESTART_ATTEMPTS = 3
"""Checkpoint/restarts one failure may take when devices keep being lost while the restart runs
(:meth:`FailureRecovery.recover`); each restarts without the devices lost in the one before."""


def await_lost_devices(control, devices: list[int], grace_s: float, silent_agent_s: float,
                       clock=time.monotonic) -> dict[int, dict[str, Any]]:
    """Devices of ``devices`` that the control plane knows to be lost (``{device: {cause, ...}}``,
    :meth:`nereusd.daemon.control_plane.ControlPlane.lost_devices`), polling up to ``grace_s`` for
    the news, and while an agent of theirs has been silent for ``silent_agent_s``, up to its
    heartbeat timeout (a killed agent's workers outlive it until their task ends; its loss is
    known by its dropped connection, :data:`~nereusd.daemon.registry.DISCONNECT_GRACE_S`, or by
    heartbeat). A task that fails because a worker exited fails first on a survivor's collective,
    before the agent's ``worker_exited`` arrives."""
    start = clock()
    grace_end = start + grace_s
    heartbeat_end = start + control.heartbeat_timeout_s + 2.0
    while True:
        control.poll(0.1 if grace_s else 0)
        lost = control.lost_devices(devices)
        now = clock()
        if lost or now >= grace_end and (now >= heartbeat_end or not control.silent_agents(devices, silent_agent_s)):
            return lost


class FailureRecovery:
    """:meth:`recover` and the restart it runs (module docstring)."""

    LOSS_GRACE_S = 5.0
    """How long :meth:`recover` waits for the control plane to learn of a lost device after a
    task failed (a survivor's collective can fail before the agent reports the dead worker)."""
    clock = staticmethod(time.monotonic)
    """Seconds, monotonic: how :meth:`lost_devices` measures its waits."""
    SILENT_AGENT_S = 3.0
    """An agent silent this long (heartbeats every second) may be lost: :meth:`recover` waits
    for its heartbeat timeout instead of giving up after :attr:`LOSS_GRACE_S`."""

    def recover(self, err: Exception) -> bool:
        """Checkpoint/restart after a step or transition failed (DESIGN.md urgent path):

        - *devices lost* (a worker process died, or its agent was lost — heartbeat, Slurm): the
          lost devices come from the control plane's registry (:meth:`lost_devices`), leave the
          world and the pool for good (journal ``device_lost``), and the survivors restart;
        - *out of device memory* (the ``frozen`` policy's only remedy): every device restarts.

        Restart (:meth:`_restart`): every worker is stopped and the survivors start again (new
        world generation) on :meth:`Controller.restart_plan`, training state comes from the latest
        checkpoint (or the initial weights before any), and the driver rewinds to that
        checkpoint's step and sample position; the steps since are lost (``fallback`` with
        ``lost_steps``) and run again. A device lost while the restart runs (a new worker killed
        while it starts or loads the checkpoint) is journalled ``device_lost`` with ``during:
        restart``, and the restart begins again without it (at most :data:`MAX_RESTART_ATTEMPTS`
        in all): the checkpoint still holds the state. Returns False (the failure stands) for
        any other error, when no plan fits the devices left, or when the last of those restarts
        lost devices too (journal ``fallback`` with ``action: none``; after a loss its reason is
        the job's failure message).
        """
        oom = isinstance(err, WorkerError) and err.error_kind == "DeviceOutOfMemory"
        if not oom and not isinstance(err, (WorkerError, TransitionInterrupted)):
            return False
        step = self.driver.step_index
        lost = self.lost_devices(wait=not oom)
        if not lost and not oom:
            return False
        # devices joining in the background are healthy and registered: the restart starts
        # workers on them too (a join is cancelled by the restart), so that they can carry the job
        joining = [d for d in self.joins.joining if d not in lost]
        survivors, leaving, error = list(self.world) + joining, [], err
        why = f"out of memory: {str(err)[:300]}" if not lost else ""
        if not lost:
            self.controller.failed(step)   # the re-run plans for the longest response until past it
        for attempt in range(1, MAX_RESTART_ATTEMPTS + 2):
            if lost:   # at the failure, or (attempt > 1) while the restart ran
                causes = ", ".join(sorted({v["cause"] for v in lost.values()}))
                survivors = [d for d in survivors if d not in lost]
                leaving = sorted(set(leaving) | set(lost))
                during = {"during": "restart"} if attempt > 1 else {}
                self.journal.event(Event.DEVICE_LOST, {
                    "step": step, "devices": sorted(lost), "cause": causes, "survivors": survivors, **during,
                    "detail": {str(d): v for d, v in sorted(lost.items())}, "error": str(error)[:300]})
                log.error("step %d: devices %s lost%s (%s); restarting on %s", step, sorted(lost),
                          " during the restart" if during else "", causes, survivors)
                why = (f"{why}; then devices {sorted(lost)} lost during the restart ({causes})" if during
                       else f"devices {sorted(lost)} lost ({causes})")
            try:
                if attempt > MAX_RESTART_ATTEMPTS:
                    raise Infeasible(f"gave up after {MAX_RESTART_ATTEMPTS} restarts, each losing devices")
                if not survivors:
                    raise Infeasible("no device is left")
                self.controller.restart_plan(tuple(sorted(survivors)))
            except Infeasible as reason:
                self.journal.event(Event.FALLBACK, {"step": step, "action": "none", "reason": f"{why}: {reason}",
                                                "survivors": survivors})
                if leaving:   # the job's failure message (PoolController.explain_failure), not the first error
                    self.pool.lost_reason = f"{why}: {reason}"
                return False
            try:
                self._restart(survivors, leaving, step, why, self.driver.last_checkpoint,
                              leave_reason=f"lost: {why}" if leaving else "")
                return True
            except (WorkerError, TransitionInterrupted) as again:
                # a device lost while the restart starts its workers or loads the checkpoint:
                # the checkpoint still holds the state, so restart once more without it
                lost, error = self.lost_devices(wait=True, world=survivors), again
                if not lost:
                    raise
        return False   # not reached: the attempt after the last gives up above

    def lost_devices(self, wait: bool = True, world: list[int] | None = None) -> dict[int, dict[str, Any]]:
        """:func:`await_lost_devices` of ``world`` (default: the job's world), waiting
        :attr:`LOSS_GRACE_S` (``wait``) or not at all."""
        return await_lost_devices(self.control, self.world if world is None else world,
                                  self.LOSS_GRACE_S if wait else 0.0, self.SILENT_AGENT_S, self.clock)

    def _restart(self, world: list[int], leaving: list[int], failed_step: int, why: str,
                 checkpoint: tuple[str, int, int] | None, leave_reason: str = "") -> None:
        """:meth:`_restart_workers`, with ``status`` saying a restart runs and why meanwhile (the
        plan it shows is the one being left)."""
        self.pool.restarting = why
        try:
            self._restart_workers(world, leaving, failed_step, why, checkpoint, leave_reason)
        finally:
            self.pool.restarting = None

    def _restart_workers(self, world: list[int], leaving: list[int], failed_step: int, why: str,
                         checkpoint: tuple[str, int, int] | None, leave_reason: str = "") -> None:
        """Stop every worker (those of ``leaving`` for good: they leave the pool), start ``world``
        again in a new world generation on :meth:`Controller.restart_plan`, load ``checkpoint``
        (initial weights when ``None``) and rewind the driver to its step and sample position.
        Metrics of the steps from there on leave ``metrics.jsonl`` (they run again).

        Workers blocked in a collective with a dead peer do not read messages: the agents stop
        them by signal (SIGTERM, SIGKILL after 3 s, :meth:`emu.agent.Agent.stop_devices`), so
        nothing waits for the backend's timeout.

        Raises:
            NereusError: when the old workers do not stop; Infeasible: nothing fits ``world``.
        """
        start = time.perf_counter()
        self.journal.event(Event.RESTART_STARTED, {
            "step": failed_step, "reason": why, "checkpoint": checkpoint[0] if checkpoint else None,
            "world": sorted(world), "leaving": sorted(leaving)})   # first: a fault during it is on record
        result = self.controller.restart_plan(tuple(sorted(world)))
        old = list(self.world)
        self.joins.cancel("checkpoint/restart: the join starts again", failed_step)
        abandoned = self.control.abandon_tasks()
        if leaving:
            self.control.release_devices(leaving, leave_reason or "removed from the local pool")
        self.control.release_devices(world, "checkpoint/restart", keep_in_pool=True)
        if not self.control.wait_exited(old):
            raise NereusError(f"the workers of {old} did not stop for the restart")
        self._start_workers(world)
        self._reform(list(world), [])     # ranks follow the world's order, not device numbers
        self.driver.plan = result.plan
        self.driver.build(self.world)
        dropped = self.driver.restore(checkpoint)
        step = checkpoint[1] if checkpoint is not None else 0
        self.controller.switched(result.plan, tuple(sorted(self.world)))
        self.controller.restart_measured(time.perf_counter() - start)
        self.switches += 1
        self.restarts += 1
        self.lost_steps += max(0, failed_step - step)
        self.journal.event(Event.FALLBACK, {"step": failed_step, "action": "checkpoint_restart", "reason": why,
                                        "checkpoint": checkpoint[0] if checkpoint else None, "resume_step": step,
                                        "lost_steps": failed_step - step, "dropped_metrics": dropped,
                                        "lost_devices": leaving, "abandoned_tasks": len(abandoned),
                                        "to_plan": result.plan.to_dict(),
                                        "world": self.world, "elapsed_s": time.perf_counter() - start})
        log.warning("step %d: %s: restarted from %s at step %d on %s", failed_step, why,
                    checkpoint[0] if checkpoint else "the initial weights", step, result.plan.describe())
