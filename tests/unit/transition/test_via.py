"""The slice-first path of a crossed layout (``nereusd.transition.via``) and the lean DAGs that
:func:`nereusd.transition.fitting_dag` tries when the first one does not fit memory. They run
bit-exact on gloo ranks in ``tests/distributed/test_primitives_transitions.py``."""

from __future__ import annotations

import pytest

from nereusd.errors import PlanError
from nereusd.plan import Candidate, Layout, ModelStage, Plan, Role, Stage
from nereusd.transition import (
    AdamStateSizes,
    MemoryBudget,
    OpKind,
    StateModel,
    chain,
    check_feasibility,
    crossed,
    fitting_dag,
    plan_transition,
    validate,
    via_plan,
)
from tests.support.specs import TINY_MODELS as MODELS

STATE = StateModel(MODELS, AdamStateSizes())
AT = ModelStage(Role.ACTOR, Stage.TRAINING)
CUR = Plan({AT: Candidate(1, 2, 2, (0, 1, 2, 3))})   # replicas [0, 1] and [2, 3], one stage each
TGT = Plan({AT: Candidate(2, 1, 2, (0, 1, 2, 3))})   # two tp2 replicas: T_sub = tp1·pp1, the whole model


def test_crossed_layouts():
    assert crossed(Layout(1, 2), Layout(2, 1)) and crossed(Layout(1, 8), Layout(2, 2))
    assert not crossed(Layout(2, 2), Layout(1, 1)) and not crossed(Layout(1, 1), Layout(2, 4))
    assert not crossed(Layout(2, 1), Layout(2, 1))


def test_via_plan_slices_every_holding_in_place():
    mid = via_plan(CUR, TGT, MODELS)
    c = mid[AT]
    assert (c.tp, c.pp, c.dp) == (2, 2, 1) and c.devices == (0, 2, 1, 3)
    for x in c.devices:   # the T_sup position lies inside the device's current T shard
        _, p, t = c.coords_of(x)
        _, p0, t0 = CUR[AT].coords_of(x)
        assert (p // 1, t // 2) == (p0, t0)
    assert via_plan(CUR, CUR, MODELS) is None   # nothing crossed
    odd = Plan({AT: Candidate(1, 2, 1, (0, 1))})   # dp 1: no two replicas to interleave
    assert via_plan(odd, Plan({AT: Candidate(2, 1, 1, (0, 1))}), MODELS) is None


def test_chain_runs_the_slice_before_the_gather_and_validates():
    mid = via_plan(CUR, TGT, MODELS)
    dag = chain(plan_transition(CUR, mid, MODELS, devices_per_node=4), plan_transition(mid, TGT, MODELS, devices_per_node=4))
    validate(dag)
    assert (dag.current, dag.target) == (CUR, TGT)
    kinds = {op.id: op.kind for op in dag.ops}
    merges = [i for i, k in kinds.items() if k is OpKind.MERGE]
    assert merges and all(":via-merge" in i for i in merges)
    assert all(k is not OpKind.MERGE for i, k in kinds.items() if ":via-" not in i)
    splits = [op for op in dag.ops if op.kind is OpKind.SPLIT]
    assert splits and all(set(dag.predecessors(op.id)) & set(merges) for op in splits)
    with pytest.raises(PlanError, match="must start from"):
        chain(plan_transition(CUR, mid, MODELS, devices_per_node=4), plan_transition(CUR, TGT, MODELS, devices_per_node=4))


def test_fitting_dag_takes_the_slice_first_path_when_the_direct_one_does_not_fit():
    """The direct DAG gathers the whole model (T_sub = tp1·pp1: 548,800 bytes) beside a device's
    stage (274,624); the slice-first one holds at most the target's tp2 half (276,416) beside
    its quarter (138,432)."""
    mid = via_plan(CUR, TGT, MODELS)
    limit = max(STATE.plan_bytes(TGT).values()) + max(STATE.plan_bytes(mid).values())
    budget = MemoryBudget(capacity_bytes=limit, headroom=0.0, collective_buffer_bytes=0)
    direct = plan_transition(CUR, TGT, MODELS, devices_per_node=4, state=STATE, budget=budget)
    assert not check_feasibility(direct, STATE, budget).feasible
    dag, report = fitting_dag(CUR, TGT, MODELS, 4, STATE, budget)
    assert report.feasible and any(":via-merge" in op.id for op in dag.ops)
    validate(dag)
    roomy = MemoryBudget(capacity_bytes=1 << 30)
    plain, report = fitting_dag(CUR, TGT, MODELS, 4, STATE, roomy)
    assert report.feasible and not any(":via-" in op.id for op in plain.ops)   # the first DAG when it fits
