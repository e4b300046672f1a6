"""Local DAGs of one model-stage: hand-built cases with the op lists written out (paper §6.1)."""

from __future__ import annotations

import pytest

from nereusd.errors import PlanError
from nereusd.models import ModelSpec
from nereusd.plan import Candidate, Layout, ModelStage, Plan, Role, Stage
from nereusd.shards import shards_of
from nereusd.transition import Delta, OpKind, deltas, emu_collection, emu_collections, plan_transition, t_sub

SPEC = ModelSpec(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=8, num_heads=8,
                 num_kv_heads=2)
MODELS = {r: SPEC for r in Role}
AT = ModelStage(Role.ACTOR, Stage.TRAINING)


def table(cur: Candidate | None, tgt: Candidate | None, devices_per_node: int = 4):
    """``(id suffix, source devices, target devices, predecessors)`` of each op of actor/training."""
    dag = plan_transition(Plan({AT: cur} if cur else {}), Plan({AT: tgt} if tgt else {}), MODELS,
                          devices_per_node=devices_per_node)
    short = lambda x: x.split(":")[1]  # noqa: E731
    return [(short(op.id), op.source_devices, op.target_devices, sorted(map(short, dag.predecessors(op.id))))
            for op in dag.ops]


def test_t_sub_is_the_gcd_layout():
    assert t_sub(Layout(4, 8), Layout(8, 2)) == Layout(4, 2)  # paper Fig. 6
    assert t_sub(Layout(1, 4), Layout(2, 4)) == Layout(1, 4)
    assert t_sub(Layout(2, 1), Layout(3, 1)) == Layout(1, 1)
    assert t_sub(Layout(6, 4), Layout(4, 6)) == Layout(2, 2)


def test_emu_collection_is_one_unit_per_replica():
    emus = emu_collection(AT, Candidate(2, 2, 2, (7, 6, 5, 4, 3, 2, 1, 0)))
    assert [e.devices for e in emus] == [(7, 6, 5, 4), (3, 2, 1, 0)]
    assert emus[1].position_of(2) == (0, 1) and emus[1].layout == Layout(2, 2)
    with pytest.raises(PlanError, match="not in EMU"):
        emus[0].position_of(0)
    assert list(emu_collections(Plan({AT: Candidate(1, 1, 1, (3,))}))) == [AT]


def test_deltas_cover_both_plans_in_stage_order():
    gen = ModelStage(Role.ACTOR, Stage.GENERATION)
    d = deltas(Plan({AT: Candidate(1, 1, 1, (0,))}), Plan({gen: Candidate(1, 1, 1, (0,))}))
    assert [(x.model_stage, x.current is None, x.target is None) for x in d] == [
        (gen, True, False), (AT, False, True)]
    assert Delta(AT, Candidate(1, 1, 1, (0,)), Candidate(1, 1, 1, (0,))).unchanged


def test_no_change_and_same_devices_reordered_by_replica():
    assert table(Candidate(2, 1, 2, (0, 1, 2, 3)), Candidate(2, 1, 2, (0, 1, 2, 3))) == []
    # Replicas swapped: every device keeps its position, so nothing moves.
    assert table(Candidate(2, 1, 2, (0, 1, 2, 3)), Candidate(2, 1, 2, (2, 3, 0, 1))) == []


def test_pure_dp_scale_up_is_extends_only():
    assert table(Candidate(2, 1, 1, (0, 1)), Candidate(2, 1, 3, (0, 1, 2, 3, 4, 5))) == [
        ("extend0", (0, 1), (2, 3), []),
        ("extend1", (0, 1), (4, 5), []),
    ]


def test_pure_dp_scale_down_is_destroys_only():
    assert table(Candidate(2, 1, 3, (0, 1, 2, 3, 4, 5)), Candidate(2, 1, 1, (2, 3))) == [
        ("destroy0", (0, 1), (), []),
        ("destroy1", (4, 5), (), []),
    ]


def test_pure_device_move_copies_then_destroys():
    assert table(Candidate(2, 1, 1, (0, 1)), Candidate(2, 1, 1, (4, 5))) == [
        ("extend0", (0, 1), (4, 5), []),
        ("destroy0", (0, 1), (), ["extend0"]),
    ]


def test_pure_tp_increase_on_same_devices():
    # [0,1],[2,3] (tp2) → [0,1,2,3] (tp4). T_sub = tp2; device 0 and 3 already hold the halves
    # they need (σ*), 1 and 2 need the other half: one Extend each, from a retained holder.
    assert table(Candidate(2, 1, 2, (0, 1, 2, 3)), Candidate(4, 1, 1, (0, 1, 2, 3))) == [
        ("destroy0", (1,), (), []),
        ("destroy1", (2,), (), []),
        ("extend0", (3,), (2,), []),
        ("extend1", (0,), (1,), []),
        ("merge0", (0, 1, 2, 3), (0, 1, 2, 3), ["destroy0", "destroy1", "extend0", "extend1"]),
    ]


def test_pure_tp_decrease_on_same_devices():
    # tp4 → tp2·dp2: split (0 gathers from 1, 3 from 2), then the halves go to 1 and 2.
    dag = plan_transition(Plan({AT: Candidate(4, 1, 1, (0, 1, 2, 3))}),
                          Plan({AT: Candidate(2, 1, 2, (0, 1, 2, 3))}), MODELS, devices_per_node=4)
    assert [(op.id.split(":")[1], op.source_devices, op.target_devices) for op in dag.ops] == [
        ("split0", (0, 1, 2, 3), (0, 3)),
        ("destroy0", (2,), ()),
        ("destroy1", (1,), ()),
        ("extend0", (3,), (1,)),
        ("extend1", (0,), (2,)),
    ]
    split = dag.ops[0]
    assert {(r.src, r.dst) for r in split.routes} == {(1, 0), (2, 3)}
    extend = dag.ops[3]
    assert [r.shard for r in extend.routes] == list(shards_of(SPEC, Layout(2, 1), (0, 1)))


def test_pp_to_dp_on_same_devices_is_one_split():
    assert table(Candidate(1, 2, 1, (0, 1)), Candidate(1, 1, 2, (0, 1))) == [("split0", (0, 1), (0, 1), [])]


def test_paper_fig6_reward_inference():
    """(TP=4, PP=8) → (TP=8, PP=2): split into four (4, 2) units, destroy two, merge two."""
    target = [(ps * 4 + ts % 2) * 4 + ts // 2 for ps in range(2) for ts in range(8)]
    assert table(Candidate(4, 8, 1, tuple(range(32))), Candidate(8, 2, 1, tuple(target)), 8) == [
        ("split0", tuple(range(32)), tuple(range(8)) + tuple(range(16, 24)), []),
        ("destroy0", (8, 9, 10, 11, 24, 25, 26, 27), (), ["split0"]),
        ("destroy1", (12, 13, 14, 15, 28, 29, 30, 31), (), ["split0"]),
        ("merge0", tuple(target), tuple(target), ["destroy0", "destroy1", "split0"]),
    ]


def test_extend_prefers_a_sender_on_the_receivers_node():
    # Two replicas on nodes 0 and 1 (2 devices per node); a third on node 1 copies from node 1.
    rows = table(Candidate(1, 1, 2, (0, 2)), Candidate(1, 1, 3, (0, 2, 3)), devices_per_node=2)
    assert rows == [("extend0", (2,), (3,), [])]


def test_model_stage_added_or_removed():
    assert table(None, Candidate(2, 1, 2, (0, 1, 2, 3))) == [
        ("create0", (), (0, 1), []),
        ("create1", (), (2, 3), []),
    ]
    dag = plan_transition(Plan({AT: Candidate(2, 1, 1, (0, 1))}), Plan({}), MODELS, devices_per_node=4)
    assert [(op.kind, op.source_devices, op.discard) for op in dag.ops] == [(OpKind.DESTROY, (0, 1), True)]


def test_merge_fetches_replicated_kv_heads():
    # kv_heads=2: at tp4 every rank holds both k/v heads, at tp2 one each, so Merge tp2→tp4
    # must fetch the other kv head from a peer of its unit; everything else is sliced locally.
    dag = plan_transition(Plan({AT: Candidate(2, 1, 2, (0, 1, 2, 3))}),
                          Plan({AT: Candidate(4, 1, 1, (0, 2, 1, 3))}), MODELS, devices_per_node=4)
    assert [op.kind for op in dag.ops] == [OpKind.MERGE]
    remote = [r for r in dag.ops[0].routes if r.src != r.dst]
    assert remote and all(r.shard.name.endswith(("k_proj.weight", "v_proj.weight")) for r in remote)
    assert {(r.src, r.dst) for r in remote} == {(0, 1), (1, 0), (2, 3), (3, 2)}


def test_bad_layout_is_refused():
    with pytest.raises(PlanError, match="does not divide model num_heads"):
        table(Candidate(1, 1, 1, (0,)), Candidate(3, 1, 1, (0, 1, 2)))
    with pytest.raises(PlanError, match="no model spec for role critic"):
        plan_transition(Plan({}), Plan({ModelStage(Role.CRITIC, Stage.TRAINING): Candidate(1, 1, 1, (0,))}),
                        {Role.ACTOR: SPEC}, devices_per_node=1)


def test_sender_picker_is_the_brute_force_minimum():
    """The heap-based Extend source choice equals ``min`` over all holders of the key the module
    docstring gives (same node first, fewest sends, retained last, lowest index), pick after pick."""
    import random
    from collections import Counter

    from nereusd.transition.local import _SenderPicker

    for trial in range(300):
        rng = random.Random(trial)
        holders = sorted(rng.sample(range(64), rng.randint(1, 24)))
        retained = {c for c in holders if rng.random() < 0.3}
        per_node = rng.choice([1, 2, 4, 8])
        node_of = lambda x: x // per_node  # noqa: E731
        sends, brute_sends = Counter(), Counter()
        picker = _SenderPicker(holders, retained, node_of, sends)
        for dst in rng.sample(range(64, 128), rng.randint(1, 40)) + [rng.randrange(64) for _ in range(8)]:
            want = min(holders, key=lambda c: (node_of(c) != node_of(dst), brute_sends[c], c not in retained, c))
            got = picker.pick(node_of(dst))
            assert got == want, (trial, dst)
            sends[got] += 1
            brute_sends[want] += 1
