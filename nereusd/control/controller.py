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
   or the achieved efficiency (the median of the last :data:`EFFICIENCY_WINDOW` steps' predicted
   over measured ratios) drifted by more than ``δ`` (opportunistic); optionally every
   ``period`` steps; a layout the operator forces;
3. *replan* — :class:`nereusd.planner.search.Planner` (on the urgent path
   :func:`nereusd.control.admission.urgent_replan`: then with recomputation),
   plus the DP-only rescale of the current plan as a cheaper fallback target
   (:func:`nereusd.planner.rescale.dp_rescale`); the ``frozen`` policy only rescales DP;
4. *admission* — :func:`nereusd.control.admission.admit` with ``L̂_tran`` and the memory
   feasibility of the transition DAG (:class:`nereusd.transition.estimate.TransitionEstimator`).
   Each target carries the DAG it was assessed with; a live job executes that DAG.

Length. The engine pads a micro-batch to its longest sequence, so memory follows the *longest*
response of a step, not the mean; the length signal is the step's longest response. Training
and inference time follow the padding the engine leaves (each micro-batch's longest at
``pp = 1``: :meth:`nereusd.workflow.Workload.priced_pass`), and generation, which decodes by
continuous batching, follows the mean as well: the controller plans with the recent steps' mean
over longest response (:meth:`Controller.mean_fraction`). The coming step's length is unknown:
plans are checked and chosen for a forecast of it, capped at ``max_response_length``
(:mod:`nereusd.control.lookahead`: the recent steps' longest plus a margin from the run's own
jumps) — so a plan is left *before* growth makes it run out of memory, not after.

Pure: no torch, no sockets, no clock. The shell that executes decisions on workers is
:mod:`nereusd.daemon.live`; the simulator's is :mod:`nereusd.sim.replay`.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Callable, Mapping

from nereusd.backends import restarts_vllm_engines
from nereusd.control.admission import ADMIT, KEEP, RESTART, Decision, Target, admit, recheck_due
from nereusd.control.lookahead import LengthLookahead, planned_mean_fraction
from nereusd.control.policy import ControlPolicy, PolicyKind
from nereusd.control.monitor import (EFFICIENCY, FORCED, GPU_POOL, PERIOD, RECHECK, RESTARTED, SEQUENCE_LENGTH,
                                     Monitor, Trigger)
from nereusd.control.problem import site_for_pool, solve
from nereusd.control.restarts import RestartPlanning
from nereusd.control.state import ControllerState
from nereusd.control.transition_costs import TransitionCostLearning
from nereusd.cost.calibration import Calibration
from nereusd.cost.memory import HEADROOM, usable_bytes
from nereusd.cost.model import CostModel
from nereusd.plan import ModelStage, Plan
from nereusd.planner.rescale import dp_rescale
from nereusd.planner.space import PlanProblem, evaluate
from nereusd.transition.estimate import TransitionEstimator

MAX_HEADROOM = 0.6
"""The memory ratio never widens the planner's headroom past this fraction."""

MEAN_FRACTION_WINDOW = 8
"""Steps whose mean-over-longest response fraction :meth:`Controller.mean_fraction` takes the
median of (the memory ratio's window, :data:`MEMORY_WINDOW`)."""
EFFICIENCY_WINDOW = 5
"""Steps whose predicted-over-measured ratio the efficiency signal takes the median of. One
step's ratio is noise: stragglers, contention, a slow first step after a switch. On the
simulator's MI250X ramp (``nereus-launch simulate … --site site_configs/frontier-mi250x.yaml``,
seed 0, 2026-12-06) the one-step signal crossed its 20 % every few steps, alternating between
~0.85 and ~1.15: 39 of 73 replans were those crossings, which also reset the other signals'
references and a rejected target's recheck. With the median of 5: 1 of 36, and Nereus's mean step
78.88 → 78.60 s; the other four 64-GPU ramps unchanged (docs/RESULTS_LOG.md)."""


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












def _outside(plan: Plan, pool: tuple[int, ...]) -> str:
    """``"uses devices [...], which are not in the pool [...]"`` when ``plan`` has devices outside
    ``pool``, else ``""``: a plan runs only on the pool's devices."""
    outside = sorted(set(plan.devices()) - set(pool))
    return f"uses devices {outside}, which are not in the pool {list(pool)}" if outside else ""


class Controller(TransitionCostLearning, RestartPlanning, ControllerState):
    """Calibrate, trigger, replan and admit for one running job (module docstring).

    Args:
        problem: the job's plan problem — workflow, model specs, a step's workload (its response
            length is replaced by the planned one), the site with the job's device memory.
        plan: the running plan.
        policy: the adaptation policy (default: ``nereus`` with γ = 0.5).
        max_response_length: the longest response a step can generate (``max_new_tokens``):
            the cap of the lookahead and the length a restart plans for.
        response_cap: the longest response step ``k`` can generate, ``response_cap(k)`` tokens
            (a length curriculum, ``rollout.max_new_tokens_schedule``); default:
            ``max_response_length`` at every step. The lookahead caps the coming step's forecast
            at it (:meth:`lookahead`).
        pool: devices of the world (default: the plan's); a boundary on another pool replans.
        calibration: initial calibration (priors when omitted).
        transition_scale_limit: assess transitions between plans of more devices than this on
            DP-scaled plans (the simulator's approximation, :mod:`nereusd.transition.estimate`);
            ``None`` (live jobs): every DAG at full size, so that it can be executed.
    """

    def __init__(self, problem: PlanProblem, plan: Plan, policy: ControlPolicy | None = None, *,
                 max_response_length: int, response_cap: Callable[[int], int] | None = None,
                 pool: tuple[int, ...] | None = None,
                 calibration: Calibration | None = None, transition_scale_limit: int | None = None) -> None:
        self.base_problem, self.plan = problem, plan
        self.policy = policy or ControlPolicy()
        self.max_response_length = int(max_response_length)
        self.response_cap = response_cap
        self._coming_step: int | None = None
        """The step :meth:`lookahead` forecasts (the one after the last observed or boundary's
        step); ``None`` before either: the forecast is capped at :attr:`max_response_length`."""
        self._clipped = False
        """The last observed step's longest response reached that step's cap (:meth:`lookahead`)."""
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
        self._efficiencies: deque[float] = deque(maxlen=EFFICIENCY_WINDOW)
        self.length = 1
        self.lengths = LengthLookahead(self.policy.delta_length)
        """The steps' longest responses: what :meth:`lookahead` forecasts from."""
        self._mean_fractions: deque[float] = deque(maxlen=MEAN_FRACTION_WINDOW)
        """Recent steps' mean over longest response (:meth:`mean_fraction`)."""
        self.predicted_step_s: float | None = None
        self.base_plan = plan
        """The ``frozen`` policy's launch plan: what it DP-rescales on every pool change and
        restarts into after losing devices (replaced by the relaunch plan after an OOM, and by a
        forced layout once the job runs it: a static framework relaunched on a new layout)."""
        self._forced_pending: Plan | None = None
        """The forced layout the last boundary's verdict goes to (a transition or a restart)."""
        self._init_restarts()
        self._rejected: tuple[int, float] | None = None
        """Faster targets the last boundary did not take (a ``reject`` for their payback, or an
        urgent decision for their cost over ``H_x``): (step, the smallest payback in steps,
        :attr:`Decision.rejected_payback_steps`); asked again once due (:data:`RECHECK`)."""

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

    def cap_of(self, step: int | None) -> int:
        """The longest response step ``step`` can generate (``None``: any step's,
        :attr:`max_response_length`)."""
        if step is None or self.response_cap is None:
            return self.max_response_length
        return min(self.max_response_length, max(1, int(self.response_cap(step))))

    def lookahead(self, length: int) -> int:
        """The coming step's longest response, forecast from ``length`` and the run's recent
        steps (:class:`nereusd.control.lookahead.LengthLookahead`), capped at the longest the
        coming step can generate (:meth:`cap_of`).

        When the last step's longest response reached its own cap, it was cut there and says
        only that the responses want at least that much: the forecast is then the coming step's
        cap. Without a curriculum that is what the capped forecast gives anyway; with one, the
        first step of a stage with a higher cap can fill it at once (the responses the old cap
        cut continue), so the plan must hold it before that step, not after."""
        cap = self.cap_of(self._coming_step)
        if self._clipped:
            return cap
        return self.lengths.coming(length, cap)

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
        """Calibrate from one step run under :attr:`plan`; returns predicted vs measured, and the
        length the coming step is planned for (``planned_length``, :meth:`lookahead`).

        The prediction is the one made at the previous boundary for this step (``None`` at the
        first step); ``measured_stage_path_s`` is the critical path of the measured model-stage
        times, the quantity the cost model predicts (the step's wall time adds the driver's
        own work and weight synchronisation).
        """
        self.length = max(1, obs.response_length_max)
        self.lengths.observe(self.length)
        self._clipped = self.length >= self.cap_of(obs.step)
        self._coming_step = obs.step + 1
        if obs.response_length_mean is not None:
            self._mean_fractions.append(obs.mean_fraction)
        problem = self.problem(self.pool, self.length, obs.mean_fraction)
        ev = evaluate(problem, self.plan, self.cost_model)
        stage_s = {m: s for m, s in obs.model_stage_s.items() if m in ev.options}
        measured_path = problem.workflow.critical_path_s(stage_s) if len(stage_s) == len(ev.options) else None
        if measured_path:
            self._efficiencies.append(ev.step_latency_s / measured_path)
            self.efficiency = statistics.median(self._efficiencies)
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
                "response_length_mean": obs.response_length_mean, "planned_length": self.lookahead(self.length)}

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
        if result is None or result.plan == plan or restarts_vllm_engines(source, result.plan, problem.engines, micro,
                                                                          self.warm_engines):
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

    def _unblocked(self, source: Plan, plan: Plan, problem: PlanProblem, headroom: float,
                   urgent: bool) -> Plan | None:
        """The planner's best plan that the job can reach from ``source``, when the move to
        ``plan`` does not fit memory; else ``None``.

        The model-stage whose op does not fit (:attr:`TransitionEstimate.blocked`) keeps its
        running TP and PP (:attr:`PlannerOptions.shapes`: its DP, micro-batch and devices stay
        free) and the planner solves again, pinning one more model-stage each time the next plan
        is blocked by another, until a plan's transition fits. ``None`` when a pinned
        model-stage blocks again (its DP change alone does not fit) or nothing fits. Without
        it, a pool growth on the noisy A100 ramp (``scripts/bench_sim.py``) went to a DP rescale
        that left actor and critic training on 16 of 64 devices each, predicted at 38.5 s a step,
        for 74 steps: the planner's plan (training ``pp8·dp4``) did not fit the move from
        ``pp4·dp4``, and ``pp4·dp8``, predicted at 28.9 s (the truth 26.2 s against 36.1 s),
        was never asked for."""
        shapes: list[tuple[ModelStage, int, int]] = []
        for _ in range(len(source.candidates)):
            est = self.transitions.estimate(source, plan)
            if est.feasible:
                return plan if shapes else None
            m = next((m for m in source.candidates if str(m) == est.blocked), None)
            if m is None or any(pinned == m for pinned, _, _ in shapes):
                return None
            shapes.append((m, source[m].tp, source[m].pp))
            result, _ = solve(problem, self.cost_model, self.plan, headroom, urgent, shapes=tuple(shapes))
            if result is None:
                return None
            plan = result.plan
        return None

    def boundary(self, step: int, pool: tuple[int, ...], *, source: Plan | None = None,
                 forced: Plan | None = None) -> Outcome | None:
        """Triggers, replan and admission at the safe boundary after ``step``.

        Args:
            pool: devices available now (sorted).
            source: the units the transition would start from when devices of :attr:`plan` are
                gone (the intact units); ``None``: :attr:`plan` is whole.
            forced: a plan the operator forces (admission checks feasibility only: taken by its
                transition, or by a checkpoint/restart into it where only the transition does
                not fit memory, :func:`~nereusd.control.admission.admit`).

        Returns:
            None when nothing triggered; else the outcome. An admitted decision is *not* applied
            here: the caller runs its ``target.dag`` and then calls :meth:`switched`.
        """
        current_valid = source is None
        source = source if source is not None else self.plan
        self._coming_step = step + 1
        self._forced_restart = self._forced_pending = None   # only this boundary's verdict may
        # send a restart to a forced layout, or make it the frozen policy's launch plan
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
                triggers.append(Trigger(RECHECK, False, step, at, f"a faster target not taken at step {at}, payback "
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
            outside = _outside(forced, pool)
            if outside:   # e.g. a device lost before the forced step (or the step re-run after a restart)
                target = dataclasses.replace(target, feasible=False, restartable=False,
                                             reason=f"the forced layout {outside}")
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
                reachable = self._unblocked(source, result.plan, problem, headroom, urgent)
                if reachable is not None and all(reachable != t.plan for t in targets):
                    targets.append(self._target(source, reachable, problem, usable))
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

        def move(a: Target, b: Target) -> Target:   # b's plan as a target from a's plan
            return self._target(a.plan, b.plan, problem, usable)

        decision = admit(step=step, triggers=triggers, current_step_latency_s=current_s, targets=targets,
                         horizon_steps=min(horizons), payback_margin=self.policy.payback_margin,
                         current_valid=runs, restart_s=self.restart_s,
                         weigh_keeping=not frozen and math.isfinite(self.policy.payback_margin), move=move)
        self._outgrown = decision.verdict == RESTART and current_valid and over
        if forced is not None and decision.target is not None and decision.target.plan == forced:
            self._forced_pending = forced if decision.admitted or decision.verdict == RESTART else None
            self._forced_restart = forced if decision.verdict == RESTART else None
        if decision.verdict == ADMIT and decision.target.plan == source:
            decision = dataclasses.replace(decision, verdict=KEEP, reason="the planner keeps the running plan")
        if runs and not decision.admitted and decision.verdict != RESTART:
            self.pool_changed(pool)   # kept on purpose: joined devices stay spares, no trigger at every boundary
        if decision.rejected_payback_steps is not None:   # a faster target passed over: ask it again
            self._rejected = (step, decision.rejected_payback_steps)
        self.monitor.replanned(signals)
        self.predicted_step_s = decision.target.step_latency_s if decision.admitted else (
            current_s if current_valid else None)
        return Outcome(decision, length, tuple(lines))

    def switched(self, plan: Plan, pool: tuple[int, ...]) -> None:
        """The transition to ``plan`` ran (or the job restarted into it) on ``pool``; warm engines
        it did not adopt are gone (:attr:`warm_engines`)."""
        self.plan, self.pool = plan, tuple(pool)
        self.warm_engines = {}
        if self.policy.kind is PolicyKind.FROZEN and plan == self._forced_pending:
            self.base_plan = plan
        self._forced_pending = None
        self._restart_done(plan)

    def resumed_on_forced(self, plan: Plan, pool: tuple[int, ...]) -> None:
        """A resumed job starts on the layout an ``adaptation.forced`` entry sets for its first
        step (the boundary that applies it ran before the checkpoint): as a switch to a forced
        layout, which the ``frozen`` policy then keeps as its launch plan."""
        self._forced_pending = plan
        self.switched(plan, pool)

    def resuming_at(self, step: int) -> None:
        """The restored controller of a job resumed at ``step``: :meth:`lookahead` forecasts that
        step from the longest response seen (step ``step − 1``'s, cut at that step's cap or not),
        as the boundary before it did."""
        self._coming_step = step
        self._clipped = self.length >= self.cap_of(step - 1)

    def unfit(self, plan: Plan, pool: tuple[int, ...], length: int | None = None) -> str:
        """Why ``plan`` cannot run on ``pool`` now, or ``""`` when it can: devices outside the
        pool, or a device peak predicted over the usable memory (:meth:`headroom`) for
        ``length``-token responses (default: what the coming step may generate, :meth:`lookahead`
        of the longest seen)."""
        outside = _outside(plan, pool)
        if outside:
            return f"it {outside}"
        length = self.lookahead(self.length) if length is None else length
        problem = self.problem(pool, length)
        ev = evaluate(problem, plan, self.cost_model)
        if ev.over_capacity(usable_bytes(problem.site.device_memory_bytes, self.headroom())):
            return f"it is predicted over the usable device memory at {length}-token responses"
        return ""

    def pool_changed(self, pool: tuple[int, ...]) -> None:
        """Devices joined without changing the plan (they stay spares until a replan uses them)."""
        self.pool = tuple(pool)
