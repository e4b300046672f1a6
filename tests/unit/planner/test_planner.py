"""Planner: every plan satisfies memory and GPU budgets; placement keeps TP groups in nodes."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from nereusd.cost.model import CostModel
from nereusd.models import preset
from nereusd.planner.search import Infeasible, Planner, frontier, solve_concurrent
from nereusd.planner.space import PlannerOptions, evaluate
from nereusd.config.site import load_site
from tests.support.specs import SMALL_1B as SMALL
from tests.support.planning import H200, problem




def check_plan(pb, result):
    dpn = pb.site.devices_per_node
    wf = pb.workflow
    assert set(result.plan) == set(wf.model_stages)
    for group in wf.concurrent_sets():
        used = [d for m in group for d in result.plan[m].devices]
        assert len(used) == len(set(used)) <= len(pb.pool)
        assert set(used) <= set(pb.pool)
    for m, cand in result.plan.items():
        if cand.tp <= dpn:
            for g in cand.tp_groups():
                assert len({d // dpn for d in g}) == 1, (m, g)
        if m.stage.value == "training":
            assert pb.workload.mini_batch_size % cand.dp == 0
            assert (pb.workload.mini_batch_size // cand.dp) % cand.micro_batch == 0
    assert max(result.peak_bytes.values()) <= result.usable_bytes
    ev = evaluate(pb, result.plan, CostModel(pb.site))
    assert ev.step_latency_s == pytest.approx(result.predicted_step_latency_s)
    assert not ev.over_capacity(result.usable_bytes)


@pytest.mark.parametrize("nodes", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("algorithm", ["ppo", "grpo", "remax"])
def test_synthetic_clusters(nodes, algorithm):
    pb = problem(nodes, algorithm)
    check_plan(pb, Planner(pb, CostModel(pb.site)).solve())


@pytest.mark.parametrize("nodes", [1, 4])
def test_async_generation_disjoint(nodes):
    pb = problem(nodes, "ppo", asynchronous=True)
    res = Planner(pb, CostModel(pb.site)).solve()
    check_plan(pb, res)
    gen = set(res.plan[pb.workflow.phases[0][0]].devices)
    others = {d for m, c in res.plan.items() if m not in pb.workflow.phases[0] for d in c.devices}
    assert not gen & others


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(nodes=st.sampled_from([1, 2, 4]), response=st.sampled_from([128, 1024, 4096, 16384]),
       batch=st.sampled_from([8, 64, 256]), algorithm=st.sampled_from(["ppo", "grpo", "remax"]),
       memory_gib=st.sampled_from([16, 40, 80, 140]), dpn=st.sampled_from([2, 4, 8]),
       any_divisor=st.booleans())
def test_property_constraints(nodes, response, batch, algorithm, memory_gib, dpn, any_divisor):
    import dataclasses
    site = dataclasses.replace(H200, devices_per_node=dpn,
                               device=dataclasses.replace(H200.device, memory_gib=memory_gib))
    pb = problem(nodes, algorithm, spec=SMALL, response=response, batch=batch, site=site)
    try:
        res = Planner(pb, CostModel(site), PlannerOptions(any_divisor=any_divisor, allow_recompute=True)).solve()
    except Infeasible as err:
        assert "GiB" in str(err) or "devices" in str(err)
        return
    check_plan(pb, res)


def test_smaller_reward_model():
    pb = problem(2, reward=preset("counting-tiny").__class__(
        vocab_size=32000, hidden_size=512, intermediate_size=1408, num_layers=4, num_heads=8, num_kv_heads=4))
    res = Planner(pb, CostModel(pb.site)).solve()
    check_plan(pb, res)


def test_infeasible_names_model_stage():
    pb = problem(1, spec=preset("llama-3.3-70b"), batch=64)
    with pytest.raises(Infeasible, match=r"actor/training \(training phase\) cannot fit on 8 devices: its smallest "
                       r"peak over every layout is .* GiB short\)$"):
        Planner(pb, CostModel(pb.site)).solve()


def test_infeasibility_says_what_would_fit():
    """Issue 16: infeasibility never suggested ``--recompute``, even where recompute fits. The
    error names the phase and the smallest peak over the whole space, then what would fit:
    recomputation, ZeRO, or the fewest more devices (each planned again)."""
    pb = problem(1, spec=preset("llama-3.3-70b"), batch=64)
    with pytest.raises(Infeasible, match=r"would fit with 32 devices$"):   # no remedy needed there
        Planner(pb, CostModel(pb.site), suggest=True).solve()
    Planner(problem(4, spec=preset("llama-3.3-70b"), batch=64), CostModel(pb.site)).solve()   # and it does
    # the fewest remedies that fit the more devices: recomputation alone, not ZeRO with it
    # (a new user's trial, 2026-12-05: the README's 70B case named both)
    pb = problem(1, spec=preset("llama-3.3-70b"), response=4096)
    with pytest.raises(Infeasible, match=r"would fit with 32 devices \(with activation recomputation \(--recompute; "
                       r"plan.\*.recompute\)\)$"):
        Planner(pb, CostModel(pb.site), suggest=True).solve()
    Planner(problem(4, spec=preset("llama-3.3-70b"), response=4096), CostModel(pb.site),
            PlannerOptions(allow_recompute=True)).solve()
    with pytest.raises(Infeasible):   # and recomputation is needed there
        Planner(problem(4, spec=preset("llama-3.3-70b"), response=4096), CostModel(pb.site)).solve()
    # a case that recomputation alone fixes, on the same devices
    site = dataclasses.replace(H200, device=dataclasses.replace(H200.device, memory_gib=80))
    pb = problem(1, spec=preset("qwen2.5-7b"), response=16384, batch=1024, site=site)
    with pytest.raises(Infeasible, match=r"training phase .* would fit with activation recomputation \(--recompute"):
        Planner(pb, CostModel(pb.site), suggest=True).solve()
    Planner(pb, CostModel(pb.site), PlannerOptions(allow_recompute=True)).solve()   # and it does


def test_placement_prefers_current_devices():
    pb = problem(2)
    first = Planner(pb, CostModel(pb.site)).solve()
    again = Planner(pb, CostModel(pb.site)).solve(current=first.plan)
    for m in first.plan:
        assert set(again.plan[m].devices) == set(first.plan[m].devices)


def test_only_a_tp_group_that_could_fit_a_node_warns_when_it_crosses_nodes(caplog):
    """``simulate`` printed the warning for every TP-16 group on 8-device nodes, which crosses
    nodes by design (and is priced so); a TP-4 group split by a fragmented pool still warns."""
    import logging

    from nereusd.plan import ModelStage
    from nereusd.planner.placement import place

    m = ModelStage.parse("actor/training")
    with caplog.at_level(logging.WARNING, logger="nereusd.planner.placement"):
        plan = place({m: (16, 1, 1, 1, False, 0)}, [[m]], list(range(16)), 8)
    assert len(plan[m].devices) == 16 and not caplog.records
    with caplog.at_level(logging.WARNING, logger="nereusd.planner.placement"):
        place({m: (4, 1, 1, 1, False, 0)}, [[m]], [5, 6, 7, 8, 9, 10], 8)   # 3 free on node 0, 3 on node 1
    assert any("crosses nodes" in r.getMessage() for r in caplog.records)


def test_frontier_and_min_max_exact():
    from nereusd.planner.space import Option
    from nereusd.plan import ModelStage
    m = ModelStage.parse("actor/inference")
    opts = [Option(m, 1, 1, g, 1, False, 10.0 / g, 1, 1) for g in (1, 2, 3, 4)]
    opts.append(Option(m, 1, 1, 5, 1, False, 5.0, 1, 1))  # dominated
    f = frontier(opts)
    assert [o.gpus for o in f] == [1, 2, 3, 4]
    lat, picks = solve_concurrent([f, f], 5)
    assert sorted(o.gpus for o in picks) == [2, 3] and lat == pytest.approx(5.0)
    assert solve_concurrent([f, f], 1) is None


def test_a_token_budget_is_priced_as_the_mean_length_sequences_it_holds():
    """With ``max_tokens_per_micro_batch`` B, an inference/training micro-batch is priced as
    ``B // seq_length`` sequences of the mean length whatever the plan's micro_batch, in a packed
    row; generation keeps its own."""
    import dataclasses

    from nereusd.cost.memory import dtype_bytes
    from nereusd.plan import ModelStage, Role, Stage
    from nereusd.planner.space import cost_candidate
    from nereusd.workflow import Workload

    padded = problem(1, response=768)   # seq_length 1024
    budget = dataclasses.replace(padded, workload=dataclasses.replace(padded.workload, max_tokens_per_micro_batch=4096))
    wl = budget.workload
    assert wl.priced_micro_batch(Stage.TRAINING, 1, 64) == 4 and wl.priced_micro_batch(Stage.INFERENCE, 16, 64) == 4
    assert wl.priced_micro_batch(Stage.GENERATION, 16, 64) == 16
    assert wl.priced_micro_batch(Stage.TRAINING, 1, 2) == 2   # never more than the replica's share
    assert dataclasses.replace(wl, max_tokens_per_micro_batch=100).priced_micro_batch(Stage.TRAINING, 8, 64) == 1
    # rows fill to nearly B: rounded up, the priced tokens never fall below B
    assert dataclasses.replace(wl, max_tokens_per_micro_batch=4097).priced_micro_batch(Stage.TRAINING, 1, 64) == 5
    cm = CostModel(padded.site)
    train = ModelStage(Role.ACTOR, Stage.TRAINING)
    spec = budget.spec(train)
    # a packed row keeps one attention output (q elements per token) more per layer
    packed_row = spec.num_layers * 4 * 1024 * spec.num_heads * spec.head_dim * dtype_bytes(cm.dtype)
    for b in (1, 8):
        with_budget = cost_candidate(budget, train, 1, 1, 8, b, False, cm)
        as_four = cost_candidate(padded, train, 1, 1, 8, 4, False, cm)
        assert with_budget.latency_s == as_four.latency_s
        assert with_budget.peak_bytes == as_four.peak_bytes + packed_row
        assert with_budget.micro_batch == b   # the plan's micro_batch still splits the global batch
    assert cost_candidate(padded, train, 1, 1, 8, 1, False, cm).peak_bytes < as_four.peak_bytes
    result = Planner(budget, cm).solve()
    assert {m: c.micro_batch for m, c in result.plan.items() if m.stage is not Stage.GENERATION} == \
        {m: padded.workload.micro_batch for m in result.plan if m.stage is not Stage.GENERATION}
    with pytest.raises(Exception, match="max_tokens_per_micro_batch: expected a positive integer"):
        Workload(prompt_length=1, response_length=1, global_batch=1, max_tokens_per_micro_batch=0)


def test_the_planner_offers_only_layouts_the_engine_accepts():
    """Tied embeddings (Qwen2.5-0.5B style) cannot be pipelined and a vocabulary of 151936 = 2^7·1187
    is not split 256 ways: no plan option breaks nereusd.shards.check_layout."""
    import dataclasses

    from nereusd.plan import Layout
    from nereusd.planner.space import option_table
    from nereusd.shards import check_layout, value_head_for

    tied = dataclasses.replace(SMALL, vocab_size=151936, tie_word_embeddings=True, num_heads=16, num_kv_heads=2)
    pb = problem(2, spec=tied)
    cm = CostModel(pb.site)
    seen_pp = set()
    for m in pb.workflow.model_stages:
        for opt in option_table(pb, m, cm, PlannerOptions(), pb.site.device_memory_bytes).options():
            check_layout(tied, Layout(opt.tp, opt.pp), value_head=value_head_for(m.role),
                         generation=m.stage.value == "generation")
            seen_pp.add((m.role.value, opt.pp))
    assert ("actor", 1) in seen_pp and not any(role == "actor" and pp > 1 for role, pp in seen_pp)
    assert any(role == "critic" and pp > 1 for role, pp in seen_pp)   # a value head is not tied


def test_generation_waves_are_searched_down_to_one_so_feasibility_is_monotone_in_the_batch():
    """Qwen2.5-7B PPO on 8 × 80 GB, prompt 2,048, response 5,120 (issue 16): with only the three
    largest waves per replica tried, batch 1,024 had a plan and 2,048 none ("co-resident
    model-stages exceed 72 GiB"), though the plan of batch 256 runs 2,048 in smaller waves. The
    search keeps the largest waves that fit, so a larger batch is never infeasible where a
    smaller one fits."""
    import dataclasses

    from nereusd.plan import Role
    from nereusd.planner.space import PlanProblem
    from nereusd.workflow import Workload, build_workflow

    site = load_site("h200-ib")
    site = dataclasses.replace(site, device=dataclasses.replace(site.device, memory_gib=80)).with_nodes(1)
    spec = preset("qwen2.5-7b")
    feasible = []
    for batch in (256, 1024, 2048, 4096):
        wl = Workload(prompt_length=2048, response_length=5120, global_batch=batch)
        pb = PlanProblem(build_workflow("ppo"), {r: spec for r in Role}, wl, site, tuple(range(8)))
        try:
            result = Planner(pb, CostModel(site)).solve()
            feasible.append(batch)
            assert max(result.peak_bytes.values()) <= result.usable_bytes
        except Infeasible:
            pass
    assert feasible == [256, 1024, 2048, 4096]


def test_micro_batches_below_the_jobs_are_searched():
    """The job's ``train.micro_batch`` is the largest a plan takes; every power of two below it
    is tried, largest first, for training lowered to a divisor of the replica's share."""
    from nereusd.planner.space import micro_batch_choices

    opts = PlannerOptions()
    assert micro_batch_choices(16, 16, opts, True) == (16, 8, 4, 2, 1)
    assert micro_batch_choices(12, 12, opts, True) == (12, 6, 4, 2, 1)   # 8 does not divide 12
    assert micro_batch_choices(4, 16, opts, True) == (4, 2, 1)           # capped at the share
    assert micro_batch_choices(12, 16, opts, False) == (12, 8, 4, 2, 1)  # inference: no divisor needed
    assert micro_batch_choices(16, 16, PlannerOptions(micro_batches=(16,)), True) == (16,)


def test_a_pinned_generation_wave_holds_where_a_replica_gets_fewer_sequences():
    """The engine-keeping alternative pins generation to the running engines' ``max_num_seqs``;
    a pool that grows back gives each replica fewer sequences than that, and the engine still
    serves them (a wave of the share): the wave stays pinned, and the decode is priced as the
    share's while the KV cache is booked for the whole ``max_num_seqs``. Before, a share below
    the pin fell back to every wave size, so the planner's plan restarted every engine at every
    return of the simulator's noisy H200 ramp (2026-12-06)."""
    import dataclasses

    from nereusd.cost.model import CostModel
    from nereusd.plan import ModelStage, Plan, Role, Stage
    from nereusd.planner.space import PlanProblem, micro_batch_choices
    from nereusd.workflow import Workload, build_workflow

    assert micro_batch_choices(128, 128, PlannerOptions(generation_micro_batch=171), False, generation=True) == (171,)
    assert micro_batch_choices(256, 128, PlannerOptions(generation_micro_batch=171), False, generation=True) == (171,)
    site = H200.with_nodes(1)
    gen = ModelStage(Role.ACTOR, Stage.GENERATION)
    problem = PlanProblem(build_workflow("grpo"), {r: preset("llama-3.1-8b") for r in Role},
                          Workload(prompt_length=512, response_length=1024, global_batch=256), site,
                          tuple(range(8)), engines={gen: 1536})
    base = Planner(problem, CostModel(site), PlannerOptions(generation_micro_batch=64)).solve().plan
    assert base[gen].micro_batch == 64 and base[gen].dp * 64 <= 256
    wide = Plan({**base.candidates, gen: dataclasses.replace(base[gen], micro_batch=256 // base[gen].dp + 32)})
    a, b = (evaluate(problem, p, CostModel(site)) for p in (base, wide))
    share = 256 // base[gen].dp
    if share == 64:   # one wave either way: priced alike
        assert b.options[gen].latency_s == pytest.approx(a.options[gen].latency_s)
    assert b.options[gen].peak_bytes > a.options[gen].peak_bytes   # the KV cache of share + 32


def test_a_layout_keeps_the_jobs_micro_batch_where_it_fits():
    """Each layout takes the largest micro-batch that fits memory: the cost model prices a GEMM
    by its FLOPs whatever the batch, so a smaller one where the job's fits would win on a
    smaller PP bubble alone, which kernels that slow down on small batches do not repay (a
    review ran such plans 3–8 % slower on the simulator's measured truth). A token budget
    (``max_tokens_per_micro_batch``) keeps the job's micro-batch in the plan, as before."""
    import dataclasses

    from nereusd.plan import Role
    from nereusd.planner.space import PlanProblem, option_table
    from nereusd.workflow import Workload, build_workflow

    site = H200.with_nodes(8)
    spec = preset("llama-3.1-8b")
    wl = Workload(prompt_length=1024, response_length=4096, global_batch=1024, micro_batch=8)
    pb = PlanProblem(build_workflow("ppo"), {r: spec for r in Role}, wl, site, tuple(range(64)))
    result = Planner(pb, CostModel(site)).solve()
    check_plan(pb, result)
    train = next(m for m in pb.workflow.model_stages if m.stage.value == "training")
    table = option_table(pb, train, CostModel(site), PlannerOptions(), result.usable_bytes)
    rows = list(zip(table.tp.tolist(), table.pp.tolist(), table.dp.tolist(), table.micro_batch.tolist()))
    assert len({r[:3] for r in rows}) == len(rows)   # one micro-batch per layout
    fits = {}
    for b in (8, 4, 2, 1):   # each micro-batch alone: the layouts it fits
        t = option_table(pb, train, CostModel(site), PlannerOptions(micro_batches=(b,)), result.usable_bytes)
        fits[b] = set(zip(t.tp.tolist(), t.pp.tolist(), t.dp.tolist(), t.micro_batch.tolist()))
    for tp, pp, dp, b in rows:   # the largest that fits: no larger one fits the layout
        assert (tp, pp, dp, b) in set().union(*fits.values())
        larger = [r for x in fits for r in fits[x] if r[:3] == (tp, pp, dp) and r[3] > b]
        assert not larger, ((tp, pp, dp, b), larger)
    assert any(b == 8 for *_, b in rows) and any(b < 8 for *_, b in rows)
    packed = dataclasses.replace(pb, workload=dataclasses.replace(wl, max_tokens_per_micro_batch=16384))
    plan = Planner(packed, CostModel(site)).solve().plan
    assert all(c.micro_batch == 8 for m, c in plan.items() if m.stage.value != "generation")


def test_packed_rows_are_timed_at_the_mean_response_and_booked_at_the_longest():
    """A token budget packs rows padding-free, so a replica's pass costs its sequences at the
    mean response (``Workload.priced_pass``): the time of packed rows of mean-length sequences,
    the memory of rows that may hold the longest. It was timed at the longest, as memory is,
    which charged a packed replica (prompt + longest) / (prompt + mean) times its tokens."""
    import dataclasses

    from nereusd.plan import ModelStage, Role, Stage
    from nereusd.planner.space import cost_candidate, option_table

    base = problem(1, response=768)   # prompt 256
    wl = dataclasses.replace(base.workload, max_tokens_per_micro_batch=4096)
    full = dataclasses.replace(base, workload=wl)
    half = dataclasses.replace(base, workload=dataclasses.replace(wl, response_mean_fraction=0.5))
    assert half.workload.priced_pass(Stage.TRAINING, 1, 64) == (7, 384)   # ceil(4096 / 640) rows of 256 + 384
    assert half.workload.priced_pass(Stage.GENERATION, 16, 64) == (16, 768)
    assert full.workload.priced_pass(Stage.TRAINING, 1, 64) == (4, 768)
    by_count = dataclasses.replace(base, workload=dataclasses.replace(base.workload, response_mean_fraction=0.5))
    assert by_count.workload.priced_pass(Stage.TRAINING, 2, 64, pp=2) == (2, 768)   # padded to the longest
    cm = CostModel(base.site)
    train = ModelStage(Role.ACTOR, Stage.TRAINING)
    packed_half = cost_candidate(half, train, 1, 1, 8, 1, False, cm)
    packed_full = cost_candidate(full, train, 1, 1, 8, 1, False, cm)
    as_rows = cost_candidate(dataclasses.replace(base, workload=dataclasses.replace(
        base.workload, response_length=384)), train, 1, 1, 8, 7, False, cm)
    assert packed_half.latency_s == as_rows.latency_s < packed_full.latency_s
    assert packed_half.peak_bytes == packed_full.peak_bytes   # booked at the longest either way
    table = option_table(half, train, cm, PlannerOptions(), 10**15)
    i = next(k for k in range(len(table)) if (table.tp[k], table.pp[k], table.dp[k]) == (1, 1, 8))
    assert table.latency_s[i] == pytest.approx(packed_half.latency_s)   # the planner's array path agrees


def test_a_smaller_micro_batch_beats_a_wider_tp_where_the_jobs_does_not_fit():
    """``scripts/bench_adaptive.py`` (2026-12-05): at response length 68 the demo's training at
    ``micro_batch`` 16 fits four 0.5 GiB devices only at tp 4, which the planner took (predicted
    1.19 s per step; it ran 1.43 s, against 0.58 s for dp 4 at micro-batch 4 one step later).
    Searching the smaller micro-batches finds dp 4, predicted faster, with no recomputation."""
    from nereusd.config.resolve import load_and_resolve
    from nereusd.control.admission import urgent_replan
    from nereusd.control.problem import job_problem
    from nereusd.plan import ModelStage, Role, Stage
    from tests.support import REPO

    job = load_and_resolve(REPO / "examples" / "counting_grpo.yaml")
    site = load_site(job.config.site)
    pb = job_problem(job, site, tuple(range(job.devices)), 68, 5)
    cost = CostModel(pb.site)
    train = ModelStage(Role.ACTOR, Stage.TRAINING)
    pinned = Planner(pb, cost, PlannerOptions(micro_batches=(job.config.train.micro_batch,))).solve()
    searched = Planner(pb, cost, PlannerOptions()).solve()
    check_plan(pb, searched)
    assert pinned.plan[train].tp > 1 and pinned.plan[train].micro_batch == job.config.train.micro_batch
    assert searched.plan[train].micro_batch < job.config.train.micro_batch
    assert searched.predicted_step_latency_s < pinned.predicted_step_latency_s
    result, attempts = urgent_replan(pb, cost)
    assert attempts == [f"job settings: step {searched.predicted_step_latency_s:.3f} s"]
    assert not any(c.recompute for _, c in result.plan.items())


def test_a_pinned_shape_leaves_dp_micro_batch_and_devices_free():
    """``PlannerOptions.shapes`` pins a model-stage's TP and PP (what the controller asks when
    the move to another shape does not fit memory); everything else is searched as before."""
    pb = problem(2)
    free = Planner(pb, CostModel(pb.site)).solve()
    train = next(m for m in free.plan if m.stage.value == "training")
    shape = next((tp, pp) for tp, pp in ((1, 2), (2, 1), (1, 1), (2, 2))
                 if (tp, pp) != (free.plan[train].tp, free.plan[train].pp))
    pinned = Planner(pb, CostModel(pb.site), PlannerOptions(shapes=((train, *shape),))).solve()
    check_plan(pb, pinned)
    assert (pinned.plan[train].tp, pinned.plan[train].pp) == shape
    assert pinned.predicted_step_latency_s >= free.predicted_step_latency_s
    assert pinned.plan[train].dp * shape[0] * shape[1] > 1   # DP still searched, not left at 1
    assert PlannerOptions(shapes=((train, *shape),)).shape_of(train) == shape
    assert PlannerOptions().shape_of(train) is None


def test_by_count_passes_are_timed_as_the_engine_pads_them():
    """By count the engine cuts a micro-batch to its own longest sequence at ``pp = 1`` and pads
    every row of a call to the call's longest at ``pp > 1`` (``emu.engine.stage.StageEngine._run``):
    ``Workload.priced_pass`` times a ``pp = 1`` pass at the mean response at micro-batch 1 (plus
    the one row as wide as the longest), wider as the micro-batch grows, never wider than the
    longest, within 10 % of what log-normal lengths pad to, and a ``pp > 1`` pass of one call at
    the longest; memory stays at the longest."""
    import dataclasses
    import math
    import statistics

    import numpy as np

    from nereusd.plan import ModelStage, Role, Stage
    from nereusd.planner.space import cost_candidate

    base = problem(1, response=768)   # prompt 256
    half = dataclasses.replace(base, workload=dataclasses.replace(base.workload, response_mean_fraction=0.5))
    wl = half.workload
    # micro-batch 1: 63 rows of the mean (384) and one of the longest (768)
    assert wl.priced_pass(Stage.TRAINING, 1, 64, pp=1, sequences=256) == (1, math.ceil((63 * 384 + 768) / 64))
    widths = [wl.priced_pass(Stage.TRAINING, b, 64, pp=1, sequences=256)[1] for b in (1, 2, 4, 16, 64)]
    assert widths == sorted(widths) and widths[0] < widths[-1] == 768   # one micro-batch holds the longest
    z = lambda k: statistics.NormalDist().inv_cdf((k - 0.375) / (k + 0.25))   # noqa: E731 (Blom 1958)
    e_4 = 384 * 2 ** (z(4) / z(256))   # the longest of 4 log-normal lengths, geometrically
    assert wl.priced_pass(Stage.INFERENCE, 4, 64, pp=1, sequences=256)[1] == math.ceil((15 * e_4 + 768) / 16)
    assert wl.priced_pass(Stage.TRAINING, 1, 64, pp=2, sequences=256) == (1, 768)
    # pp > 1 pads a call (one per optimizer step) to its own longest: one of 4 holds the longest
    four = dataclasses.replace(wl, global_batch=1024, mini_batches=4)
    e_64 = 384 * 2 ** (z(64) / z(256))
    assert four.priced_pass(Stage.TRAINING, 1, 64, pp=2, sequences=256) == (1, math.ceil((3 * e_64 + 768) / 4))
    assert four.priced_pass(Stage.INFERENCE, 1, 64, pp=2, sequences=256) == (1, 768)   # one call
    # against log-normal draws (σ = 0.41, the simulator's verl fit): each group's longest, as priced
    rng = np.random.default_rng(0)
    for b in (1, 2, 4, 8):
        drawn = []
        for _ in range(200):
            x = np.exp(rng.normal(0.0, 0.41, 256))
            lengths = x / x.max() * 768
            fraction = lengths.mean() / 768
            priced = dataclasses.replace(wl, response_mean_fraction=fraction).priced_pass(
                Stage.INFERENCE, b, 256, pp=1, sequences=256)[1]
            engine = lengths.reshape(-1, b).max(axis=1).mean()   # each micro-batch at its longest
            drawn.append(priced / engine)
        assert 0.9 < float(np.median(drawn)) < 1.1, (b, np.median(drawn))
    assert wl.priced_pass(Stage.GENERATION, 1, 64, pp=1, sequences=256) == (1, 768)
    assert base.workload.priced_pass(Stage.TRAINING, 1, 64, pp=1) == (1, 768)   # equal lengths: no change
    cm = CostModel(base.site)
    train = ModelStage(Role.ACTOR, Stage.TRAINING)
    flat, short_pp1 = cost_candidate(base, train, 1, 1, 8, 1, False, cm), cost_candidate(half, train, 1, 1, 8, 1, False, cm)
    flat_pp2, short_pp2 = (cost_candidate(base, train, 1, 2, 4, 1, False, cm),
                           cost_candidate(half, train, 1, 2, 4, 1, False, cm))
    assert short_pp1.latency_s < 0.8 * flat.latency_s   # fewer tokens computed
    assert short_pp2.latency_s == flat_pp2.latency_s    # every row padded to the longest
    assert short_pp1.peak_bytes == flat.peak_bytes      # booked at the longest either way


def test_a_smaller_micro_batch_wins_at_pp_1_when_lengths_differ():
    """At ``pp = 1`` by count a smaller micro-batch computes less padding, so the enumeration
    keeps every micro-batch that fits there (not only the largest, as at ``pp > 1``) and the
    planner may take a smaller one than the job's (a review, 2026-12-07: the planner's own model
    priced the plan at micro-batch 8 27 % slower than the same layouts at 1)."""
    import dataclasses

    from nereusd.plan import Stage
    from nereusd.planner.space import enumerate_options

    base = problem(1, response=2048)
    wl = dataclasses.replace(base.workload, micro_batch=8)
    for fraction, smaller in ((0.35, True), (1.0, False)):
        pb = dataclasses.replace(base, workload=dataclasses.replace(wl, response_mean_fraction=fraction))
        cm = CostModel(pb.site)
        train = next(m for m in pb.workflow.model_stages if m.stage is Stage.TRAINING)
        rows = enumerate_options(pb, train, cm, PlannerOptions(), float("inf"))
        at_pp1 = {o.micro_batch for o in rows if o.pp == 1 and (o.tp, o.dp) == (1, 8) and not o.recompute}
        at_pp2 = {o.micro_batch for o in rows if o.pp == 2 and (o.tp, o.dp) == (1, 4) and not o.recompute}
        assert at_pp2 == {8}   # a larger micro-batch fits: only it is kept
        assert (at_pp1 == {1, 2, 4, 8}) is smaller and (at_pp1 == {8}) is not smaller
        plan = Planner(pb, cm).solve().plan
        trained = {c.micro_batch for m, c in plan.items() if m.stage is Stage.TRAINING and c.pp == 1}
        if smaller:
            assert trained and max(trained) < 8, plan.describe()
