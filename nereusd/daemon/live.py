"""Live adaptation, the shell: executes the controller's decisions on the workers at the safe
boundary (paper §6, DESIGN.md "One RL step", step 5): the end of a synchronous RL step, or
the weight synchronisation of an asynchronous one (``rollout.max_staleness ≥ 1``,
:mod:`nereusd.rl.driver`) — generations submitted before it have run; their rollouts keep the
policy version they were generated with.

:class:`LiveAdaptation.at_boundary` runs after every step, on the control-plane thread. What to
do is planned as pure values (:mod:`nereusd.daemon.boundary`: :func:`plan_pool` for the pool
change, :func:`plan_actions` for what follows the decision); this class gathers their inputs
and executes them:

1. journal ``step_prediction`` (predicted vs measured step latency and peak memory) and
   calibrate (:meth:`nereusd.control.controller.Controller.observe`);
2. apply pool changes due now — the job's ``pool.schedule`` and ``pool.trace`` (local mode; due
   events from :class:`nereusd.config.pool_schedule.PoolSchedule`, journalled as ``pool_schedule_due``,
   and the ``pool_changed`` they cause names them in ``sources``) and ``nereus-launch pool
   --remove`` requests: devices that *leave* are drained first (the plan moves off them
   while their state is still alive, as after a preemption notice), then their workers are
   stopped and the survivors re-form the world (new generation); devices that *join* get new
   workers (started in a private world, then every worker re-forms the world with them): in the
   background by default (:mod:`nereusd.daemon.joins`: workers and early vLLM engines start while
   steps go on, and the devices join at the first boundary after), or at once with
   ``pool.join: immediate``;
3. ask the controller (:meth:`~nereusd.control.controller.Controller.boundary`) and journal ``trigger``,
   ``replan`` and ``admission`` (ΔL, L_tran, H_x, γ, alternatives);
4. run an admitted transition — the DAG admission assessed, as it is
   (:class:`nereusd.transition.runner.TransitionRunner`) — and journal ``transition`` with
   per-op timings; an urgent decision with no feasible target is a
   ``fallback``: checkpoint now, restart every worker into the plan that holds the longest
   response, load the checkpoint and go on. A step that fails with ``DeviceOutOfMemory`` is
   recovered the same way from the latest checkpoint (:meth:`LiveAdaptation.recover`), and so
   is a step or transition that fails because devices were lost abruptly (a worker process
   died, an agent went silent or Slurm took its node): the lost devices leave the world and the
   pool, the survivors restart on a plan for them.
"""

from __future__ import annotations

import logging
import subprocess
import time
from pathlib import Path
from typing import Any

from nereusd import protocol as P
from nereusd.control.controller import Controller, StepObservation
from nereusd.control.monitor import Signal
from nereusd.control.jobs import forced_plan
from nereusd.daemon.boundary import Action, ActionKind, plan_actions, plan_pool
from nereusd.daemon.joins import BackgroundJoins
from nereusd.daemon.local_agents import AGENT_REGISTER_S, agent_log_path, start_local_agent, wait_registered
from nereusd.daemon.pool import PoolController
from nereusd.daemon.recovery import FailureRecovery
from nereusd.errors import NereusError, PlanError, WorkerError
from nereusd.config.resolve import ResolvedJob
from nereusd.journal import Event, Journal
from nereusd.plan import Plan
from nereusd.rl.record import StepRecord
from nereusd.planner.search import Infeasible
from nereusd.config.pool_schedule import schedule_for
from nereusd.transition.ops import TransitionDag
from nereusd.transition.runner import TransitionRunner

log = logging.getLogger(__name__)

class LiveAdaptation(FailureRecovery):
    """See the module docstring.

    Args:
        job: the resolved job; ``controller``: its controller; ``driver``: the RL driver (its
        ``plan`` changes here); ``control``: the control plane; ``store``: the rendezvous store
        (world generations); ``pool``: the owner of the pool state (the world in rank order,
        requested removals).
    """

    def __init__(self, job: ResolvedJob, controller: Controller, driver, control, store, journal: Journal,
                 run_dir: Path, pool: PoolController, keys_dir: Path | None = None) -> None:
        self.job, self.controller, self.driver, self.control, self.store = job, controller, driver, control, store
        self.journal, self.run_dir, self.pool = journal, Path(run_dir), pool
        self.keys_dir = keys_dir
        """The job's CURVE keys, handed to the agents this job starts (``pool.schedule`` adds)."""
        self.switches = 0
        self.restarts = 0
        """Checkpoint/restarts (out of memory, nothing fits, devices lost)."""
        self.lost_steps = 0
        """Steps re-run after restarts."""
        self.last_decision: dict[str, Any] | None = None
        """The latest admission record (``nereus-launch status`` shows it)."""
        self._added = 0
        self._agent_procs: dict[str, subprocess.Popen] = {}
        """The agents this job started (``pool.schedule`` adds), by node id: reaped once they exit
        (:meth:`_reap_agents`), so a retired one does not linger as a zombie."""
        self._schedule = schedule_for(job)
        self._first_step_start: float | None = None   # monotonic clock; time base of pool.schedule[].at_s
        self._forced = {f.at_step: f for f in job.config.adaptation.forced}
        self.joins = BackgroundJoins(control=control, store=store, controller=controller,
                                     build_args=lambda: self.driver.build_args(Plan({})), journal=journal,
                                     run_dir=self.run_dir, device_memory_bytes=job.device_memory_bytes)
        """Devices joining in the background (``pool.join: background``; :mod:`nereusd.daemon.joins`)."""

    @property
    def world(self) -> list[int]:
        """Devices of the current world in rank order (held by the pool owner)."""
        return self.pool.world

    @world.setter
    def world(self, devices: list[int]) -> None:
        self.pool.world = list(devices)

    # ------------------------------------------------------------------ the boundary
    def at_boundary(self, record: StepRecord) -> None:
        """Everything of the module docstring after step ``record.step``: gather the inputs,
        plan with :func:`~nereusd.daemon.boundary.plan_pool` and
        :func:`~nereusd.daemon.boundary.plan_actions`, execute.

        Raises:
            Infeasible: a restart found no plan that holds the longest response.
            WorkerError / TransitionInterrupted: devices of the plan were lost, or a worker
                failed during a transition.
        """
        step = record.step
        if self._first_step_start is None:
            self._first_step_start = time.monotonic() - record.step_latency_s
        obs = StepObservation(step, record.response_length_max, record.model_stage_s, record.peak_memory_bytes,
                              record.step_latency_s, record.response_length_mean)
        self.journal.event(Event.STEP_PREDICTION, self.controller.observe(obs))
        if self.driver.engine_start_s:   # a build started engines: what a transition that starts them costs
            self.controller.engine_started(self.driver.engine_start_s)
            self.driver.engine_start_s = 0.0
        if self.driver.rebuild_s:   # a build: what re-attaching engines costs, before any transition ran
            groups = self.controller.groups_built(self.driver.plan)
            self.controller.engines_built(self.driver.rebuild_s, self.driver.finish_overhead_s,
                                          self.driver.sync_setup_s, groups)
            self.driver.rebuild_s = {}
        upcoming = step + 1
        if upcoming >= self.job.config.steps:
            return
        self.driver.drain_rollouts()   # asynchronous: generations already ran, keep their versions
        self.control.poll(0)
        self.control.retire_idle_agents()   # those whose devices all left at an earlier boundary
        self._reap_agents()
        elapsed_s = time.monotonic() - self._first_step_start
        due = self._schedule.due(upcoming, elapsed_s)
        if due:
            self.journal.event(Event.POOL_SCHEDULE_DUE, {"step": step, "elapsed_s": round(elapsed_s, 3),
                                                     "events": [e.to_dict() for e in due]})
        pending = self.pool.pending_remove   # requests that arrive from here on wait for the next boundary
        pool_actions = plan_pool(world=self.world, registered=self.control.devices(),
                                 lost=self.control.lost_devices(self.world),   # since the step's last task
                                 plan_devices=self.driver.plan.devices(), pending_remove=pending,
                                 due=due, min_devices=self.pool.min_devices, unfit=self._unfit)
        if pool_actions.add:
            # polls the control plane: a removal request may arrive
            self._add_devices(pool_actions.add, step, pool_actions.sources)
        if pool_actions.lost_plan_devices:
            # their state is gone: the recovery path (checkpoint/restart); a queued removal waits
            # for the next boundary
            raise WorkerError(f"devices {list(pool_actions.lost_plan_devices)} of the running plan were lost "
                              f"after step {step}")
        # only what this boundary read: once, this set the count to 0 after _add_devices had
        # polled, and a request accepted meanwhile was dropped without a word (a helper's run)
        self.pool.pending_remove -= pending
        leaving = list(pool_actions.leaving)
        released: list[int] = []
        if pool_actions.lost_spares:
            gone = pool_actions.lost_spares
            self.world = [d for d in self.world if d not in gone]   # never in a world again
            self.journal.event(Event.DEVICE_LOST, {
                "step": step, "devices": sorted(gone), "cause": ", ".join(sorted({v["cause"] for v in gone.values()})),
                "survivors": list(self.world), "spare": True,
                "detail": {str(d): v for d, v in sorted(gone.items())}})
            # the world still has their dead ranks: re-form it without them before anything runs
            # on it (devices that join in the background no longer re-form it first)
            self._release(sorted(gone), step, "lost (a spare)")
            leaving = [d for d in leaving if d not in gone]
            released = sorted(gone)
        outside = list(pool_actions.leaving_outside)   # waiting for a join or in one: nothing to move
        if outside:
            joining = [d for d in outside if d in self.joins.joining]
            if joining:
                self.joins.cancel(f"devices {joining} removed from the pool while joining", step, leave=joining)
            waiting = [d for d in outside if d not in joining]
            if waiting:
                self.control.release_devices(waiting, "removed from the pool before they joined")
        if pool_actions.refused_remove:
            self.journal.event(Event.POOL_REQUEST_REFUSED, {
                "remove": pool_actions.refused_remove, "sources": list(pool_actions.sources),
                "pool": [d for d in self.control.devices() if d in self.world],
                "reason": pool_actions.refused_reason})
        arrived = self.waiting()
        background = self.job.config.pool.join == "background"
        if background:
            joined = self.joins.advance(arrived, list(self.world), step)
            if joined:
                self._reform(sorted(self.world) + joined, joined)
        else:
            joined = arrived
            if joined:
                self._grow_world(joined)
        pool = tuple(d for d in sorted(self.world) if d not in leaving)
        if leaving or joined or released or outside:
            self.journal.event(Event.POOL_CHANGED, {
                "step": step, "joined": joined, "leaving": sorted(leaving + released + outside),
                "pool_devices": list(pool),
                "verdict": "replan" if leaving or joined or released else "none (they had not joined)",
                "sources": list(pool_actions.sources) + (
                    [] if not joined or pool_actions.add and not background else
                    [f"devices that arrived after step {self.joins.arrived_after_step} joined in the background"]
                    if background else ["an agent registered (nereus-launch pool --add)"])})
        forced = None
        if upcoming in self._forced:
            try:
                forced = forced_plan(self.job, self.driver.plan, self._forced[upcoming].model_stages)
            except PlanError as err:   # it cannot apply to the plan this step runs: said, not fatal
                log.warning("adaptation.forced for step %d not applied: %s", upcoming, err)
                self.journal.event(Event.TRIGGER, {"step": step, "signal": Signal.FORCED.value, "urgent": False,
                                                   "value": upcoming, "reference": None,
                                                   "detail": f"adaptation.forced for step {upcoming} not applied "
                                                             f"to {self.driver.plan.describe()}: {err}"})
        outcome = self.controller.boundary(step, pool, forced=forced)
        if outcome is not None:
            self._journal_decision(step, outcome)
        actions = plan_actions(outcome.decision if outcome is not None else None, plan=self.driver.plan,
                               leaving=leaving, joined=joined)
        for action in actions:
            self._execute(action, step)
        if leaving or joined or released:
            self.controller.switched(self.driver.plan, tuple(sorted(self.world)))

    def waiting(self) -> list[int]:
        """Devices registered in the pool, in no world and no join yet (they join next)."""
        return [d for d in self.control.devices() if d not in self.world and d not in self.joins.joining]

    def _journal_decision(self, step: int, outcome) -> None:
        """Journal ``trigger``, ``replan`` and ``admission`` for the controller's outcome."""
        d = outcome.decision
        for trigger in d.triggers:
            self.journal.event(Event.TRIGGER, {"step": step, **trigger.to_dict()})
        self.journal.event(Event.REPLAN, {"step": step, "planned_length": outcome.planned_length,
                                      "memory_ratio": self.controller.memory_ratio(),
                                      "headroom": self.controller.headroom(), "planner_log": list(outcome.planner_log),
                                      "targets": len(d.alternatives) + (1 if d.admitted else 0)})
        self.last_decision = {k: v for k, v in d.to_dict().items() if k != "event"} | {
            "current_plan": self.driver.plan.to_dict()}
        self.journal.event(Event.ADMISSION, self.last_decision)
        log.info("step %d: %s (%s)", step, d.verdict, d.reason)

    def _execute(self, action: Action, step: int) -> None:
        """Execute one :class:`~nereusd.daemon.boundary.Action` planned at the boundary after ``step``."""
        if action.kind is ActionKind.TRANSITION:
            self._transition(action.target, step, action.why, dag=action.dag, predicted_s=action.predicted_s)
            self.switches += 1
        elif action.kind is ActionKind.RESTART:
            path = self.run_dir / "checkpoints" / f"fallback-step{step + 1:06d}"
            self.driver.save_checkpoint(str(path))
            self._restart([d for d in self.world if d not in action.devices], list(action.devices), step + 1,
                          action.why, self.driver.last_checkpoint)
        elif action.kind is ActionKind.RELEASE:
            self._release(list(action.devices), step)
        else:
            self._transition(self.driver.plan, step, action.why)

    def _unfit(self, pool: tuple[int, ...]) -> str | None:
        """Why no plan fits ``pool`` (the controller's restart plan), or ``None`` when one does:
        a requested removal that leaves such a pool is refused, not run into a failed restart."""
        try:
            self.controller.restart_plan(tuple(sorted(pool)))
        except Infeasible as reason:
            return f"no plan fits the {len(pool)} device(s) left: {str(reason)[:300]}"
        return None

    # ------------------------------------------------------------------ execution
    def _transition(self, target: Plan, step: int, why: str, dag: TransitionDag | None = None,
                    predicted_s: float | None = None) -> None:
        """Run the transition from the driver's plan to ``target`` on the world as one DAG; the
        driver continues on ``target``.

        ``dag`` is the DAG admission assessed (:attr:`nereusd.control.admission.Target.dag`),
        executed as it is; ``None`` only for a change that moves no state (the same plan, after
        the world re-formed: every engine is rebuilt). Every changed model-stage moves in the
        same DAG, its ready primitives concurrently (:class:`TransitionRunner`); each op has
        communicators of its own (:class:`emu.state.communicators.Communicators`), so ops of two
        model-stages on the same ranks never share a process group. ``predicted_s`` is the
        admitted ``L̂_tran`` in seconds (``None``: not predicted); the measured wall time is
        journalled and fed back to the controller.

        Raises:
            NereusError: the DAG does not start from the driver's plan or end at ``target``.
            TransitionInterrupted: if a worker died or failed mid-transition (the driver's plan
                stays the current one).
        """
        current = self.driver.plan
        if dag is None:
            if target != current:
                raise NereusError(f"no assessed transition DAG for {current.describe()} -> {target.describe()}")
            dag = TransitionDag(current, target, (), ())
        if dag.current != current or dag.target != target:
            raise NereusError(f"the admitted DAG runs {dag.current.describe()} -> {dag.target.describe()}, but the "
                              f"job is at {current.describe()} and switches to {target.describe()}")
        # the DAG's own price (memoised: what admission assessed), before the learned terms, to
        # journal beside what its terms measured (TransitionProgress.dag_terms_s)
        predicted_dag_s = self.controller.transitions.estimate(current, target).l_tran_s if dag.ops else None
        start = time.perf_counter()
        progress = TransitionRunner(self.control, self.world).run(dag, syncs=self.driver.sync_args(target))
        elapsed = time.perf_counter() - start
        self.driver.plan = target
        if predicted_s is not None:
            self.controller.transition_measured(predicted_s, elapsed, progress.terms_s())
        if dag.ops or target != current:
            self.controller.sync_groups_set_up(progress.phases_s.get("sync_setup", 0.0),
                                               self.controller.transitions.sync_groups_created(dag))
        self.controller.transition_ran(dag)
        self.controller.engine_started(progress.engine_start_s)
        self.controller.engines_rebuilt(progress.rebuild_s)
        self.controller.switched(target, tuple(sorted(self.world)))
        self.journal.event(Event.TRANSITION, {
            "step": step, "why": why, "from_plan": current.to_dict(), "to_plan": target.to_dict(),
            "ops": len(dag.ops), "predicted_l_tran_s": predicted_s, "elapsed_s": elapsed,
            "predicted_dag_s": predicted_dag_s, "measured_dag_s": progress.dag_terms_s(),
            "setup_s": progress.setup_s, "engine_start_s": progress.engine_start_s, "world": self.world,
            "phases_s": progress.phases_s, "rebuild_s": {str(m): s for m, s in progress.rebuild_s.items()},
            "generation": self.store.generation,
            "op_timings": progress.timings})
        log.info("transition at step %d: %d ops in %.2f s -> %s", step, len(dag.ops), elapsed, target.describe())

    def _reform(self, world: list[int], new: list[int]) -> None:
        """Every worker of ``world`` joins a new world generation (rank = position in ``world``)."""
        generation = self.store.next_generation()
        start = time.perf_counter()
        args = P.ReformWorldArgs(generation=generation, devices=world, timeout_s=120)
        self.control.run({d: args for d in world}, 300)
        self.world = list(world)
        self.controller.world_formed()
        self.journal.event(Event.WORLD_FORMED, {"generation": generation, "devices": world, "new_devices": new,
                                            "elapsed_s": time.perf_counter() - start})

    def _start_workers(self, devices: list[int]) -> int:
        """Start workers on ``devices`` in a new world generation of their own and set them up
        (``build`` with no model-stage yet); returns that generation. The caller re-forms the
        world with them (:meth:`_reform`)."""
        generation = self.store.next_generation()
        self.control.spawn_workers(generation=generation, world=devices, store_host=self.store.host,
                                   store_port=self.store.port, memory_capacity_bytes=self.job.device_memory_bytes,
                                   run_dir=str(self.run_dir.resolve()))
        args = self.driver.build_args(Plan({}))
        self.control.run({d: args for d in devices}, 300)
        return generation

    def _grow_world(self, joined: list[int]) -> None:
        """Start workers for ``joined`` devices (a private world first, so that they can take the
        same tasks as the others), then re-form the world with them."""
        private = self._start_workers(joined)
        self.journal.event(Event.WORKERS_STARTED, {"devices": joined, "generation": private})
        self._reform(sorted(self.world) + joined, joined)

    def _release(self, leaving: list[int], step: int, reason: str = "removed from the local pool") -> None:
        """Stop the workers of ``leaving`` (the plan no longer uses them), re-form the world and
        rebuild the engines on it."""
        assert not set(leaving) & set(self.driver.plan.devices()), "devices that leave still hold the plan"
        self.control.release_devices(leaving, reason)
        if not self.control.wait_exited(leaving):
            raise NereusError(f"the workers of devices {leaving} did not stop")
        survivors = [d for d in self.world if d not in leaving]
        self._reform(survivors, [])
        self._transition(self.driver.plan, step, "rebuild after re-forming the world")

    def _add_devices(self, count: int, step: int, sources: tuple[str, ...] = ()) -> None:
        """Start a local agent with ``count`` virtual devices and wait until it registered.

        An add the job cannot take is journalled (``pool_request_refused``, with the reason) and
        the job goes on on the devices it has, as a refused removal does: one over
        ``pool.max_devices`` is refused before any agent starts (the control plane would refuse
        the agent's registration); an agent that cannot start, exits before it registers (its
        exit status and log are in the reason) or does not register within
        :data:`AGENT_REGISTER_S` is stopped. Before, any of these failed the whole job, whose
        devices were fine, and an agent refused for the pool limit looked like a crash."""
        have = set(self.control.devices())
        limit = self.control.max_pool_devices

        def refuse(reason: str) -> None:
            self.journal.event(Event.POOL_REQUEST_REFUSED, {"step": step, "add": count, "sources": list(sources),
                                                           "pool": sorted(have), "reason": reason})
            log.warning("the pool cannot add %d device(s): %s", count, reason)

        if limit is not None and len(have) + count > limit:
            return refuse(f"the pool holds {len(have)} devices and the job allows {limit} (pool.max_devices)")
        self._added += 1
        node = f"local-add{self._added}"
        log_path = agent_log_path(self.run_dir, node)
        try:
            proc = self._agent_procs[node] = start_local_agent(
                self.control.endpoint, self.run_dir, count, self.job.device_memory_bytes, node, keys_dir=self.keys_dir)
        except OSError as err:
            return refuse(f"agent {node} could not start: {err.strerror or err} ({err.filename or log_path})")
        why = wait_registered(proc, lambda: len(set(self.control.devices()) - have) >= count, self.control.poll,
                              AGENT_REGISTER_S, f"agent {node} with {count} devices", log_path)
        if why is not None:
            return refuse(why)

    def _reap_agents(self) -> None:
        """Collect the exit status of the agents this job started that have exited (retired
        ones: :meth:`~nereusd.daemon.control_plane.ControlPlane.retire_idle_agents`), so none
        stays a zombie until the job ends."""
        for node, proc in list(self._agent_procs.items()):
            if proc.poll() is not None:
                del self._agent_procs[node]
                log.info("agent %s exited with status %s", node, proc.returncode)
