"""Where a checkpoint/restart goes (DESIGN.md "One RL step", urgent path): after an
out-of-memory step the plan for the longest response; after a device loss the plan for the
coming steps; when growth outgrew the running plan and no transition fits, the plan whose
restart repays itself over the steps it will last (:meth:`RestartPlanning._restart_for_growth`);
the ``frozen`` policy's DP rescale of its launch plan. And the marks a restart leaves: the steps a
re-run after an OOM plans for, and whether the next boundary replans.

:class:`RestartPlanning` is a part of :class:`nereusd.control.controller.Controller` (its
attributes are the controller's, kept in its ``state()``), in a module of its own so that the
controller's decision logic stays readable, as :mod:`nereusd.control.transition_costs` is.
"""

from __future__ import annotations

import math

from nereusd.backends import restarts_vllm_engines, vllm_replicas_on
from nereusd.control.policy import PolicyKind
from nereusd.control.problem import solve
from nereusd.cost.memory import usable_bytes
from nereusd.plan import ModelStage, Plan
from nereusd.planner.rescale import dp_rescale
from nereusd.planner.search import Infeasible, PlanResult
from nereusd.planner.space import PlanProblem, evaluate

OOM_EXCESS = 1.02
"""An out-of-memory step's true peak exceeded the device's capacity by an amount nobody measured:
:meth:`RestartPlanning.failed` counts it as this much over (a second failure, on a plan predicted
lower, raises the ratio again)."""

RESTART_LENGTH_FACTOR = math.sqrt(2.0)
"""Ratio between the response lengths :meth:`RestartPlanning._restart_for_growth` plans for."""


class RestartPlanning:
    """The restart plan and its marks (module docstring); call :meth:`_init_restarts` from
    ``__init__``."""

    def _init_restarts(self) -> None:
        self._replay_until, self._replay_length = 0, 0
        self._restarted = False
        """A restart put the job on the plan for the longest response: replan at the next boundary."""
        self._restart_target: tuple[Plan, bool, bool] | None = None
        """The last :meth:`restart_plan` answer: (plan, after an OOM, planned past the coming steps)."""
        self._relaunch = False
        self._forced_restart: Plan | None = None
        """A forced layout that only a checkpoint/restart reaches (the last boundary's verdict):
        :meth:`restart_plan` goes to it while its devices are in the pool."""
        self._outgrown = False
        """The last boundary's verdict was checkpoint/restart because the running plan no longer
        fits the coming steps (it still had its devices): :meth:`restart_plan` weighs plans for
        longer responses against the restarts they save (:meth:`_restart_for_growth`)."""

    def restart_plan(self, pool: tuple[int, ...]) -> PlanResult:
        """The plan a checkpoint/restart goes to (urgent path: with recomputation if nothing else fits).

        After an out-of-memory failure (:meth:`failed`) the planner's plan for the longest
        response, :attr:`max_response_length`; after a device loss or a pool that no plan's units
        survive, the plan for the coming steps (the lookahead length), as at any boundary. After a
        boundary whose verdict restarts into a forced layout (no transition to it fits memory),
        that layout, while its devices are in ``pool``.

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
        forced = self._forced_restart
        if forced is not None and not oom and set(forced.devices()) <= set(pool):
            self._restart_target = (forced, False, False)
            return self._priced(forced, self.problem(pool, coming))
        if frozen and not oom:
            problem = self.problem(pool, coming)
            rescaled = dp_rescale(self.base_plan, problem)
            if rescaled is not None:
                return self._priced(rescaled, problem)
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

    def _priced(self, plan: Plan, problem: PlanProblem) -> PlanResult:
        """``plan`` as a restart plan on ``problem``: its predicted step, options and peaks under
        the controller's cost model (no search ran)."""
        ev = evaluate(problem, plan, self.cost_model)
        usable = usable_bytes(problem.site.device_memory_bytes, self.headroom())
        return PlanResult(plan, ev.options, ev.step_latency_s, ev.peak_bytes, usable, 0.0)

    def anticipated_plan(self, pool: tuple[int, ...]) -> Plan | None:
        """The plan the controller expects to run once ``pool`` is the pool (a background join's
        devices joined, :mod:`nereusd.daemon.joins`), ``None`` when nothing fits; no side effect
        (the boundary decides). The ``frozen`` policy's launch plan DP-rescaled to it; else the
        planner's plan for the coming steps with the running vLLM engines' wave size
        (``max_num_seqs``) kept where they share one — the plan :meth:`_keeping_engines` offers
        the boundary, which starts no engine on the devices that stay when the joining ones have
        theirs (on the simulator's noisy H200 ramp the unpinned plan went from waves of 171 to
        128 at every growth and restarted every engine anyway, 2026-12-06) — or, when nothing
        fits that wave, the planner's plan."""
        problem = self.problem(pool, self.lookahead(self.length))
        if self.policy.kind is PolicyKind.FROZEN:
            return dp_rescale(self.base_plan, problem)
        micro = problem.workload.micro_batch
        running = {self.plan[ms].micro_batch or micro for ms in problem.engines if ms in self.plan}
        result = None
        if len(running) == 1:
            result, _ = solve(problem, self.cost_model, self.plan, self.headroom(), True,
                              generation_micro_batch=running.pop())
        if result is None:
            result, _ = solve(problem, self.cost_model, self.plan, self.headroom(), True)
        return result.plan if result is not None else None

    def early_engines(self, pool: tuple[int, ...], joining) -> dict[ModelStage, dict[int, tuple]]:
        """The vLLM engines a background join starts on ``joining`` before those devices join
        (:mod:`nereusd.daemon.joins`; the simulator's ``Simulation._join_step``):
        ``{model_stage: {device: replica key}}`` for the replicas of :meth:`anticipated_plan` on
        ``pool`` that lie wholly on ``joining`` (:func:`~nereusd.backends.vllm_replicas_on`).
        Empty where there are none, or where the move to that plan starts engines anyway (a
        replica that stays changes its key: then an early start saves nothing)."""
        problem = self.problem(pool, 1)
        if not problem.engines:
            return {}
        plan = self.anticipated_plan(pool)
        if plan is None:
            return {}
        micro = problem.workload.micro_batch
        warm: dict[ModelStage, dict[int, tuple]] = {}
        for ms, key in vllm_replicas_on(plan, joining, problem.engines, micro):
            warm.setdefault(ms, {}).update({d: key for d in key[1]})
        if not warm or restarts_vllm_engines(self.plan, plan, problem.engines, micro, warm):
            return {}
        return warm

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
        ``tests/unit/sim/test_sim.py`` replays such a run).

        The failure is also a memory measurement: the running plan's true peak at ``length``
        exceeded the capacity, where the model predicted ``p``. It enters the memory ratios
        (:meth:`Controller.memory_ratio`) as ``OOM_EXCESS · capacity / p``, so the headroom
        widens until no plan predicted as high as the failed one fits (:meth:`Controller.headroom`).
        Planning for at least the failed length alone does not exclude a plan that was chosen
        *for* that length: a job whose responses are cut at their cap plans for exactly the cap,
        and on the simulator's A100 ramp under a length curriculum such a plan failed at step 568,
        was restarted from, replanned for the same length and chosen again, 66 times
        (2026-12-05)."""
        length = self.max_response_length if length is None else int(length)
        problem = self.problem(self.pool, length)
        predicted = max(evaluate(problem, self.plan, self.cost_model).peak_bytes.values(), default=0)
        if predicted > 0:
            self._memory.append(OOM_EXCESS * problem.site.device_memory_bytes / predicted)
        self._replay_length = max(self._replay_length if step < self._replay_until else 0, length)
        self._replay_until = max(self._replay_until, step + 1)
        self._relaunch = True   # the next restart plans for the longest response (frozen: and keeps it)

    def _restart_done(self, plan: Plan) -> None:
        """The job now runs ``plan`` (a transition or a restart, :meth:`Controller.switched`):
        clear the outgrown mark, and when it is the restart :meth:`restart_plan` planned, its
        relaunch mark, and set whether the next boundary replans."""
        self._outgrown = False
        self._forced_restart = None
        target, self._restart_target = self._restart_target, None
        if target is not None and target[0] == plan:   # the restart :meth:`restart_plan` planned
            _, oom, past_coming = target
            self._relaunch = False
            self._restarted = past_coming   # planned past the coming steps: replan at the next boundary
            if oom and self.policy.kind is PolicyKind.FROZEN:   # a user relaunching after an OOM keeps it
                self.base_plan = plan
