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


def test_the_mirror_decides_as_the_workers_pools_do(monkeypatch):
    """The workers' own ``Communicators`` and ``GroupPool`` (``torch.distributed.new_group``
    counted instead of called) against the mirror, over random transitions of two model-stages
    on 16 devices, ranks in a shuffled world order, long enough to fill the pool past its 32
    idle groups, with a world re-formation and the kept workers' rebuild (an empty DAG) halfway:
    for every transition the mirror counts exactly the DAG groups and weight-sync groups the
    workers create (fewer would under-price ``L̂_tran``; more would teach the DAG scale and the
    per-group sync set-up too little)."""
    import random

    import torch.distributed as dist

    from emu.state.communicators import Communicators, create_communicators
    from emu.state.groups import GroupPool
    from nereusd.transition import sync_communicator_plan, weight_sync_dags

    made: list[tuple[int, ...]] = []
    monkeypatch.setattr(dist, "new_group", lambda ranks, backend=None: made.append(tuple(ranks)) or object())
    monkeypatch.setattr(dist, "destroy_process_group", lambda group=None: None)
    generation = ModelStage(Role.ACTOR, Stage.GENERATION)

    class Worker:   # what emu.worker.transition_tasks does with its pool
        def __init__(self, world):
            self.pool, self.syncs = GroupPool(), []
            self.rank_of = {d: i for i, d in enumerate(world)}.__getitem__

        def plan_syncs(self, plan):
            for comms in self.syncs:
                comms.destroy()
            self.syncs = []
            for sync in weight_sync_dags(plan, MODELS, devices_per_node=4).values():
                comms = Communicators(self.rank_of, pool=self.pool)
                create_communicators(sync, comms)
                self.syncs.append(comms)

        def transition(self, dag):
            before = len(made)
            comms = Communicators(self.rank_of, pool=self.pool)
            create_communicators(dag, comms, communicator_plan(dag))
            own = len(made) - before
            comms.destroy()
            before = len(made)
            self.plan_syncs(dag.target)
            return own, len(made) - before

        def reform(self, world):
            for comms in self.syncs:
                comms.destroy()
            self.syncs = []
            self.pool.clear()
            self.rank_of = {d: i for i, d in enumerate(world)}.__getitem__

    rng = random.Random(1)

    def candidate(count):
        while True:
            tp, pp = rng.choice([1, 2, 4]), rng.choice([1, 2])
            if count % (tp * pp) == 0:
                devices = sorted(rng.sample(range(16), count))
                return Candidate(tp, pp, count // (tp * pp), tuple(devices))

    def random_plan():
        return Plan({AT: candidate(rng.choice([4, 8, 16])), generation: candidate(rng.choice([4, 8]))})

    world = list(range(16))
    rng.shuffle(world)
    worker = Worker(world)
    mirror = GroupPoolMirror(lambda p: sync_communicator_plan(p, MODELS, devices_per_node=4))
    current = random_plan()
    worker.plan_syncs(current)
    mirror.built(current)
    checked = fullest = 0
    for i in range(60):
        if i == 30:   # a re-formed world, the plan rebuilt on it (kept workers, a pool change)
            rng.shuffle(world)
            worker.reform(world)
            mirror.world_formed()
            rebuild = TransitionDag(current, current, (), ())
            assert worker.transition(rebuild) == (0, mirror.sync_created(rebuild))
            mirror.ran(rebuild)
        target = random_plan()
        try:
            step = dag(current, target)
        except Exception:   # noqa: BLE001 - a layout the tiny model cannot take
            continue
        own = len(created_groups(communicator_plan(step))) - len(mirror.reused(step))
        sync = mirror.sync_created(step)
        assert worker.transition(step) == (own, sync), f"transition {i}"
        mirror.ran(step)
        assert len(worker.pool.idle) == len(mirror.idle)
        fullest = max(fullest, len(mirror.idle))
        current = target
        checked += 1
    assert checked >= 30 and fullest == 32
