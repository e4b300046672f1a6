"""The composition root of ``nereusd``: every object of the daemon is built here, in one place,
and wired to the others; :meth:`Daemon.run` runs the job and always stops what it started.

Objects and who owns what:

- :class:`~nereusd.journal.Journal` — the run directory's journals;
- :class:`~nereusd.daemon.pool.PoolController` — the one owner of the job's pool state: the
  world (devices in rank order), pending removals, the plan's devices, why the job must stop;
- :class:`~nereusd.daemon.control_plane.ControlPlane` — sockets, the agent registry, task dispatch;
- :class:`~nereusd.slurm.AllocationWatcher` (under Slurm) and the
  :class:`~nereusd.daemon.rendezvous.RendezvousStore`;
- :class:`~nereusd.rl.driver.RLDriver` — the RL steps; with live adaptation the
  :class:`~nereusd.control.controller.Controller` and its shell
  :class:`~nereusd.daemon.live.LiveAdaptation` at every safe boundary.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import time
import traceback
from pathlib import Path
from typing import Any

from nereusd import checkpoints
from nereusd.config.pool_schedule import min_devices_of
from nereusd.config.resolve import ResolvedJob, load_and_resolve
from nereusd.config.site import SiteConfig, load_site
from nereusd.control.jobs import controller_for_job, forced_plan, job_fingerprint
from nereusd.control.problem import choose_launch
from nereusd.daemon.control_plane import ControlPlane
from nereusd.heap import settle_heap
from nereusd.daemon.kept import KeptState, NotKept, keep_workers
from nereusd.daemon.live import LiveAdaptation
from nereusd.daemon.observe import Observer
from nereusd.daemon.pool import PoolController, PoolStop
from nereusd.daemon.recovery import FailureRecovery, await_lost_devices
from nereusd.daemon.rendezvous import RendezvousStore
from nereusd.daemon.security import load_keys
from nereusd.errors import ConfigError, NereusError, PlanError, StorageError, WorkerError
from nereusd.loggers import open_trackers
from nereusd.journal import (ENDPOINT_FILE, EVENTS_FILE, METRICS_FILE, Event, Journal,
                             check_resume_steps, drop_metrics_from, metrics_steps, read_jsonl)
from nereusd.rundir import RunDirLock
from nereusd.summary import earlier_attempts, summarise_metrics
from nereusd.plan import Plan
from nereusd.rl.driver import RLDriver
from nereusd.rl.record import StepRecord
from nereusd.slurm import AllocationWatcher, SlurmClient
from nereusd.stop import SignalStop

log = logging.getLogger(__name__)

RESUME_REGISTER_WAIT_S = 10.0
"""How long a resumed nereusd waits for the devices of the lost one's last world to register
again before it chooses its world without them (their agents look for it once a second)."""

class Terminated(BaseException):
    """SIGTERM or SIGINT reached nereusd (raised by the entry point's signal handler). A
    ``BaseException``, like ``KeyboardInterrupt``: the guards that keep a bad message or a
    handler's bug from stopping the daemon (``except Exception``) must not swallow a stop."""


STOP = SignalStop(Terminated)
"""nereusd's SIGTERM/SIGINT handler (the entry point installs :meth:`SignalStop.handler`); the
control plane's poll raises a stop whose exception was lost."""


def loopback(bind: str) -> bool:
    """Whether ``bind`` is reachable from this host only."""
    return bind.startswith(("tcp://127.", "tcp://localhost:", "ipc://", "inproc://"))


class Daemon:
    """nereusd for one job (module docstring).

    Args:
        args: the parsed command line (:func:`nereusd.daemon.main.build_parser`).

    Raises:
        ConfigError: the job or its site is invalid (nothing was started).
        NereusError: a control plane reachable from other hosts without the job's keys.
    """

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.run_dir = Path(args.run_dir)
        self.job: ResolvedJob = load_and_resolve(args.job)
        self.job_sha256 = job_fingerprint(self.job)   # journalled at start and with every checkpoint
        self.site: SiteConfig = load_site(self.job.config.site)
        launch_devices = (args.nodes or 1) * self.site.devices_per_node
        limit = self.job.config.pool.max_devices
        if args.nodes and limit is not None and limit < launch_devices:   # every Slurm node registers all its GPUs
            raise NereusError(f"{self.job.source}: pool.max_devices: {limit} is below the launch allocation's "
                              f"{launch_devices} devices ({args.nodes} nodes x {self.site.devices_per_node}): its "
                              "own agents would be refused")
        keys = load_keys(args.keys_dir, "server") if args.keys_dir else None
        if keys is None and not loopback(args.bind):
            raise NereusError(f"--bind {args.bind} is reachable from other hosts: pass --keys-dir with the job's "
                              "CURVE keys")
        self.curve = keys is not None
        try:
            self.run_dir_lock = RunDirLock(self.run_dir)   # before anything is written there
            self.journal = Journal(self.run_dir)
        except OSError as err:   # a file in the way, a read-only or full file system
            raise NereusError(f"run directory {self.run_dir}: cannot write its journals: {err}") from None
        self.pool = PoolController(self.journal, self.run_dir, self.job.config.name, self.job.config.steps,
                                   args.slurm_job_id)
        self.pool.live = self.job.config.adaptation.enabled
        self.pool.min_devices = min_devices_of(self.job)
        self.control = ControlPlane(args.bind, heartbeat_timeout_s=args.heartbeat_timeout_s, on_event=self.journal.event,
                                    keys=keys, on_pool_change=self.pool.on_pool_change, status=self.pool.status,
                                    on_pool_request=self.pool.request_remove,
                                    worker_stall_s=self.site.liveness.worker_stall_s,
                                    straggler_factor=self.site.liveness.straggler_factor,
                                    straggler_min_s=self.site.liveness.straggler_min_s,
                                    task_max_s=self.site.liveness.task_max_s,
                                    max_pool_devices=self.job.pool_limit(launch_devices))
        self.pool.control = self.control
        self.control.interrupted = STOP.raise_pending   # a stop whose signal's exception was lost
        self.control.accept_kept_workers = bool(args.resume)
        self.watcher: AllocationWatcher | None = None
        if args.slurm_job_id:
            self.watcher = AllocationWatcher(
                SlurmClient(), [args.slurm_job_id],
                on_event=lambda ev: self.control.call_soon(lambda: self.pool.on_slurm_event(ev)))
            self.pool.watcher = self.watcher
        try:
            self.store = RendezvousStore(args.store_host)
        except OSError as err:   # not an address of this machine, or unresolvable
            raise NereusError(f"--store-host {args.store_host}: cannot listen there: {err}") from None
        self.driver: RLDriver | None = None
        self.live: LiveAdaptation | None = None
        trackers = open_trackers(self.job.config.loggers, self.run_dir, self.job.config.name,
                                 self.job.config.model_dump(mode="json"))
        try:
            self.observer = Observer(self.run_dir, self.control, metrics_host=args.metrics_host,
                                     metrics_port=None if args.no_metrics else args.metrics_port,
                                     tensorboard=not args.no_tensorboard, trackers=trackers)
        except OSError as err:
            for tracker in trackers:
                tracker.close(ok=False)
            raise NereusError(f"--metrics-host {args.metrics_host} --metrics-port {args.metrics_port}: cannot serve "
                              f"metrics there: {err}") from None
        self.journal.listeners.append(self.observer.on_record)

    # ------------------------------------------------------------------ run
    def run(self) -> int:
        """Run the job; returns the exit code (0 succeeded or preempted, 130 interrupted, 1
        failed). ``summary.json`` always gets the status, and every agent is stopped first."""
        signal.signal(signal.SIGUSR2, lambda signum, frame: self.pool.request_preemption("SIGUSR2"))
        if self.watcher is not None:
            self.watcher.start()
        endpoint = self._announce()
        self.journal.event(Event.NEREUSD_STARTED, {
            "endpoint": endpoint, "job": self.job.config.name, "algorithm": self.job.config.algorithm.value,
            "devices": self.job.devices, "curve": self.curve, "adaptive": self.pool.live,
            "slurm_job_id": self.args.slurm_job_id, "nodes": self.args.nodes,
            "job_file": str(Path(self.args.job).resolve()), "job_sha256": self.job_sha256,
            "resume": bool(self.args.resume)})
        started = time.time()
        summary: dict[str, Any] = {"job": self.job.config.name, "algorithm": self.job.config.algorithm.value,
                                   "status": "running"}
        code = 1
        try:
            self._run_job()
            summary.update(status="succeeded", steps=self.driver.step_index)
            code = 0
        except PoolStop as err:
            summary.update(status="preempted", error=str(err), error_kind="Preempted")
            self.journal.event(Event.JOB_PREEMPTED, {"reason": str(err)})
            log.warning("job stopped: %s", err)
            code = 0
        except (StorageError, WorkerError) as err:
            if isinstance(err, StorageError) or err.error_kind == "StorageError":
                message = self._storage_fault(err)
                summary.update(status="stopped", error=message, error_kind="StorageFault")
                self.journal.event(Event.JOB_STOPPED, {"error": message, "error_kind": "StorageFault"})
                log.error("job stopped: %s", message)
                return code
            pool_reason = self.pool.explain_failure(err)
            kind = "PoolShrunk" if pool_reason else (err.error_kind or "WorkerError")
            if pool_reason is None and err.error_kind != "DeviceOutOfMemory":
                pool_reason = self._lost_workers(err)
                kind = "DeviceLost" if pool_reason else kind
            message = pool_reason or str(err)
            summary.update(status="stopped" if pool_reason else "failed", error=message, error_kind=kind)
            self.journal.event(Event.JOB_STOPPED if pool_reason else Event.JOB_FAILED,
                               {"error": message, "error_kind": kind})
            log.error("job %s: %s", summary["status"], message)
        except NereusError as err:
            summary.update(status="failed", error=str(err), error_kind=type(err).__name__)
            self.journal.event(Event.JOB_FAILED, {"error": str(err), "error_kind": type(err).__name__})
            log.error("job failed: %s", err)
        except Terminated as err:
            STOP.taken()
            summary.update(status="interrupted", error=f"nereusd received {err}")
            self.journal.event(Event.JOB_INTERRUPTED, {"signal": str(err)})
            code = 130
        except Exception as err:  # noqa: BLE001 - a bug in nereusd: record it as a failure, then stop everything
            log.exception("nereusd crashed")
            summary.update(status="failed", error=f"nereusd crashed: {type(err).__name__}: {err}",
                           error_kind=type(err).__name__)
            self.journal.event(Event.JOB_FAILED, {"error": summary["error"], "error_kind": type(err).__name__,
                                                  "traceback": traceback.format_exc(limit=20)})
        finally:
            self._stop(summary, started)
        return code

    def _lost_workers(self, err: Exception) -> str | None:
        """The stop message of a task that failed because workers of the running plan exited (a
        process killed, or crashed) where live adaptation does not recover it (it is off, or the
        workers were still starting: the build and a resume's checkpoint load recover,
        :meth:`RLDriver.run`), or ``None`` when none did. The task's own error is a
        survivor's collective failing (gloo's ``Connection reset by peer``), which names neither
        the device nor the cause (an adversarial trial)."""
        driver = getattr(self, "driver", None)
        if driver is None or driver.plan is None:
            return None
        lost = await_lost_devices(self.control, sorted(driver.plan.devices()), FailureRecovery.LOSS_GRACE_S,
                                  FailureRecovery.SILENT_AGENT_S)
        if not lost:
            return None
        what = "; ".join(f"device {d}: {v['cause']}" + (f" (exit code {v['exitcode']})" if "exitcode" in v else "")
                         + (f" on node {v['node_id']}" if v.get("node_id") else "") for d, v in sorted(lost.items()))
        why = ("live adaptation is off (adaptation.enabled: false)" if not self.pool.live
               else "live adaptation recovers a loss only once every worker has started")
        return (f"lost {what}; the job stops: {why}; latest checkpoint: {self.pool.latest_checkpoint() or 'none'}; "
                f"`nereus-launch resume {self.run_dir}` continues it on new workers (task error: {str(err)[:200]})")

    def _storage_fault(self, err: Exception) -> str:
        """The stop message of a storage fault: its cause (path, errno, free bytes), the
        checkpoint the job can resume from, and what the next one needs (the size of the last)."""
        latest = checkpoints.latest(self.run_dir / "checkpoints")
        if latest is None:
            return f"storage fault: {err}; no checkpoint was written yet"
        size = checkpoints.size_bytes(latest)
        return (f"storage fault: {err}; the latest checkpoint {latest} is kept ({size} bytes; "
                f"the next needs about as much)")

    def _announce(self) -> str:
        """Write ``nereusd.json`` (endpoint, store, pid) atomically; returns the endpoint agents use."""
        endpoint = self.control.endpoint
        if self.args.advertise_host:
            endpoint = f"tcp://{self.args.advertise_host}:{endpoint.rsplit(':', 1)[1]}"
        tmp = self.run_dir / (ENDPOINT_FILE + ".tmp")
        tmp.write_text(json.dumps({"endpoint": endpoint, "pid": os.getpid(),
                                   "store": f"{self.store.host}:{self.store.port}", "curve": self.curve,
                                   "slurm_job_id": self.args.slurm_job_id,
                                   "device_memory_bytes": self.job.device_memory_bytes,
                                   "max_devices_per_agent": self.control.max_devices_per_agent,
                                   "max_pool_devices": self.control.max_pool_devices,
                                   "metrics": self.observer.endpoint}))
        os.replace(tmp, self.run_dir / ENDPOINT_FILE)
        return endpoint

    def _run_job(self) -> list[StepRecord]:
        """Launch plan, world, workers, the controller and its shell; then every step."""
        job = self.job
        site = self.site
        self.driver = driver = RLDriver(job, self.control, self.journal, devices_per_node=site.devices_per_node)
        if self.args.resume:   # before anything is dropped: a job file edited below the steps run is refused
            check_resume_steps(self.run_dir, job.config.steps)
        records = checkpoints.resume_records(self.run_dir) if self.args.resume else []
        record = records[0] if records else None
        resumed = self._resumed_controller(record, driver) if self.pool.live and record is not None else None
        driver.plan = resumed.plan if resumed is not None else self._launch_plan(
            site, driver, int(record.get("step", 0)) if record is not None else 0)
        world = self.control.wait_for_devices(job.devices, self.args.register_timeout_s)
        if self.args.resume and self.control.rejoined:
            world = self._await_last_world(job.devices)
        kept = self._keep_workers(world, driver) if self.args.resume else None
        if self.args.resume and kept is None:
            checkpoints.check_resume_checkpoints(self.run_dir)
            checkpoints.check_resume_models(record, job)
        if record is not None and kept is None and self.pool.live:
            driver.plan = self._forced_at_resume(int(record["step"]), driver.plan, resumed, driver, world)
        if self.args.resume:
            self._journal_resume(record, kept, restored=resumed is not None)
        if kept is None:
            self.control.spawn_workers(generation=self.store.generation, world=world, store_host=self.store.host,
                                       store_port=self.store.port, memory_capacity_bytes=job.device_memory_bytes,
                                       run_dir=str(self.run_dir.resolve()))
        self.journal.event(Event.WORLD_FORMED, {"generation": self.store.generation, "devices": world,
                                                **({"kept_workers": True} if kept else {})})
        self.pool.world_formed(driver.plan.to_dict(), world)
        resume = None if record is None or kept else (str(record["dir"]), int(record["step"]),
                                                      int(record["sample_position"]))
        if self.pool.live:
            controller = resumed or controller_for_job(job, site, driver.plan, driver.prompt_length, pool=tuple(world))
            if kept is not None and kept.plan != controller.plan:
                controller.switched(kept.plan, tuple(sorted(world)))
            if kept is not None:   # re-formed, then the plan's weight-sync groups created and held
                controller.world_formed()
                controller.groups_built(kept.plan)
            if tuple(sorted(world)) != controller.pool:
                controller.pool_changed(tuple(sorted(world)))
            self.live = LiveAdaptation(job, controller, driver, self.control, self.store, self.journal, self.run_dir,
                                       self.pool, keys_dir=Path(self.args.keys_dir) if self.args.keys_dir else None)
            driver.on_failure = self._on_failure
            self.pool.joining = lambda: self.live.joins.status(self.live.waiting())
            driver.checkpoint_fields = lambda: {"controller": self.live.controller.state(), "job_sha256": self.job_sha256}
        driver.on_step = self._on_step
        settle_heap()   # set-up done: its objects leave the garbage collector's full passes
        fallbacks = [(str(r["dir"]), int(r["step"]), int(r["sample_position"])) for r in records[1:]]
        return driver.run(resume=resume, built=kept is not None, fallbacks=fallbacks if resume else ())

    def _await_last_world(self, count: int) -> list[int]:
        """``--resume`` with agents of the lost nereusd coming back (``rejoined``): the first
        ``count`` devices registered once the devices of the world it last formed (its last
        ``world_formed``) are back, or after :data:`RESUME_REGISTER_WAIT_S`. Its agents
        re-register within a second or two of each other (:meth:`emu.agent.Agent._rejoin`); a
        world chosen on the first of them had left out the kept workers of a node that came a
        moment after a node without workers (an adversarial trial on Slurm, 2026-12-07)."""
        formed = [e.get("devices") for e in read_jsonl(self.run_dir / EVENTS_FILE)
                  if e.get("event") == Event.WORLD_FORMED.value]
        wanted = set(formed[-1]) if formed and isinstance(formed[-1], list) else set()
        deadline = time.monotonic() + RESUME_REGISTER_WAIT_S
        while not wanted <= set(self.control.devices()) and time.monotonic() < deadline:
            self.control.poll(0.2)
        return self.control.devices()[:count]

    def _keep_workers(self, world: list[int], driver: RLDriver) -> KeptState | None:
        """``--resume`` with the workers the lost nereusd's agents kept: continue on their EMUs
        (:func:`nereusd.daemon.kept.keep_workers`), or stop them (restart from the checkpoint)
        and return ``None``; also ``None`` when no agent kept any."""
        kept_devices = sorted(self.control.kept_workers)
        if not kept_devices:
            return None
        try:
            kept = keep_workers(self.control, self.store, driver, world, self.run_dir, self.job_sha256)
        except NotKept as err:
            log.warning("not keeping the workers of devices %s: %s; restarting them from the checkpoint",
                        kept_devices, err)
            self.journal.event(Event.WORKERS_KEPT, {"devices": kept_devices, "kept": False, "reason": str(err)})
            self.control.abandon_tasks()
            self.control.release_devices(kept_devices, f"resume: {err}", keep_in_pool=True)
            if not self.control.wait_exited(kept_devices):
                raise NereusError(f"the kept workers of {kept_devices} did not stop for the restart") from None
            self.control.kept_workers.clear()
            return None
        self.journal.event(Event.WORKERS_KEPT, {"devices": kept_devices, "kept": True, "step": kept.step,
                                                "sample_position": kept.position, "plan": kept.plan.to_dict(),
                                                "elapsed_s": kept.elapsed_s})
        log.warning("resumed on the kept workers of devices %s at step %d (%.1f s)", kept_devices, kept.step,
                    kept.elapsed_s)
        return kept

    def _journal_resume(self, record: dict | None, kept: KeptState | None, *, restored: bool) -> None:
        """``--resume``: journal where the job continues. From the latest committed checkpoint
        (``record``, the newest of :func:`nereusd.checkpoints.resume_records`) the steps from it
        on run again (``dropped_metrics``; their metrics leave ``metrics.jsonl`` once the
        checkpoint has loaded, :meth:`RLDriver.restore`), from the initial weights every step
        (their metrics leave now); on kept workers nothing is re-run. ``controller_state`` says whether the checkpoint's controller
        state was restored (``restored``; a refused one is named in the ``launch_plan`` event)."""
        if kept is not None:
            self.journal.event(Event.NEREUSD_RESUMED, {"mode": "kept_workers", "step": kept.step,
                                                       "dropped_metrics": 0, "controller_state": restored})
            return
        step = int(record["step"]) if record is not None else 0
        dropped = ([s for s in metrics_steps(self.run_dir / METRICS_FILE) if s >= step] if record is not None
                   else drop_metrics_from(self.run_dir / METRICS_FILE, step))
        self.journal.event(Event.NEREUSD_RESUMED, {"mode": "checkpoint", "checkpoint": record["dir"] if record else None,
                                                   "step": step, "dropped_metrics": dropped,
                                                   "controller_state": restored})
        log.warning("resuming at step %d from %s", step, record["dir"] if record else "the initial weights")

    def _resumed_controller(self, record: dict, driver: RLDriver):
        """A resumed live job's controller as its checkpoint left it (the ``controller`` state of
        its ``checkpoint`` event, :meth:`~nereusd.control.controller.Controller.state`), on the plan
        it ran then — all of it, or ``None`` (then the job starts as a new one would, logged):
        the job file must be the one the state was journalled under (``job_sha256``), the plan's
        devices among the job's, and the plan predicted to fit the device memory for the
        responses the controller had seen (a restart's checkpoint can hold a plan that did not)."""
        job = self.job
        state = record.get("controller")
        if state is None:
            return None
        try:
            if record.get("job_sha256") != job_fingerprint(job):
                raise ConfigError("the job file differs from the one it was journalled under")
            plan = Plan.from_dict(state["plan"])
            pool = tuple(range(job.devices))
            outside = sorted(set(plan.devices()) - set(pool))
            if outside:
                raise ConfigError(f"its plan uses devices {outside} beyond the job's {job.devices}")
            controller = controller_for_job(job, self.site, plan, driver.prompt_length, pool=pool)
            controller.restore(state)
            controller.resuming_at(int(record["step"]))
            unfit = controller.unfit(plan, pool)
            if unfit:
                raise ConfigError(f"its plan: {unfit}")
        except (ConfigError, PlanError, KeyError, TypeError, ValueError, OverflowError) as err:
            log.warning("resuming without the checkpoint's controller state: %s", err)
            self.journal.event(Event.LAUNCH_PLAN, {"plan": None, "source": "resumed: the checkpoint's controller "
                                                   f"state not used ({err}); planning as a new job"})
            return None
        self.journal.event(Event.LAUNCH_PLAN, {"plan": plan.to_dict(), "source": "resumed: the plan of the checkpoint"})
        return controller

    def _forced_at_resume(self, step: int, plan: Plan, resumed, driver: RLDriver, world: list[int]) -> Plan:
        """The plan a job resumed from its checkpoint at ``step`` starts on: the layout its
        ``adaptation.forced`` entry for ``step`` sets, where there is one and it can run (in the
        pool, predicted within the usable memory), else ``plan``. The boundary that applies an
        entry runs before the entry's step, and a resumed job starts at its checkpoint's step
        with no boundary before it: a nereusd lost while it restarted the job into a forced
        layout resumed on the old one. ``resumed`` (the checkpoint's controller, or ``None``)
        learns of the switch."""
        entry = next((f for f in self.job.config.adaptation.forced if f.at_step == step), None)
        if entry is None:
            return plan
        pool = tuple(sorted(world))
        try:
            forced = forced_plan(self.job, plan, entry.model_stages)
        except PlanError as err:
            unfit = str(err)
        else:
            if forced == plan:
                return plan
            if resumed is not None:   # at the responses it had seen (Controller.resuming_at)
                unfit = resumed.unfit(forced, pool)
            else:   # a job planned afresh: at the responses its launch plan is for
                unfit = controller_for_job(self.job, self.site, plan, driver.prompt_length, pool=pool).unfit(
                    forced, pool, length=self.job.config.launch_response_length(step))
        if unfit:
            log.warning("resuming at step %d without the layout adaptation.forced sets for it: %s", step, unfit)
            self.journal.event(Event.LAUNCH_PLAN, {"plan": plan.to_dict(), "source": f"resumed: the layout "
                                                   f"adaptation.forced sets for step {step} not used ({unfit})"})
            return plan
        if resumed is not None:
            resumed.resumed_on_forced(forced, pool)
        self.journal.event(Event.LAUNCH_PLAN, {"plan": forced.to_dict(),
                                               "source": f"resumed: the layout adaptation.forced sets for step {step}"})
        return forced

    def _launch_plan(self, site: SiteConfig, driver: RLDriver, step: int = 0):
        """The job's plan, or — adaptive and none in the YAML — the planner's launch plan for a job
        starting at ``step`` (a resume that plans afresh starts at its checkpoint's step, which a
        length curriculum may cap higher than step 0)."""
        job = self.job
        choice = choose_launch(job, site, driver.prompt_length, step=step, plan=driver.plan)   # ConfigError: none runs
        if choice.warning:
            log.warning("%s", choice.warning)
        fields: dict[str, Any] = {"plan": choice.plan.to_dict(), "source": choice.source}
        if choice.result is not None:
            fields.update(predicted_step_latency_s=choice.result.predicted_step_latency_s,
                          response_length=job.config.launch_response_length(step))
        self.journal.event(Event.LAUNCH_PLAN, fields)
        return choice.plan

    def _on_step(self, record: StepRecord) -> None:
        """The safe boundary after a step: preemption checkpoint, then live adaptation."""
        self.pool.after_step(record, self.driver.save_checkpoint)
        if self.live is not None:
            self.live.at_boundary(record)
            self.pool.plan = self.driver.plan.to_dict()
            self.pool.last_decision = self.live.last_decision or self.pool.last_decision

    def _on_failure(self, err: Exception) -> bool:
        """A step or boundary failed: True when live adaptation restarted the job."""
        if not self.live.recover(err):
            return False
        self.pool.recovered(self.driver.plan.to_dict(), self.pool.world)
        return True

    def _stop(self, summary: dict[str, Any], started: float) -> None:
        """Stop every agent first (nothing below may leave them running), then write the summary.
        Its outcome is written before the agents stop too: agents whose workers are still
        starting take longer to stop than Slurm's ``KillWait`` between ``scancel``'s SIGTERM and
        its SIGKILL, and a run killed there had ``job_interrupted`` journalled but no summary
        (``status``: "starting, or gone"; an adversarial trial on Slurm, 2026-12-07)."""
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        self.journal.summary({**summary, "wall_time_s": round(time.time() - started, 3)})
        if self.watcher is not None:
            self.watcher.stop()
        if self.live is not None:
            self.live.joins.abandon(f"the job ended ({summary['status']})")
        self.control.shutdown_agents(summary["status"])
        summary["wall_time_s"] = round(time.time() - started, 3)
        summary["backends"] = {str(ms): b.value for ms, b in self.job.backends.items()}
        earlier = earlier_attempts(self.run_dir)
        if self.live is not None:
            summary.update(switches=self.live.switches, restarts=self.live.restarts, lost_steps=self.live.lost_steps)
        if earlier["resumes"]:   # the job's totals, not this nereusd's alone
            for key in ("switches", "restarts", "lost_steps"):
                summary[key] = summary.get(key, 0) + earlier[key]
            summary.update(resumes=earlier["resumes"],
                           job_wall_time_s=round(time.time() - earlier["started_s"], 3) if earlier["started_s"] else None,
                           job_run_time_s=round(earlier["earlier_run_s"] + summary["wall_time_s"], 3))
        try:
            summarise_metrics(self.run_dir, summary)
        except Exception as err:  # noqa: BLE001 - the summary is still written, with why its figures are missing
            log.exception("cannot summarise %s", self.run_dir / METRICS_FILE)
            summary["summary_error"] = f"{type(err).__name__}: {err}"
        self.journal.summary(summary)
        self.journal.event(Event.NEREUSD_STOPPED, {"status": summary["status"]})
        self.journal.close()
        self.observer.close(ok=summary["status"] in ("succeeded", "preempted"))
        self.control.close()
