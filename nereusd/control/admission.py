"""Admission: feasibility, payback and the urgent path (paper §4.3; DESIGN.md step 4).

- *Feasibility*: a target whose transition DAG does not fit memory (reported by the transition
  engine) is skipped; the next, slightly slower target with a cheaper transition is tried
  before keeping the current plan.
- *Profitability* (opportunistic transitions): admit when ``L_tran / ΔL ≤ γ · H_x`` with
  ``ΔL = L̂_step(S) − L̂_step(S*)``, the payback margin ``γ = 0.5`` by default, ``H_x`` the
  smallest horizon of the triggering signals. ``γ = 0`` admits only urgent transitions.
- *Urgent path* (pool change, predicted OOM): profitability is waived; the target cheapest
  over the horizon is taken (by a transition, or by a checkpoint/restart where its transition
  does not fit), or the current plan kept where it still runs and is cheaper; faster targets
  not taken are asked again later (the recheck); if the planner finds none (each layout at the largest micro-batch up to the job's
  that fits), recomputation is tried (:func:`urgent_replan`); if still nothing fits, the
  verdict is checkpoint/restart.
- *Restart to switch*: a target whose plan fits but whose transition does not is reached by a
  checkpoint/restart when its learned cost repays itself by the same payback rule.

Every decision is a :class:`Decision` whose :meth:`Decision.to_json_line` is one JSONL record
explaining it (trigger, ΔL, L_tran, H_x, payback margin γ, verdict, alternatives).
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from nereusd.config.job import DEFAULT_PAYBACK_MARGIN
from nereusd.cost.model import CostModel
from nereusd.control.monitor import FORCED, Trigger
from nereusd.plan import Plan
from nereusd.planner.search import Infeasible, Planner, PlanResult
from nereusd.planner.space import PlannerOptions, PlanProblem
from nereusd.transition.ops import TransitionDag


class Verdict(str, enum.Enum):
    """What admission decides (a ``str``: journal records and comparisons read the value)."""

    ADMIT = "admit"
    """Execute the transition to the target."""
    REJECT = "reject"
    """Opportunistic: nothing feasible pays for itself; keep the current plan."""
    KEEP = "keep"
    """Urgent, but no target is reached, or the current plan still runs and is the cheapest over ``H_x``."""
    RESTART = "checkpoint_restart"
    """Checkpoint/restart: urgent, nothing fits and the current plan cannot run; or the target a
    transition cannot reach (it does not fit memory) repays a restart (opportunistic), or is the
    cheapest over ``H_x`` (urgent)."""

    def __str__(self) -> str:
        return self.value


ADMIT, REJECT, KEEP, RESTART = Verdict.ADMIT, Verdict.REJECT, Verdict.KEEP, Verdict.RESTART
UNPROFITABLE = "unprofitable"
"""An alternative's verdict: faster, feasible, but its payback exceeds ``γ·H_x``."""


@dataclass(frozen=True)
class Target:
    """A candidate target plan ``S*`` with its predictions.

    Attributes:
        plan: the target plan.
        step_latency_s: ``L̂_step(S*)``.
        transition_s: ``L̂_tran`` of the transition DAG from the current plan.
        feasible: whether the DAG fits memory at every operation.
        reason: why not, when infeasible.
        dag: see below.
    """

    plan: Plan
    step_latency_s: float
    transition_s: float
    feasible: bool = True
    reason: str = ""
    restartable: bool = False
    """The plan fits memory but its transition DAG does not: only a checkpoint/restart reaches it."""
    dag: TransitionDag | None = field(default=None, compare=False, repr=False)
    """The transition DAG that was assessed (its memory feasibility, its ``L̂_tran``): the one
    an admitted transition executes. ``None`` only where the assessment was scaled (the
    simulator) or nothing moves."""


@dataclass(frozen=True)
class Decision:
    """One admission decision and everything that explains it."""

    step: int
    verdict: Verdict
    urgent: bool
    triggers: tuple[Trigger, ...]
    current_step_latency_s: float
    payback_margin: float
    horizon_steps: float
    target: Target | None = None
    delta_l_s: float | None = None
    l_tran_s: float | None = None
    payback_steps: float | None = None
    alternatives: tuple[dict, ...] = field(default_factory=tuple)
    reason: str = ""
    rejected_payback_steps: float | None = None
    """A ``reject`` whose targets were faster but did not repay within ``γ·H_x``: the smallest of
    their payback periods (``L̂_tran/ΔL``, or ``L̂_restart/ΔL`` for a target only a restart
    reaches). An urgent ``admit`` or ``keep`` that passed over faster targets for their cost over
    ``H_x``: the least of their paybacks from the plan that runs next (the seconds to reach each
    from there, ``L̂_tran`` or ``L̂_restart``, over its gain on that plan). The plan is asked
    again once it has stayed valid long enough for that payback (:func:`recheck_due`); ``None``
    otherwise, and for ``γ = 0`` or greedy."""

    @property
    def admitted(self) -> bool:
        return self.verdict == ADMIT

    def to_dict(self) -> dict[str, Any]:
        return {
            "event": "admission", "step": self.step, "verdict": self.verdict, "urgent": self.urgent,
            "triggers": [t.to_dict() for t in self.triggers],
            "current_step_latency_s": self.current_step_latency_s,
            "target_step_latency_s": self.target.step_latency_s if self.target else None,
            "delta_l_s": self.delta_l_s, "l_tran_s": self.l_tran_s, "h_x": self.horizon_steps,
            "payback_margin": self.payback_margin if math.isfinite(self.payback_margin) else "inf",
            "payback_steps": self.payback_steps,
            "target_plan": self.target.plan.to_dict() if self.target and self.admitted else None,
            "alternatives": list(self.alternatives), "reason": self.reason,
            "rejected_payback_steps": self.rejected_payback_steps,
        }

    def to_json_line(self) -> str:
        """One line of JSON (no newline inside), for the job's event log."""
        return json.dumps(self.to_dict(), sort_keys=True, default=str)


def admit(
    *,
    step: int,
    triggers: Sequence[Trigger],
    current_step_latency_s: float,
    targets: Sequence[Target],
    horizon_steps: float,
    payback_margin: float = DEFAULT_PAYBACK_MARGIN,
    current_valid: bool = True,
    restart_s: float = 0.0,
    weigh_keeping: bool = True,
    move: Callable[[Target, Target], Target] | None = None,
) -> Decision:
    """Decide whether to execute a transition.

    Args:
        triggers: what started the replan (any urgent one waives profitability).
        current_step_latency_s: ``L̂_step(S)`` under the coming step's conditions.
        targets: ``S*`` first, then slower fallbacks with cheaper transitions.
        horizon_steps: ``H_x`` (the smallest of the triggering signals').
        payback_margin: ``γ``; ``inf`` admits any positive gain, 0 urgent switches only.
        current_valid: False when the current plan cannot run any more (lost devices, OOM).
        restart_s: ``L̂_restart``, what a checkpoint/restart costs (learned from measured ones; 0:
            unknown). A target that only a restart reaches (:attr:`Target.restartable`) is
            weighed at that cost on the urgent path (below); on the opportunistic path, when no
            target is admitted, it is restarted into when that repays itself by the payback
            rule, ``L̂_restart / ΔL ≤ γ · H_x`` (the verdict ``checkpoint_restart`` with that
            target). Neither for ``γ = 0`` nor for a forced layout (below). The restart goes to the
            controller's restart plan (:meth:`nereusd.control.restarts.RestartPlanning.restart_plan`:
            the planner's plan for the coming steps, which the target is, or the plan weighed
            against growth when the running one was outgrown).
        weigh_keeping: whether keeping a current plan that still runs competes on the urgent path
            (below): payback admission's; not the frozen baselines', which always DP-rescale on a
            pool change, nor greedy's (``γ = ∞``), which takes any gain whatever it costs.
        move: ``move(a, b)``, the target ``b`` as seen from target ``a``'s plan (its
            ``L̂_tran``, feasibility and restartability from there): what a faster target an
            urgent admit passes over costs once the admitted one runs
            (:attr:`Decision.rejected_payback_steps`). Without it, its cost from the current plan.

    An urgent trigger waives profitability but not cost: of the feasible targets it admits the
    one with the least ``L̂_step·H_x + L̂_tran`` (S* on a tie) — a fallback whose transition
    starts no engine can beat a slightly faster S* whose transition starts several. Where the
    current plan still runs (devices joined, or only spares left; not a forced layout), keeping
    it (``L̂_step(S)·H_x``, no transition) is one more choice, taken on a tie: joining devices
    that starts vLLM engines for 30 s is not worth a few steps of a pool that leaves again. A
    target whose transition does not fit memory competes too, at ``L̂_step·H_x + L̂_restart``
    (when ``L̂_restart`` is known, ``γ > 0``, and no layout is forced): on the MI250X ramp a pool
    change took a plan 23 % slower than one a 200 s restart reached, with ``H_x`` ≈ 100 steps.
    The faster targets not taken are asked again by the recheck
    (:attr:`Decision.rejected_payback_steps`).

    A forced layout (the ``forced`` trigger; ``targets`` is that one layout) is taken whatever
    it costs: by its transition where that fits memory, else, where the layout itself fits
    (:attr:`Target.restartable`), by a checkpoint/restart into it (``checkpoint_restart`` with it
    as the target: :meth:`nereusd.control.restarts.RestartPlanning.restart_plan` then returns it,
    not the planner's plan).

    Returns:
        ``admit`` with the chosen target; else ``reject`` (opportunistic), ``keep`` (urgent but
        the current plan still runs) or ``checkpoint_restart`` (urgent: nothing fits, or the
        cheapest target over ``H_x`` is one only a restart reaches, given as the target).
    """
    urgent = any(t.urgent for t in triggers)
    common = dict(step=step, urgent=urgent, triggers=tuple(triggers),
                  current_step_latency_s=current_step_latency_s, payback_margin=payback_margin,
                  horizon_steps=horizon_steps)
    tried: list[dict] = []
    restarts = restart_s > 0 and payback_margin > 0
    forced = any(t.signal == FORCED for t in triggers)

    def reach_s(t: Target) -> float:
        """Seconds to reach ``t``: its transition, a checkpoint/restart where only that reaches
        it (``inf``: neither)."""
        return t.transition_s if t.feasible else restart_s if restarts and t.restartable else math.inf

    if forced and targets and not targets[0].feasible and targets[0].restartable:
        # the operator's layout fits memory but no transition reaches it within memory: a
        # checkpoint/restart goes to it (Controller.restart_plan), whatever it costs
        forced_target = targets[0]
        delta = current_step_latency_s - forced_target.step_latency_s
        cost = f"{restart_s:.0f} s" if restart_s > 0 else "its cost not yet measured"
        return Decision(verdict=RESTART, target=forced_target, delta_l_s=delta, l_tran_s=restart_s,
                        payback_steps=_payback_steps(restart_s, delta),
                        alternatives=(_unreached(forced_target, current_step_latency_s),),
                        reason=f"layout forced; its transition does not fit memory, so a checkpoint/restart "
                               f"({cost}) goes to it", **common)
    if urgent:   # the target cheapest over the horizon, S* on a tie

        def over_horizon(step_latency_s: float, transition_s: float) -> tuple[float, float]:
            if math.isfinite(horizon_steps):
                return step_latency_s * horizon_steps + transition_s, 0.0
            return step_latency_s, transition_s

        # a restart goes to the planner's plan (Controller.restart_plan), never to a forced layout
        reachable = [t for t in targets if t.feasible or (not forced and math.isfinite(reach_s(t)))]
        best = min(reachable, key=lambda t: over_horizon(t.step_latency_s, reach_s(t)), default=None)
        unreached = tuple(_unreached(t, current_step_latency_s) for t in targets if all(t is not r for r in reachable))
        keeps = weigh_keeping and current_valid and math.isfinite(current_step_latency_s) and not forced

        def costlier(others: Sequence[Target], against: str = "") -> tuple[dict, ...]:
            return tuple({"step_latency_s": t.step_latency_s, "l_tran_s": reach_s(t), "verdict": "costlier",
                          "reason": f"L_step·H_x + L_tran over H_x = {horizon_steps:.2f} steps{against}"
                                    + ("" if t.feasible else " (by checkpoint/restart)")} for t in others)

        def asked_again(running: Target | None, running_s: float) -> float | None:
            """The least payback of a target faster than the plan that runs next (``running``;
            ``None``: the current plan), from there: the recheck asks for it once that plan has
            lasted long enough (:attr:`Decision.rejected_payback_steps`)."""
            if not rechecks(payback_margin) or not math.isfinite(running_s):
                return None
            paybacks = []
            for t in reachable:
                if t is running or not running_s > t.step_latency_s:
                    continue
                seconds = reach_s(t if running is None or move is None else move(running, t))
                if math.isfinite(seconds):
                    paybacks.append(_payback_steps(seconds, running_s - t.step_latency_s))
            return min(paybacks, default=None)

        if best is not None and keeps and (over_horizon(best.step_latency_s, reach_s(best))
                                           >= over_horizon(current_step_latency_s, 0.0)):
            return Decision(verdict=KEEP, alternatives=costlier(reachable, ", against keeping the current plan")
                            + unreached,
                            reason=f"urgent, but the current plan still runs and is the cheapest over H_x = "
                                   f"{horizon_steps:.2f} steps (L_step·H_x + L_tran)",
                            rejected_payback_steps=asked_again(None, current_step_latency_s), **common)
        if best is not None:
            delta = current_step_latency_s - best.step_latency_s
            others = costlier([t for t in reachable if t is not best]) + unreached
            if not best.feasible:
                return Decision(verdict=RESTART, target=best, delta_l_s=delta, l_tran_s=restart_s,
                                payback_steps=_payback_steps(restart_s, delta), alternatives=others,
                                reason=f"urgent: the target cheapest over H_x = {horizon_steps:.2f} steps "
                                       f"(L_step·H_x + L_tran) is one whose transition does not fit memory; a "
                                       f"checkpoint/restart ({restart_s:.0f} s) reaches the planner's plan",
                                **common)
            return Decision(verdict=ADMIT, target=best, delta_l_s=delta, l_tran_s=best.transition_s,
                            payback_steps=_payback_steps(best.transition_s, delta),
                            alternatives=others,
                            reason="urgent: profitability waived; of the feasible targets the cheapest over "
                                   "H_x (L_step·H_x + L_tran)",
                            rejected_payback_steps=asked_again(best, best.step_latency_s), **common)
    for target in targets:
        record = _record(target, current_step_latency_s)
        delta, payback = record["delta_l_s"], record["payback_steps"]
        if not target.feasible:
            tried.append(_unreached(target, current_step_latency_s))
            continue
        if delta <= 0:
            tried.append(record | {"verdict": "no_gain", "reason": "not faster than the current plan"})
            continue
        bound = payback_margin * horizon_steps if payback_margin > 0 else 0.0
        if payback_margin > 0 and payback <= bound:
            return Decision(verdict=ADMIT, target=target, delta_l_s=delta, l_tran_s=target.transition_s,
                            payback_steps=payback, alternatives=tuple(tried),
                            reason=f"payback {payback:.2f} steps <= γ·H_x = {bound:.2f}",
                            **common)
        tried.append(record | {"verdict": UNPROFITABLE,
                               "reason": f"payback {payback:.2f} steps > γ·H_x = {bound:.2f}"})
    paybacks = [r["payback_steps"] for r in tried if r.get("verdict") == UNPROFITABLE]
    if restarts and not forced:   # a restart goes to the planner's plan, not a forced layout
        bound = payback_margin * horizon_steps
        for target in targets:
            delta = current_step_latency_s - target.step_latency_s
            if not (target.restartable and delta > 0):
                continue
            if restart_s / delta <= bound:
                return Decision(verdict=RESTART, target=target, delta_l_s=delta, l_tran_s=restart_s,
                                payback_steps=restart_s / delta, alternatives=tuple(tried),
                                reason=f"the transition does not fit memory; a checkpoint/restart into the planner's "
                                       f"plan repays its {restart_s:.0f} s in {restart_s / delta:.2f} steps "
                                       f"<= γ·H_x = {bound:.2f}", **common)
            paybacks.append(restart_s / delta)
    if urgent:
        if current_valid:
            return Decision(verdict=KEEP, alternatives=tuple(tried),
                            reason="urgent trigger, no feasible target; the current plan still runs", **common)
        return Decision(verdict=RESTART, alternatives=tuple(tried),
                        reason="urgent trigger, no feasible target and the current plan cannot run", **common)
    return Decision(verdict=REJECT, alternatives=tuple(tried),
                    reason="no feasible, profitable target; keeping the current plan",
                    rejected_payback_steps=min(paybacks, default=None) if rechecks(payback_margin) else None,
                    **common)


def _payback_steps(seconds: float, gain_s: float) -> float:
    """Steps a switch costing ``seconds`` takes to repay at ``gain_s`` a step (``inf`` without a gain)."""
    return seconds / gain_s if gain_s > 0 else float("inf")


def _record(target: Target, current_step_latency_s: float) -> dict:
    """The journal's figures of ``target`` against the current plan: its ``L̂_step``, ``L̂_tran``,
    ``ΔL`` and payback."""
    delta = current_step_latency_s - target.step_latency_s
    return {"step_latency_s": target.step_latency_s, "l_tran_s": target.transition_s, "delta_l_s": delta,
            "payback_steps": _payback_steps(target.transition_s, delta)}


def _unreached(target: Target, current_step_latency_s: float) -> dict:
    """The journal's record of a target no transition (and no restart) reaches."""
    return _record(target, current_step_latency_s) | {"verdict": "infeasible", "reason": target.reason}


def rechecks(payback_margin: float) -> bool:
    """Whether a policy with payback margin ``γ`` asks a rejected target again (:func:`recheck_due`):
    only ``0 < γ < ∞`` (greedy rejects no faster target, ``γ = 0`` admits urgent switches only)."""
    return 0 < payback_margin < math.inf


def recheck_due(payback_steps: float, steps_since: int, payback_margin: float) -> bool:
    """Whether a target rejected ``steps_since`` steps ago for its payback period would now pass
    the payback rule with ``H_x`` = the steps the plan has stayed valid since, a lower bound on
    the interval the signals are in: ``payback ≤ γ · steps_since`` (only for ``0 < γ < ∞``: greedy
    rejects no faster target, ``γ = 0`` admits urgent switches only).

    ``H_x`` is 1 before a signal's first interval (paper §4.3), so the first crossing of a signal
    admits only a switch that repays in half a step; without asking again, a plan found faster at
    step 1 (2 % on the simulator's ``verl-0.5b-ppo`` trace, repaid in 6 steps) was never taken,
    while greedy took it."""
    return rechecks(payback_margin) and payback_margin * steps_since >= payback_steps


def urgent_replan(problem: PlanProblem, cost_model: CostModel, current: Plan | None = None,
                  base: PlannerOptions | None = None) -> tuple[PlanResult | None, list[str]]:
    """Plan for the urgent path, widening the space once.

    Order: the planner's own space (every layout, each at the largest micro-batch up to the
    job's that fits it: :func:`nereusd.planner.space.micro_batch_choices`); then also full
    activation recomputation, which is slower wherever the plain plans fit. Returns the first
    plan found (or None: the caller checkpoints and restarts) and a line per attempt.
    """
    base = base or PlannerOptions()
    attempts = [
        ("job settings", base),
        ("with recomputation", dataclasses.replace(base, allow_recompute=True)),
    ]
    log_lines: list[str] = []
    for name, options in attempts:
        try:
            result = Planner(problem, cost_model, options).solve(current)
        except Infeasible as err:
            log_lines.append(f"{name}: {err}")
            continue
        log_lines.append(f"{name}: step {result.predicted_step_latency_s:.3f} s")
        return result, log_lines
    return None, log_lines
