"""The job's pool state, nereusd's reaction to pool changes, and the job status that
``nereus-launch status`` shows.

:class:`PoolController` is the one owner of the job's pool state: the world (devices of the
current world generation, in rank order), the removals requested for the next boundary, and why
the job must stop. The control plane keeps the agent registry (which devices are registered and
which were lost); :class:`nereusd.daemon.live.LiveAdaptation` changes the world at safe
boundaries through this object. It receives every :class:`~nereusd.daemon.pool_events.PoolChange` (from the
control plane: registrations, lost heartbeats, nodes Slurm took; from the ``SIGUSR2``
handler: preemption), journals it as ``pool_changed`` with the verdict of
:func:`~nereusd.daemon.pool_events.assess`, and keeps what the driver's step hook needs: whether to
stop, and why. All of it runs on the control-plane thread (other threads go through
``ControlPlane.call_soon``), so events are handled one at a time, in order.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Callable

from nereusd import checkpoints
from nereusd.daemon.boundary import too_few_left
from nereusd.daemon.control_plane import ControlPlane
from nereusd.errors import NereusError
from nereusd.journal import Event, Journal
from nereusd.rl.record import StepRecord
from nereusd.daemon.pool_events import PoolChange, PoolChangeKind, PoolVerdict, assess
from nereusd.slurm import AllocationWatcher, SlurmPoolEvent

log = logging.getLogger(__name__)


class PoolStop(NereusError):
    """The job stops because of a pool change (a plan device lost, or preemption)."""


class PoolController:
    """See the module docstring. ``plan_devices`` is set once the world is formed."""

    def __init__(self, journal: Journal, run_dir: Path, job_name: str, steps: int,
                 slurm_job_id: str | None = None) -> None:
        self.world: list[int] = []
        """Devices of the current world generation, in rank order (empty until it forms)."""
        self.pending_remove = 0
        """Devices ``nereus-launch pool --remove`` asked to release at the next safe boundary."""
        self.restarting: str | None = None
        """Why a checkpoint/restart is running (``status`` says so), else ``None``."""
        self.joining: Callable[[], dict[str, Any] | None] = lambda: None
        """Reads the background join in progress (:meth:`nereusd.daemon.joins.BackgroundJoins.status`;
        ``None``: none) when ``status`` is asked, so its time so far and its end by a restart show
        at once, not at the next boundary."""
        self.min_devices = 1
        """The fewest devices the job runs on (:func:`~nereusd.config.pool_schedule.min_devices_of`):
        a removal request below it is refused on arrival."""
        self.journal = journal
        self.run_dir = run_dir
        self.job_name = job_name
        self.steps = steps
        self.slurm_job_id = slurm_job_id
        self.control: ControlPlane | None = None
        self.watcher: AllocationWatcher | None = None
        self.plan: dict[str, Any] = {}
        self.step: int | None = None
        self.last_metrics: dict[str, Any] = {}
        self.last_decision: dict[str, Any] | None = None
        self.stop_reason: str | None = None
        self.lost_reason: str | None = None
        """Live adaptation: devices the job used were lost and not yet recovered from."""
        self.preempt_reason: str | None = None
        self.started_s = time.time()
        self.live = False
        """Live adaptation is on: joins and spare losses re-plan (:func:`assess` ``live``)."""

    # ------------------------------------------------------------------ events
    def on_pool_change(self, change: PoolChange) -> None:
        """Journal ``change`` with its verdict; remember a stop or preemption for the step hook.

        With live adaptation, a lost device the job uses is not a stop: the task that fails on it
        is recovered (:meth:`nereusd.daemon.live.LiveAdaptation.recover`: the survivors
        restart from the latest checkpoint); the reason is kept for :meth:`explain_failure` in
        case nothing fits the survivors. PoolVerdict ``recover``.
        """
        verdict, reason = assess(change, self.plan_devices, self.live)
        label = verdict.value
        left = self.control.devices() if self.control else None
        if self.live and change.kind == PoolChangeKind.LOST and verdict == PoolVerdict.STOP and left == []:
            reason = f"{change.detail}: no device is left in the pool; the job stops"
        elif self.live and change.kind == PoolChangeKind.LOST and verdict == PoolVerdict.STOP:
            hit = sorted(self.plan_devices & set(change.devices))
            label, reason = "recover", (f"{change.detail}: the job uses devices {hit} of it; live adaptation "
                                        "restarts it on the remaining devices from the latest checkpoint")
            self.lost_reason = (f"{change.detail}: the job lost devices {hit} and live adaptation found no plan "
                                "that fits the remaining devices")
        record = {"kind": change.kind.value, "cause": change.cause, "node_id": change.node_id,
                  "devices": list(change.devices), "verdict": label, "reason": reason,
                  "pool_devices": left or []}
        self.journal.event(Event.POOL_CHANGED, record)
        self.last_decision = {"time_s": round(time.time(), 3), **record}
        log.warning("pool change: %s -> %s", reason, label)
        if label == PoolVerdict.STOP.value and self.stop_reason is None:
            self.stop_reason = reason
        elif verdict == PoolVerdict.CHECKPOINT_AND_STOP and self.preempt_reason is None:
            self.preempt_reason = reason
        if change.kind == PoolChangeKind.JOINED and self.control is not None and self.watcher is not None:
            agent = self.control.agents.get(change.node_id or "")
            if agent is not None and agent.slurm_job_id:
                self.watcher.add_job(agent.slurm_job_id)

    def on_slurm_event(self, event: SlurmPoolEvent) -> None:
        """A node Slurm took leaves the pool; a grow allocation that ends takes its nodes along."""
        self.journal.event(Event.SLURM_EVENT, {"kind": event.kind, "job_id": event.job_id, "node": event.node,
                                           "detail": event.detail})
        if self.control is None:
            return
        if event.node is not None:
            self.control.remove_node(event.node, f"slurm:{event.kind}", event.detail)
        elif event.job_id != self.slurm_job_id:
            for node_id, agent in list(self.control.agents.items()):
                if agent.slurm_job_id == event.job_id:
                    self.control.remove_node(node_id, f"slurm:{event.kind}", event.detail)

    def request_preemption(self, signal_name: str) -> None:
        """Called from the signal handler: queue the preemption event for the control thread."""
        change = PoolChange(PoolChangeKind.PREEMPTION, f"signal:{signal_name}", None, (),
                            f"Slurm sent {signal_name} (preemption or time limit ahead)")
        if self.control is not None:
            self.control.call_soon(lambda: self.on_pool_change(change))

    # ------------------------------------------------------------------ the driver's hook
    @property
    def plan_devices(self) -> set[int]:
        """Devices the job's workers run on (the world): a change that takes one needs a replan
        or a recovery."""
        return set(self.world)

    def world_formed(self, plan: dict[str, Any], devices: list[int]) -> None:
        """The world (re-)formed on ``devices`` (rank order) running ``plan``."""
        self.plan = plan
        self.world = list(devices)
        if self.control is not None:
            self.control.world_formed = True

    def request_remove(self, count: int) -> dict[str, Any]:
        """``nereus-launch pool --remove``: queue ``count`` devices to leave at the next boundary
        (answered with the queue and the pool)."""
        if not self.live or not self.world:
            return {"error": "live adaptation is off or the world is not formed yet"}
        pool = len(self.control.devices()) if self.control is not None else len(self.world)
        short = too_few_left(pool - self.pending_remove - count, self.min_devices)
        if count < 1 or short:
            # refused here, not at the boundary: there it would take the requests queued beside it along
            return {"error": f"remove {count}: the pool holds {pool} devices"
                             + (f", {self.pending_remove} already leaving" if self.pending_remove else "")
                             + f"; {short or 'expected a positive count'}"}
        self.pending_remove += count
        self.journal.event(Event.POOL_REQUEST, {"remove": count})
        return {"queued_remove": self.pending_remove, "pool": self.control.devices() if self.control else []}

    def after_step(self, record: StepRecord, save_checkpoint) -> None:
        """At the safe boundary after a step: checkpoint and raise :class:`PoolStop` on preemption.

        Raises:
            PoolStop: after saving ``checkpoints/preempted-stepNNNNNN``.
        """
        self.step = record.step
        self.last_metrics = {"reward_mean": record.reward_mean, "response_length_mean": record.response_length_mean,
                             "response_length_max": record.response_length_max,
                             "max_new_tokens": record.max_new_tokens, "step_latency_s": record.step_latency_s}
        if self.control is not None:
            self.control.poll(0)  # handle queued events (signals, watcher) before deciding
        if self.preempt_reason:
            path = self.run_dir / "checkpoints" / f"preempted-step{record.step + 1:06d}"
            save_checkpoint(str(path))
            raise PoolStop(f"{self.preempt_reason}; checkpoint saved in {path}")

    def recovered(self, plan: dict[str, Any], devices: list[int]) -> None:
        """Live adaptation restarted the job after a failure, on ``plan`` over ``devices``."""
        self.lost_reason = None
        self.world_formed(plan, devices)

    def explain_failure(self, err: Exception) -> str | None:
        """The clear message for a task failure caused by a pool change, or ``None``. With live
        adaptation this is reached only when recovery failed (no plan fits the survivors)."""
        reason = self.stop_reason or self.lost_reason
        if reason is None:
            return None
        return f"{reason}; latest checkpoint: {self.latest_checkpoint() or 'none'} (task error: {err})"

    def latest_checkpoint(self) -> str | None:
        latest = checkpoints.latest(self.run_dir / "checkpoints")
        return str(latest) if latest is not None else None

    # ------------------------------------------------------------------ status
    def status(self) -> dict[str, Any]:
        """What ``nereus-launch status`` prints: plan, pool, step, last decision."""
        pool = {}
        if self.control is not None:
            held = set(self.control.devices())   # an agent's released devices are no longer the pool's
            pool = {node: {"devices": [d for d in a.global_devices if d in held], "slurm_job_id": a.slurm_job_id,
                           "workers_alive": sorted(a.workers_alive)} for node, a in self.control.agents.items()}
        state = ("stopping" if (self.stop_reason or self.preempt_reason)
                 else f"restarting: {self.restarting}" if self.restarting else "running")
        return {"job": self.job_name, "state": state,
                "step": self.step, "steps": self.steps, "plan": self.plan, "plan_devices": sorted(self.plan_devices),
                "pool": pool, "pool_devices": len(self.control.devices()) if self.control is not None else 0, "last_decision": self.last_decision, "last_metrics": self.last_metrics,
                "joining": self.joining(),
                "slurm_job_id": self.slurm_job_id, "uptime_s": round(time.time() - self.started_s, 1)}
