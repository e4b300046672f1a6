"""Background joins: devices that arrive join the job while its steps go on (``pool.join:
background``, the default; DESIGN.md "Engine backends and generation on vLLM").

A device that arrives (a ``pool.schedule``/``pool.trace`` add, ``nereus-launch pool --add``, a
``grow`` allocation's agent) needs a worker process, the job's models recorded in it, and, where
generation runs on vLLM, an engine: seconds on this machine, tens of seconds to minutes on GPUs
(``bench_costmodel.py`` measured 6.6–7.5 s per vLLM start-up here). A foreground join
(``pool.join: immediate``) does all of it at the boundary the devices arrive at, and the job
waits. A background join does it beside the running steps, one phase per safe boundary once the
phase before has finished (:meth:`BackgroundJoins.advance`):

1. *starting*: the workers start in a private world of the joining devices;
2. *building*: they record the job's models (a build with an empty plan, as a foreground join);
3. *engines*: where generation runs on vLLM, they start the engines of the replicas that the
   controller expects to place wholly on them (:meth:`Controller.early_engines`: on the plan it
   anticipates for the grown pool; the ``prestart_engines`` task) — when that saves the growth
   every start-up: where a replica that stays on its devices changes its key (another wave
   size), the transition starts engines anyway and this phase is skipped;
4. *ready*: the shell re-forms the world with them and replans, as for any devices that joined;
   the controller knows the warm engines (:attr:`Controller.warm_engines`), so a target that
   places those replicas there prices no engine start-up, and the workers adopt the engines
   instead of starting new ones (:meth:`emu.worker.vllm_stages.VllmStages._adopt_warm`).

Devices that arrive while a join runs wait for the next one. A joining worker that exits, or a
phase's task that fails, ends the join (``join_failed``): the workers of the devices that failed
stop and those devices leave the pool; the others stop and join again from the start. A
checkpoint/restart of the job, or a removal that takes joining devices (they hold nothing of the
job, so a removal takes them before the world's: :func:`nereusd.daemon.boundary.plan_pool`),
cancels a running join the same way (:meth:`BackgroundJoins.cancel`, ``join_cancelled``); the
end of the job abandons it (:meth:`BackgroundJoins.abandon`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from nereusd import protocol as P
from nereusd.errors import WorkerError
from nereusd.journal import Event, Journal
from nereusd.plan import ModelStage

log = logging.getLogger(__name__)

BUILD_TIMEOUT_S = 300.0
"""Seconds a phase's task may take once it has been collected for (never reached in practice:
:meth:`BackgroundJoins.advance` collects only a task that is done)."""


@dataclass
class Join:
    """One background join in progress."""

    devices: list[int]
    """The joining devices, in the rank order of their private world."""
    generation: int
    """Their private world generation."""
    arrived_s: float
    """When they arrived (the shell's clock)."""
    step: int
    """The step after which they arrived."""
    phase: str = "starting"
    task_id: int | None = None
    warm: dict[ModelStage, dict[int, tuple]] = field(default_factory=dict)
    """``{model_stage: {device: replica key}}`` of the engines started early."""
    engine_start_s: float = 0.0
    """The slowest of those engines' start-up, seconds."""


class BackgroundJoins:
    """The background join of a live job (module docstring).

    Args:
        control: the control plane (spawn, submit, done, collect, release).
        store: the rendezvous store (world generations).
        controller: the job's controller (anticipated plan, warm engines, engine start-up).
        build_args: the build of a joining worker (``driver.build_args(Plan({}))``).
        journal, run_dir, device_memory_bytes: as the shell's.
        clock: monotonic seconds.
    """

    def __init__(self, *, control, store, controller, build_args: Callable[[], P.BuildArgs], journal: Journal,
                 run_dir: Path, device_memory_bytes: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.control, self.store, self.controller = control, store, controller
        self.build_args, self.journal, self.run_dir = build_args, journal, Path(run_dir)
        self.device_memory_bytes = device_memory_bytes
        self.clock = clock
        self.join: Join | None = None
        self.arrived_after_step: int | None = None
        """The step after which the devices of the last join that ended ready arrived."""
        self._arrived: dict[int, tuple[int, float]] = {}
        """``{device: (step, clock)}``: when each device not yet joined was first seen arrived (a
        device that waits for a running join is reported from its arrival, not the next join's start)."""

    @property
    def joining(self) -> list[int]:
        """Devices of the join in progress (none: ``[]``)."""
        return list(self.join.devices) if self.join is not None else []

    def advance(self, arrived: list[int], world: list[int], step: int) -> list[int]:
        """Start a join of ``arrived`` (devices registered, in no world and no join) when none
        runs, and move the running one through every phase whose work is done. Returns the
        devices that are ready to join the world now (``[]`` while none is), with the
        controller's :attr:`~Controller.warm_engines` set for them.

        Never raises for a joining worker's failure: the join ends (module docstring)."""
        now = self.clock()
        present = set(arrived) | set(self.joining)   # forget devices that left the pool before joining
        self._arrived = {d: v for d, v in self._arrived.items() if d in present}
        for d in arrived:
            self._arrived.setdefault(d, (step, now))
        j = self.join
        if j is None:
            if not arrived:
                return []
            j = self._start(arrived, step)
            arrived = []
        try:
            ready = self._advance(j, world, step)
        except WorkerError as err:
            self._fail(j, step, str(err))
            return []
        if ready and arrived:   # devices that waited for this join start theirs now, not a boundary later
            self._start(arrived, step)
        return ready

    def _start(self, devices: list[int], step: int) -> Join:
        """Start the join of ``devices``: their workers, in a private world."""
        first_step, first_s = min(self._arrived[d] for d in devices)
        j = self.join = Join(list(devices), self.store.next_generation(), first_s, first_step)
        self.control.spawn_workers(generation=j.generation, world=j.devices, store_host=self.store.host,
                                   store_port=self.store.port, memory_capacity_bytes=self.device_memory_bytes,
                                   run_dir=str(self.run_dir.resolve()), wait=False)
        self.journal.event(Event.JOIN_STARTED, {"step": step, "devices": j.devices, "generation": j.generation})
        return j

    def _advance(self, j: Join, world: list[int], step: int) -> list[int]:
        while True:
            exited = [d for d in j.devices if d in self.control.exited_workers]
            if exited:
                raise WorkerError(f"the workers of joining devices {exited} exited")
            if j.phase == "starting":
                if not set(j.devices) <= self.control.ready_workers:
                    return []
                build = self.build_args()
                j.task_id, j.phase = self.control.submit({d: build for d in j.devices}), "building"
            elif j.phase in ("building", "engines"):
                if not self.control.done(j.task_id):
                    self.control.raise_if_lost(j.task_id)
                    return []
                results = self.control.collect(j.task_id, BUILD_TIMEOUT_S)
                j.task_id = None
                if j.phase == "engines":
                    j.engine_start_s = max((float((r.result or {}).get("engine_start_s", 0.0)) for r in results.values()),
                                           default=0.0)
                    j.phase = "ready"
                    continue
                pool = tuple(sorted(set(world) | set(j.devices)))
                j.warm = self.controller.early_engines(pool, j.devices)
                if not j.warm:
                    j.phase = "ready"
                    continue
                replicas = sorted({(ms, key) for ms, keys in j.warm.items() for key in keys.values()},
                                  key=lambda r: (ModelStage.sort_key(r[0]), r[1]))
                args = P.PrestartEnginesArgs(world=j.devices, replicas=[
                    P.EngineReplica(model_stage=str(ms), tp=key[0], devices=list(key[1]), max_num_seqs=key[2])
                    for ms, key in replicas])
                j.task_id, j.phase = self.control.submit({d: args for d in j.devices}), "engines"
            else:   # ready
                self.join, self.arrived_after_step = None, j.step
                for d in j.devices:
                    self._arrived.pop(d, None)
                if j.engine_start_s:
                    self.controller.engine_started(j.engine_start_s)
                self.controller.warm_engines = j.warm
                self.journal.event(Event.WORKERS_STARTED, {
                    "step": step, "devices": j.devices, "generation": j.generation, "background": True,
                    "arrived_after_step": j.step, "elapsed_s": round(self.clock() - j.arrived_s, 3),
                    "engine_start_s": round(j.engine_start_s, 3),
                    "warm": {str(ms): sorted(keys) for ms, keys in j.warm.items()}})
                log.info("devices %s joined in the background (%.1f s after they arrived)", j.devices,
                         self.clock() - j.arrived_s)
                return j.devices

    def _fail(self, j: Join, step: int, why: str) -> None:
        """End ``j`` (module docstring): the devices whose workers exited leave the pool, the
        others are stopped and join again."""
        self.join = None
        if j.task_id is not None:
            self.control.abandon_task(j.task_id)
        failed = sorted(d for d in j.devices if d in self.control.exited_workers) or list(j.devices)
        again = [d for d in j.devices if d not in failed]
        self.control.release_devices(failed, f"failed while joining: {why[:200]}")
        if again:
            self.control.release_devices(again, "a background join failed; they join again", keep_in_pool=True)
            self.control.wait_exited(again)
        self.journal.event(Event.JOIN_FAILED, {"step": step, "devices": j.devices, "phase": j.phase,
                                               "left_pool": failed, "join_again": again, "error": why[:300]})
        log.warning("a background join of devices %s failed in phase %s: %s", j.devices, j.phase, why)

    def cancel(self, reason: str, step: int | None = None, leave: list[int] | tuple[int, ...] = ()) -> list[int]:
        """Stop the workers of a running join (a checkpoint/restart of the job, or a removal of
        joining devices: their private world's tasks are abandoned) and journal
        ``join_cancelled``. The devices of ``leave`` leave the pool; the others stay in it and
        join again. Returns the devices that stay."""
        j, self.join = self.join, None
        if j is None:
            return []
        if j.task_id is not None:
            self.control.abandon_task(j.task_id)
        gone = [d for d in j.devices if d in leave]
        again = [d for d in j.devices if d not in gone]
        if gone:
            self.control.release_devices(gone, reason)
        if again:
            self.control.release_devices(again, reason, keep_in_pool=True)
        self.control.wait_exited(j.devices)
        self._cancelled(j, step, reason, gone, again)
        return again

    def abandon(self, reason: str) -> None:
        """The job ends with a join running: journal ``join_cancelled`` (the job's shutdown stops
        every worker)."""
        j, self.join = self.join, None
        if j is not None:
            self._cancelled(j, None, reason, [], [])

    def _cancelled(self, j: Join, step: int | None, reason: str, gone: list[int], again: list[int]) -> None:
        self.journal.event(Event.JOIN_CANCELLED, {"step": step, "devices": j.devices, "phase": j.phase,
                                                  "reason": reason, "left_pool": gone, "join_again": again})
        log.info("the background join of devices %s was cancelled in phase %s: %s", j.devices, j.phase, reason)

    def status(self, waiting: list[int] | None = None) -> dict[str, Any] | None:
        """The join in progress for ``nereus-launch status`` (``None``: none); ``waiting``: devices
        that arrived while it runs (they join next)."""
        j = self.join
        if j is None:
            return None
        return {"devices": j.devices, "phase": j.phase, "elapsed_s": round(self.clock() - j.arrived_s, 1),
                "waiting": sorted(waiting or [])}
