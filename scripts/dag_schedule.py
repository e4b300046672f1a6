"""The scheduling instance of a transition DAG, its greedy schedule, and exact CP-SAT/SCIP models.

Split out of ``scripts/bench_dag.py`` (whose docstring describes the model): ops become jobs
with durations and ports from :func:`nereusd.transition.cost._profile` (the same profile
``estimate_l_tran`` schedules), precedence from the DAG edges, per-device memory deltas from the
transition memory model.
"""

from __future__ import annotations

import math
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nereusd.transition import (  # noqa: E402
    MemoryBudget,
    StateModel,
    TransitionDag,
    rebuilt_model_stages,
    topological_order,
)
from nereusd.transition.cost import (  # noqa: E402  (L_tran: durations, ports, order, schedule)
    LinkCosts, _profile, best_list_schedule, list_schedule)
from nereusd.transition.dag import closure  # noqa: E402

MIB = 1 << 20


# --- the scheduling instance -------------------------------------------------------------------

@dataclass(frozen=True)
class Job:
    """One op: duration in seconds and ticks, ports, and per device the memory taken at the start
    and given back at the end (in the instance's memory unit)."""

    op_id: str
    duration_s: float
    ticks: int
    ports: tuple[int, ...]
    up_mem: Mapping[int, int]
    down_mem: Mapping[int, int]


@dataclass(frozen=True)
class Instance:
    """Jobs (in DAG op order), edges as job indices, the greedy's order, and per device the
    memory at time 0 and the limit, in units of ``mem_unit_bytes`` (MiB in the benchmark)."""

    jobs: tuple[Job, ...]
    edges: tuple[tuple[int, int], ...]
    order: tuple[int, ...]
    base_mem: Mapping[int, int]
    limit_mem: int
    tick_s: float
    mem_unit_bytes: int = MIB
    reaches: Sequence[int] = field(default=(), repr=False)
    """Descendant bitsets of the DAG (bit ``j`` of ``reaches[i]``: ``i`` precedes ``j``)."""

    def devices(self) -> list[int]:
        return sorted(set(self.base_mem) | {x for j in self.jobs for x in (*j.ports, *j.up_mem, *j.down_mem)})

    def precedes(self, i: int, j: int) -> bool:
        return bool(self.reaches[i] >> j & 1)


def build_instance(dag: TransitionDag, state: StateModel, links: LinkCosts, budget: MemoryBudget,
                   *, tick_s: float = 1e-5, mem_unit_bytes: int = MIB) -> Instance:
    """The scheduling instance of ``dag`` (module docstring): durations and ports as
    :func:`~nereusd.transition.cost.estimate_l_tran` counts them, memory as
    :func:`~nereusd.transition.memory.check_feasibility` does, in units of ``mem_unit_bytes``
    (``*_mem`` fields: takes rounded up, releases and the limit rounded down)."""
    unit = mem_unit_bytes
    jobs = []
    for op in dag.ops:
        seconds, _, busy = _profile(op, state.sizes, links)
        ticks = math.ceil(seconds / tick_s - 1e-9) if seconds > 0 else 0
        up, down = {}, {}
        for x, (alloc, transient, free) in state.op_bytes(op, budget.collective_buffer_bytes).items():
            if alloc + transient:
                up[x] = -(-(alloc + transient) // unit)
            if (transient + free) // unit:
                down[x] = (transient + free) // unit
        jobs.append(Job(op.id, seconds, max(ticks, 1) if seconds > 0 else 0,
                        tuple(sorted(busy)) if seconds > 0 else (), up, down))
    devices = set(dag.current.devices()) | set(dag.target.devices()) | set(budget.reserved_bytes)
    base = defaultdict(int, state.start_bytes(dag.current, rebuilt_model_stages(dag.current, dag.target,
                                                                             {op.model_stage for op in dag.ops})))
    for x, v in budget.baseline_bytes(devices).items():
        base[x] += v
    edges = tuple((dag.index_of(e.src), dag.index_of(e.dst)) for e in dag.edges)
    order = tuple(dag.index_of(x) for x in topological_order(dag))
    return Instance(tuple(jobs), edges, order, {x: -(-v // unit) for x, v in base.items()},
                    budget.limit_bytes // unit, tick_s, unit, tuple(closure(dag)))


def durations(inst: Instance, ticks: bool) -> list:
    return [j.ticks if ticks else j.duration_s for j in inst.jobs]


def greedy_starts(inst: Instance, *, ticks: bool = True) -> list:
    """``estimate_l_tran``'s schedule (:func:`nereusd.transition.cost.best_list_schedule`, the same
    function, its order chosen on the seconds ``L̂_tran`` uses, replayed in ticks): each job starts
    at the earliest time when its predecessors have finished and its ports are free for its whole
    duration."""
    d = durations(inst, ticks)
    preds = defaultdict(list)
    for a, b in inst.edges:
        preds[b].append(a)
    ports = {i: j.ports for i, j in enumerate(inst.jobs)}
    order, _, _ = best_list_schedule(inst.order, dict(enumerate(durations(inst, False))), ports, preds)  # as L_tran
    start, _ = list_schedule(order, dict(enumerate(d)), ports, preds)
    return [start[i] for i in range(len(d))]


def serial_starts(inst: Instance) -> list[int]:
    """One job at a time in ``inst.order``: the schedule ``check_feasibility`` walks."""
    start, t = [0] * len(inst.jobs), 0
    for i in inst.order:
        start[i], t = t, t + inst.jobs[i].ticks
    return start


def makespan(inst: Instance, starts: Sequence, *, ticks: bool = True):
    return max((s + d for s, d in zip(starts, durations(inst, ticks))), default=0)


def schedule_problems(inst: Instance, starts: Sequence[int]) -> list[str]:
    """What a tick schedule breaks: precedence, one port per device, memory (module docstring)."""
    d = durations(inst, True)
    out = [f"{inst.jobs[b].op_id} starts before {inst.jobs[a].op_id} ends"
           for a, b in inst.edges if starts[b] < starts[a] + d[a]]
    on_port = defaultdict(list)
    for i, j in enumerate(inst.jobs):
        for x in j.ports:
            on_port[x].append((starts[i], starts[i] + d[i], j.op_id))
    for x, spans in on_port.items():
        spans.sort()
        out += [f"device {x}: {b[2]} overlaps {a[2]}" for a, b in zip(spans, spans[1:]) if b[0] < a[1]]
    events = defaultdict(lambda: defaultdict(int))
    for i, j in enumerate(inst.jobs):
        for x, v in j.up_mem.items():
            events[x][starts[i]] += v
        for x, v in j.down_mem.items():
            events[x][starts[i] + d[i]] -= v
    for x in inst.devices():
        level = inst.base_mem.get(x, 0)
        for t in sorted(events[x]):
            level += events[x][t]
            if level > inst.limit_mem:
                out.append(f"device {x}: memory {level} > {inst.limit_mem} at tick {t}")
                break
    return out


# --- exact solvers -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Solution:
    solver: str
    makespan: int | None
    """Best makespan found, ticks (``None``: none within the limit)."""
    optimal: bool
    wall_s: float
    starts: tuple[int, ...] = ()


def solve_cpsat(inst: Instance, *, time_limit_s: float, workers: int, hint: Sequence[int] | None,
                memory: bool = True) -> Solution:
    """CP-SAT on the model of the module docstring (``memory=False``: without the memory constraint)."""
    from ortools.sat.python import cp_model

    t0 = time.perf_counter()
    m = cp_model.CpModel()
    d = durations(inst, True)
    horizon = sum(d)
    s = [m.new_int_var(0, horizon - d[i], f"s{i}") for i in range(len(d))]
    c = m.new_int_var(0, horizon, "makespan")
    on_port = defaultdict(list)
    for i, j in enumerate(inst.jobs):
        iv = m.new_fixed_size_interval_var(s[i], d[i], f"iv{i}")
        for x in j.ports:
            on_port[x].append(iv)
        m.add(c >= s[i] + d[i])
    for ivs in on_port.values():
        if len(ivs) > 1:
            m.add_no_overlap(ivs)
    for a, b in inst.edges:
        m.add(s[b] >= s[a] + d[a])
    for x in inst.devices() if memory else ():
        times, changes = [], []
        for i, j in enumerate(inst.jobs):
            if j.up_mem.get(x):
                times.append(s[i])
                changes.append(j.up_mem[x])
            if j.down_mem.get(x):
                times.append(s[i] + d[i])
                changes.append(-j.down_mem[x])
        if times:
            base = inst.base_mem.get(x, 0)
            m.add_reservoir_constraint(times, changes, sum(v for v in changes if v < 0) - base,
                                       inst.limit_mem - base)
    m.minimize(c)
    if hint is not None:
        for i, v in enumerate(hint):
            m.add_hint(s[i], v)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = time_limit_s
    solver.parameters.num_workers = workers
    status = solver.solve(m)
    wall = time.perf_counter() - t0
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return Solution("cp-sat", None, False, wall)
    return Solution("cp-sat", int(solver.objective_value), status == cp_model.OPTIMAL, wall,
                    tuple(int(solver.value(v)) for v in s))


def solve_scip(inst: Instance, *, time_limit_s: float, hint: Sequence[int] | None) -> Solution:
    """SCIP on the MIP form of the model (module docstring)."""
    from pyscipopt import Model, quicksum

    t0 = time.perf_counter()
    m = Model("transition")
    m.hideOutput()
    m.setParam("limits/time", time_limit_s)
    m.setParam("numerics/feastol", 1e-7)  # big-M ~1e6 ticks: a binary 1e-6 off would be a tick
    d = durations(inst, True)
    big = sum(d)
    n = len(d)
    s = [m.addVar(f"s{i}", vtype="I", lb=0, ub=big - d[i]) for i in range(n)]
    c = m.addVar("makespan", lb=0, ub=big)
    for i in range(n):
        m.addCons(c >= s[i] + d[i])
    for a, b in inst.edges:
        m.addCons(s[b] >= s[a] + d[a])
    ports = defaultdict(list)
    for i, j in enumerate(inst.jobs):
        for x in j.ports:
            ports[x].append(i)
    order: dict[tuple[int, int], object] = {}  # (i, j), i < j -> binary "i before j"

    def before(i: int, j: int):
        """1 if ``i`` ends by the time ``j`` starts, as a constant or binary (ports only)."""
        if inst.precedes(i, j):
            return 1
        if inst.precedes(j, i):
            return 0
        a, b = min(i, j), max(i, j)
        if (a, b) not in order:
            y = m.addVar(f"y{a}_{b}", vtype="B")
            m.addCons(s[b] >= s[a] + d[a] - big * (1 - y))
            m.addCons(s[a] >= s[b] + d[b] - big * y)
            order[(a, b)] = y
        return order[(a, b)] if a == i else 1 - order[(a, b)]

    for x, jobs in ports.items():
        m.addCons(c >= sum(d[i] for i in jobs))
        for k, i in enumerate(jobs):
            for j in jobs[k + 1:]:
                before(i, j)
    tail = _tail(inst, d)
    for i in range(n):  # critical path through each job, from the DAG alone
        m.addCons(c >= s[i] + tail[i])
    share = {x: set(js) for x, js in ports.items()}
    started_vars: dict[tuple[int, int], object] = {}
    for x in inst.devices():
        touch = [i for i, j in enumerate(inst.jobs) if x in j.up_mem or x in j.down_mem]
        for j in (i for i in touch if inst.jobs[i].up_mem.get(x)):
            terms = []
            for i in touch:
                if i == j:
                    continue
                up, down = inst.jobs[i].up_mem.get(x, 0), inst.jobs[i].down_mem.get(x, 0)
                shared = any(i in js and j in js for js in share.values())
                if shared or inst.precedes(i, j) or inst.precedes(j, i):
                    b = before(i, j)  # disjoint in time: started before == ended before
                    terms.append((up - down) * b)
                    continue
                a = _started(m, s, d, big, inst, i, j, started_vars)
                e = m.addVar(f"e{i}_{j}", vtype="B")  # 1 ⇒ i has ended when j starts
                m.addCons(s[i] + d[i] <= s[j] + big * (1 - e))
                m.addCons(e <= a)
                terms.append(up * a - down * e)
            m.addCons(inst.base_mem.get(x, 0) + inst.jobs[j].up_mem[x] + quicksum(terms) <= inst.limit_mem)
    m.setObjective(c, "minimize")
    if hint is not None:
        sol = m.createPartialSol()
        for i, v in enumerate(hint):
            m.setSolVal(sol, s[i], v)
        m.setSolVal(sol, c, makespan(inst, hint))
        m.addSol(sol)
    m.optimize()
    wall = time.perf_counter() - t0
    if m.getNSols() == 0:
        return Solution("scip", None, False, wall)
    best = m.getBestSol()
    return Solution("scip", round(m.getSolObjVal(best)), m.getStatus() == "optimal", wall,
                    tuple(round(m.getSolVal(best, v)) for v in s))


def _started(m, s, d, big, inst, i, j, cache):
    """Binary "``i`` has started when ``j`` starts" for a pair the DAG and ports leave unordered;
    ``a_ij + a_ji ≥ 1`` so two jobs that start together count each other once."""
    if (i, j) not in cache:
        for p, q in ((i, j), (j, i)):
            cache[(p, q)] = m.addVar(f"a{p}_{q}", vtype="B")
            m.addCons(s[p] >= s[q] - big * cache[(p, q)])  # 0 ⇒ p starts no earlier than q
        m.addCons(cache[(i, j)] + cache[(j, i)] >= 1)
    return cache[(i, j)]


def _tail(inst: Instance, d: Sequence[int]) -> list[int]:
    """Longest path from the start of each job to the end of the DAG, ticks."""
    succ = defaultdict(list)
    for a, b in inst.edges:
        succ[a].append(b)
    tail = [0] * len(d)
    for i in reversed(inst.order):
        tail[i] = d[i] + max((tail[k] for k in succ[i]), default=0)
    return tail


# --- random cases --------------------------------------------------------------------------------
