"""Discrete-event replay of an RL job under one policy.

Events happen at safe boundaries (the end of each synchronous RL step) on one wall clock. The
controller is the one live jobs run (:class:`nereusd.control.controller.Controller`), fed what a
live job's shell feeds it (:mod:`nereusd.daemon.live`), in the same order:

1. at step ``i`` the ground truth prices the running plan at the trace's length ``L_i``: if a
   device's true peak exceeds its capacity the step fails (half of it is lost, an assumption),
   the job restarts from the last checkpoint (:class:`~nereusd.sim.truth.TruthConfig`) into the
   controller's restart plan (:meth:`Controller.restart_plan`, the plan for the longest
   response), and the steps since the checkpoint run again; otherwise the clock advances by the
   true step time;
2. the controller observes the step (:class:`~nereusd.control.controller.StepObservation`:
   true model-stage times, true per-device peaks, the trace's length as the step's longest
   response) and calibrates;
3. at the boundary the pool trace gives the devices now available; the controller decides
   (:meth:`Controller.boundary`; a pool that took devices of the plan passes the surviving
   replicas as ``source``) and an admitted transition costs its *true* ``L_tran`` (the
   transition engine priced with the hidden efficiencies), which the controller then learns
   from (:meth:`Controller.transition_measured`), as a live job learns the measured one. A pool
   that lost every replica of some model-stage, or a verdict of checkpoint/restart, costs a
   restart instead; a pool too small for any plan stalls the job until the trace changes, then
   restarts it.

Bookkeeping (checked by the tests): ``total_s = Σ executed step_s + lost_s + transition_s +
restart_s + stall_s``; ``mean_step_s = (total_s − stall_s) / steps`` (step latency including
transitions and failures, excluding waiting for GPUs); ``switches`` counts admitted transitions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable, Sequence

from nereusd.control.admission import ADMIT, RESTART
from nereusd.control.controller import Controller, StepObservation
from nereusd.control.lookahead import LengthLookahead
from nereusd.control.problem import launch_for
from nereusd.errors import NereusError
from nereusd.plan import Candidate, Plan
from nereusd.planner.search import Infeasible
from nereusd.cost.memory import usable_bytes
from nereusd.cost.model import CostModel
from nereusd.planner.space import PlanProblem, evaluate
from nereusd.sim.policies import ADAPTIVE, ORACLE, Policy
from nereusd.sim.measured import ground_truth
from nereusd.sim.oracle import Oracle
from nereusd.sim.results import PolicyResult, StepRecord
from nereusd.sim.truth import GroundTruth, TruthConfig
from nereusd.traces import LengthTrace, PoolTrace
from nereusd.transition.estimate import TransitionEstimator

TRANSITION_SCALE_LIMIT = 32
"""Transitions between plans of more devices are assessed on DP-scaled plans
(:mod:`nereusd.transition.estimate`): an assumption of the simulator, for speed."""
OOM_LOST_FRACTION = 0.5


class SimulationError(NereusError):
    """The simulated job cannot run at all (nothing fits the whole cluster)."""


class Simulation:
    """Replays ``steps`` RL steps of ``problem`` on traces, one policy at a time.

    Args:
        problem: workflow, specs, base workload (prompt length, batch), site sized to the
            cluster and its full pool.
        lengths, pool_trace: the traces.
        steps: RL steps to complete.
        truth: ground-truth assumptions.
        max_response_length: the job's ``max_new_tokens`` (default: the longest length of the
            trace over the run, rounded up).
        response_cap: each step's cap under a length curriculum, as
            :class:`~nereusd.control.controller.Controller` takes it (the trace is already cut
            at it: :func:`nereusd.sim.scenario.build`); ``None``: ``max_response_length``.
    """

    def __init__(self, problem: PlanProblem, lengths: LengthTrace, pool_trace: PoolTrace, steps: int,
                 truth: TruthConfig | None = None, max_response_length: int | None = None,
                 response_cap: Callable[[int], int] | None = None, join: str = "background") -> None:
        if join not in ("background", "immediate"):
            raise ValueError(f"join must be 'background' or 'immediate', got {join!r}")
        self.join = join
        """How devices that come back join (a job's ``pool.join``; :meth:`_join_step`)."""
        self.problem = problem
        self.response_cap = response_cap
        self.max_response_length = max_response_length or math.ceil(max(lengths.at(i) for i in range(steps)))
        self.lengths = lengths
        self.pool_trace = pool_trace
        self.steps = steps
        self.truth_config = truth or TruthConfig()
        self.total = len(problem.pool)
        self.dpn = problem.site.devices_per_node
        self._oracle = Oracle(problem, ground_truth(problem, self.truth_config, response_cap))
        self._oracles = {0.0: self._oracle}
        """The oracle of each ``oracle@H`` policy by ``H`` (:meth:`oracle_for`)."""
        self.launch = self._oracle.plan(0, lengths.at(0), problem.pool, 0.0)
        if self.launch is None:
            try:   # the planner says which model-stage and phase does not fit, and what would
                planned = launch_for(problem).plan
                over = self._oracle.truth.oom(planned, lengths.at(0), 0)
                why = (f": the controller's planner holds {planned.describe()}, " + (
                    f"over memory in the ground truth ({over})" if over else
                    "but the oracle, which every run is measured against, searches no activation recomputation"
                    if any(c.recompute for c in planned.candidates.values()) else
                    "which the oracle's search did not find"))
            except Infeasible as err:
                why = f": {err}"
            raise SimulationError(f"no plan fits {self.total} devices at a response length of {lengths.at(0):.0f} "
                                  f"tokens and prompts of {problem.workload.prompt_length}{why}")
        self.min_devices = self._min_devices()
        self._launch_final: Plan | None = None
        self._launch_adaptive: dict[float, Plan] = {}

    def learn_plans(self, results: Sequence[PolicyResult]) -> None:
        """Give the oracle the plans ``results`` ran (:attr:`Oracle.known`): run the other
        policies first, then the oracle (:func:`nereusd.sim.scenario.run_policies` does)."""
        for res in results:
            for oracle in self._oracles.values():
                oracle.known.update(res.layouts)

    def launch_adaptive(self, delta_length: float) -> Plan:
        """The plan the adaptive policies launch on: :attr:`launch` (``frozen-start``'s, the
        truth's fastest for the first step) when the controller's memory model, at its headroom,
        holds it for the length its first boundary judges it at (the first step's with the
        lookahead's margin before a window is seen, ``δ_len``,
        :class:`~nereusd.control.lookahead.LengthLookahead`); else the controller's own launch
        plan for that length (:func:`~nereusd.control.problem.launch_for`: the site's priors),
        as a job whose given layout its launcher refuses gets.

        Handed a plan its safety margin refuses, Nereus paid a checkpoint restart at its first
        boundary on the memory-tight A100 ramp (188 s); launched on its own plan everywhere, it
        ran 5.4 % slower than ``frozen-start`` on the 64-GPU H200 ramp, whose own launch plan its
        calibrated model then never left (``scripts/bench_sim.py``, 2026-12-04). Falls back to
        :attr:`launch` when the planner finds nothing."""
        plan = self._launch_adaptive.get(delta_length)
        if plan is None:
            cap = self.max_response_length if self.response_cap is None else min(self.max_response_length,
                                                                                 self.response_cap(0))
            length = LengthLookahead(delta_length).coming(math.ceil(self.lengths.at(0)), cap)
            problem = replace(self.problem, workload=replace(self.problem.workload, response_length=length))
            ev = evaluate(problem, self.launch, CostModel(problem.site))
            plan = self.launch
            if ev.over_capacity(usable_bytes(problem.site.device_memory_bytes)):
                try:
                    plan = launch_for(problem).plan
                except Infeasible:
                    pass
            self._launch_adaptive[delta_length] = plan
        return plan

    @property
    def launch_final(self) -> Plan:
        """The ``frozen-final`` launch plan: the truth's fastest plan on the whole cluster that
        runs every step of the run without running out of memory (the longest responses with
        each step's padding)."""
        if self._launch_final is None:
            self._launch_final = self._oracle.plan_for_run(self.lengths, self.steps, self.problem.pool)
            if self._launch_final is None:
                raise SimulationError(f"no plan on {self.total} devices holds every step of the run (the longest "
                                      f"response is {self.max_response_length} tokens, with prompts of "
                                      f"{self.problem.workload.prompt_length})")
        return self._launch_final

    def _min_devices(self) -> int:
        """Fewest whole nodes on which the truth fits a plan at the run's longest length: a
        smaller pool stalls the job (assumption: it waits for capacity rather than run)."""
        longest = max(self.lengths.at(i) for i in range(self.steps))
        for nodes in range(1, self.total // self.dpn + 1):
            if self._oracle.plan(0, longest, tuple(range(nodes * self.dpn)), 0.0) is not None:
                return nodes * self.dpn
        return self.dpn

    def oracle_for(self, policy: Policy) -> "Oracle":
        """The oracle of ``policy`` (``oracle`` or ``oracle@H``: its memory headroom), sharing
        the plans the other policies ran."""
        headroom = policy.memory_headroom
        if headroom not in self._oracles:
            oracle = self._oracles[headroom] = Oracle(self.problem, self._oracle.truth, headroom,
                                                       memo=self._oracle.memo)
            oracle.known.update(self._oracle.known)
        return self._oracles[headroom]

    def pool_at(self, time_s: float) -> tuple[int, ...]:
        return tuple(range(self.pool_trace.devices_at(time_s, self.total, self.dpn)))

    def run(self, policy: Policy) -> PolicyResult:
        """Replay the whole run under ``policy``.

        Raises:
            SimulationError: the policy's run cannot go on (no plan fits a restart, no progress);
                the message starts with the policy's name.
        """
        try:
            return self._replay(policy)
        except SimulationError as err:
            raise SimulationError(f"{policy.name}: {err}") from None

    def _replay(self, policy: Policy) -> PolicyResult:
        truth = ground_truth(self.problem, self.truth_config, self.response_cap)
        links = TransitionEstimator(self.problem.specs, self.problem.site, truth.cost_model(False),
                                    self.problem.workflow.concurrent_sets(), max_devices=TRANSITION_SCALE_LIMIT)
        launch = (self.launch_final if policy.launch_at_longest else
                  self.launch_adaptive(policy.control.delta_length) if policy.kind in ADAPTIVE else self.launch)
        oracle = self.oracle_for(policy) if policy.kind == ORACLE else None
        ctl = None if oracle is not None else Controller(
            self.problem, launch, policy.control, max_response_length=self.max_response_length,
            response_cap=self.response_cap, pool=self.problem.pool, transition_scale_limit=TRANSITION_SCALE_LIMIT)
        res = PolicyResult(policy, self.steps)
        plan = launch
        links.groups.built(launch)   # the build's weight-sync groups, held (live: the first step's record)
        if ctl is not None:
            ctl.groups_built(launch)
        ids: dict[str, int] = {}
        t, i, ckpt, done = 0.0, 0, 0, set()
        pool = self.problem.pool
        join: _Join | None = None
        while i < self.steps:
            if len(res.records) > 20 * self.steps + 1000:
                raise SimulationError(f"{policy.name} makes no progress: {len(res.records)} records "
                                      f"for {self.steps} steps (repeated failures)")
            length = self.lengths.at(i)
            if oracle is not None:
                plan = oracle.plan(i, length, pool, t, incumbent=plan) or plan
            desc = plan.describe()
            rec = StepRecord(i, t, length, len(pool), ids.setdefault(desc, len(ids)), rerun=i in done,
                             margin_missed=oracle is not None and oracle.margin_missed)
            if rec.plan_id == len(res.plans):
                res.plans.append(desc)
                res.layouts[desc] = plan
            res.records.append(rec)
            stage_s = truth.stage_times(plan, length, i, t)
            step_s = self.problem.workflow.critical_path_s(stage_s)
            if truth.oom(plan, length, i):
                rec.oom, rec.lost_s = True, OOM_LOST_FRACTION * step_s
                if ctl is not None:
                    ctl.failed(i, math.ceil(length))
                plan = self._restart(ctl, oracle, rec, truth, links, plan, length, pool, t)
                t += rec.lost_s + rec.restart_s
                i = ckpt
                continue
            rec.step_s = step_s
            t += step_s
            done.add(i)
            i += 1
            if i % self.truth_config.checkpoint_interval == 0:
                ckpt = i
            if ctl is not None:
                ctl.observe(StepObservation(i - 1, max(1, math.ceil(length)), stage_s,
                                            truth.device_peaks(plan, length, i - 1), step_s,
                                            truth.response_length_mean(length, i - 1)))
                if len(res.records) == 1 or res.records[-2].restart_s > 0:   # a build's (launch, restart) first
                    ctl.engine_started(truth.engine_rebuild_s(Plan({}), plan))   # step: its engines' start-up
            # ---- safe boundary ----
            new_pool = self.pool_at(t)
            while len(new_pool) < self.min_devices:
                nxt = self.pool_trace.next_change_s(t)
                if math.isinf(nxt):
                    raise SimulationError("the pool is too small for any plan and never changes")
                rec.stall_s += nxt - t
                t = nxt
                new_pool = self.pool_at(t)
            if ctl is not None and not rec.stall_s:   # devices that came back join in the background
                new_pool, join = self._join_step(new_pool, pool, join, t, ctl)   # (live: nereusd.daemon.joins)
            else:   # after an outage every worker starts anew, on every device there
                join = None
            outage = rec.stall_s > 0   # the pool fell below any plan: every replica is gone
            rec.pool_changed = tuple(new_pool) != tuple(pool)
            source = None if outage else surviving_units(plan, len(new_pool))
            if outage or source is None:   # some model-stage lost every replica (the oracle's too:
                pool = new_pool            # a lost device is no layout choice; its moves are free)
                plan = self._restart(ctl, oracle, rec, truth, links, plan, length, pool, t)
                t += rec.restart_s
                continue
            if ctl is None:
                pool = new_pool
                continue
            if rec.pool_changed:   # live, the workers re-form their world: their group pools empty
                ctl.world_formed()
                links.groups.world_formed()
            outcome = ctl.boundary(i - 1, new_pool, source=None if source == plan else source)
            pool = new_pool
            d = outcome.decision if outcome is not None else None
            if d is not None:
                res.decisions.append(d.to_dict() | {"time_s": t})
            warm = ctl.warm_engines   # a background join's (switched() clears them)
            if d is not None and d.verdict == ADMIT:
                started_s = truth.engine_rebuild_s(source, d.target.plan, warm)
                truth_est = links.estimate(source, d.target.plan)
                rec.transition_s = truth_est.l_tran_s + started_s
                rec.engine_start_s = started_s
                rec.switched = True
                # the engines' start-up is measured on its own, as the live workers report it
                # (engine_start_s): the fixed cost learns the rest of the prediction's error
                priced_start_s = ctl.engine_start_term_s(source, d.target.plan, self.problem.engines,
                                                         self.problem.workload.micro_batch)
                ctl.transition_measured(d.l_tran_s - priced_start_s, rec.transition_s - started_s)
                ctl.engine_started(started_s)
                # the workers' group pools after it; a scaled assessment has no DAG (and prices
                # every set-up): its target's weight-sync groups are held, as after a build
                for ran, built, dag in ((links.groups.ran, links.groups.built, truth_est.dag),
                                        (ctl.transition_ran, ctl.groups_built, d.target.dag)):
                    if dag is not None:
                        ran(dag)
                    else:
                        built(d.target.plan)
                plan = d.target.plan
                ctl.switched(plan, pool)
            elif source != plan or (d is not None and d.verdict == RESTART):
                plan = self._restart(ctl, oracle, rec, truth, links, plan, length, pool, t)
            elif rec.pool_changed:   # live, the kept plan's engines are rebuilt on the new world
                ctl.groups_built(plan)
                links.groups.built(plan)
            ctl.warm_engines = {}   # the workers close the warm engines the boundary's rebuild did not adopt
            t += rec.transition_s + rec.restart_s
        return res

    def _join_step(self, available: tuple[int, ...], pool: tuple[int, ...], join: "_Join | None", time_s: float,
                   ctl: Controller) -> tuple[tuple[int, ...], "_Join | None"]:
        """The pool the controller sees at a boundary at ``time_s`` when ``available`` devices
        are there and it ran on ``pool``, and the background join after it (live:
        :mod:`nereusd.daemon.joins`). Devices that come back start the vLLM engines of the
        replicas the controller expects to place wholly on them (:meth:`Controller.early_engines`)
        while the job runs on, and join at the first
        boundary ``engine_rebuild_s`` (the truth's start-up) after they came, with those engines
        warm (:attr:`Controller.warm_engines`). Without such replicas, or a start-up to wait for,
        where the growth starts engines anyway (a replica that stays changes its wave size; the
        workers' start-up, which the background also hides live, is not simulated), or with
        ``join="immediate"``, they join at once, as before. Devices lost meanwhile leave
        the join; devices that come during a join wait for the next (live: the same). The
        oracle, whose switches are free, takes devices at once."""
        start_s = self.truth_config.engine_rebuild_s
        if self.join != "background" or not start_s or len(available) < len(pool):
            return available, None   # immediate, nothing to wait for, or a loss (a join's devices went too)
        if join is not None:
            joining = tuple(d for d in join.devices if d in available)
            if not joining:
                return available[:len(pool)], None
            if time_s < join.ready_s:
                return pool, replace(join, devices=joining)
            ctl.warm_engines = {ms: {d: k for d, k in keys.items() if d in joining} for ms, keys in join.warm.items()}
            return tuple(sorted(set(pool) | set(joining))), None
        new = tuple(d for d in available if d not in pool)
        if not new:
            return available, None
        warm = ctl.early_engines(available, new)
        if not warm:
            return available, None   # nothing to start early, or the growth starts engines anyway
        return pool, _Join(new, time_s + start_s, warm)

    def _restart(self, ctl: Controller | None, oracle: "Oracle | None", rec: StepRecord, truth: GroundTruth,
                 links: TransitionEstimator, plan: Plan, length: float, pool: tuple[int, ...], time_s: float) -> Plan:
        """Checkpoint/restart into the controller's restart plan for ``pool`` (an oracle: its
        best plan for the step); the new workers' group pools hold the new plan's weight-sync
        groups only (``links``: the truth's transition estimates)."""
        if ctl is None:
            target = oracle.plan(rec.step, length, pool, time_s)
            if target is None:
                raise SimulationError(f"step {rec.step}: no plan fits {len(pool)} devices at a response length of "
                                      f"{length:.0f} tokens and prompts of {self.problem.workload.prompt_length}")
        else:
            try:
                target = ctl.restart_plan(pool).plan
            except Infeasible as err:   # it names the length it planned for (the longest so far after
                raise SimulationError(    # an out-of-memory step) and the model-stage that does not fit
                    f"step {rec.step}: a checkpoint/restart on {len(pool)} devices found no plan: {err}") from None
        restart_s = truth.restart_s(target)
        rec.restart_s += restart_s
        if ctl is not None:
            ctl.restart_measured(restart_s)
            ctl.world_formed()
            ctl.groups_built(target)
            ctl.switched(target, pool)
        links.groups.world_formed()
        links.groups.built(target)
        return target


@dataclass(frozen=True)
class _Join:
    """A background join in the simulator (:meth:`Simulation._join_step`)."""

    devices: tuple[int, ...]
    ready_s: float
    """When their engines are up: they join at the first boundary from then."""
    warm: dict
    """``{model_stage: {device: replica key}}`` of those engines."""


def surviving_units(plan: Plan, n: int) -> Plan | None:
    """``plan`` with only the replicas that lie entirely on devices ``< n`` (the intact units
    after the pool shrank to ``n`` devices); ``None`` when some model-stage keeps none."""
    out = {}
    for m, c in plan.items():
        keep = [r for r in range(c.dp) if all(d < n for d in c.replica_devices(r))]
        if not keep:
            return None
        if len(keep) == c.dp:
            out[m] = c
        else:
            out[m] = Candidate(c.tp, c.pp, len(keep), tuple(d for r in keep for d in c.replica_devices(r)),
                               micro_batch=c.micro_batch, recompute=c.recompute)
    return Plan(out)
