"""DP-only rescaling of a plan to a new pool: the "frozen TP/PP with DP scaling" baseline.

Every model-stage keeps its TP, PP and micro-batch; its DP degree scales with the pool, so
``dp' = floor(dp × n / n_plan)`` (at least 1), where ``n_plan`` is the most devices any
concurrent set of the plan uses, or the devices the whole plan spans if more; training DP
stays a divisor of the mini-batch (the global batch stays exact, DESIGN.md "Training
semantics") and its micro-batch shrinks to divide the new per-replica share. If a concurrent
set still does not fit, the member with the most devices that can still step down steps down to
its next valid DP until it does. Devices the floors leave idle are then filled: the member
furthest below its share of the plan (fewest devices relative to ``base``) steps up to its next
valid DP while every concurrent set it is in stays within its share of the pool,
``⌊devices of the set in base × n / n_plan⌋`` (so a set the plan left partly idle on purpose
stays so, and a rescale to the devices the plan spans is the plan; a plan that leaves some pool
device idle in every set is filled into it). Without this a pool growing from 24 to 64 devices
left a quarter of them idle: training DP must divide the
mini-batch, so ``floor(1 × 64/24) = 2`` was the critic's DP and ``floor(2 × 64/24) = 5`` the
actor's, stepped down to 4, 48 devices of 64 (``scripts/bench_sim.py``, A100 ramp, 2026-12-04).
"""

from __future__ import annotations

import math

from nereusd.errors import PlanError
from nereusd.planner.placement import place
from nereusd.plan import Plan, Stage
from nereusd.planner.space import PlanProblem


def _valid_dps(problem: PlanProblem, m, limit: int) -> list[int]:
    if m.stage is Stage.TRAINING:
        mini = problem.workload.mini_batch_size
        return [d for d in range(1, min(limit, mini) + 1) if mini % d == 0]
    return list(range(1, min(limit, problem.workflow.sequences(m, problem.workload)) + 1))


def dp_rescale(base: Plan, problem: PlanProblem, current: Plan | None = None) -> Plan | None:
    """``base`` with DP scaled to ``problem.pool``, placed near ``current`` (default ``base``).

    Returns None when even DP 1 of every model-stage does not fit the pool.
    """
    n = len(problem.pool)
    sets = problem.workflow.concurrent_sets()
    if not n or any(m not in base for group in sets for m in group):
        return None
    n_plan = max(max(sum(base[m].size for m in group) for group in sets), len(base.devices()))
    dps = {}
    for m, c in base.items():
        valid = _valid_dps(problem, m, max(1, n // (c.tp * c.pp)))
        want = max(1, math.floor(c.dp * n / n_plan))
        fit = [d for d in valid if d <= want]
        if not fit:
            return None
        dps[m] = fit[-1]
    for group in sets:
        while sum(base[m].tp * base[m].pp * dps[m] for m in group) > n:
            shrinkable = [x for x in group if _valid_dps(problem, x, dps[x] - 1)]
            if not shrinkable:
                return None
            m = max(shrinkable, key=lambda x: (base[x].tp * base[x].pp * dps[x], str(x)))
            dps[m] = _valid_dps(problem, m, dps[m] - 1)[-1]
    _fill(problem, base, dps, sets, n, n_plan)
    layouts = {}
    for m, c in base.items():
        b = c.micro_batch
        if m.stage is Stage.TRAINING and b:
            share = problem.workload.mini_batch_size // dps[m]
            b = max(d for d in range(1, min(b, share) + 1) if share % d == 0)
        layouts[m] = (c.tp, c.pp, dps[m], b, c.recompute, c.zero_stage)
    try:
        return place(layouts, sets, problem.pool, problem.site.devices_per_node,
                     current if current is not None else base)
    except PlanError:
        return None


def _fill(problem: PlanProblem, base: Plan, dps: dict, sets, n: int, n_plan: int) -> None:
    """Step members up to their next valid DP, the one with the fewest devices relative to
    ``base`` first, while every concurrent set it is in stays within its share of the pool,
    ``min(n, ⌊devices of the set in base × n / n_plan⌋)`` (in place): devices the floors left
    idle are used, and a rescale to the devices the plan spans returns the plan."""
    budgets = [min(n, sum(base[m].size for m in group) * n // n_plan) for group in sets]

    def size(m, dp):
        return base[m].tp * base[m].pp * dp

    def fits(m, dp):
        return all(sum(size(x, dp if x == m else dps[x]) for x in group) <= budget
                   for group, budget in zip(sets, budgets) if m in group)

    while True:
        ups = []
        for m in base:
            bigger = [d for d in _valid_dps(problem, m, n // (base[m].tp * base[m].pp)) if d > dps[m]]
            if bigger and fits(m, bigger[0]):
                ups.append((dps[m] / base[m].dp, str(m), m, bigger[0]))
        if not ups:
            return
        _, _, m, dp = min(ups)
        dps[m] = dp
