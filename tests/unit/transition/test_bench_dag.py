"""Pure pieces of scripts/bench_dag.py: the scheduling instance of a transition DAG, the greedy
replay of ``estimate_l_tran``, the schedule checker, and (when installed) the exact models on
hand-made instances whose optimum is known. No timings are asserted."""

from __future__ import annotations

import importlib.util
import random
import sys

import pytest

from nereusd.plan import ModelStage, Plan, Role, Stage
from nereusd.transition import (
    AdamStateSizes,
    MemoryBudget,
    SiteLinkCosts,
    StateModel,
    check_feasibility,
    estimate_l_tran,
    op_duration_s,
    plan_transition,
)
from tests.support.specs import TINY_MODELS as MODELS
from tests.support import REPO

_PATH = REPO / "scripts" / "bench_dag.py"
_spec = importlib.util.spec_from_file_location("bench_dag", _PATH)
bench = importlib.util.module_from_spec(_spec)
sys.modules["bench_dag"] = bench  # dataclasses look their module up while the class is built
_spec.loader.exec_module(bench)
sched = sys.modules["dag_schedule"]  # the instance, greedy and solvers bench_dag imports

STATE = StateModel(MODELS, AdamStateSizes())
LINKS = SiteLinkCosts(devices_per_node=4, intra_node_gbps=100.0, inter_node_gbps=25.0, hbm_gbps=1000.0)
GEN, TRAIN = ModelStage(Role.ACTOR, Stage.GENERATION), ModelStage(Role.ACTOR, Stage.TRAINING)
MIB = 1 << 20

try:
    import ortools  # noqa: F401
    HAVE_ORTOOLS = True
except ImportError:
    HAVE_ORTOOLS = False
try:
    import pyscipopt  # noqa: F401
    HAVE_SCIP = True
except ImportError:
    HAVE_SCIP = False


def _random_pairs(n: int, seed: int = 0):
    """Plan pairs on 2–8 devices with co-resident model-stages, budgets from ample to barely."""
    rng = random.Random(seed)
    while n:
        pool = rng.randint(2, 8)
        stages = rng.sample([GEN, TRAIN, ModelStage(Role.CRITIC, Stage.TRAINING)], rng.randint(1, 3))
        current = Plan({m: bench._candidate(rng, pool) for m in stages})
        target = Plan({m: bench._candidate(rng, pool) for m in stages})
        need = max(max(STATE.plan_bytes(p).values()) for p in (current, target))
        budget = MemoryBudget(capacity_bytes=int(need * rng.uniform(1.2, 3.0) / 0.9) + MIB,
                              collective_buffer_bytes=4096)
        dag = plan_transition(current, target, MODELS, devices_per_node=4, state=STATE, budget=budget)
        if dag.ops and check_feasibility(dag, STATE, budget).feasible:
            n -= 1
            yield dag, budget


def test_instance_has_the_dags_durations_edges_and_memory():
    for dag, budget in _random_pairs(10):
        inst = sched.build_instance(dag, STATE, LINKS, budget, tick_s=1e-6, mem_unit_bytes=1)
        assert [j.op_id for j in inst.jobs] == [op.id for op in dag.ops]
        assert len(inst.edges) == len(dag.edges)
        for op, job in zip(dag.ops, inst.jobs):
            seconds, _ = op_duration_s(op, STATE.sizes, LINKS)
            assert job.duration_s == seconds
            assert (job.ticks > 0) == (seconds > 0) and job.ticks >= seconds / 1e-6 - 1e-6
            assert set(job.ports) <= set(op.devices)
            for x, (alloc, transient, free) in STATE.op_bytes(op, budget.collective_buffer_bytes).items():
                assert job.up_mem.get(x, 0) == alloc + transient
                assert job.down_mem.get(x, 0) == transient + free
        for a, b in inst.edges:
            assert inst.precedes(a, b)
        assert inst.limit_mem == budget.limit_bytes
        in_mib = sched.build_instance(dag, STATE, LINKS, budget)
        for exact, job in zip(inst.jobs, in_mib.jobs):  # rounded so that MiB never looks roomier
            assert all(job.up_mem[x] * MIB >= v for x, v in exact.up_mem.items())
            assert all(job.down_mem.get(x, 0) * MIB <= v for x, v in exact.down_mem.items())


def test_greedy_replay_is_estimate_l_tran():
    for dag, budget in _random_pairs(15, seed=1):
        inst = sched.build_instance(dag, STATE, LINKS, budget)
        cost = estimate_l_tran(dag, STATE.sizes, LINKS)
        starts = sched.greedy_starts(inst, ticks=False)
        assert sched.makespan(inst, starts, ticks=False) == cost.l_tran_s
        assert starts == [cost.start_s[op.id] for op in dag.ops]
        # Precedence and ports always hold; memory is what the benchmark reports.
        problems = sched.schedule_problems(inst, sched.greedy_starts(inst))
        assert not [p for p in problems if "memory" not in p]


def test_serial_schedule_is_what_check_feasibility_walks():
    for dag, budget in _random_pairs(10, seed=2):  # so it is a valid horizon and big-M
        inst = sched.build_instance(dag, STATE, LINKS, budget, mem_unit_bytes=1)
        serial = sched.serial_starts(inst)
        assert sched.makespan(inst, serial) == sum(j.ticks for j in inst.jobs)
        assert sched.schedule_problems(inst, serial) == []


def _job(name, ticks, ports=(), up=None, down=None):
    return sched.Job(name, ticks * 1e-6, ticks, tuple(ports), up or {}, down or {})


def _instance(jobs, edges, *, base=None, limit=1000):
    reaches = [0] * len(jobs)
    for a, b in edges:  # hand-made instances: edges listed so that one pass closes them
        reaches[a] |= 1 << b | reaches[b]
    return sched.Instance(tuple(jobs), tuple(edges), tuple(range(len(jobs))), base or {0: 0}, limit, 1e-6,
                          MIB, tuple(reaches))


# C can run on port 1 while A runs on port 0. Placed in order, B (after A) takes port 1 from 10 on;
# the greedy back-fills C into the gap before it: 20, the optimum (appending to each port's
# timeline, as the greedy once did, gave 30).
NO_BACKFILL = _instance([_job("A", 10, [0]), _job("B", 10, [1]), _job("C", 10, [1])], [(0, 1)])
# A and B use different ports but each takes 60 of device 0's 100 MiB: they cannot overlap.
MEMORY = _instance([_job("A", 10, [1], up={0: 60}, down={0: 60}),
                    _job("B", 10, [2], up={0: 60}, down={0: 60})], [], base={0: 0}, limit=100)
# B frees what A needs; A and B overlap only if B ends by the time A starts (release at the end).
RELEASE = _instance([_job("A", 10, [1], up={0: 50}), _job("B", 10, [2], down={0: 50})], [],
                    base={0: 80}, limit=100)


def test_schedule_problems_names_what_breaks():
    assert sched.greedy_starts(NO_BACKFILL) == [0, 10, 0]
    assert sched.schedule_problems(NO_BACKFILL, [0, 10, 0]) == []
    assert sched.schedule_problems(NO_BACKFILL, [0, 10, 20]) == []
    assert sched.schedule_problems(NO_BACKFILL, [0, 5, 20]) == ["B starts before A ends"]
    assert sched.schedule_problems(NO_BACKFILL, [0, 10, 15]) == ["device 1: C overlaps B"]
    assert sched.schedule_problems(MEMORY, [0, 0]) == ["device 0: memory 120 > 100 at tick 0"]
    assert sched.schedule_problems(MEMORY, [0, 10]) == []  # A's release at 10 is free for B
    assert sched.schedule_problems(RELEASE, [0, 0]) == ["device 0: memory 130 > 100 at tick 0"]
    assert sched.schedule_problems(RELEASE, [10, 0]) == []


@pytest.mark.parametrize("instance, greedy, optimum, without_memory",
                         [(NO_BACKFILL, 20, 20, 20), (MEMORY, 10, 20, 10), (RELEASE, 10, 20, 10)])
def test_exact_models_find_the_known_optimum(instance, greedy, optimum, without_memory):
    if not (HAVE_ORTOOLS or HAVE_SCIP):
        pytest.skip("neither ortools nor pyscipopt installed (pip install -e .[bench])")
    assert sched.makespan(instance, sched.greedy_starts(instance)) == greedy
    solutions = []
    if HAVE_ORTOOLS:
        solutions.append(sched.solve_cpsat(instance, time_limit_s=10, workers=1, hint=None))
        free = sched.solve_cpsat(instance, time_limit_s=10, workers=1, hint=None, memory=False)
        assert free.makespan == without_memory and free.optimal
    if HAVE_SCIP:
        solutions.append(sched.solve_scip(instance, time_limit_s=10, hint=None))
    for sol in solutions:
        assert (sol.makespan, sol.optimal) == (optimum, True), sol.solver
        assert sched.schedule_problems(instance, sol.starts) == []


@pytest.mark.skipif(not HAVE_ORTOOLS, reason="ortools not installed (pip install -e .[bench])")
def test_cpsat_never_beats_a_lower_bound_nor_loses_to_the_greedy():
    for dag, budget in _random_pairs(6, seed=3):
        inst = sched.build_instance(dag, STATE, LINKS, budget, mem_unit_bytes=1)
        greedy = sched.greedy_starts(inst)
        sol = sched.solve_cpsat(inst, time_limit_s=10, workers=1, hint=None)
        assert sol.optimal and sched.schedule_problems(inst, sol.starts) == []
        assert max(sched._tail(inst, sched.durations(inst, True))) <= sol.makespan
        if not sched.schedule_problems(inst, greedy):
            assert sol.makespan <= sched.makespan(inst, greedy)
