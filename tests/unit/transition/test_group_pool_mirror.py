"""nereusd's copy of the workers' group pools (:class:`GroupPoolMirror`) and the bookkeeping it
shares with them (:class:`IdleGroups`, which ``emu.state.groups.GroupPool`` keeps its groups in):
which communicators a transition takes back from the pools and which it creates, and what
``L̂_tran`` then prices."""

from __future__ import annotations

from nereusd.plan import Candidate, ModelStage, Plan, Role, Stage
from nereusd.transition import AdamStateSizes, SiteLinkCosts, estimate_l_tran, plan_transition
from nereusd.transition.comms import GroupPoolMirror, IdleGroups, communicator_plan, created_groups
from nereusd.transition.ops import TransitionDag
from tests.support.specs import TINY_MODELS as MODELS

AT = ModelStage(Role.ACTOR, Stage.TRAINING)
SIZES = AdamStateSizes()
LINKS = SiteLinkCosts(devices_per_node=4, intra_node_gbps=100.0, inter_node_gbps=25.0, hbm_gbps=1000.0,
                      intra_node_latency_s=5e-6, inter_node_latency_s=1e-5, setup_s=0.5)


def plan(tp: int, pp: int, dp: int) -> Plan:
    return Plan({AT: Candidate(tp, pp, dp, tuple(range(tp * pp * dp)))})


def dag(a: Plan, b: Plan) -> TransitionDag:
    return plan_transition(a, b, MODELS, devices_per_node=4)


def test_idle_groups_take_the_oldest_of_a_key_and_evict_the_oldest_past_capacity():
    idle: IdleGroups[str] = IdleGroups(capacity=2)
    assert idle.put((0, 1), "a") == [] and idle.put((0, 1), "b") == []
    assert idle.put((2, 3), "c") == ["a"]            # past capacity: the oldest goes
    assert idle.take((0, 1)) == (True, "b") and idle.take((0, 1)) == (False, None)
    assert len(idle) == 1
    idle.clear()
    assert idle.take((2, 3)) == (False, None)


def test_created_groups_are_one_per_op_and_device_set_as_the_workers_create_them():
    assert created_groups([("x", (1, 0)), ("x", (0, 1)), ("y", (0, 1)), ("z", (3,)), ("z", (3, 3))]) == [
        ("x", (0, 1)), ("y", (0, 1))]


def test_a_transition_back_takes_the_groups_the_way_there_handed_back():
    """No sync DAGs here (one model-stage): the groups of ``S → S*`` are idle after it ran, and
    ``S* → S`` over the same device sets takes them; ``L̂_tran`` of the way back then prices no
    set-up for them. A new world empties the pools."""
    a, b = plan(2, 1, 2), plan(1, 2, 2)
    there, back = dag(a, b), dag(b, a)
    mirror = GroupPoolMirror(lambda p: [])
    assert mirror.reused(back) == frozenset()
    version = mirror.version
    mirror.ran(there)
    assert mirror.version != version
    idle = [k for k, _ in mirror.idle.entries]
    assert sorted(idle) == sorted(g for _, g in created_groups(communicator_plan(there)))
    reused = mirror.reused(back)
    expected = []
    pool = list(idle)
    for key in created_groups(communicator_plan(back)):
        if key[1] in pool:
            pool.remove(key[1])
            expected.append(key)
    assert reused == frozenset(expected) and reused
    full = estimate_l_tran(back, SIZES, LINKS).l_tran_s
    assert estimate_l_tran(back, SIZES, LINKS, reused).l_tran_s < full - LINKS.setup_s / 2   # every set-up gone
    mirror.world_formed()
    assert mirror.reused(back) == frozenset() and mirror.held == []


def test_weight_sync_groups_are_held_and_handed_back_at_the_next_transition():
    """The running plan's weight-sync groups are held (:meth:`built`); a transition hands them
    back and takes its target's, creating only those the pool lacks; capacity bounds what stays."""
    syncs = {plan(2, 1, 2).key(): [("s", (0, 1)), ("s", (2, 3))], plan(1, 2, 2).key(): [("s", (0, 1, 2, 3))]}
    a, b = plan(2, 1, 2), plan(1, 2, 2)
    mirror = GroupPoolMirror(lambda p: syncs.get(p.key(), []), capacity=64)
    mirror.built(a)
    assert mirror.held == [(0, 1), (2, 3)]
    keep = TransitionDag(a, a, (), ())
    assert mirror.sync_created(keep) == 0            # the same sync groups come straight back
    there = dag(a, b)
    own = [g for _, g in created_groups(communicator_plan(there))]
    assert mirror.sync_created(there) == (0 if (0, 1, 2, 3) in own else 1)
    mirror.ran(there)
    assert mirror.held == [(0, 1, 2, 3)]
    idle = [k for k, _ in mirror.idle.entries]
    assert idle.count((0, 1)) >= 1 and idle.count((2, 3)) >= 1   # a's sync groups, handed back
    small = GroupPoolMirror(lambda p: syncs.get(p.key(), []), capacity=1)
    small.built(a)
    small.ran(there)
    assert len(small.idle) == 1
