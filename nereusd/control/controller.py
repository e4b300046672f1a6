"""The adaptation controller: measurements in, decisions out (paper §4; DESIGN.md "One RL step",
steps 2–4). Live jobs and the simulator run this one class; adaptation policies differ only in
the :class:`ControlPolicy` they pass.

At every safe boundary the caller hands :meth:`Controller.observe` what its last step measured
and then asks :meth:`Controller.boundary` what to do:

1. *calibration* — each model-stage's measured task time refines the cost model's efficiency per
   operation class (:meth:`nereusd.cost.calibration.Calibration.observe_stage`); measured peak
   memory per device against the predicted peak gives a memory ratio (the largest of the last
   ``memory_window`` steps) that widens the planner's headroom to ``max(headroom, 1 − 1/ratio)``
   (:meth:`Controller.headroom`);
   the measured start-up of a vLLM engine (the build's, then each transition's) is added to the
   ``L̂_tran`` of every target that starts one (:meth:`Controller.engine_started`,
   :func:`nereusd.backends.restarts_vllm_engines`: the workers' own rule for keeping an engine);
   each model-stage's measured re-attachment (the build's, then each transition's) is added to
   the ``L̂_tran`` of every target that rebuilds it (:meth:`Controller.engines_rebuilt`,
   :func:`nereusd.transition.rebuilt_model_stages`); the measured time of a transition outside
   its priced terms gives the fixed cost the DAG's byte-and-link model leaves out (round trips,
   weight-sync set-up, garbage collection), added to every ``L̂_tran``
   (:meth:`Controller.transition_measured`);
2. *triggers* — :class:`nereusd.control.monitor.Monitor`: the pool changed or the current plan's
   predicted peak for the coming step exceeds the usable memory (urgent); the response length
   or the achieved efficiency drifted by more than ``δ`` (opportunistic); optionally every
   ``period`` steps; a layout the operator forces;
3. *replan* — :class:`nereusd.planner.search.Planner` (on the urgent path
   :func:`nereusd.control.admission.urgent_replan`: then with recomputation),
   plus the DP-only rescale of the current plan as a cheaper fallback target
   (:func:`nereusd.planner.rescale.dp_rescale`); the ``frozen`` policy only rescales DP;
4. *admission* — :func:`nereusd.control.admission.admit` with ``L̂_tran`` and the memory
   feasibility of the transition DAG (:class:`nereusd.transition.estimate.TransitionEstimator`).
   Each target carries the DAG it was assessed with; a live job executes that DAG.

Length. The engine pads every micro-batch to its longest sequence, so memory and training time
follow the *longest* response of a step, not the mean; the length signal is the step's longest
response. Generation decodes by continuous batching and follows the mean as well: the
controller plans with the recent steps' mean over longest response (:meth:`Controller.mean_fraction`). The coming step's length is unknown:
plans are checked and chosen for a forecast of it, capped at ``max_response_length``
(:mod:`nereusd.control.lookahead`: the recent steps' longest plus a margin from the run's own
jumps) — so a plan is left *before* growth makes it run out of memory, not after.

Pure: no torch, no sockets, no clock. The shell that executes decisions on workers is
:mod:`nereusd.daemon.live`; the simulator's is :mod:`nereusd.sim.replay`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Mapping

from nereusd.backends import Backend, check_zero_stage, restarts_vllm_engines
from nereusd.config.resolve import ResolvedJob
from nereusd.config.site import SiteConfig
from nereusd.control.admission import ADMIT, KEEP, REJECT, RESTART, Decision, Target, admit, recheck_due
from nereusd.control.lookahead import MAX_TOKENS, LengthLookahead, planned_mean_fraction
from nereusd.control.policy import MEMORY_WINDOW, ControlPolicy, PolicyKind
from nereusd.control.monitor import (EFFICIENCY, FORCED, GPU_POOL, PERIOD, RECHECK, RESTARTED, SEQUENCE_LENGTH,
                                     Monitor, Trigger)
from nereusd.control.problem import job_problem, site_for_pool, solve
from nereusd.control.transition_costs import TransitionCostLearning
from nereusd.cost.calibration import Calibration
from nereusd.cost.memory import HEADROOM, usable_bytes
from nereusd.cost.model import CostModel
from nereusd.errors import ConfigError, PlanError
from nereusd.plan import ModelStage, Plan
from nereusd.planner.rescale import dp_rescale
from nereusd.planner.search import Infeasible, PlanResult
from nereusd.planner.space import PlanProblem, evaluate
from nereusd.transition.estimate import TransitionEstimator

MAX_HEADROOM = 0.6
"""The memory ratio never widens the planner's headroom past this fraction."""

RESTART_LENGTH_FACTOR = math.sqrt(2.0)
"""Ratio between the response lengths :meth:`Controller._restart_for_growth` plans for."""

MEAN_FRACTION_WINDOW = 8
"""Steps whose mean-over-longest response fraction :meth:`Controller.mean_fraction` takes the
median of (the memory ratio's window, :data:`MEMORY_WINDOW`)."""


@dataclass(frozen=True)
class StepObservation:
    """What one RL step measured.

    Attributes:
        step: step index.
        response_length_max: longest generated response (tokens).
        model_stage_s: seconds per model-stage (its slowest device's task time, summed over the
            step's tasks of that model-stage).
        peak_bytes: measured peak bytes per device (all model-stages resident on it).
        step_latency_s: wall time of the whole step.
        response_length_mean: mean generated response (tokens); ``None``: not measured (taken
            as equal lengths).
    """

    step: int
    response_length_max: int
    model_stage_s: Mapping[ModelStage, float]
    peak_bytes: Mapping[int, int]
    step_latency_s: float
    response_length_mean: float | None = None

    @property
    def mean_fraction(self) -> float:
        """Mean over longest response, in (0, 1] (1 when the mean is not measured)."""
        if self.response_length_mean is None or self.response_length_max < 1:
            return 1.0
        return min(1.0, max(1.0 / self.response_length_max, self.response_length_mean / self.response_length_max))


@dataclass(frozen=True)
class Outcome:
    """A decision, the length it was planned for and the planner's log."""

    decision: Decision
    planned_length: int
    planner_log: tuple[str, ...] = ()












class Controller(TransitionCostLearning):
    """Calibrate, trigger, replan and admit for one running job (module docstring).

    Args:
        problem: the job's plan problem — workflow, model specs, a step's workload (its response
            length is replaced by the planned one), the site with the job's device memory.
        plan: the running plan.
        policy: the adaptation policy (default: ``nereus`` with γ = 0.5).
        max_response_length: the longest response a step can generate (``max_new_tokens``):
            the cap of the lookahead and the length a restart plans for.
        pool: devices of the world (default: the plan's); a boundary on another pool replans.
        calibration: initial calibration (priors when omitted).
        transition_scale_limit: assess transitions between plans of more devices than this on
            DP-scaled plans (the simulator's approximation, :mod:`nereusd.transition.estimate`);
            ``None`` (live jobs): every DAG at full size, so that it can be executed.
    """

    def __init__(self, problem: PlanProblem, plan: Plan, policy: ControlPolicy | None = None, *,
                 max_response_length: int, pool: tuple[int, ...] | None = None,
                 calibration: Calibration | None = None, transition_scale_limit: int | None = None) -> None:
        self.base_problem, self.plan = problem, plan
        self.policy = policy or ControlPolicy()
        self.max_response_length = int(max_response_length)
        self.pool: tuple[int, ...] = tuple(sorted(pool)) if pool is not None else plan.devices()
        """Devices of the world (default: the plan's); a boundary on another pool replans."""
        self.calibration = calibration or Calibration()
        self.cost_model = CostModel(problem.site, self.calibration)
        self.monitor = Monitor(deltas={SEQUENCE_LENGTH: self.policy.delta_length,
                                       EFFICIENCY: self.policy.delta_efficiency})
        self.transitions = TransitionEstimator(problem.specs, problem.site, self.cost_model,
                                               problem.workflow.concurrent_sets(), max_devices=transition_scale_limit)
        self._memory: deque[float] = deque(maxlen=self.policy.memory_window)
        self._init_transition_costs()
        self.efficiency = 1.0
        self.length = 1
        self.lengths = LengthLookahead(self.policy.delta_length)
        """The steps' longest responses: what :meth:`lookahead` forecasts from."""
        self._mean_fractions: deque[float] = deque(maxlen=MEAN_FRACTION_WINDOW)
        """Recent steps' mean over longest response (:meth:`mean_fraction`)."""
        self.predicted_step_s: float | None = None
        self._replay_until, self._replay_length = 0, 0
        self._restarted = False
        """A restart put the job on the plan for the longest response: replan at the next boundary."""
        self._restart_target: tuple[Plan, bool, bool] | None = None
        """The last :meth:`restart_plan` answer: (plan, after an OOM, planned past the coming steps)."""
        self.base_plan = plan
        """The ``frozen`` policy's launch plan: what it DP-rescales on every pool change and
        restarts into after losing devices (replaced by the relaunch plan after an OOM)."""
        self._relaunch = False
        self._outgrown = False
        """The last boundary's verdict was checkpoint/restart because the running plan no longer
        fits the coming steps (it still had its devices): :meth:`restart_plan` weighs plans for
        longer responses against the restarts they save (:meth:`_restart_for_growth`)."""
        self._rejected: tuple[int, float] | None = None
        """The last boundary's ``reject`` of faster targets for their payback: (step, the smallest
        payback in steps); asked again once due (:data:`RECHECK`)."""

    # ---- state of a resumed nereusd ------------------------------------------------------------
    STATE_VERSION = 2

    def state(self) -> dict:
        """What the controller learned, for the journal (JSON; ``checkpoint`` events carry it, so
        that ``nereusd --resume`` continues with it, :meth:`restore`): the plan, the response
        length seen, the calibration, the memory ratios, the transition overhead and each
        model-stage's rebuild time, the monitor's
        signals and ``H_x``, the re-run and relaunch marks, a rejection waiting to be asked again,
        and the ``frozen`` policy's base plan."""
        return {"version": self.STATE_VERSION, "plan": self.plan.to_dict(), "length": self.length,
                "calibration": self.calibration.to_json(), "memory_ratios": list(self._memory),
                "efficiency": self.efficiency, "monitor": self.monitor.to_json(),
                "replay": [self._replay_until, self._replay_length], "relaunch": self._relaunch,
                "restarted": self._restarted, "predicted_step_s": self.predicted_step_s,
                "base_plan": self.base_plan.to_dict(), "lengths": self.lengths.to_json(),
                "mean_fractions": list(self._mean_fractions), "rejected": self._rejected,
                **self._transition_costs_state()}

    def restore(self, state: Mapping) -> None:
        """Continue from :meth:`state` (the plan is the caller's: a resumed job may run another).

        Raises:
            ConfigError: another version or a malformed state, naming the field; the controller
                is unchanged (the caller resumes with what it has).
        """
        try:
            if type(state.get("version")) is not int or state.get("version") != self.STATE_VERSION:
                raise ValueError(f"version {state.get('version')!r}, expected {self.STATE_VERSION}")
            Calibration.from_json(state["calibration"], "controller state: calibration")   # checked first
            monitor = Monitor.from_json(state["monitor"])
            memory = [float(x) for x in state["memory_ratios"]]
            if not all(math.isfinite(x) and x > 0 for x in memory):   # a nan hid the largest ratio from max()
                raise ValueError(f"memory_ratios {memory!r}: expected finite ratios > 0")
            base_plan = Plan.from_dict(state["base_plan"])
            replay_until, replay_length = (int(x) for x in state["replay"])
            if not (0 <= replay_until and 0 <= replay_length <= max(self.max_response_length, 1)):
                raise ValueError(f"replay {state['replay']!r}: a step ≥ 0 and a length of at most max_new_tokens")
            flags = (state["relaunch"], state["restarted"])
            if not all(isinstance(f, bool) for f in flags):   # bool("false") is True
                raise TypeError(f"relaunch / restarted must be true or false, got {flags!r}")
            fields = (int(state["length"]), float(state["efficiency"]), *flags)
            if not (1 <= fields[0] <= MAX_TOKENS and math.isfinite(fields[1]) and fields[1] > 0):
                raise ValueError(f"length {state['length']!r} / efficiency {state['efficiency']!r} out of range")
            predicted = state["predicted_step_s"]
            predicted = None if predicted is None else float(predicted)
            if predicted is not None and not (math.isfinite(predicted) and predicted >= 0):
                raise ValueError(f"predicted_step_s {predicted!r}")
            costs = self._parse_transition_costs(state)
            lengths = LengthLookahead(self.policy.delta_length)
            lengths.restore(state["lengths"])
            fractions = [float(x) for x in state.get("mean_fractions", [])]   # absent before 2026-12-04
            if not all(0.0 < x <= 1.0 for x in fractions):
                raise ValueError(f"mean_fractions outside (0, 1]: {fractions}")
            rejected = state.get("rejected")   # absent before 2026-12-05
            if rejected is not None:
                if not (isinstance(rejected, list) and len(rejected) == 2 and type(rejected[0]) is int
                        and type(rejected[1]) in (int, float)):
                    raise ValueError(f"rejected: expected [step, payback steps], got {rejected!r}")
                rejected = (rejected[0], float(rejected[1]))
                if not (rejected[0] >= 0 and math.isfinite(rejected[1]) and rejected[1] >= 0):
                    raise ValueError(f"rejected: a step ≥ 0 and a finite payback ≥ 0, got {list(rejected)!r}")
        except ConfigError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError, PlanError) as err:
            raise ConfigError(f"controller state: malformed ({type(err).__name__}: {err})") from None
        self.calibration.restore(state["calibration"], "controller state: calibration")
        self.cost_model.refresh()
        self.transitions.forget()
        self.monitor = monitor
        self._memory.clear()
        self._memory.extend(memory)
        self.base_plan = base_plan
        self._replay_until, self._replay_length = replay_until, replay_length
        self.length, self.efficiency, self._relaunch, self._restarted = fields
        self.predicted_step_s = predicted
        self.lengths = lengths
        self._mean_fractions.clear()
        self._mean_fractions.extend(fractions)
        self._rejected = rejected
        self._set_transition_costs(costs)

    # ---- problem ---------------------------------------------------------------------------
    def problem(self, pool: tuple[int, ...], length: int, mean_fraction: float | None = None) -> PlanProblem:
        """The plan problem on ``pool`` for responses of at most ``length`` tokens whose mean is
        ``mean_fraction`` of it (default: :meth:`mean_fraction`)."""
        base = self.base_problem
        fraction = self.mean_fraction() if mean_fraction is None else mean_fraction
        workload = dataclasses.replace(base.workload, response_length=max(1, int(length)),
                                       response_mean_fraction=fraction)
        return dataclasses.replace(base, workload=workload, site=site_for_pool(base.site, tuple(pool)),
                                   pool=tuple(pool))

    def mean_fraction(self) -> float:
        """The coming steps' mean over longest response: the median of the last
        :data:`MEAN_FRACTION_WINDOW` steps', to a twentieth (so that step-to-step noise does not
        change the plans); 1 (equal lengths) before any is measured.

        Generation's continuous batching finishes short responses early
        (:func:`nereusd.cost.formulas.continuous_batching`); a cost model that takes every
        response as long as the longest over-prices the KV cache, which the longest responses
        alone read late in the step, and so under-rates layouts with more tensor parallelism
        (``scripts/bench_sim.py``, 2026-12-04)."""
        if not self._mean_fractions:
            return 1.0
        return planned_mean_fraction(statistics.median(self._mean_fractions))

    def lookahead(self, length: int) -> int:
        """The coming step's longest response, forecast from ``length`` and the run's recent
        steps (:class:`nereusd.control.lookahead.LengthLookahead`), capped at the longest possible."""
        return self.lengths.coming(length, self.max_response_length)

    def memory_ratio(self) -> float:
        """Largest recent measured/predicted device peak (1 before any measurement)."""
        return max(self._memory, default=1.0)

    def headroom(self) -> float:
        """Planner headroom widened by the memory ratio ``r``: ``max(h, 1 − 1/r)``, at most
        :data:`MAX_HEADROOM`; a plan then fits when its predicted peak times ``r`` (the worst
        recent measured/predicted) is within capacity, and within ``1 − h`` of it as before.

        The headroom ``h`` is the allowance for what the model misses; once measured peaks say
        what it misses, both are not needed. It was ``1 − (1 − h)/r``, the measured excess and
        ``h`` on top: on the simulator's memory-tight A100 ramp Nereus then ran slower layouts
        than frozen-start without one OOM avoided (+1.2 % against it; −4.3 % with this rule,
        no OOM either; ``scripts/bench_sim.py``, 2026-12-03)."""
        return min(MAX_HEADROOM, max(HEADROOM, 1.0 - 1.0 / max(1.0, self.memory_ratio())))

    # ---- measurements ----------------------------------------------------------------------
    def observe(self, obs: StepObservation) -> dict:
        """Calibrate from one step run under :attr:`plan`; returns predicted vs measured.

        The prediction is the one made at the previous boundary for this step (``None`` at the
        first step); ``measured_stage_path_s`` is the critical path of the measured model-stage
        times, the quantity the cost model predicts (the step's wall time adds the driver's
        own work and weight synchronisation).
        """
        self.length = max(1, obs.response_length_max)
        self.lengths.observe(self.length)
        if obs.response_length_mean is not None:
            self._mean_fractions.append(obs.mean_fraction)
        problem = self.problem(self.pool, self.length, obs.mean_fraction)
        ev = evaluate(problem, self.plan, self.cost_model)
        stage_s = {m: s for m, s in obs.model_stage_s.items() if m in ev.options}
        measured_path = problem.workflow.critical_path_s(stage_s) if len(stage_s) == len(ev.options) else None
        if measured_path:
            self.efficiency = ev.step_latency_s / measured_path
        for ms, opt in ev.options.items():
            if stage_s.get(ms, 0.0) > 0.0:
                self.calibration.observe_stage(opt.cost_by_class, stage_s[ms])
        measured_peak = max(obs.peak_bytes.values(), default=0)
        predicted_peak = max((ev.peak_bytes.get(d, 0) for d in obs.peak_bytes), default=0)
        if measured_peak and predicted_peak:
            self._memory.append(measured_peak / predicted_peak)
        self.cost_model.refresh()
        return {"step": obs.step, "predicted_step_latency_s": self.predicted_step_s,
                "measured_stage_path_s": measured_path, "measured_step_latency_s": obs.step_latency_s,
                "predicted_peak_bytes": predicted_peak, "measured_peak_bytes": measured_peak,
                "memory_ratio": self.memory_ratio(), "response_length_max": obs.response_length_max,
                "response_length_mean": obs.response_length_mean}

    # ---- decisions -------------------------------------------------------------------------
    def _keeping_engines(self, source: Plan, plan: Plan, problem: PlanProblem, headroom: float,
                         urgent: bool) -> Plan | None:
        """The planner's best plan whose generation keeps ``source``'s vLLM engines (its wave
        size pinned to their ``max_num_seqs``), when ``plan`` starts engines and a start-up has
        been measured; else ``None``. The planner minimises the step alone, and a slightly faster
        wave size can cost an engine start-up per replica (a pool change in ``bench_adaptive``
        went to 22 sequences per wave and restarted every engine, 16 s, where 16 kept them).
        Admission weighs the two by ``L̂_tran``."""
        micro = problem.workload.micro_batch
        if not self.engine_start_term_s(source, plan, problem.engines, micro):
            return None
        running = {source[ms].micro_batch or micro for ms in problem.engines if ms in source}
        if len(running) != 1:
            return None
        result, _ = solve(problem, self.cost_model, self.plan, headroom, urgent, generation_micro_batch=running.pop())
        if result is None or result.plan == plan or restarts_vllm_engines(source, result.plan, problem.engines, micro):
            return None
        return result.plan

    def _target(self, source: Plan, plan: Plan, problem: PlanProblem, usable: int) -> Target:
        ev = evaluate(problem, plan, self.cost_model)
        est = self.transitions.estimate(source, plan)
        over = ev.over_capacity(usable)
        reason = est.reason or (f"predicted peak over usable memory on devices {sorted(over)}" if over else "")
        l_tran = est.l_tran_s + self.extra_l_tran_s(source, plan, est.dag, problem.engines,
                                                     problem.workload.micro_batch)
        return Target(plan, ev.step_latency_s, l_tran, est.feasible and not over, reason,
                      restartable=not est.feasible and not over, dag=est.dag)

    def boundary(self, step: int, pool: tuple[int, ...], *, source: Plan | None = None,
                 forced: Plan | None = None) -> Outcome | None:
        """Triggers, replan and admission at the safe boundary after ``step``.

        Args:
            pool: devices available now (sorted).
            source: the units the transition would start from when devices of :attr:`plan` are
                gone (the intact units); ``None``: :attr:`plan` is whole.
            forced: a plan the operator forces (admission checks feasibility only).

        Returns:
            None when nothing triggered; else the outcome. An admitted decision is *not* applied
            here: the caller runs its ``target.dag`` and then calls :meth:`switched`.
        """
        current_valid = source is None
        source = source if source is not None else self.plan
        length = self.lookahead(self.length)
        if step < self._replay_until:   # re-running the steps before an out-of-memory failure
            length = max(length, self._replay_length)
        problem = self.problem(pool, length)
        headroom = self.headroom()
        usable = usable_bytes(problem.site.device_memory_bytes, headroom)
        signals = {SEQUENCE_LENGTH: float(self.length), EFFICIENCY: self.efficiency}
        peak, current_s = None, math.inf
        if current_valid:
            ev = evaluate(problem, self.plan, self.cost_model)
            peak, current_s = max(ev.peak_bytes.values()), ev.step_latency_s
        triggers = self.monitor.observe(step, signals=signals, pool=pool, predicted_peak_bytes=peak,
                                        usable_bytes=usable if peak is not None else None)
        if not current_valid and not any(t.signal == GPU_POOL for t in triggers):
            triggers.append(Trigger(GPU_POOL, True, len(pool), len(self.pool), "devices of the running plan lost"))
        elif tuple(pool) != tuple(self.pool) and not any(t.signal == GPU_POOL for t in triggers):
            # the monitor's first observation only sets its reference: a pool change at the
            # first boundary must still replan (devices leaving may hold the plan)
            triggers.append(Trigger(GPU_POOL, True, len(pool), len(self.pool), "the pool changed"))
        period = self.policy.period
        if period and step % period == 0:
            triggers.append(Trigger(PERIOD, False, step, None, f"every {period} steps"))
        if forced is not None:
            triggers.append(Trigger(FORCED, True, step, None, "layout forced by the job's adaptation.forced"))
        if self._restarted and current_valid and not any(t.urgent for t in triggers):
            triggers.append(Trigger(RESTARTED, False, step, None,
                                    "restarted on the plan for the longest response; the coming steps may be shorter"))
        self._restarted = False
        rejected, self._rejected = self._rejected, None   # another trigger replans anyway
        if rejected is not None and not triggers:   # (a plan that lost devices has a pool trigger)
            at, payback = rejected
            if recheck_due(payback, step - at, self.policy.payback_margin):
                triggers.append(Trigger(RECHECK, False, step, at, f"a target rejected at step {at} for its payback "
                                        f"({payback:.1f} steps) would repay within γ of the {step - at} steps since"))
            else:
                self._rejected = rejected   # not due yet: still waiting
        frozen = self.policy.kind is PolicyKind.FROZEN
        if frozen:   # static framework: only a pool change (DP rescale) or a forced layout
            triggers = [t for t in triggers if t.signal in (GPU_POOL, FORCED)]
        if not triggers:
            self.predicted_step_s = current_s if current_valid else None
            return None
        urgent = any(t.urgent for t in triggers)
        lines: list[str] = []
        targets: list[Target] = []
        if forced is not None:
            target = self._target(source, forced, problem, usable)
            outside = sorted(set(forced.devices()) - set(pool))
            if outside:   # e.g. a device lost before the forced step (or the step re-run after a restart)
                target = dataclasses.replace(target, feasible=False, reason=(
                    f"the forced layout uses devices {outside}, which are not in the pool {list(pool)}"))
            targets.append(target)
        elif frozen:
            rescaled = dp_rescale(self.base_plan, problem, current=source)
            if rescaled is not None:
                targets.append(dataclasses.replace(self._target(source, rescaled, problem, usable), feasible=True))
        else:
            result, lines = solve(problem, self.cost_model, self.plan, headroom, urgent)
            if result is not None:
                targets.append(self._target(source, result.plan, problem, usable))
                kept = self._keeping_engines(source, result.plan, problem, headroom, urgent)
                if kept is not None:
                    targets.append(self._target(source, kept, problem, usable))
            rescaled = dp_rescale(self.plan, problem, current=source)
            if rescaled is not None and (result is None or rescaled != result.plan) and rescaled != self.plan:
                targets.append(self._target(source, rescaled, problem, usable))
        # after a restart the plan lasts as long as the lengths stay put: at least H_len, and as
        # long as they have been steady already
        restart_h = max(self.monitor.horizon(SEQUENCE_LENGTH), float(self.monitor.steps_since_crossing(SEQUENCE_LENGTH, step)))
        horizons = [restart_h if t.signal is RESTARTED else float(step - t.reference) if t.signal is RECHECK else
                    self.monitor.horizon(t.signal) if t.signal not in (PERIOD, FORCED) else float(period or 1)
                    for t in triggers]
        if not urgent and targets and targets[0].plan == self.plan:
            targets = targets[1:]   # the planner keeps the running plan: nothing to switch to
        # a running plan predicted over usable memory is not kept for want of a feasible
        # transition: the verdict is then checkpoint/restart now, not an OOM later (issue 16: a
        # ramp ran 190 steps like that, then failed and lost the steps since its checkpoint)
        over = peak is not None and peak > usable
        runs = current_valid and not over and set(self.plan.devices()) <= set(pool)
        decision = admit(step=step, triggers=triggers, current_step_latency_s=current_s, targets=targets,
                         horizon_steps=min(horizons), payback_margin=self.policy.payback_margin,
                         current_valid=runs, restart_s=self.restart_s,
                         weigh_keeping=not frozen and math.isfinite(self.policy.payback_margin))
        self._outgrown = decision.verdict == RESTART and decision.target is None and current_valid and over
        if decision.verdict == ADMIT and decision.target.plan == source:
            decision = dataclasses.replace(decision, verdict=KEEP, reason="the planner keeps the running plan")
        if runs and not decision.admitted and decision.verdict != RESTART:
            self.pool_changed(pool)   # kept on purpose: joined devices stay spares, no trigger at every boundary
        if decision.verdict == REJECT and decision.rejected_payback_steps is not None:
            self._rejected = (step, decision.rejected_payback_steps)
        self.monitor.replanned(signals)
        self.predicted_step_s = decision.target.step_latency_s if decision.admitted else (
            current_s if current_valid else None)
        return Outcome(decision, length, tuple(lines))

    def restart_plan(self, pool: tuple[int, ...]) -> PlanResult:
        """The plan a checkpoint/restart goes to (urgent path: with recomputation if nothing else fits).

        After an out-of-memory failure (:meth:`failed`) the planner's plan for the longest
        response, :attr:`max_response_length`; after a device loss or a pool that no plan's units
        survive, the plan for the coming steps (the lookahead length), as at any boundary.

        The ``frozen`` policy restarts after a device loss into its launch plan DP-rescaled to
        ``pool`` (a static framework relaunches the same TP/PP on fewer GPUs; when even DP 1 of it
        does not fit ``pool``, into the planner's plan, until the GPUs are back), and after an
        out-of-memory failure into the planner's plan for the longest response, which becomes its
        launch plan.

        Raises:
            Infeasible: when nothing holds it.
        """
        frozen = self.policy.kind is PolicyKind.FROZEN
        oom = self._relaunch   # cleared by switched(): callers may ask more than once before restarting
        coming = self.lookahead(self.length)
        if frozen and not oom:
            problem = self.problem(pool, coming)
            rescaled = dp_rescale(self.base_plan, problem)
            if rescaled is not None:
                ev = evaluate(problem, rescaled, self.cost_model)
                usable = usable_bytes(problem.site.device_memory_bytes, self.headroom())
                return PlanResult(rescaled, ev.options, ev.step_latency_s, ev.peak_bytes, usable, 0.0)
        if self._outgrown and not (oom or frozen):
            chosen = self._restart_for_growth(pool, coming)
            if chosen is not None:
                self._restart_target = (chosen.plan, False, False)
                return chosen
        length = self.max_response_length if oom or frozen else coming
        problem = self.problem(pool, length)
        result, lines = solve(problem, self.cost_model, self.plan, self.headroom(), True)
        if result is None:
            raise Infeasible(f"no plan holds responses of {length} tokens: " + "; ".join(lines))
        self._restart_target = (result.plan, oom, length > coming)
        return result

    def _restart_for_growth(self, pool: tuple[int, ...], coming: int) -> PlanResult | None:
        """The restart plan when the running plan was outgrown (:attr:`_outgrown`): of the
        planner's plans for the coming length and for lengths √2, 2, 2√2 … times it, up to
        :attr:`max_response_length`, the one with the least step time at the coming length plus
        the restart amortised over the steps the plan lasts::

            L̂_step(S_L) + L̂_restart / n_L,   n_L = ln(L / ℓ) / ln(1 + g)

        where ``ℓ`` is the last step's longest response, ``g`` the run's growth per step
        (:meth:`nereusd.control.lookahead.LengthLookahead.growth_per_step`) and ``n_L`` the
        steps until the lengths reach ``L`` (infinite for the plan for the longest response).
        Planning for the coming length alone, a growing run restarts again as soon as the
        lengths pass it: on the simulator's memory-tight A100 ramp, three restarts of 188 s
        each in the last 60 steps (``scripts/bench_sim.py``, 2026-12-05). The rule is the
        payback rule's amortisation (paper §4.3) applied to the restart that growth will force.

        Returns ``None`` (the caller plans for the coming length) before a restart was measured
        or while the lengths do not grow."""
        growth, restart_s = self.lengths.growth_per_step(), self.restart_s
        if growth <= 0.0 or restart_s <= 0.0:
            return None
        coming_problem = self.problem(pool, coming)
        best: tuple[float, PlanResult] | None = None
        length = coming
        while True:
            result, _ = solve(self.problem(pool, length), self.cost_model, self.plan, self.headroom(), True)
            if result is None:
                break   # nothing holds this length: nor any longer one
            if length >= self.max_response_length:
                life = math.inf
            else:
                life = math.log(length / max(1, self.length)) / math.log1p(growth)
            amortised = restart_s / life if life > 0 else math.inf
            cost = evaluate(coming_problem, result.plan, self.cost_model).step_latency_s + amortised
            if best is None or cost < best[0]:
                best = (cost, result)
            if length >= self.max_response_length:
                break
            length = min(self.max_response_length, math.ceil(length * RESTART_LENGTH_FACTOR))
        return best[1] if best is not None else None

    def failed(self, step: int, length: int | None = None) -> None:
        """Step ``step`` ran out of memory at responses of ``length`` tokens (default, when the
        caller does not know: :attr:`max_response_length`). Until the job is past it again —
        the steps since the checkpoint re-run the same batches — plans are chosen for at least
        that length, so that a replan during the re-run does not return to a layout that
        failed (without this a job can fail, restart and fail again at the same step forever;
        ``tests/unit/sim/test_sim.py`` replays such a run)."""
        length = self.max_response_length if length is None else int(length)
        self._replay_length = max(self._replay_length if step < self._replay_until else 0, length)
        self._replay_until = max(self._replay_until, step + 1)
        self._relaunch = True   # the next restart plans for the longest response (frozen: and keeps it)

    def switched(self, plan: Plan, pool: tuple[int, ...]) -> None:
        """The transition to ``plan`` ran (or the job restarted into it) on ``pool``."""
        self.plan, self.pool = plan, tuple(pool)
        self._outgrown = False
        target, self._restart_target = self._restart_target, None
        if target is not None and target[0] == plan:   # the restart :meth:`restart_plan` planned
            _, oom, past_coming = target
            self._relaunch = False
            self._restarted = past_coming   # planned past the coming steps: replan at the next boundary
            if oom and self.policy.kind is PolicyKind.FROZEN:   # a user relaunching after an OOM keeps it
                self.base_plan = plan

    def pool_changed(self, pool: tuple[int, ...]) -> None:
        """Devices joined without changing the plan (they stay spares until a replan uses them)."""
        self.pool = tuple(pool)


def job_fingerprint(job: ResolvedJob) -> str:
    """SHA-256 of the job's validated configuration: a controller state journalled under another
    job file is not resumed (its plan and calibration may not fit it)."""
    return hashlib.sha256(job.config.model_dump_json().encode()).hexdigest()


def controller_for_job(job: ResolvedJob, site: SiteConfig, plan: Plan, prompt_length: int,
                       pool: tuple[int, ...] | None = None, calibration: Calibration | None = None) -> Controller:
    """The controller of a live job: its plan problem, its ``adaptation`` policy, every
    transition assessed at full size (the DAG admission assesses is the one executed)."""
    pool = tuple(sorted(pool)) if pool is not None else plan.devices()
    problem = job_problem(job, site, pool, job.config.rollout.max_new_tokens, prompt_length)
    return Controller(problem, plan, ControlPolicy.from_config(job.config.adaptation),
                      max_response_length=job.config.rollout.max_new_tokens, pool=pool, calibration=calibration)


def forced_plan(job: ResolvedJob, current: Plan, overrides: Mapping[str, object]) -> Plan:
    """``current`` with the per-model-stage overrides of an ``adaptation.forced`` entry.

    Unspecified degrees keep the current values; ``dp`` defaults to ``devices / (tp·pp)``.

    Raises:
        PlanError: naming the model-stage when the override does not fit its devices.
    """
    out = dict(current.candidates)
    for name, cfg in overrides.items():
        ms = ModelStage.parse(name)
        cur = current[ms]
        devices = tuple(cfg.devices) if cfg.devices is not None else cur.devices
        tp, pp = cfg.tp or cur.tp, cfg.pp or cur.pp
        if len(devices) % (tp * pp):
            raise PlanError(f"adaptation.forced: {ms}: {len(devices)} devices are not a multiple of tp·pp={tp * pp}")
        dp = cfg.dp or len(devices) // (tp * pp)
        mb = cfg.micro_batch if cfg.micro_batch is not None else cur.micro_batch
        zero = cfg.zero_stage if cfg.zero_stage is not None else cur.zero_stage
        try:
            check_zero_stage(ms, job.backends.get(ms, Backend.NATIVE), zero, tp=tp, pp=pp,
                             key=f"adaptation.forced: {ms}")
        except ConfigError as err:
            raise PlanError(str(err)) from None
        out[ms] = dataclasses.replace(cur, tp=tp, pp=pp, dp=dp, devices=devices[:tp * pp * dp], micro_batch=mb,
                                      recompute=cfg.recompute if cfg.recompute is not None else cur.recompute,
                                      zero_stage=zero)
    return Plan(out)
