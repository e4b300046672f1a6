"""The adaptation controller: measurements in, admitted transitions out.

This is the controller of a live job, with no simulator inside: it is fed one
:class:`StepMeasurement` per RL step (model-stage times and peak memory, the step's mean
response length) and the device pool, and at each safe boundary it runs the project's own
pieces in the order of DESIGN.md "One RL step":

1. calibration — :meth:`nereusd.cost.calibration.Calibration.observe_stage` with the cost model's
   ideal seconds per operation class; peak memory calibrates a memory ratio
   ``measured / predicted`` (the largest of the last ``memory_window`` steps), which widens the
   planner's headroom (``1 − (1 − headroom)/ratio``) so that predicted plans fit what is measured;
2. triggers — :class:`nereusd.control.monitor.Monitor` (pool change and predicted OOM urgent; drift of
   the sequence length, ``δ = 30 %``, and of achieved efficiency, predicted/measured step time);
   ``period > 0`` also replans every ``period`` steps;
3. replan — :class:`nereusd.planner.search.Planner` (:func:`nereusd.control.admission.urgent_replan` on the
   urgent path), for the observed length rounded *up* to a grid of ``buckets_per_octave``
   lengths per doubling, so that the costed option lists of a bucket are reused between
   replans (the target and the current plan are then evaluated at the exact length);
4. admission — :func:`nereusd.control.admission.admit` with ``L̂_tran`` and feasibility from the
   transition engine (:mod:`nereusd.transition.estimate`); a DP-only rescale of the current plan
   is offered as the cheaper fallback target.

``gamma = inf`` admits any positive predicted gain (the "greedy" policy).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, replace
from typing import Mapping

from nereusd.control.admission import KEEP, Decision, Target, admit, urgent_replan
from nereusd.cost.calibration import Calibration
from nereusd.cost.model import CostModel
from nereusd.cost.memory import HEADROOM, usable_bytes
from nereusd.control.monitor import EFFICIENCY, PEAK_MEMORY, SEQUENCE_LENGTH, Monitor, Trigger
from nereusd.plan import ModelStage, Plan
from nereusd.planner.search import Infeasible, Planner, PlanResult
from nereusd.planner.space import PlannerOptions, PlanProblem, evaluate
from nereusd.planner.rescale import dp_rescale
from nereusd.transition.estimate import TransitionEstimator, plan_key

PERIOD = "period"


@dataclass(frozen=True)
class StepMeasurement:
    """What the job measured in one RL step.

    Attributes:
        step: step index.
        response_length: mean generated tokens per sequence.
        stage_s: measured seconds per model-stage.
        peak_bytes: measured peak bytes per model-stage (its most loaded device, own working set).
    """

    step: int
    response_length: float
    stage_s: Mapping[ModelStage, float]
    peak_bytes: Mapping[ModelStage, int]


@dataclass(frozen=True, kw_only=True)
class ControllerConfig:
    """Policy knobs: ``gamma`` (payback margin; ``inf``: any gain), ``period`` (replan every
    k steps, 0: triggers only), ``headroom``, the length grid and the memory window."""

    gamma: float = 0.5
    period: int = 0
    headroom: float = HEADROOM
    buckets_per_octave: int = 16
    memory_window: int = 32


@dataclass(frozen=True)
class Outcome:
    """A decision with the transition estimate behind it (``None`` when nothing triggered)."""

    decision: Decision
    target: PlanResult | None


def length_bucket(length: float, per_octave: int) -> int:
    """``length`` rounded up to the grid ``2^(k/per_octave)`` tokens (an integer ≥ 1)."""
    if length <= 1:
        return 1
    return int(math.ceil(2 ** (math.ceil(per_octave * math.log2(length) - 1e-9) / per_octave)))


class Controller:
    """Calibrate, trigger, replan and admit for one job.

    Args:
        problem: workflow, model specs, base workload (its response length is replaced by
            the measured one), site and the full device pool.
        plan: the running plan.
        config: policy knobs.
        calibration: initial calibration (priors when omitted).
    """

    def __init__(self, problem: PlanProblem, plan: Plan, config: ControllerConfig | None = None,
                 calibration: Calibration | None = None) -> None:
        self.problem = problem
        self.plan = plan
        self.config = config or ControllerConfig()
        self.calibration = calibration or Calibration()
        self.cost_model = CostModel(problem.site, self.calibration)
        self.monitor = Monitor()
        self.transitions = TransitionEstimator(problem.specs, problem.site, self.cost_model,
                                               problem.workflow.concurrent_sets())
        self._memory = deque(maxlen=self.config.memory_window)
        self._planners: dict[tuple, Planner] = {}
        self._solutions: dict[tuple, PlanResult | None] = {}
        self._efficiency = 1.0
        self._replay_until, self._replay_length = 0, 0.0
        self._kept: tuple | None = None

    # ---- measurements ------------------------------------------------------------------------
    def problem_at(self, length: float, pool: tuple[int, ...]) -> PlanProblem:
        wl = replace(self.problem.workload, response_length=max(1, int(math.ceil(length))))
        return replace(self.problem, workload=wl, pool=pool)

    def memory_ratio(self) -> float:
        """Largest recent ``measured / predicted`` peak (1 before any measurement)."""
        return max(self._memory, default=1.0)

    def headroom(self) -> float:
        return min(0.6, 1.0 - (1.0 - self.config.headroom) / max(1.0, self.memory_ratio()))

    def observe(self, m: StepMeasurement) -> None:
        """Calibrate from one step run under :attr:`plan`."""
        ev = evaluate(self.problem_at(m.response_length, self.problem.pool), self.plan, self.cost_model)
        if len(m.stage_s) == len(ev.options):
            measured = self.problem.workflow.critical_path_s(m.stage_s)
            self._efficiency = ev.step_latency_s / measured if measured > 0 else 1.0
        for ms, opt in ev.options.items():
            if ms in m.stage_s:
                self.calibration.observe_stage(opt.cost_by_class, m.stage_s[ms])
            if m.peak_bytes.get(ms) and opt.peak_bytes > 0:
                self._memory.append(m.peak_bytes[ms] / opt.peak_bytes)
        self.cost_model.refresh()

    # ---- planning ----------------------------------------------------------------------------
    def _solve(self, length: float, pool: tuple[int, ...], urgent: bool) -> PlanResult | None:
        bucket = length_bucket(length, self.config.buckets_per_octave)
        headroom = math.ceil(self.headroom() / 0.02 - 1e-9) * 0.02   # 2 % steps, rounded up
        # efficiencies on a 2 % log grid: the costed option lists of a bucket are reused until
        # calibration moves by more than that (target and current are re-evaluated exactly)
        snapshot = tuple((c, round(1.02 ** round(math.log(v) / math.log(1.02)), 6))
                         for c, v in self.calibration.snapshot().items())
        key = (bucket, pool, headroom, snapshot)
        options = PlannerOptions(headroom=headroom)
        current = plan_key(self.plan)
        if (key, current, urgent) in self._solutions:
            return self._solutions[(key, current, urgent)]
        problem = self.problem_at(bucket, pool)
        cm = CostModel(self.problem.site, Calibration(priors=dict(snapshot)))
        result = None
        try:
            planner = self._planners.get(key)
            if planner is None:
                if len(self._planners) > 64:
                    self._planners.clear()
                planner = self._planners[key] = Planner(problem, cm, options)
            result = planner.solve(self.plan)
        except Infeasible:
            if urgent:
                result, _ = urgent_replan(problem, cm, self.plan, options)
        if len(self._solutions) > 1024:
            self._solutions.clear()
        self._solutions[(key, current, urgent)] = result
        return result

    def _target(self, plan: Plan, problem: PlanProblem, usable: int) -> Target:
        ev = evaluate(problem, plan, self.cost_model)
        est = self.transitions.estimate(self.plan, plan)
        over = ev.over_capacity(usable)
        feasible = est.feasible and not over
        reason = est.reason or (f"predicted peak over usable memory on {len(over)} devices" if over else "")
        return Target(plan, ev.step_latency_s, est.l_tran_s, feasible, reason)

    def boundary(self, step: int, length: float, pool: tuple[int, ...], current_valid: bool = True) -> Outcome | None:
        """Triggers, replan and admission at the safe boundary after ``step``.

        Args:
            length: the step's measured mean response length (the coming step's estimate).
            pool: devices available now.
            current_valid: False when devices of the running plan are gone.

        Returns:
            None when nothing triggered, else the admission outcome; an admitted target
            becomes :attr:`plan`.
        """
        plan_length = max(length, self._replay_length) if step < self._replay_until else length
        problem = self.problem_at(plan_length, pool)
        usable = usable_bytes(problem.site.device_memory_bytes, self.headroom())
        signals = {SEQUENCE_LENGTH: float(length), EFFICIENCY: self._efficiency}
        peak, current = None, None
        if current_valid:
            current = evaluate(problem, self.plan, self.cost_model)
            # the prediction calibrated by measured peaks
            peak = int(max(current.peak_bytes.values()) * self.memory_ratio())
            # it does not fit the device at all: keeping the plan is not an option (the urgent
            # path ends in checkpoint/restart if no transition is feasible)
            current_valid = peak <= problem.site.device_memory_bytes
        triggers = self.monitor.observe(step, signals=signals, pool=pool, predicted_peak_bytes=peak,
                                        usable_bytes=usable_bytes(problem.site.device_memory_bytes,
                                                                  self.config.headroom) if peak else None)
        if [t.signal for t in triggers] == [PEAK_MEMORY] and current_valid:
            # the same urgent condition as at the last boundary, with nothing changed: the
            # replan would repeat its verdict (keep), so it is not run again
            state = (plan_key(self.plan), length_bucket(plan_length, self.config.buckets_per_octave), pool)
            if state == self._kept:
                triggers = []
        if self.config.period and step % self.config.period == 0:
            triggers.append(Trigger(PERIOD, False, step, None, f"every {self.config.period} steps"))
        if not current_valid and not any(t.urgent for t in triggers):
            triggers.append(Trigger("gpu_pool", True, len(pool), None, "devices of the running plan lost"))
        if not triggers:
            return None
        urgent = any(t.urgent for t in triggers)
        result = self._solve(plan_length, pool, urgent)
        targets = []
        if result is not None:
            targets.append(self._target(result.plan, problem, usable))
        if not targets or not targets[0].feasible:
            # fallback with a cheaper transition: the running layouts, DP rescaled to the pool
            rescaled = dp_rescale(self.plan, problem)
            if rescaled is not None and (result is None or plan_key(rescaled) != plan_key(result.plan)):
                targets.append(self._target(rescaled, problem, usable))
        current_s = current.step_latency_s if current_valid else math.inf
        horizons = [self.monitor.horizon(t.signal) if t.signal != PERIOD else float(self.config.period)
                    for t in triggers]
        decision = admit(step=step, triggers=triggers, current_step_latency_s=current_s, targets=targets,
                         horizon_steps=min(horizons), gamma=self.config.gamma, current_valid=current_valid)
        self.monitor.replanned(signals)
        self._kept = (plan_key(self.plan), length_bucket(plan_length, self.config.buckets_per_octave), pool) \
            if decision.verdict == KEEP else None
        if decision.admitted:
            self.plan = decision.target.plan
        return Outcome(decision, result)

    def restarted(self, plan: Plan) -> None:
        """The job was checkpointed and restarted into ``plan``."""
        self.plan = plan

    def failed(self, step: int, length: float) -> None:
        """Step ``step`` of mean length ``length`` ran out of memory: until the job is past it
        again (the steps since the checkpoint re-run the same batches), plan for at least that
        length, so that a replan during the re-run does not return to a layout that failed."""
        self._replay_until = max(self._replay_until, step + 1)
        self._replay_length = max(self._replay_length if step < self._replay_until else 0.0, length)
