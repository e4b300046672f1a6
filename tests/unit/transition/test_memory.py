"""Per-device memory of a transition at every op, with hand-computed bytes (paper §4.3, §6.2)."""

from __future__ import annotations

import pytest

from nereusd.errors import PlanError
from nereusd.plan import Candidate, Layout, ModelStage, Plan, Role, Stage
from nereusd.config.site import load_site
from nereusd.transition import (
    AdamStateSizes,
    EdgeReason,
    MemoryBudget,
    StateModel,
    check_feasibility,
    plan_transition,
    stage_in_host,
)
from nereusd.transition.memory import pinned_bytes
from tests.support.specs import TINY_MODELS as MODELS

STATE = StateModel(MODELS, AdamStateSizes())  # bf16 + fp32 master + Adam: 14 bytes/element in training
AT = ModelStage(Role.ACTOR, Stage.TRAINING)
CT = ModelStage(Role.CRITIC, Stage.TRAINING)
AG = ModelStage(Role.ACTOR, Stage.GENERATION)
# P = 64·32 embed + 4·(32·32 q + 2·8·32 kv + 32·32 o + 3·64·32 mlp + 2·32 norms) + 32 + 64·32 head
P = 39_200
P_TP2 = 19_744  # per rank at tp2: halves of everything but the 4·2·32 + 32 norm elements
CRITIC = 2_048 + 4 * 8_768 + 32 + 32 + 1  # value head [1, 32] + bias instead of lm_head


def test_sizes_per_element():
    assert STATE.holding_bytes(AT, Layout(1, 1), (0, 0)) == 14 * P
    assert STATE.holding_bytes(AG, Layout(1, 1), (0, 0)) == 2 * P
    assert STATE.holding_bytes(AT, Layout(2, 1), (0, 1)) == 14 * P_TP2
    assert STATE.holding_bytes(CT, Layout(1, 1), (0, 0)) == 14 * CRITIC
    fp32 = AdamStateSizes.for_dtype("fp32")
    assert (fp32.resident_bytes_per_element(AT), fp32.moved_bytes_per_element(AT)) == (12, 12)
    assert fp32.resident_bytes_per_element(AG) == 4
    # an engine a transition keeps: its gradients too (ZeRO-0), or its ZeRO-2 partitions
    assert AdamStateSizes().engine_bytes(AT, P, 1, 0) == 16 * P and AdamStateSizes().engine_bytes(AG, P, 1, 0) == 2 * P
    assert fp32.engine_bytes(AT, 800, 4, 2) == 4 * 800 + 4 * 200 + 4 * 800 + 12 * 200   # bucket: all 800


def test_device_move_peaks_and_final_bytes():
    cur, tgt = Plan({AT: Candidate(1, 1, 1, (0,))}), Plan({AT: Candidate(1, 1, 1, (1,))})
    budget = MemoryBudget(capacity_bytes=10**7, collective_buffer_bytes=1_000)
    dag = plan_transition(cur, tgt, MODELS, devices_per_node=4, state=STATE, budget=budget)
    report = check_feasibility(dag, STATE, budget)
    assert report.feasible and report.order == ("actor/training:extend0", "actor/training:destroy0")
    # During the Extend both ends hold a 1,000-byte staging buffer; the copy lands on device 1.
    assert report.peak_bytes == {0: 14 * P + 1_000, 1: 14 * P + 1_000}
    assert report.final_bytes == {0: 0, 1: 14 * P}


def test_first_violation_names_op_device_and_bytes():
    """The critic already fills most of device 1, so the actor's copy does not fit there. The
    critic's engine is not rebuilt, so it keeps its gradients (16 bytes an element in all; until
    2026-12-07 they were left out, as if it were a holding)."""
    cur = Plan({AT: Candidate(1, 1, 1, (0,)), CT: Candidate(1, 1, 1, (1,))})
    tgt = Plan({AT: Candidate(1, 1, 1, (1,)), CT: Candidate(1, 1, 1, (1,))})
    limit = 16 * CRITIC + 14 * P + 999  # one byte short of copy + staging
    budget = MemoryBudget(capacity_bytes=limit, headroom=0.0, collective_buffer_bytes=1_000)
    dag = plan_transition(cur, tgt, MODELS, devices_per_node=4, state=STATE, budget=budget)
    v = check_feasibility(dag, STATE, budget).violation
    assert (v.op_id, v.device, v.model_stage) == ("actor/training:extend0", 1, "actor/training")
    assert (v.needed_bytes, v.in_use_bytes, v.limit_bytes) == (14 * P + 1_000, 16 * CRITIC, limit)
    assert "device 1: op actor/training:extend0 (actor/training) needs" in v.describe()
    budget_ok = MemoryBudget(capacity_bytes=limit + 1, headroom=0.0, collective_buffer_bytes=1_000)
    assert check_feasibility(dag, STATE, budget_ok).feasible


def test_current_plan_over_capacity_is_reported_before_any_op():
    plan = Plan({AT: Candidate(1, 1, 1, (0,))})
    dag = plan_transition(plan, plan, MODELS, devices_per_node=1)
    v = check_feasibility(dag, STATE, MemoryBudget(capacity_bytes=1_000)).violation
    assert v.op_id is None and v.device == 0 and v.in_use_bytes == 16 * P   # a kept engine, gradients and all


def test_tight_devices_get_release_before_acquire_inside_a_model_stage():
    """tp2·dp2 → tp4 on the same devices: devices 1 and 2 each swap halves. With room for both
    halves no ordering is added; on a tight budget each Extend waits for the Destroy of the
    half its device gives up, and the walk then fits."""
    cur = Plan({AT: Candidate(2, 1, 2, (0, 1, 2, 3))})
    tgt = Plan({AT: Candidate(4, 1, 1, (0, 1, 2, 3))})
    ample = MemoryBudget(capacity_bytes=10**8, collective_buffer_bytes=0)
    dag = plan_transition(cur, tgt, MODELS, devices_per_node=4, state=STATE, budget=ample)
    assert not [e for e in dag.edges if e.reason is EdgeReason.RESOURCE]
    # Room for one tp2 half plus the tp4 quarter Merge allocates (≈ 0.5 of a half) — not two halves.
    tight = MemoryBudget(capacity_bytes=int(14 * P_TP2 * 1.6), headroom=0.0, collective_buffer_bytes=0)
    dag = plan_transition(cur, tgt, MODELS, devices_per_node=4, state=STATE, budget=tight)
    resource = sorted((e.src, e.dst) for e in dag.edges if e.reason is EdgeReason.RESOURCE)
    assert resource == [("actor/training:destroy0", "actor/training:extend1"),
                        ("actor/training:destroy1", "actor/training:extend0")]
    assert check_feasibility(dag, STATE, tight).feasible


def test_co_resident_model_stages_are_counted():
    cur = Plan({AG: Candidate(1, 1, 1, (0,)), AT: Candidate(1, 1, 1, (0,))})
    tgt = Plan({AG: Candidate(1, 1, 2, (0, 1)), AT: Candidate(1, 1, 1, (0,))})
    budget = MemoryBudget(capacity_bytes=10**8, collective_buffer_bytes=0, workspace_bytes=7, reserved_bytes={1: 5})
    dag = plan_transition(cur, tgt, MODELS, devices_per_node=4, state=STATE, budget=budget)
    report = check_feasibility(dag, STATE, budget)
    assert report.final_bytes == {0: 2 * P + 16 * P + 7, 1: 2 * P + 12}   # the training engine is kept whole


def test_budget_checks_and_site_defaults():
    with pytest.raises(PlanError, match="headroom must be in"):
        MemoryBudget(capacity_bytes=1, headroom=1.0)
    with pytest.raises(PlanError, match="capacity_bytes must be a positive integer"):
        MemoryBudget(capacity_bytes=0)
    site = load_site("local")
    b = MemoryBudget.from_site(site)
    assert b.capacity_bytes == 512 * 2**20 and b.headroom == 0.1 and b.workspace_bytes == 16 << 20
    assert b.limit_bytes == int(0.9 * 512 * 2**20)
    assert b.host_staging_bytes == 0   # virtual CPU devices: host memory is the device's
    assert MemoryBudget.from_site(load_site("frontier-mi250x")).host_staging_bytes == 32 << 30
    with pytest.raises(PlanError, match="host_staging_bytes"):
        MemoryBudget(capacity_bytes=1, host_staging_bytes=-1)


def test_two_splits_on_a_tight_device_run_one_after_the_other():
    """A Split allocates its receivers' ``T_sub`` holding before it frees their ``T`` one. Two
    of them on one device whose worst case does not fit (both new holdings with both old
    ones) must not run at once: the join orders them, as the walk that found them feasible
    did (the executor runs the ops of a level concurrently)."""
    cur = Plan({AG: Candidate(2, 1, 1, (0, 1)), AT: Candidate(2, 1, 1, (0, 1))})
    tgt = Plan({AG: Candidate(1, 1, 2, (0, 1)), AT: Candidate(1, 1, 2, (0, 1))})
    limit = 14 * P_TP2 + 16 * P + P_TP2   # the walk's peak, 14·P_TP2 + 16·P, fits; both at once do not
    budget = MemoryBudget(capacity_bytes=limit, headroom=0.0, collective_buffer_bytes=0)
    dag = plan_transition(cur, tgt, MODELS, devices_per_node=4, state=STATE, budget=budget)
    splits = sorted(op.id for op in dag.ops if op.kind.value == "split")
    assert splits == ["actor/generation:split0", "actor/training:split0"]
    resource = {(e.src, e.dst) for e in dag.edges if e.reason is EdgeReason.RESOURCE}
    assert ("actor/generation:split0", "actor/training:split0") in resource
    report = check_feasibility(dag, STATE, budget)
    assert report.feasible and report.peak_bytes[0] == 14 * P_TP2 + 16 * P


def test_two_merges_on_a_tight_device_run_one_after_the_other():
    """A Merge, too, allocates its ``T*`` holding before it frees the ``T_sub`` one: two Merges
    on one device whose walk fits only one at a time are ordered (fault search, 2026-12-05:
    they ran at once and overran the device by 74 KB)."""
    ci, ct = ModelStage(Role.CRITIC, Stage.INFERENCE), CT
    cur = Plan({ci: Candidate(1, 1, 2, (0, 1)), ct: Candidate(1, 1, 2, (0, 1))})
    tgt = Plan({ci: Candidate(2, 1, 1, (0, 1)), ct: Candidate(1, 2, 1, (0, 1))})
    ample = MemoryBudget(capacity_bytes=10**9, headroom=0.0, collective_buffer_bytes=0)
    walk_peak = max(check_feasibility(plan_transition(cur, tgt, MODELS, devices_per_node=4, state=STATE,
                                                      budget=ample), STATE, ample).peak_bytes.values())
    budget = MemoryBudget(capacity_bytes=walk_peak, headroom=0.0, collective_buffer_bytes=0)
    dag = plan_transition(cur, tgt, MODELS, devices_per_node=4, state=STATE, budget=budget)
    assert sorted(op.kind.value for op in dag.ops) == ["merge", "merge"]
    assert {(e.src, e.dst) for e in dag.edges} == {("critic/inference:merge0", "critic/training:merge0")}
    assert check_feasibility(dag, STATE, budget).feasible
    # both at once would need the current state plus both new holdings on device 0
    both = STATE.plan_bytes(cur)[0] + sum(STATE.op_bytes(op, 0)[0][0] for op in dag.ops)
    assert both > walk_peak


def test_a_device_that_only_sends_in_a_split_counts_its_chunk_copies():
    """tp2 on devices 0, 1 → tp1 on device 0: device 1 only sends. Chunked, each send is a copy
    the executor books; the model counts it (capped at the staging bound) — it counted 0."""
    cur, tgt = Plan({AT: Candidate(2, 1, 1, (0, 1))}), Plan({AT: Candidate(1, 1, 1, (0,))})
    budget = MemoryBudget(capacity_bytes=10**9, collective_buffer_bytes=4096)
    dag = plan_transition(cur, tgt, MODELS, devices_per_node=4, state=STATE, budget=budget)
    split = next(op for op in dag.ops if op.kind.value == "split")
    assert split.target_devices == (0,)
    assert STATE.op_bytes(split, dag.staging_bytes)[1][1] == 4096
    assert STATE.op_bytes(split, 10**9)[1][1] == 14 * P_TP2   # its whole holding, under a large bound


def test_collective_buffer_bytes_must_be_an_integer():
    for bad in (True, 1.5, "64M", None):
        with pytest.raises(PlanError, match="collective_buffer_bytes must be an integer"):
            MemoryBudget(capacity_bytes=10**6, collective_buffer_bytes=bad)


def test_a_split_over_memory_stages_its_receivers_holding_in_host_memory():
    """tp2 → tp1 on device 0: unstaged the Split holds the tp2 half (14·P_TP2) beside the whole new
    holding (14·P); staged it frees the half first, so 14·P fits. Host memory too small for the
    half leaves the DAG as it was."""
    cur, tgt = Plan({AT: Candidate(2, 1, 1, (0, 1))}), Plan({AT: Candidate(1, 1, 1, (0,))})
    budget = MemoryBudget(capacity_bytes=14 * P, headroom=0.0, collective_buffer_bytes=0,
                          host_staging_bytes=pinned_bytes(14 * P_TP2))   # the pinned allocator's power of two
    assert pinned_bytes(14 * P_TP2) == 1 << 19 and pinned_bytes(1 << 19) == 1 << 19
    dag = plan_transition(cur, tgt, MODELS, devices_per_node=4, state=STATE, budget=budget)
    report = check_feasibility(dag, STATE, budget)
    v = report.violation
    assert (v.op_id, v.device, v.needed_bytes, v.in_use_bytes) == ("actor/training:split0", 0, 14 * P, 14 * P_TP2)

    staged, report = stage_in_host(dag, STATE, budget, report)
    split = staged.op("actor/training:split0")
    assert split.host_staged == ((0, P_TP2),) and report.feasible
    assert STATE.op_bytes(split, 0)[0] == (14 * (P - P_TP2), 0, 0)   # alloc is the growth; nothing freed at the end
    assert report.peak_bytes[0] == 14 * P and report.final_bytes == {0: 14 * P, 1: 0}
    assert [op.host_staged for op in dag.ops] == [(), ()]   # the input DAG is not modified

    small = MemoryBudget(capacity_bytes=14 * P, headroom=0.0, collective_buffer_bytes=0,
                         host_staging_bytes=pinned_bytes(14 * P_TP2) - 1)
    same, report = stage_in_host(dag, STATE, small)
    assert same is dag and not report.feasible
    without = MemoryBudget(capacity_bytes=14 * P, headroom=0.0, collective_buffer_bytes=0)
    assert stage_in_host(dag, STATE, without)[0] is dag


def test_staging_does_not_help_a_violation_outside_a_split():
    cur = Plan({AT: Candidate(1, 1, 1, (0,)), CT: Candidate(1, 1, 1, (1,))})
    tgt = Plan({AT: Candidate(1, 1, 1, (1,)), CT: Candidate(1, 1, 1, (1,))})
    budget = MemoryBudget(capacity_bytes=14 * CRITIC + 14 * P, headroom=0.0, collective_buffer_bytes=1_000,
                          host_staging_bytes=1 << 30)
    dag = plan_transition(cur, tgt, MODELS, devices_per_node=4, state=STATE, budget=budget)
    same, report = stage_in_host(dag, STATE, budget)
    assert same is dag and report.violation.op_id == "actor/training:extend0"


def test_a_merge_over_memory_stages_its_holding_and_slices_from_the_host_copy():
    """tp1 → tp2 on devices 0, 1 (one unit): each device slices its half (14·P_TP2) out of the
    whole model (14·P); unstaged it holds both, staged it frees the whole first."""
    cur, tgt = Plan({AT: Candidate(1, 1, 2, (0, 1))}), Plan({AT: Candidate(2, 1, 1, (0, 1))})
    budget = MemoryBudget(capacity_bytes=14 * P, headroom=0.0, collective_buffer_bytes=0,
                          host_staging_bytes=pinned_bytes(14 * P))
    dag = plan_transition(cur, tgt, MODELS, devices_per_node=4, state=STATE, budget=budget)
    merge = next(op for op in dag.ops if op.kind.value == "merge")
    assert check_feasibility(dag, STATE, budget).violation.op_id == merge.id
    staged, report = stage_in_host(dag, STATE, budget)
    assert report.feasible and staged.op(merge.id).host_staged == ((0, P), (1, P))
    assert STATE.op_bytes(staged.op(merge.id), 0)[0] == (14 * (P_TP2 - P), 0, 0)   # the slice, less the whole
    assert report.final_bytes == {0: 14 * P_TP2, 1: 14 * P_TP2}
