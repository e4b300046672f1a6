"""``L̂_tran``: per-op costs from bytes over links plus communicator set-up, and the critical path."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings, strategies as st

from nereusd.cost.model import CostModel
from nereusd.errors import PlanError
from nereusd.models import ModelSpec
from nereusd.plan import Candidate, ModelStage, Plan, Role, Stage
from nereusd.config.site import load_site
from nereusd.transition import (
    AdamStateSizes,
    CostModelLinks,
    MemoryBudget,
    SiteLinkCosts,
    assess_transition,
    estimate_l_tran,
    op_duration_s,
    plan_transition,
)
from nereusd.transition.cost import (best_list_schedule, bottleneck_order, critical_path_order, list_schedule,
                                     makespan_lower_bound)
from tests.support.specs import TINY_MODELS as MODELS

SIZES = AdamStateSizes()  # 14 bytes moved per element in training
AT = ModelStage(Role.ACTOR, Stage.TRAINING)
CT = ModelStage(Role.CRITIC, Stage.TRAINING)
P = 39_200
LINKS = SiteLinkCosts(devices_per_node=4, intra_node_gbps=100.0, inter_node_gbps=25.0, hbm_gbps=1000.0,
                      intra_node_latency_s=5e-6, inter_node_latency_s=1e-5, setup_s=0.5)


def dag_for(cur: Candidate, tgt: Candidate, m: ModelStage = AT):
    return plan_transition(Plan({m: cur}), Plan({m: tgt}), MODELS, devices_per_node=4)


def test_extend_across_nodes():
    cost = estimate_l_tran(dag_for(Candidate(1, 1, 1, (0,)), Candidate(1, 1, 1, (4,))), SIZES, LINKS)
    transfer = 1e-5 + 14 * P / 25e9
    assert cost.duration_s == pytest.approx({"actor/training:extend0": 0.5 + transfer,
                                             "actor/training:destroy0": 0.0})
    assert cost.l_tran_s == pytest.approx(0.5 + transfer)
    assert cost.critical_path == ("actor/training:extend0", "actor/training:destroy0")
    assert cost.bytes_moved == 14 * P


def test_extend_inside_a_node_is_cheaper():
    cost = estimate_l_tran(dag_for(Candidate(1, 1, 1, (0,)), Candidate(1, 1, 1, (1,))), SIZES, LINKS)
    assert cost.l_tran_s == pytest.approx(0.5 + 5e-6 + 14 * P / 100e9)


def test_split_gathers_the_missing_half():
    # tp2 → tp1 on device 0: device 0 receives everything but its own half and the replicated
    # norms (4·2·32 + 32 elements) from device 1 in one message; then device 1 is destroyed.
    dag = dag_for(Candidate(2, 1, 1, (0, 1)), Candidate(1, 1, 1, (0,)))
    assert [op.id for op in dag.ops] == ["actor/training:split0", "actor/training:destroy0"]
    received = P - 19_744
    assert sum(r.shard.numel for r in dag.ops[0].routes) == received
    seconds, moved = op_duration_s(dag.ops[0], SIZES, LINKS)
    assert moved == 14 * received
    assert seconds == pytest.approx(0.5 + 5e-6 + 14 * received / 100e9)


def test_a_source_sending_to_many_serialises_its_sends_and_set_ups():
    # One replica on device 0 feeds three new ones on node 1: device 0 sends three messages and
    # creates three pair communicators one after another.
    dag = dag_for(Candidate(1, 1, 1, (0,)), Candidate(1, 1, 4, (0, 4, 5, 6)))
    cost = estimate_l_tran(dag, SIZES, LINKS)
    assert cost.l_tran_s == pytest.approx(3 * 0.5 + 3 * (1e-5 + 14 * P / 25e9))


def test_independent_model_stages_overlap():
    cur = Plan({AT: Candidate(1, 1, 1, (0,)), CT: Candidate(1, 1, 1, (1,))})
    tgt = Plan({AT: Candidate(1, 1, 2, (0, 2)), CT: Candidate(1, 1, 2, (1, 3))})
    dag = plan_transition(cur, tgt, MODELS, devices_per_node=4)
    cost = estimate_l_tran(dag, SIZES, LINKS)
    assert cost.l_tran_s == pytest.approx(max(cost.duration_s.values()))
    assert cost.start_s == {"actor/training:extend0": 0.0, "critic/training:extend0": 0.0}


def test_no_op_transition_costs_nothing():
    plan = Plan({AT: Candidate(1, 1, 1, (0,))})
    cost = estimate_l_tran(plan_transition(plan, plan, MODELS, devices_per_node=1), SIZES, LINKS)
    assert (cost.l_tran_s, cost.critical_path, cost.bytes_moved) == (0.0, (), 0)


def test_site_and_cost_model_links():
    site = load_site("local")
    ideal = SiteLinkCosts.from_site(site)
    assert ideal.transfer_s(1e6, 0, 1) == pytest.approx(2e-3 + 1e6 / 1e9)
    assert ideal.transfer_s(1e6, 2, 2) == pytest.approx(2e6 / 8e9)
    assert ideal.communicator_setup_s((0, 1)) == 0.02 and ideal.communicator_setup_s((3,)) == 0.0
    learned = CostModelLinks(CostModel(site))
    # The calibrated model divides peak by an efficiency ≤ 1, so it never predicts faster.
    assert learned.transfer_s(1e6, 0, 1, "broadcast") >= ideal.transfer_s(1e6, 0, 1)
    assert learned.communicator_setup_s((0, 1)) == pytest.approx(0.02)
    dag = dag_for(Candidate(1, 1, 1, (0,)), Candidate(1, 1, 1, (1,)))
    assert estimate_l_tran(dag, SIZES, learned).l_tran_s >= estimate_l_tran(dag, SIZES, ideal).l_tran_s


def test_assess_transition_on_a_site():
    """Admission's view: the paper's 16 → 32 GPU example (actor TP 1 → 2, critic DP 2 → 4)."""
    site = load_site("h200-ib")
    spec = ModelSpec(vocab_size=1024, hidden_size=256, intermediate_size=512, num_layers=8, num_heads=8,
                     num_kv_heads=8)
    ag = ModelStage(Role.ACTOR, Stage.GENERATION)
    cur = Plan({ag: Candidate(1, 4, 2, tuple(range(8))), CT: Candidate(1, 4, 2, tuple(range(8, 16)))})
    tgt = Plan({ag: Candidate(2, 4, 2, tuple(range(16))), CT: Candidate(1, 4, 4, tuple(range(16, 32)))})
    a = assess_transition(cur, tgt, {r: spec for r in Role}, site, cost_model=CostModel(site))
    assert a.feasible and a.reason == "" and a.l_tran_s > 0
    assert {op.kind.value for op in a.dag.ops} >= {"extend", "destroy", "merge"}
    tiny = assess_transition(cur, tgt, {r: spec for r in Role}, site,
                             budget=MemoryBudget(capacity_bytes=10_000))
    assert not tiny.feasible and tiny.reason.startswith("transition does not fit memory: device")


# The list schedule behind L̂_tran, on hand-made and random job sets (durations in ticks,
# ports = devices whose link a job uses, preds = DAG edges).

def _makespan(order, duration, ports, preds) -> float:
    start, _ = list_schedule(order, duration, ports, preds)
    return max((start[x] + duration[x] for x in order), default=0)


def _topological_orders(jobs, preds):
    def extend(placed, rest):
        if not rest:
            yield list(placed)
        for x in sorted(rest):
            if all(p in placed for p in preds.get(x, ())):
                yield from extend(placed + [x], rest - {x})
    yield from extend([], frozenset(jobs))


def test_forward_backward_justification_finds_a_shorter_schedule():
    # Jobs 0 and 1 on ports {1, 2} and {0, 2}; job 2 (3 ticks, port 0) waits for both, job 3
    # (port 1, 2) for job 0; job 4 (5 ticks, port 1) is free. Critical-path and index order both
    # give 8 ticks; one round of justification moves job 4 first: 7, the optimum.
    duration = {0: 1, 1: 1, 2: 3, 3: 1, 4: 5}
    ports = {0: [1, 2], 1: [0, 2], 2: [0], 3: [1, 2], 4: [1]}
    preds = {2: [0, 1], 3: [0]}
    optimum = min(_makespan(o, duration, ports, preds) for o in _topological_orders(duration, preds))
    assert optimum == 7
    order, start, _ = best_list_schedule(list(duration), duration, ports, preds, passes=0)
    assert max(start[x] + duration[x] for x in order) == 8
    order, start, _ = best_list_schedule(list(duration), duration, ports, preds)
    assert max(start[x] + duration[x] for x in order) == 7


def test_bottleneck_order_runs_the_busiest_links_jobs_first():
    # Job 0 (2 ticks, port 0) precedes job 1 (3 ticks, ports 1 and 2); job 2 (3 ticks, the same
    # two ports) is free. The critical path ranks job 0's chain (5) above job 2 (3), so critical-
    # path and index order both run job 1 first and job 2 after it: 8 ticks, and justification
    # keeps that. Ports 1 and 2 carry 6 ticks of work: bottleneck order starts job 2 at once, 6.
    duration = {0: 2, 1: 3, 2: 3}
    ports = {0: [0], 1: [1, 2], 2: [2, 1]}
    preds = {1: [0]}
    assert _makespan(critical_path_order([0, 1, 2], duration, preds), duration, ports, preds) == 8
    assert bottleneck_order([0, 1, 2], duration, ports, preds) == [2, 0, 1]
    order, start, _ = best_list_schedule([0, 1, 2], duration, ports, preds)
    assert max(start[x] + duration[x] for x in order) == 6 == makespan_lower_bound([0, 1, 2], duration, ports, preds)


@given(st.integers(0, 2**32 - 1))
@settings(max_examples=150, deadline=None)
def test_best_list_schedule_is_a_valid_schedule_between_the_bound_and_a_plain_list_schedule(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 7)
    duration = {i: rng.choice([0, 1, 2, 3, 5]) for i in range(n)}
    ports = {i: rng.sample(range(3), rng.randint(0, 2)) for i in range(n)}
    preds = {i: [j for j in range(i) if rng.random() < 0.3] for i in range(n)}
    order, start, _ = best_list_schedule(list(range(n)), duration, ports, preds)
    assert sorted(order) == list(range(n)) and list_schedule(order, duration, ports, preds)[0] == start
    for x in range(n):
        assert all(start[x] >= start[p] + duration[p] for p in preds[x])
        for y in range(x):
            if duration[x] and duration[y] and set(ports[x]) & set(ports[y]):
                assert start[x] >= start[y] + duration[y] or start[y] >= start[x] + duration[x]
    end = max(start[x] + duration[x] for x in order)
    optimum = min(_makespan(o, duration, ports, preds) for o in _topological_orders(range(n), preds))
    assert makespan_lower_bound(list(range(n)), duration, ports, preds) <= optimum <= end
    assert end <= _makespan(critical_path_order(list(range(n)), duration, preds), duration, ports, preds)
    assert end <= _makespan(list(range(n)), duration, ports, preds)
    assert end <= _makespan(bottleneck_order(list(range(n)), duration, ports, preds), duration, ports, preds)


def test_a_host_staged_split_pays_the_copy_out_and_back():
    """Receiver 0 copies its tp2 half (14·19,744 bytes moved per element) to host memory and back
    into the new holding, after the exchange, at the link's host bandwidth."""
    import dataclasses
    dag = dag_for(Candidate(2, 1, 1, (0, 1)), Candidate(1, 1, 1, (0,)))
    split = dataclasses.replace(dag.ops[0], host_staged=((0, 19_744),))
    received = P - 19_744
    links = dataclasses.replace(LINKS, host_link_gbps=20.0)
    seconds, moved = op_duration_s(split, SIZES, links)
    assert moved == 14 * received
    assert seconds == pytest.approx(0.5 + 5e-6 + 14 * received / 100e9 + 2 * 14 * 19_744 / 20e9)
    with pytest.raises(PlanError, match="host_link_gbps"):
        op_duration_s(split, SIZES, LINKS)
    assert SiteLinkCosts.from_site(load_site("a100-ib")).host_transfer_s(25e9) == pytest.approx(1.0)


def test_a_host_staged_merge_pays_the_whole_out_and_its_slice_back():
    """tp1 → tp2 on devices 0, 1: device 0 copies the whole model out (14·P) and its tp2 half
    back (14·19,744) from the host copy instead of slicing it in device memory; its remote
    pieces are priced as before."""
    import dataclasses
    dag = dag_for(Candidate(1, 1, 2, (0, 1)), Candidate(2, 1, 1, (0, 1)))
    merge = next(op for op in dag.ops if op.kind.value == "merge")
    links = dataclasses.replace(LINKS, host_link_gbps=20.0)
    plain, _ = op_duration_s(merge, SIZES, links)
    staged, _ = op_duration_s(dataclasses.replace(merge, host_staged=((0, P), (1, P))), SIZES, links)
    local = sum(r.shard.numel for r in merge.routes if r.src == r.dst == 0)
    assert local == 19_744
    assert staged - plain == pytest.approx((14 * P + 14 * local) / 20e9 - 2 * 14 * local / 1000e9)
