"""Planner: the lowest-latency plan under memory and stage-wise GPU budgets (paper §4.2, Eq. 1).

1. Per model-stage, enumerate options ``(tp, pp, dp, micro_batch, recompute)``
   (:mod:`nereusd.planner.space`) and cost them once (cost and memory model).
2. Per model-stage, a latency–GPU frontier: the fastest option for each GPU count that fits
   the device memory, dominated options dropped.
3. Per concurrent set (a phase), minimise the slowest member under ``Σ|R_M| ≤ |pool|`` exactly
   by bisection over frontier latencies (the knapsack of min-max form), then hand spare GPUs to
   the slowest members.
4. Co-resident model-stages couple phases through memory: a device may hold one model-stage of
   every phase, so phase ``p`` fits when its working peak plus the largest resident state
   ``B_q`` of every other phase ``q`` stays under ``(1 − headroom)·capacity``. The planner first
   solves without the coupling; if that plan violates it, it searches the ``B_q`` values
   (dynamic programming over phases with memoised phase solutions).
5. Placement onto concrete devices (:func:`nereusd.planner.placement.place`).

Pure: no torch, no I/O. Raises :class:`Infeasible` (a ``PlanError``) saying which model-stage
cannot fit and by how much.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import logging
import time
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from nereusd.cost.model import CostModel
from nereusd.errors import PlanError, format_bytes
from nereusd.cost.memory import usable_bytes
from nereusd.planner.placement import place
from nereusd.plan import ModelStage, Plan, Stage
from nereusd.planner.space import (Option, OptionTable, PlannerOptions, PlanProblem, device_peaks, enumerate_options,
                                   option_table)

log = logging.getLogger(__name__)
INF = float("inf")


class Infeasible(PlanError):
    """No plan fits. ``model_stage``/``need_bytes``/``usable_bytes`` say what fails, if one does."""

    def __init__(self, message: str, model_stage: ModelStage | None = None, need_bytes: int = 0,
                 usable_bytes: int = 0) -> None:
        super().__init__(message)
        self.model_stage = model_stage
        self.need_bytes = need_bytes
        self.usable_bytes = usable_bytes


@dataclass(frozen=True)
class PlanResult:
    """A chosen plan with its predictions.

    Attributes:
        plan: candidates with concrete devices.
        options: the chosen option per model-stage (latency, peak and resident bytes).
        predicted_step_latency_s: critical path of the step under this plan.
        peak_bytes: predicted peak per device (working set + co-resident state).
        usable_bytes: ``(1 − headroom)·capacity`` per device.
        search_time_s: wall time of the search, placement included.
    """

    plan: Plan
    options: Mapping[ModelStage, Option]
    predicted_step_latency_s: float
    peak_bytes: Mapping[int, int]
    usable_bytes: int
    search_time_s: float


def frontier(options: Sequence[Option], max_peak: float = INF, max_resident: float = INF) -> list[Option]:
    """Latency–GPU frontier: options under the memory limits, increasing GPUs, strictly
    decreasing latency (ties: lower peak memory first)."""
    ok = [o for o in options if o.peak_bytes <= max_peak and o.resident_bytes <= max_resident]
    ok.sort(key=lambda o: (o.gpus, o.latency_s, o.peak_bytes))
    out: list[Option] = []
    for o in ok:
        if not out or o.latency_s < out[-1].latency_s:
            out.append(o)
    return out


def solve_concurrent(frontiers: Sequence[Sequence[Option]], budget: int) -> tuple[float, list[Option]] | None:
    """Minimise ``max latency`` over members, one frontier option each, ``Σ gpus ≤ budget``.

    Exact: the optimum is one of the frontier latencies; the smallest latency ``t`` whose
    cheapest options (fewest GPUs with latency ≤ t) fit the budget is found by bisection.
    Spare GPUs then go to the slowest member while they fit. None if nothing fits.
    """
    if any(not f for f in frontiers):
        return None
    negs = [[-o.latency_s for o in f] for f in frontiers]   # increasing along each frontier

    def need(t: float) -> list[int] | None:
        idx = []
        for neg in negs:
            i = bisect.bisect_left(neg, -t)
            if i == len(neg):
                return None
            idx.append(i)
        return idx

    values = sorted({o.latency_s for f in frontiers for o in f})
    lo, hi, best = 0, len(values) - 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        idx = need(values[mid])
        if idx is not None and sum(f[i].gpus for f, i in zip(frontiers, idx)) <= budget:
            best, hi = idx, mid - 1
        else:
            lo = mid + 1
    if best is None:
        return None
    spare = budget - sum(f[i].gpus for f, i in zip(frontiers, best))
    while True:
        order = sorted(range(len(best)), key=lambda k: -frontiers[k][best[k]].latency_s)
        for k in order:
            i = best[k]
            if i + 1 < len(frontiers[k]) and frontiers[k][i + 1].gpus - frontiers[k][i].gpus <= spare:
                spare -= frontiers[k][i + 1].gpus - frontiers[k][i].gpus
                best[k] = i + 1
                break
        else:
            break
    picks = [f[i] for f, i in zip(frontiers, best)]
    return max(o.latency_s for o in picks), picks


class _SortedOptions:
    """A model-stage's :class:`~nereusd.planner.space.OptionTable` ordered once by ``(gpus,
    latency, peak)`` (stable, as :func:`frontier` sorts), so that :meth:`frontier` under
    changing memory limits is a masked numpy scan instead of a filter-and-sort of Option
    objects per call; only frontier members are materialised. Same result as
    :func:`frontier` over the table's options and the same limits."""

    def __init__(self, table: OptionTable) -> None:
        self.table = table
        self.order = np.lexsort((table.peak_bytes, table.latency_s, table.gpus))  # stable
        self.latency = table.latency_s[self.order]
        self.peak = table.peak_bytes[self.order]
        self.resident = table.resident_bytes[self.order]
        self._memo: dict[tuple[float, float], list[Option]] = {}

    def frontier_arrays(self, max_peak: float = INF, max_resident: float = INF):
        """``(latency, gpus, rows)`` of the frontier as arrays (rows index the table)."""
        key = (max_peak, max_resident)
        hit = self._memo.get(key)
        if hit is not None:
            return hit
        idx = np.flatnonzero((self.peak <= max_peak) & (self.resident <= max_resident))
        lat = self.latency[idx]
        if len(lat):
            # keep an option when it is strictly faster than everything before it
            best_before = np.minimum.accumulate(np.concatenate(([INF], lat[:-1])))
            keep = lat < best_before
            idx, lat = idx[keep], lat[keep]
        rows = self.order[idx]
        out = self._memo[key] = (lat, self.table.gpus[rows], rows)
        return out

    def frontier(self, max_peak: float = INF, max_resident: float = INF) -> list[Option]:
        return [self.table.option(int(r)) for r in self.frontier_arrays(max_peak, max_resident)[2]]


def _solve_arrays(fronts, budget: int) -> tuple[float, list[int]] | None:
    """:func:`solve_concurrent` over frontiers given as ``(latency, gpus, rows)`` arrays;
    returns the slowest latency and the chosen position in each frontier. Same search, same
    tie-breaks."""
    if any(not len(f[0]) for f in fronts):
        return None
    negs = [-f[0] for f in fronts]
    gpus = [f[1].tolist() for f in fronts]
    lats = [f[0].tolist() for f in fronts]
    values = np.unique(np.concatenate([f[0] for f in fronts]))
    lo, hi, best = 0, len(values) - 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        t = values[mid]
        idx = [int(np.searchsorted(neg, -t, side="left")) for neg in negs]
        if all(i < len(g) for i, g in zip(idx, gpus)) and sum(g[i] for g, i in zip(gpus, idx)) <= budget:
            best, hi = idx, mid - 1
        else:
            lo = mid + 1
    if best is None:
        return None
    spare = budget - sum(g[i] for g, i in zip(gpus, best))
    while True:
        order = sorted(range(len(best)), key=lambda k: -lats[k][best[k]])
        for k in order:
            i = best[k]
            if i + 1 < len(gpus[k]) and gpus[k][i + 1] - gpus[k][i] <= spare:
                spare -= gpus[k][i + 1] - gpus[k][i]
                best[k] = i + 1
                break
        else:
            break
    return max(lats[k][best[k]] for k in range(len(best))), best


class Planner:
    """Plans for one problem; options are enumerated and costed once per instance.

    Args:
        problem: workflow, model specs per role, workload, site and device pool.
        cost_model: costs with the current calibration.
        options: search space knobs (divisors, micro-batches, recomputation, headroom).
    """

    def __init__(self, problem: PlanProblem, cost_model: CostModel, options: PlannerOptions | None = None, *,
                 suggest: bool = False):
        self.problem = problem
        self.suggest = suggest
        """When nothing fits, plan again with recomputation, ZeRO and more devices to say what would
        (for a person reading the error: ``nereus-launch plan``, a job's launch)."""
        self.cost_model = cost_model
        self.options = options or PlannerOptions()
        self.usable = usable_bytes(problem.site.device_memory_bytes, self.options.headroom)
        wf = problem.workflow
        self.phases = [p for p in wf.phases if p]
        self.shared = list(range(1, len(self.phases))) if wf.asynchronous else list(range(len(self.phases)))
        self.tables = {m: option_table(problem, m, cost_model, self.options, self.usable)
                       for m in wf.model_stages}
        self._memo: dict = {}
        self._sorted = {m: _SortedOptions(t) for m, t in self.tables.items()}
        self._all_options: dict[ModelStage, list[Option]] | None = None

    @property
    def all_options(self) -> dict[ModelStage, list[Option]]:
        """Every costed option per model-stage, in enumeration order (materialised on use)."""
        if self._all_options is None:
            self._all_options = {m: t.options() for m, t in self.tables.items()}
        return self._all_options

    # ---- phase solutions ---------------------------------------------------------------------
    def _phase(self, p: int, budget: int, max_resident: float, reserve: float):
        key = (p, budget, max_resident, reserve)
        if key not in self._memo:
            fronts = [self._sorted[m].frontier_arrays(self.usable - reserve, max_resident) for m in self.phases[p]]
            sol = _solve_arrays(fronts, budget)
            if sol is not None:
                sol = (sol[0], [self.tables[m].option(int(f[2][i]))
                                for m, f, i in zip(self.phases[p], fronts, sol[1])])
            self._memo[key] = sol
        return self._memo[key]

    def _shared_solve(self, budget: int, bounds: Mapping[int, float] | None):
        """Phases that share devices (all of a synchronous step; inference+training when
        asynchronous) under resident bounds ``B_q`` (None: memory coupling ignored); returns
        (latency, picks) or None."""
        total, picks = 0.0, []
        coupled = bounds is not None and len(self.shared) > 1
        for p in self.shared:
            reserve = sum(bounds[q] for q in self.shared if q != p) if coupled else 0.0
            sol = self._phase(p, budget, bounds[p] if coupled else INF, reserve)
            if sol is None:
                return None
            total += sol[0]
            picks += sol[1]
        return total, picks

    def _coupled_search(self, budget: int):
        """Exact search over ``B_q`` (largest resident state of each shared phase)."""
        sol = self._shared_solve(budget, None)
        if sol is None:
            return None
        if len(self.shared) <= 1 or self._consistent(sol[1]):
            return sol
        # Branch and bound: LB_q(B) = phase q under resident bound B with no reserve is a lower
        # bound of its latency under any reserve; combos are tried by increasing Σ LB.
        values: dict[int, list[tuple[float, int]]] = {}
        for q in self.shared:
            kept: list[tuple[float, int]] = []
            for b in sorted({int(r) for m in self.phases[q] for r in np.unique(self.tables[m].resident_bytes)}):
                sol = self._phase(q, budget, b, 0.0)
                if sol is not None:
                    kept.append((sol[0], b))
            if not kept:
                return None
            values[q] = kept
        combos = sorted(itertools.product(*(values[q] for q in self.shared)),
                        key=lambda c: sum(lb for lb, _ in c))
        best = None
        for combo in combos:
            if best is not None and sum(lb for lb, _ in combo) >= best[0]:
                break
            bounds = [b for _, b in combo]
            if sum(bounds) - min(bounds) > self.usable:
                continue
            cand = self._shared_solve(budget, dict(zip(self.shared, bounds)))
            if cand is not None and (best is None or cand[0] < best[0]):
                best = cand
        return best

    def _consistent(self, picks: Sequence[Option]) -> bool:
        by_phase: dict[int, list[Option]] = {}
        for o in picks:
            by_phase.setdefault(self.problem.workflow.phase_of(o.model_stage), []).append(o)
        bounds = {q: max(o.resident_bytes for o in by_phase[q]) for q in self.shared}
        for p in self.shared:
            reserve = sum(bounds[q] for q in self.shared if q != p)
            if max(o.peak_bytes for o in by_phase[p]) + reserve > self.usable:
                return False
        return True

    # ---- entry point -------------------------------------------------------------------------
    def solve(self, current: Plan | None = None) -> PlanResult:
        """The best plan (ties broken towards fewer GPUs), placed near ``current``.

        Raises:
            Infeasible: when no model-stage option fits memory, or no combination fits the pool.
        """
        start = time.perf_counter()
        self._explain_empty()
        n = len(self.problem.pool)
        best = None
        if self.problem.workflow.asynchronous:
            gen_front = self._sorted[self.phases[0][0]].frontier(self.usable)
            for g in gen_front:
                if g.gpus >= n:
                    break
                rest = self._coupled_search(n - g.gpus)
                if rest is not None:
                    latency = max(g.latency_s, rest[0])
                    if best is None or latency < best[0]:
                        best = (latency, [g] + rest[1])
        else:
            best = self._coupled_search(n)
        if best is None:
            raise self._explain_budget()
        latency, picks = best
        chosen = {o.model_stage: o for o in picks}
        plan = place({m: o.layout for m, o in chosen.items()}, self.problem.workflow.concurrent_sets(),
                     self.problem.pool, self.problem.site.devices_per_node, current)
        peaks = device_peaks(self.problem.workflow, plan, chosen)
        elapsed = time.perf_counter() - start
        log.debug("planner: %d GPUs, step %.3f s, search %.1f ms", n, latency, elapsed * 1e3)
        return PlanResult(plan, chosen, self.problem.workflow.critical_path_s(
            {m: o.latency_s for m, o in chosen.items()}), peaks, self.usable, elapsed)

    def _explain_empty(self) -> None:
        for m, table in self.tables.items():
            if not len(table):
                need = min_peak_bytes(self.problem, m, self.cost_model, self.options)
                raise Infeasible(
                    f"{m} ({m.stage} phase) cannot fit on {len(self.problem.pool)} devices: its smallest peak over "
                    f"every layout is {format_bytes(need)} per device, {format_bytes(self.usable)} usable "
                    f"({format_bytes(need - self.usable)} short)" + self._suggestions(), m, need, self.usable)

    def _explain_budget(self) -> Infeasible:
        n = len(self.problem.pool)
        for group in self.problem.workflow.concurrent_sets():
            least = sum(int(self.tables[m].gpus.min()) for m in group)
            if least > n:
                return Infeasible(f"model-stages {', '.join(map(str, group))} run concurrently on disjoint devices, "
                                  f"and their smallest layouts that fit memory take {least} devices together (a "
                                  f"lower bound: more may be needed); the pool has {n}" + self._suggestions())
        # co-residence: a phase's working peak plus the other phases' resident state on its devices
        worst = None
        for p in self.shared:
            reserve = sum(min(int(self.tables[m].resident_bytes.min()) for m in self.phases[q])
                          for q in self.shared if q != p)
            own = max(int(self.tables[m].peak_bytes.min()) for m in self.phases[p])
            m = max(self.phases[p], key=lambda x: int(self.tables[x].peak_bytes.min()))
            if worst is None or own + reserve > worst[0]:
                worst = (own + reserve, p, m, own, reserve)
        need, p, m, own, reserve = worst
        phase = " + ".join(str(x) for x in self.phases[p])
        if need > self.usable:
            what = (f"the {m.stage} phase ({phase}) needs at least {format_bytes(need)} per device: {m}'s smallest "
                    f"peak {format_bytes(own)} plus the other phases' smallest resident state {format_bytes(reserve)}, "
                    f"{format_bytes(self.usable)} usable")
        else:   # each bound is met by some layout, but no one combination meets them all
            what = (f"no combination of layouts fits both the devices and memory: the {m.stage} phase ({phase}) "
                    f"needs at least {format_bytes(need)} per device ({m}'s smallest peak plus the other phases' "
                    f"smallest resident state), within the {format_bytes(self.usable)} usable, but the layouts that "
                    f"reach those minima do not fit the devices together")
        return Infeasible(f"no plan fits {n} devices: {what}" + self._suggestions(), m, need, self.usable)

    def _suggestions(self) -> str:
        """What would fit instead, tried by planning again: recomputation, ZeRO, more devices
        (``""`` without :attr:`suggest`)."""
        if not self.suggest:
            return ""
        # the remedies alone and together, fewest first: (label, options)
        remedies: list[tuple[str, PlannerOptions]] = []
        if not self.options.allow_recompute:
            remedies.append(("activation recomputation (--recompute; plan.*.recompute)",
                             dataclasses.replace(self.options, allow_recompute=True)))
        if (any(m.stage is Stage.TRAINING for m in self.problem.workflow.model_stages)
                and not self.options.zero_stages and not self.problem.zero_stages):
            remedies.append(("ZeRO-1/2 for training (--zero; backends: {<role>/training: deepspeed})",
                             dataclasses.replace(self.options, zero_stages=(0, 1, 2))))
        if len(remedies) == 2:
            remedies.append((" and ".join(label for label, _ in remedies),
                             dataclasses.replace(remedies[0][1], zero_stages=(0, 1, 2))))

        def fits(problem: PlanProblem, options: PlannerOptions) -> bool:
            try:
                Planner(problem, self.cost_model, options, suggest=False).solve()
            except Infeasible:
                return False
            return True

        # on these devices: each remedy that fits alone (the pair only when neither does)
        alone = [label for label, options in remedies[:2] if fits(self.problem, options)]
        if not alone and len(remedies) == 3 and fits(self.problem, remedies[2][1]):
            alone = [remedies[2][0]]
        # else the fewest more devices, with the fewest remedies that fit there (a 70B job on 8
        # GPUs was told "32 devices with recomputation and ZeRO" where recomputation alone fits)
        more_fit = ""
        n, dpn = len(self.problem.pool), self.problem.site.devices_per_node
        if not alone:   # the next whole node first (3 devices of a 4-device node: 4, not 8)
            for more in sorted({-(-m // dpn) * dpn for m in (n + 1, 2 * n, 4 * n, 8 * n)}):
                bigger = dataclasses.replace(self.problem, site=self.problem.site.with_nodes(more // dpn),
                                             pool=tuple(range(more)))
                for label, options in (("", self.options), *remedies):
                    if fits(bigger, options):
                        more_fit = f"{more} devices" + (f" (with {label})" if label else "")
                        break
                if more_fit:
                    break
        found = alone or ([more_fit] if more_fit else [])
        if found:
            return f"; would fit with {' or with '.join(found)}"
        widest = f" with {remedies[-1][0]}" if remedies else ""
        return f"; nothing tried fits (up to {-(-8 * n // dpn) * dpn} devices{widest})"


def min_peak_bytes(problem: PlanProblem, model_stage: ModelStage, cost_model: CostModel,
                   options: PlannerOptions) -> int:
    """Smallest own peak memory of any option of ``model_stage`` over the whole search space (TP
    across nodes included, as the search goes when nothing fits a node), memory limit ignored."""
    table = option_table(problem, model_stage, cost_model, options, INF, across_nodes=True)
    return int(table.peak_bytes.min()) if len(table) else 0
