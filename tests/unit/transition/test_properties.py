"""Properties of planned transitions over random plan pairs on 1–16 devices (hypothesis).

An independent executor replays each DAG at the level of parameter slices, in a random order
that respects its edges: every route reads a slice its source really holds, every holding an
op creates is exactly the shard its layout and position call for, no parameter element of a
model-stage is ever on no device, and the end state is the target plan. Memory accounting and
``L_tran`` are checked for consistency on the same DAGs.
"""

from __future__ import annotations

import random
from collections import defaultdict

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nereusd.plan import Candidate, ModelStage, Plan, Role, Stage
from nereusd.shards import Shard, canonical_shapes, shard_dim, shards_of, value_head_for
from nereusd.transition import (
    AdamStateSizes,
    MemoryBudget,
    OpKind,
    SiteLinkCosts,
    StateModel,
    TransitionDag,
    check_feasibility,
    estimate_l_tran,
    plan_transition,
    rebuilt_model_stages,
    topological_order,
)
from tests.support.specs import TINY as SPEC, TINY_MODELS as MODELS

STAGES = [ModelStage(Role.ACTOR, Stage.GENERATION), ModelStage(Role.REWARD, Stage.INFERENCE),
          ModelStage(Role.ACTOR, Stage.TRAINING), ModelStage(Role.CRITIC, Stage.TRAINING)]
SIZES = AdamStateSizes()
STATE = StateModel(MODELS, SIZES)
LINKS = SiteLinkCosts(devices_per_node=4, intra_node_gbps=100.0, inter_node_gbps=25.0, hbm_gbps=1000.0)


@st.composite
def candidates(draw, pool: int) -> Candidate:
    tp = draw(st.sampled_from([t for t in (1, 2, 4, 8) if t <= pool]))
    pp = draw(st.sampled_from([p for p in (1, 2, 4) if tp * p <= pool]))
    dp = draw(st.integers(1, pool // (tp * pp)))
    devices = draw(st.permutations(range(pool)))[: tp * pp * dp]
    return Candidate(tp, pp, dp, tuple(devices))


@st.composite
def plans(draw, pool: int) -> Plan:
    chosen = draw(st.lists(st.sampled_from(STAGES), min_size=0, max_size=3, unique=True))
    return Plan({m: draw(candidates(pool)) for m in chosen})


@st.composite
def plan_pairs(draw):
    pool = draw(st.integers(1, 16))
    current = draw(plans(pool))
    if current and draw(st.booleans()):
        # Mostly the same model-stages on both sides, sometimes one joins or leaves.
        target = Plan({m: draw(candidates(pool)) for m in current})
    else:
        target = draw(plans(pool))
    return current, target, draw(st.sampled_from([1, 2, 4, 8]))


def _covers(pieces: list[Shard], need: Shard) -> bool:
    if any(p.contains(need) for p in pieces):
        return True
    dims = {p.dim for p in pieces if not p.is_full} | ({need.dim} if not need.is_full else set())
    dim = dims.pop() if dims else need.dim
    need = need.along(dim)
    spans = sorted((p.along(dim).start, p.along(dim).stop) for p in pieces if need.contains(p))
    reach = need.start
    for a, b in spans:
        if a > reach:
            return False
        reach = max(reach, b)
    return reach >= need.stop


def replay(dag: TransitionDag, rnd: random.Random) -> list[str]:
    """Run ``dag`` on slices in a random topological order; return the order. Asserts inside."""
    held: dict[tuple, tuple[Shard, ...]] = {}
    for m, cand in dag.current.items():
        vh = value_head_for(m.role)
        for x in cand.devices:
            _, p, t = cand.coords_of(x)
            held[(m, x, cand.layout, (p, t))] = shards_of(SPEC, cand.layout, (p, t), vh)
    preds = defaultdict(set)
    for e in dag.edges:
        preds[e.dst].add(e.src)
    done: list[str] = []
    remaining = [op.id for op in dag.ops]
    while remaining:
        ready = [x for x in remaining if preds[x] <= set(done)]
        assert ready, "no ready op: the DAG has a cycle"
        op = dag.op(rnd.choice(ready))
        remaining.remove(op.id)
        _apply(op, held)
        done.append(op.id)
        for m in dag.current:
            if m in dag.target:
                _assert_whole(m, held, op.id)
    want = set()
    for m, cand in dag.target.items():
        for x in cand.devices:
            _, p, t = cand.coords_of(x)
            want.add((m, x, cand.layout, (p, t)))
    assert set(held) == want
    return done


def _apply(op, held) -> None:
    m, vh = op.model_stage, value_head_for(op.model_stage.role)
    on = defaultdict(list)
    for (hm, x, _, _), shards in held.items():
        if hm == m:
            on[x].extend(shards)
    for r in op.routes:  # every route reads what its source holds before the op
        assert any(s.contains(r.shard) for s in on[r.src]), (op.id, r)
    received = defaultdict(list)
    for r in op.routes:
        received[r.dst].append(r.shard)
    src = list(zip(op.source_devices, op.source_positions))
    dst = list(zip(op.target_devices, op.target_positions))
    if op.kind is OpKind.SPLIT:
        receivers = set(op.target_devices)
        own = {x: held.pop((m, x, op.source_layout, p)) for x, p in src if x in receivers}
        for x, p in dst:
            _create(held, (m, x, op.target_layout, p), list(own[x]) + received[x], vh)
        for x, p in src:
            if x not in receivers:
                assert (m, x, op.source_layout, p) in held
    elif op.kind is OpKind.EXTEND:
        for x, p in src:
            assert (m, x, op.source_layout, p) in held
        for x, p in dst:
            _create(held, (m, x, op.target_layout, p), received[x], vh)
    elif op.kind is OpKind.DESTROY:
        for x, p in src:
            del held[(m, x, op.source_layout, p)]
    elif op.kind is OpKind.MERGE:
        for x, p in src:
            del held[(m, x, op.source_layout, p)]
        for x, p in dst:
            _create(held, (m, x, op.target_layout, p), received[x], vh)
    else:
        for x, p in dst:
            held[(m, x, op.target_layout, p)] = shards_of(SPEC, op.target_layout, p, vh)


def _create(held, key, pieces, vh) -> None:
    assert key not in held, key
    m, x, layout, p = key
    by_name = defaultdict(list)
    for s in pieces:
        by_name[s.name].append(s)
    for need in shards_of(SPEC, layout, p, vh):
        assert _covers(by_name[need.name], need), (key, need)
    held[key] = shards_of(SPEC, layout, p, vh)


def _assert_whole(m, held, after) -> None:
    by_name = defaultdict(list)
    for (hm, _, _, _), shards in held.items():
        if hm == m:
            for s in shards:
                by_name[s.name].append(s)
    for name, shape in canonical_shapes(SPEC, value_head_for(m.role)).items():
        dim = shard_dim(name, SPEC, 2) or 0
        full = Shard(name, dim, 0, shape[dim], shape)
        assert _covers(by_name[name], full), f"{m}: {name} is on no device after {after}"


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plan_pairs(), st.randoms(use_true_random=False))
def test_every_order_of_every_dag_is_correct(pair, rnd):
    current, target, per_node = pair
    dag = plan_transition(current, target, MODELS, devices_per_node=per_node)  # validates
    assert len(topological_order(dag)) == len(dag.ops)
    replay(dag, rnd)
    for m in set(current) & set(target):
        if (current[m].layout, current[m].devices) == (target[m].layout, target[m].devices):
            assert not dag.ops_of(m)
    assert all(op.discard == (op.model_stage not in target) for op in dag.ops if op.kind is OpKind.DESTROY)
    assert TransitionDag.from_json(dag.to_json()) == dag


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plan_pairs(), st.floats(0.0, 1.0), st.randoms(use_true_random=False))
def test_memory_accounting_and_tight_budgets(pair, squeeze, rnd):
    current, target, per_node = pair
    start, end = STATE.plan_bytes(current), STATE.plan_bytes(target)
    need = max([*start.values(), *end.values(), 1])
    # Budgets from ample down to "barely the larger of the two plans": the DAG stays valid.
    capacity = int(need * (1 + 3 * squeeze) / 0.9) + 1
    budget = MemoryBudget(capacity_bytes=capacity, collective_buffer_bytes=256)
    dag = plan_transition(current, target, MODELS, devices_per_node=per_node, state=STATE, budget=budget)
    replay(dag, rnd)
    report = check_feasibility(dag, STATE, budget)
    # the engines the transition keeps hold their gradients throughout; the others are holdings
    rebuilt = rebuilt_model_stages(current, target, {op.model_stage for op in dag.ops})
    start, end = STATE.start_bytes(current, rebuilt), STATE.start_bytes(target, rebuilt)
    assert {x: v for x, v in report.final_bytes.items() if v} == end
    for x in set(start) | set(end):
        assert report.peak_bytes[x] >= max(start.get(x, 0), end.get(x, 0))
    if report.feasible:
        assert max(report.peak_bytes.values(), default=0) <= budget.limit_bytes
    else:
        v = report.violation
        assert v.in_use_bytes + v.needed_bytes > budget.limit_bytes
    cost = estimate_l_tran(dag, SIZES, LINKS)
    if dag.ops:
        path = cost.critical_path
        for a, b in zip(path, path[1:]):  # a DAG edge or a device both use
            assert b in dag.successors(a) or set(dag.op(a).devices) & set(dag.op(b).devices)
            assert abs(cost.start_s[b] - cost.start_s[a] - cost.duration_s[a]) < 1e-9
        assert cost.start_s[path[0]] == 0.0
        assert abs(sum(cost.duration_s[x] for x in path) - cost.l_tran_s) < 1e-9
        assert cost.l_tran_s >= max(cost.duration_s.values())
        for e in dag.edges:
            assert cost.start_s[e.dst] >= cost.start_s[e.src] + cost.duration_s[e.src] - 1e-12
    else:
        assert cost.l_tran_s == 0.0
