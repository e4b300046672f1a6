"""What ``transition_prepare`` sends each worker: its slice of the DAG (the ops it takes part
in, the edges between them), the whole DAG's communicator plan and changed model-stages
(nereusd.transition.runner.prepare_args). The whole DAG to every worker grew as devices × ops."""

from __future__ import annotations

import json

from nereusd import protocol as P
from nereusd.plan import Candidate, ModelStage, Plan, Role, Stage
from nereusd.transition import plan_transition
from nereusd.transition.comms import communicator_plan
from nereusd.transition.ops import TransitionDag
from nereusd.transition.runner import prepare_args

TRAIN = ModelStage(Role.ACTOR, Stage.TRAINING)
GEN = ModelStage(Role.ACTOR, Stage.GENERATION)


def test_each_worker_gets_its_ops_and_the_whole_communicator_plan(tiny_models):
    current = Plan({TRAIN: Candidate(2, 1, 1, (0, 1)), GEN: Candidate(1, 1, 2, (0, 1))})
    target = Plan({TRAIN: Candidate(1, 1, 4, (0, 1, 2, 3)), GEN: Candidate(1, 1, 2, (0, 1))})
    dag = plan_transition(current, target, tiny_models, devices_per_node=4)
    world = [0, 1, 2, 3, 4]   # device 4 takes part in nothing
    args = prepare_args(dag, world)
    assert sorted(args) == world
    whole = [(op_id, list(devices)) for op_id, devices in communicator_plan(dag)]
    for device, a in args.items():
        part = TransitionDag.from_json(a.dag, a.plans)
        assert [op.id for op in part.ops] == [op.id for op in dag.ops if device in op.participants]
        ids = {op.id for op in part.ops}
        assert set(part.edges) == {e for e in dag.edges if e.src in ids and e.dst in ids}
        assert part.current == dag.current and part.target == dag.target
        assert [(o, list(d)) for o, d in a.communicators] == whole   # every rank creates every group, in order
        assert a.changed == ["actor/training"]
        decoded = P.decode(P.encode(P.Task(task_id=1, args=a)))   # it crosses the wire as it is
        assert decoded.args == a
    assert TransitionDag.from_json(args[4].dag, args[4].plans).ops == ()
    assert all(len(a.dag) < len(dag.to_json()) for a in args.values())
    # every op reaches every one of its participants, and nothing else
    assert sorted(op.id for a in args.values() for op in TransitionDag.from_json(a.dag, a.plans).ops) == sorted(
        op.id for op in dag.ops for _ in op.participants)
    assert json.loads(args[0].dag)["version"] == json.loads(dag.to_json())["version"]
    # a slice without its plans is the whole text less current and target, with or without the op cache
    for part in dag.slices(world).values():
        whole = json.loads(part.to_json())
        del whole["current"], whole["target"]
        assert part.to_json(plans=False) == part.to_json(plans=False, op_cache={}) == json.dumps(
            whole, separators=(",", ":"), sort_keys=True)


def test_a_ready_set_is_one_level_on_every_slice():
    """The runner hands out ready sets (one level of the whole DAG); a worker holding only its
    slice must run such a set as one level too. Levels of the slice itself split it differently
    on different ranks — here, on device 2 of this transition, ops of one ready set have levels 0
    and 1 in the slice — and two ranks each running the other's second op first wait on each
    other."""
    from emu.state.executor import TransitionExecutor, levels
    from emu.state.primitives import HoldingStore
    from tests.distributed.test_primitives_transitions import random_case

    dag = random_case(14)[3]
    whole = levels(dag)
    ready_sets = [[x for x, lv in whole.items() if lv == level] for level in sorted(set(whole.values()))]
    split = False
    for device, part in dag.slices(sorted({d for op in dag.ops for d in op.participants})).items():
        ex = TransitionExecutor(part, device, HoldingStore(None), {})
        own = levels(part)
        for ready in ready_sets:
            mine = [x for x in ready if x in own]
            split |= len({own[x] for x in mine}) > 1
            assert len({ex.levels(ready)[x] for x in mine}) <= 1, (device, ready)
    assert split   # the case is what the docstring says
