"""The simulator's oracle: the best plan at each step under the ground truth, with free
switches (:class:`Oracle`; :mod:`nereusd.sim.replay` runs it as a policy and launches
``frozen-final`` on its plan for the whole run)."""

from __future__ import annotations

import math
from dataclasses import replace

from nereusd.control.lookahead import planned_mean_fraction
from nereusd.plan import Plan
from nereusd.planner.search import Infeasible, Planner
from nereusd.planner.space import PlannerOptions, PlanProblem
from nereusd.sim.truth import GroundTruth
from nereusd.traces import LengthTrace


def length_bucket(length: float, per_octave: int) -> int:
    """``length`` rounded up to the grid ``2^(k/per_octave)`` tokens (an integer ≥ 1)."""
    if length <= 1:
        return 1
    return int(math.ceil(2 ** (math.ceil(per_octave * math.log2(length) - 1e-9) / per_octave)))


HEADROOMS = (0.0, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4)
"""Headrooms at which the oracle asks the planner for a plan (until one fits the true peak)."""


class Oracle:
    """Best plan per step under the ground truth. The planner's plans are memoised per (length
    bucket, pool, contention, headroom). For a truth that is the planner's model, the first plan
    by rising headroom whose true peak fits; for another (``ranks_by_truth``), the truth's
    fastest that fits among several such plans (:meth:`_candidates`)."""

    def __init__(self, problem: PlanProblem, truth: GroundTruth, memory_headroom: float = 0.0,
                 memo: dict[tuple, object] | None = None) -> None:
        self.problem, self.truth = problem, truth
        self.memory_headroom = memory_headroom
        """Share of each device's memory a plan leaves free under the truth where some plan can
        (``oracle@H``)."""
        self.margin_missed = False
        """Whether the last :meth:`plan` found no plan leaving :attr:`memory_headroom` free."""
        self.memo: dict[tuple, object] = {} if memo is None else memo
        """The planner's plans (:meth:`_solve`) and candidate sets (:meth:`_candidates`): the same
        whatever the memory headroom, so the oracles of one simulation share them."""
        self.known: dict[str, Plan] = {}
        """Plans other policies ran on this simulation (:meth:`Simulation.learn_plans`): the
        oracle of a truth the planner cannot search ranks them too, so that it bounds what the
        policies found and not only what its own planner calls propose."""

    def plan(self, step: int, length: float, pool: tuple[int, ...], time_s: float,
             incumbent: Plan | None = None) -> Plan | None:
        """The best plan at ``step``; ``incumbent``: the oracle's current plan, kept among the
        candidates of a truth the planner cannot search while it lies in ``pool``. With a
        :attr:`memory_headroom`, the best that leaves it free, else (no plan does) the best that
        fits at all."""
        for headroom in dict.fromkeys((self.memory_headroom, 0.0)):
            plan = self._best(step, length, pool, time_s, incumbent, headroom)
            if plan is not None:
                self.margin_missed = headroom < self.memory_headroom
                return plan
        self.margin_missed = self.memory_headroom > 0
        return None

    def _best(self, step: int, length: float, pool: tuple[int, ...], time_s: float, incumbent: Plan | None,
              memory_headroom: float) -> Plan | None:
        """:meth:`plan` at one memory headroom."""
        contended = self.truth.contended(time_s)
        bucket = length_bucket(length, 16)
        if self.truth.ranks_by_truth:   # the truth is not the planner's model: rank its plans
            candidates = {p.describe(): p for p in self._candidates(bucket, pool, contended,
                                                                      self._fraction(length, step))}
            here = set(pool)
            for plan in (*self.known.values(), *(() if incumbent is None else (incumbent,))):
                if set(plan.devices()) <= here:
                    candidates.setdefault(plan.describe(), plan)
            candidates = list(candidates.values())
            fitting = [p for p in candidates if not self.truth.oom(p, length, step, memory_headroom)]
            return min(fitting, key=lambda p: self.truth.rank_key(p, length, step, contended)) if fitting else None
        for headroom in HEADROOMS:
            plan = self._solve(bucket, pool, contended, headroom)
            if plan is not None and not self.truth.oom(plan, length, step, memory_headroom):
                return plan
        return None

    def _fraction(self, length: float, step: int) -> float:
        """The truth's mean over longest response at ``step`` on the planning grid (what the
        controller plans for, :meth:`~nereusd.control.controller.Controller.mean_fraction`)."""
        return planned_mean_fraction(self.truth.response_length_mean(length, step) / max(1.0, length))

    def _solve(self, bucket: int, pool: tuple[int, ...], contended: bool, headroom: float,
               mean_fraction: float = 1.0) -> Plan | None:
        """The planner's plan at ``bucket`` tokens (mean ``mean_fraction`` of it) under the
        truth's efficiencies (memoised)."""
        key = (bucket, pool, contended, headroom, mean_fraction)
        if key not in self.memo:
            wl = replace(self.problem.workload, response_length=bucket, response_mean_fraction=mean_fraction)
            pb = replace(self.problem, workload=wl, pool=pool)
            try:
                plan = Planner(pb, self.truth.cost_model(contended), PlannerOptions(headroom=headroom)).solve().plan
            except Infeasible:
                plan = None
            self.memo[key] = plan
        return self.memo[key]

    def _candidates(self, bucket: int, pool: tuple[int, ...], contended: bool,
                    mean_fraction: float = 1.0) -> list[Plan]:
        """The distinct plans the planner (under the truth's efficiencies) proposes for
        ``bucket`` tokens at every one of :data:`HEADROOMS`, equal lengths and with the step's
        ``mean_fraction``, and for 2 ×, 4 × and 8 × longer responses at the first two
        (memoised): the oracle takes the one the truth runs fastest at the step (its lengths,
        without noise). Plans for longer responses are there because a truth whose generation
        waits on its longest responses may run them faster."""
        key = ("candidates", bucket, pool, contended, mean_fraction)
        if key not in self.memo:
            plans: dict[str, Plan] = {}
            asks = [(bucket, h, 1.0) for h in HEADROOMS] + [(bucket * k, h, 1.0) for k in (2, 4, 8)
                                                             for h in HEADROOMS[:2]]
            if mean_fraction < 1.0:
                asks += [(bucket, h, mean_fraction) for h in HEADROOMS]
            for length, headroom, fraction in asks:
                plan = self._solve(length, pool, contended, headroom, fraction)
                if plan is not None:
                    plans.setdefault(plan.describe(), plan)
            self.memo[key] = list(plans.values())
        return self.memo[key]

    def plan_for_run(self, lengths: LengthTrace, steps: int, pool: tuple[int, ...]) -> Plan | None:
        """The fastest plan for the run's longest length that no step of the run (its length
        and padding) drives out of memory, uncontended; ``None`` when none does."""
        run = [(i, lengths.at(i)) for i in range(steps)]
        longest = max(length for _, length in run)
        tall = [(i, length) for i, length in run if length >= 0.5 * longest]
        fitting = []
        step = max(run, key=lambda r: r[1])[0]
        fractions = (1.0,) if not self.truth.ranks_by_truth else tuple(sorted({1.0, self._fraction(longest, step)}))
        for headroom in HEADROOMS + (0.5,):
            for fraction in fractions:
                plan = self._solve(length_bucket(longest, 16), pool, False, headroom, fraction)
                if plan is not None and not any(self.truth.oom(plan, length, i) for i, length in tall):
                    if not self.truth.ranks_by_truth:
                        return plan
                    fitting.append(plan)
        return min(fitting, key=lambda p: self.truth.rank_key(p, longest, 0)) if fitting else None
