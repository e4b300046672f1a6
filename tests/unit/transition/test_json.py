"""The transition DAG travels to workers as JSON: exact round trips and strict refusals."""

from __future__ import annotations

import json

import pytest

from nereusd.errors import PlanError
from nereusd.plan import Candidate, ModelStage, Plan, Role, Stage
from nereusd.transition import Op, OpKind, TransitionDag, plan_transition, validate
from nereusd.transition.ops import SCHEMA_VERSION
from tests.support.specs import TINY_MODELS as MODELS

AG = ModelStage(Role.ACTOR, Stage.GENERATION)
AT = ModelStage(Role.ACTOR, Stage.TRAINING)
CT = ModelStage(Role.CRITIC, Stage.TRAINING)
RI = ModelStage(Role.REWARD, Stage.INFERENCE)


@pytest.fixture(scope="module")
def dag() -> TransitionDag:
    """Every op kind: split, destroy, extend, merge, create, and a discard."""
    cur = Plan({AT: Candidate(4, 1, 1, (0, 1, 2, 3)), CT: Candidate(1, 2, 1, (4, 5)),
                RI: Candidate(1, 1, 1, (6,))})
    tgt = Plan({AT: Candidate(2, 1, 2, (0, 1, 2, 3)), CT: Candidate(2, 2, 1, (4, 6, 5, 7)),
                AG: Candidate(2, 1, 1, (6, 7))})
    return plan_transition(cur, tgt, MODELS, devices_per_node=4)


def _split(data: dict) -> dict:
    """The first Split op of a DAG's JSON form (receiver 0 among its target devices)."""
    op = next(o for o in data["ops"] if o["kind"] == "split")
    assert 0 in op["target_devices"]
    return op


def test_round_trip_is_exact(dag):
    assert {op.kind for op in dag.ops} == set(OpKind)
    text = dag.to_json()
    back = TransitionDag.from_json(text)
    assert back == dag and back.to_json() == text
    validate(back)
    assert [Op.from_dict(o.to_dict()) for o in dag.ops] == list(dag.ops)


def test_a_host_staged_split_round_trips(dag):
    import dataclasses
    split = next(op for op in dag.ops if op.kind is OpKind.SPLIT)
    assert split.kind is OpKind.SPLIT and split.host_staged == () and "host_staged" not in split.to_dict()
    staged = dataclasses.replace(split, host_staged=((split.target_devices[0], 123),))
    assert staged.to_dict()["host_staged"] == [[split.target_devices[0], 123]]
    assert Op.from_dict(json.loads(json.dumps(staged.to_dict()))) == staged


def test_json_is_plain_and_versioned(dag):
    data = json.loads(dag.to_json())
    assert data["version"] == SCHEMA_VERSION
    assert set(data) == {"version", "current", "target", "ops", "edges", "staging_bytes"}
    extend = next(o for o in data["ops"] if o["kind"] == "extend")
    src, dst, shard = extend["routes"][0]
    assert isinstance(src, int) and isinstance(dst, int) and shard[0].startswith("model.")


@pytest.mark.parametrize("mutate,message", [
    (lambda d: d.update(version=99), "schema version 99"),
    (lambda d: d.update(extra=1), "unknown field 'extra'"),
    (lambda d: d["ops"][0].update(kind="teleport"), "unknown kind 'teleport'"),
    (lambda d: d["ops"][0].pop("routes"), "missing field 'routes'"),
    (lambda d: d["ops"][0].update(colour="red"), "unknown field 'colour'"),
    (lambda d: d["ops"][0].update(model_stage="actor/dreaming"), "unknown stage 'dreaming'"),
    (lambda d: d["ops"][0].update(source_positions=[[0, 0]]), "source devices but 1 positions"),
    (lambda d: d["ops"][0].update(routes=[[1, 2]]), "expected \\[src, dst, shard\\]"),
    (lambda d: d["edges"].append(["a", "b", "state"]), "names unknown op 'a'"),
    (lambda d: d["edges"].append([d["ops"][0]["id"], d["ops"][1]["id"], "whim"]), "malformed"),
    (lambda d: d.pop("edges"), "missing field 'edges'"),
    (lambda d: d.update(staging_bytes=-1), "staging_bytes must be an integer >= 0"),
    (lambda d: d.update(staging_bytes="64M"), "staging_bytes must be an integer >= 0"),
    (lambda d: _split(d).update(host_staged=[[99, 10]]), "host-staged devices \\[99\\] must be distinct receivers"),
    (lambda d: _split(d).update(host_staged=[[0, 10], [0, 10]]), "must be distinct receivers"),
    (lambda d: _split(d).update(host_staged=[[0, 0]]), "must have 1 to 1e\\+15 elements"),
    (lambda d: _split(d).update(host_staged=[[0, 10 ** 400]]), "must have 1 to"),
    (lambda d: _split(d).update(host_staged=[[0, True]]), "integer pairs"),
    (lambda d: _split(d).update(host_staged=[[0, 1.5]]), "integer pairs"),
    (lambda d: _split(d).update(host_staged=[["0", "10"]]), "integer pairs"),
    (lambda d: _split(d).update(host_staged=[[0]]), "malformed field"),
    (lambda d: next(o for o in d["ops"] if o["kind"] == "extend").update(host_staged=[[0, 10]]),
     "only a Split or a Merge stages"),
])
def test_malformed_json_is_refused(dag, mutate, message):
    data = json.loads(dag.to_json())
    mutate(data)
    with pytest.raises(PlanError, match=message):
        TransitionDag.from_dict(data)


def test_not_json_is_refused():
    with pytest.raises(PlanError, match="not valid JSON"):
        TransitionDag.from_json("{")
    with pytest.raises(PlanError, match="expected an object"):
        TransitionDag.from_json("[]")
    # an integer literal past Python's digit limit is a ValueError of json, not a JSONDecodeError
    with pytest.raises(PlanError, match="not valid JSON"):
        TransitionDag.from_json('{"staging_bytes": ' + "1" * 5000 + "}")


def test_the_staging_bound_travels_with_the_dag_and_its_slices(dag):
    """The executor stages what the memory model counted: the budget's bound rides in the DAG,
    in its worker slices (sent without their plans) and in older JSON without it (the default)."""
    from nereusd.transition import MemoryBudget, StateModel, AdamStateSizes
    from nereusd.transition.ops import STAGING_BYTES
    budget = MemoryBudget(capacity_bytes=10**9, collective_buffer_bytes=4096)
    planned = plan_transition(dag.current, dag.target, MODELS, devices_per_node=4,
                              state=StateModel(MODELS, AdamStateSizes()), budget=budget)
    assert planned.staging_bytes == 4096 and dag.staging_bytes == STAGING_BYTES
    for part in planned.slices(planned.target.devices()).values():
        back = TransitionDag.from_json(part.to_json(plans=False), plans=part.plans_json())
        assert back.staging_bytes == 4096
    data = json.loads(planned.to_json())
    del data["staging_bytes"]
    assert TransitionDag.from_dict(data).staging_bytes == STAGING_BYTES
