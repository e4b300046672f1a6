"""Global DAG: release-before-acquire edges, stage-order tie-break, and the validator's refusals."""

from __future__ import annotations

import dataclasses

import pytest

from nereusd.errors import PlanError
from nereusd.plan import Candidate, Layout, ModelStage, Plan, Role, Stage
from nereusd.transition import (
    Edge,
    EdgeReason,
    Op,
    OpKind,
    TransitionDag,
    plan_transition,
    topological_order,
    validate,
)
from nereusd.transition.dag import Reachability
from nereusd.transition.validate import two_sat
from tests.support.specs import TINY_MODELS as MODELS

AG = ModelStage(Role.ACTOR, Stage.GENERATION)
AT = ModelStage(Role.ACTOR, Stage.TRAINING)
CT = ModelStage(Role.CRITIC, Stage.TRAINING)


def one(*devices: int, tp: int = 1) -> Candidate:
    return Candidate(tp, 1, len(devices) // tp, tuple(devices))


def edges_of(dag: TransitionDag, reason: EdgeReason) -> list[tuple[str, str]]:
    return [(e.src, e.dst) for e in dag.edges if e.reason is reason]


def test_critic_extend_waits_for_actor_destroy():
    """Paper Fig. 1(b): the critic's new replica on GPU 1 waits until the actor releases it."""
    dag = plan_transition(Plan({AT: one(0, 1), CT: one(2, 3)}), Plan({AT: one(0), CT: one(2, 3, 1)}),
                          MODELS, devices_per_node=4)
    assert [op.id for op in dag.ops] == ["actor/training:destroy0", "critic/training:extend0"]
    assert edges_of(dag, EdgeReason.RESOURCE) == [("actor/training:destroy0", "critic/training:extend0")]
    assert topological_order(dag) == ["actor/training:destroy0", "critic/training:extend0"]


def test_swap_between_model_stages_stays_acyclic_and_earlier_stage_goes_first():
    # actor/generation moves 0 → 1 while actor/training moves 1 → 0: each Extend would wait for
    # the other's Destroy, which waits for its own Extend. One wait is dropped — the later
    # stage's acquisition waits, the earlier (generation) proceeds.
    dag = plan_transition(Plan({AG: one(0), AT: one(1)}), Plan({AG: one(1), AT: one(0)}), MODELS,
                          devices_per_node=2)
    assert edges_of(dag, EdgeReason.STATE) == [("actor/generation:extend0", "actor/generation:destroy0"),
                                               ("actor/training:extend0", "actor/training:destroy0")]
    assert edges_of(dag, EdgeReason.RESOURCE) == [("actor/generation:destroy0", "actor/training:extend0")]
    assert topological_order(dag) == ["actor/generation:extend0", "actor/generation:destroy0",
                                      "actor/training:extend0", "actor/training:destroy0"]


def test_no_edges_between_model_stages_that_keep_their_devices():
    dag = plan_transition(Plan({AG: one(0, 1, tp=2), AT: one(0, 1, tp=2)}),
                          Plan({AG: one(0, 1, 2, 3, tp=2), AT: one(0, 1, tp=2)}), MODELS, devices_per_node=4)
    assert [op.id for op in dag.ops] == ["actor/generation:extend0"] and dag.edges == ()


def test_reachability_refuses_a_cycle():
    r = Reachability(3)
    r.add_edge(0, 1)
    r.add_edge(1, 2)
    assert r.reaches(0, 2) and not r.reaches(2, 0)
    with pytest.raises(AssertionError):
        r.add_edge(2, 0)


def test_two_sat():
    # literal 2v = x_v, 2v+1 = ¬x_v
    assert two_sat(2, [(0, 2), (1, 1), (3, 3)]) is None  # (x0 ∨ x1) ∧ ¬x0 ∧ ¬x1
    sol = two_sat(3, [(0, 2), (1, 1), (5, 2)])  # (x0 ∨ x1) ∧ ¬x0 ∧ (¬x2 ∨ x1)
    assert sol is not None and sol[1] and not sol[0]


# ---- the validator refuses broken DAGs -------------------------------------------------------

MOVE = (Plan({AT: one(0, 1, tp=2)}), Plan({AT: one(4, 5, tp=2)}))


def moved() -> TransitionDag:
    return plan_transition(*MOVE, MODELS, devices_per_node=4)


def test_validator_accepts_what_the_planner_builds():
    validate(moved())


def test_validator_refuses_a_cycle():
    dag = moved()
    bad = dataclasses.replace(dag, edges=dag.edges + (Edge(dag.ops[1].id, dag.ops[0].id),))
    with pytest.raises(PlanError, match="cycle"):
        validate(bad)


def test_validator_refuses_a_destroy_that_frees_a_holding_before_it_is_read():
    dag = moved()
    with pytest.raises(PlanError, match=r"op actor/training:extend0: device 0 does not hold actor/training"):
        validate(dataclasses.replace(dag, edges=()))


def test_validator_refuses_a_race_that_its_own_order_happens_to_avoid():
    """The Destroy waits for an unrelated op, so the walk reads first — but another order frees
    device 0 before the Extend reads it, and the validator must see that."""
    dag = moved()
    cur, tgt = dag.current, Plan({**dag.target.candidates, CT: one(7)})
    create = Op("critic/training:create0", OpKind.CREATE, CT, None, (), (), Layout(1, 1), (7,), ((0, 0),))
    bad = TransitionDag(cur, tgt, dag.ops + (create,), (Edge(create.id, dag.ops[1].id),))
    assert topological_order(bad)[0] == "actor/training:extend0"
    race = "may free device 0's actor/training before actor/training:extend0 reads it"
    with pytest.raises(PlanError, match=race):
        validate(bad)


def test_validator_refuses_a_missing_target_unit():
    dag = moved()
    with pytest.raises(PlanError, match=r"lacks \[\('actor/training', 4\), \('actor/training', 5\)\]"):
        validate(TransitionDag(dag.current, dag.target, dag.ops[1:], ()))


def test_validator_refuses_dropping_the_last_copy_even_if_recreated():
    """Destroy everything, then Create: holdings end right, but the state was lost on the way."""
    cur, tgt = MOVE
    ops = (
        Op("x:destroy0", OpKind.DESTROY, AT, Layout(2, 1), (0, 1), ((0, 0), (0, 1)), None, (), ()),
        Op("x:create0", OpKind.CREATE, AT, None, (), (), Layout(2, 1), (4, 5), ((0, 0), (0, 1))),
    )
    lost = r"actor/training: part \(0, 0\) .* is on no device once \['x:destroy0'\]"
    with pytest.raises(PlanError, match=lost):
        validate(TransitionDag(cur, tgt, ops, (Edge("x:destroy0", "x:create0"),)))


def test_validator_refuses_discard_of_a_model_stage_that_stays():
    dag = plan_transition(Plan({AT: one(0, 1)}), Plan({AT: one(0)}), MODELS, devices_per_node=4)
    bad = dataclasses.replace(dag, ops=(dataclasses.replace(dag.ops[0], discard=True),))
    with pytest.raises(PlanError, match="discard is only for a Destroy of a model-stage the target plan"):
        validate(bad)


def test_validator_refuses_reading_what_a_device_does_not_hold():
    dag = moved()
    bad_extend = dataclasses.replace(dag.ops[0], source_devices=(2, 3))
    with pytest.raises(PlanError, match="device 2 does not hold actor/training"):
        validate(dataclasses.replace(dag, ops=(bad_extend,) + dag.ops[1:]))


def test_dag_refuses_unknown_ops_and_duplicate_ids():
    dag = moved()
    with pytest.raises(PlanError, match="names unknown op 'nope'"):
        TransitionDag(dag.current, dag.target, dag.ops, (Edge("nope", dag.ops[0].id),))
    with pytest.raises(PlanError, match="used twice"):
        TransitionDag(dag.current, dag.target, dag.ops + dag.ops[:1], ())
    with pytest.raises(PlanError, match="no op 'nope'"):
        dag.op("nope")
