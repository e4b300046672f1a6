"""Two model-stages change layout on the same ranks in one transition DAG: state stays bit-exact.

actor/training (parameters and Adam state) and actor/inference (parameters) share devices 0 and
1. Every transition of the cycle below changes both at once, and the planner puts an op of each
at the same DAG level with a communicator over the same two ranks (a Split's all-gather next to
an Extend's broadcasts, or two all-gathers of different sizes), so the executor runs them
concurrently, one thread each. With communicators keyed by their ranks only, both ops issued
collectives on one process group in an order that differed between the ranks (gloo size
mismatch, or pieces paired with the wrong op); keyed per op (:class:`emu.state.communicators.Communicators`)
they cannot meet. Two gloo ranks run the cycle a few times through :class:`TransitionExecutor`;
after every transition each holding must equal the canonical slices exactly (``torch.equal``)
with its logical state, and nothing else may be held.
"""

from __future__ import annotations

import time


from tests.support.distributed import run_distributed
from emu.state.devmem import DeviceMemory
from emu.state.executor import TransitionExecutor, levels
from emu.state.primitives import HoldingStore, op_communicators
from emu.state.unit import slots_for
from nereusd.plan import Candidate, ModelStage, Plan, Role, Stage
from nereusd.shards import value_head_for
from nereusd.transition import plan_transition
from tests.support.holdings import check_holdings, fill, logical_for, specs_for
from tests.support.specs import TINY as SPEC, TINY_MODELS as MODELS

TRAIN = ModelStage(Role.ACTOR, Stage.TRAINING)
INFER = ModelStage(Role.ACTOR, Stage.INFERENCE)
BOTH_DP2 = Plan({TRAIN: Candidate(1, 1, 2, (0, 1)), INFER: Candidate(1, 1, 2, (0, 1))})
CYCLE = [
    Plan({TRAIN: Candidate(2, 1, 1, (0, 1)), INFER: Candidate(1, 1, 1, (0,))}),
    BOTH_DP2,            # training Split (all-gather) ∥ inference Extend 0→1 (broadcasts)
    Plan({TRAIN: Candidate(2, 1, 1, (0, 1)), INFER: Candidate(2, 1, 1, (1, 0))}),
    BOTH_DP2,            # training Split ∥ inference Split: all-gathers of 3 and 1 slots
    Plan({TRAIN: Candidate(2, 1, 1, (0, 1)), INFER: Candidate(1, 1, 1, (1,))}),
    BOTH_DP2,            # training Split ∥ inference Extend 1→0
]
ROUNDS = 4
SEED = 11


def transitions() -> list[tuple[Plan, Plan]]:
    plans = CYCLE * ROUNDS + CYCLE[:1]
    return list(zip(plans, plans[1:]))


def shared_concurrent(dag) -> bool:
    """Whether two ops of different model-stages at one level use communicators over the same ranks."""
    seen: dict[tuple[int, tuple[int, ...]], ModelStage] = {}
    level = levels(dag)
    for op in dag.ops:
        for devices in op_communicators(op):
            key = (level[op.id], tuple(sorted(devices)))
            if seen.setdefault(key, op.model_stage) != op.model_stage:
                return True
    return False


def check(store: HoldingStore, memory: DeviceMemory, plan: Plan, rank: int, where: str) -> None:
    check_holdings(store, plan, rank, SEED, where)
    assert memory.in_use_bytes == sum(h.nbytes for h in store.items.values()), where


def body(rank: int, world: int) -> dict:
    memory = DeviceMemory(rank, 1 << 30)
    store = HoldingStore(memory)
    first = CYCLE[0]
    for m, cand in first.items():
        if rank in cand.devices:
            _, p, t = cand.coords_of(rank)
            h = store.allocate((m, SPEC, value_head_for(m.role), slots_for(m)), cand.layout, (p, t),
                               logical_for(SEED, m))
            fill(h, SEED)
            store.put(h)
    report = {"transitions": 0, "ops": 0, "elapsed_s": 0.0}
    for i, (current, target) in enumerate(transitions()):
        dag = plan_transition(current, target, MODELS, devices_per_node=1 << 20)
        start = time.perf_counter()
        ex = TransitionExecutor(dag, rank, store, specs_for(target))
        ex.prepare()
        ex.run()
        ex.close()
        report["elapsed_s"] += time.perf_counter() - start
        check(store, memory, target, rank, f"transition {i}: {current.describe()} -> {target.describe()}")
        report["transitions"] += 1
        report["ops"] += len(dag.ops)
    return report


def test_cycle_changes_both_model_stages_on_shared_ranks():
    """The scenario is what the test claims: every transition changes both model-stages, and
    those into ``BOTH_DP2`` run ops of both at one level on communicators over the same ranks."""
    for current, target in transitions():
        assert all(current[m] != target[m] for m in (TRAIN, INFER))
        dag = plan_transition(current, target, MODELS, devices_per_node=1 << 20)
        assert shared_concurrent(dag) == (target == BOTH_DP2), dag.summary()


def test_concurrent_model_stages_on_shared_ranks_are_bit_exact():
    reports = run_distributed(body, 2, timeout_s=90)
    print(reports[0])
    assert all(r["transitions"] == len(transitions()) for r in reports)
