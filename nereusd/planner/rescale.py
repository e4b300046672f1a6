"""DP-only rescaling of a plan to a new pool: the "frozen TP/PP with DP scaling" baseline.

Every model-stage keeps its TP, PP and micro-batch; its DP degree scales with the pool, so
``dp' = floor(dp × n / n_plan)`` (at least 1), where ``n_plan`` is the most devices any
concurrent set of the plan uses; training DP stays a divisor of the mini-batch (the global
batch stays exact, DESIGN.md "Training semantics") and its micro-batch shrinks to divide the
new per-replica share. If a concurrent set still does not fit, the member with the most
devices steps down to its next valid DP until it does.
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
    n_plan = max(sum(base[m].size for m in group) for group in sets)
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
            m = max(group, key=lambda x: (base[x].tp * base[x].pp * dps[x], str(x)))
            smaller = [d for d in _valid_dps(problem, m, dps[m] - 1)]
            if not smaller:
                return None
            dps[m] = smaller[-1]
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
