"""ZeRO in the job file and the planner: pinned stages are kept, bad ones name the key, and the
planner offers ZeRO-1/2 only where the deepspeed backend runs it (tp = pp = 1)."""

from __future__ import annotations

import pytest

from nereusd import backends
from nereusd.cost.memory import ZERO_BUCKET_ELEMENTS, stage_memory, zero_state_bytes
from nereusd.errors import ConfigError
from nereusd.plan import Candidate, ModelStage, PlanError
from nereusd.planner.search import Planner
from nereusd.planner.space import PlannerOptions
from nereusd.cost.model import CostModel
from tests.support.planning import problem
from tests.support.specs import SMALL_1B
from tests.unit.config.test_job_config import resolve, tiny_job, write

TRAIN = ModelStage.parse("actor/training")


@pytest.fixture(autouse=True)
def deepspeed_installed(monkeypatch):
    monkeypatch.setattr(backends, "deepspeed_available", lambda: True)


def test_a_deepspeed_training_stage_launches_at_zero1_and_may_use_1_or_2(tmp_path):
    job = resolve(write(tmp_path, tiny_job("backends: {actor/training: deepspeed}\n")))
    assert job.plan[TRAIN].zero_stage == 1
    assert job.zero_stages == {TRAIN: (1, 2)}
    assert all(c.zero_stage == 0 for m, c in job.plan.items() if m != TRAIN)


def test_a_pinned_zero_stage_is_kept(tmp_path):
    job = resolve(write(tmp_path, tiny_job("backends: {actor/training: deepspeed}\n"
                                           "plan: {model_stages: {actor/training: {zero_stage: 2}}}\n")))
    assert job.plan[TRAIN].zero_stage == 2 and job.zero_stages == {TRAIN: (2,)}


def test_native_training_stays_zero0(tmp_path):
    job = resolve(write(tmp_path, tiny_job()))
    assert job.plan[TRAIN].zero_stage == 0 and job.zero_stages == {}


@pytest.mark.parametrize("extra, match", [
    ("plan: {model_stages: {actor/training: {zero_stage: 1}}}\n",
     r"job.yaml: plan.model_stages.actor/training.zero_stage: zero_stage 1 needs backends: "
     r"\{actor/training: deepspeed\}"),
    ("backends: {actor/training: deepspeed}\nplan: {model_stages: {actor/training: {tp: 2}}}\n",
     r"job.yaml: plan.model_stages.actor/training: the deepspeed backend runs tp = pp = 1 units \(got tp=2, pp=1\)"),
    ("backends: {actor/training: deepspeed}\nplan: {model_stages: {actor/training: {zero_stage: 0}}}\n",
     r"actor/training.zero_stage: deepspeed runs zero_stage \[1, 2\] for actor/training"),
    ("backends: {actor/inference: deepspeed}\n", r"backends.actor/inference: deepspeed cannot run inference"),
    ("plan: {model_stages: {actor/inference: {zero_stage: 1}}}\n",
     r"plan.model_stages.actor/inference.zero_stage: 1: ZeRO applies to training model-stages only"),
    ("plan: {default: {zero_stage: 3}}\n", r"plan.default.zero_stage: Input should be less than or equal to 2"),
])
def test_bad_zero_settings_name_the_key(tmp_path, extra, match):
    with pytest.raises(ConfigError, match=match):
        resolve(write(tmp_path, tiny_job(extra)))


def test_deepspeed_missing_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(backends, "deepspeed_available", lambda: False)
    with pytest.raises(ConfigError, match="backends.actor/training: deepspeed is not installed"):
        resolve(write(tmp_path, tiny_job("backends: {actor/training: deepspeed}\n")))


def test_candidate_zero_stage_round_trips_and_is_checked():
    c = Candidate(1, 1, 2, (0, 1), zero_stage=2)
    assert Candidate.from_dict(c.to_dict()) == c and "zero2" in c.describe()
    assert "zero_stage" not in Candidate(1, 1, 2, (0, 1)).to_dict()   # ZeRO-0 plans read as before
    with pytest.raises(PlanError, match="zero_stage must be one of"):
        Candidate(1, 1, 1, (0,), zero_stage=3)


def test_zero_state_bytes():
    p = 1_000_003
    assert zero_state_bytes(p, 4, 0, 2) == {"gradients": 2 * p, "optimizer": 12 * p}
    assert zero_state_bytes(p, 4, 0, 4) == {"gradients": 4 * p, "optimizer": 8 * p}
    part = -(-p // 4)
    assert zero_state_bytes(p, 4, 1, 2) == {"gradients": 2 * p + 4 * part, "optimizer": 12 * part}
    bucket = p + 1   # rounded up to even
    assert zero_state_bytes(p, 4, 2, 2) == {"gradients": 2 * bucket + 4 * part, "optimizer": 12 * part}
    big = 10 * ZERO_BUCKET_ELEMENTS
    assert zero_state_bytes(big, 8, 2, 2)["gradients"] == 2 * ZERO_BUCKET_ELEMENTS + 4 * big // 8
    with pytest.raises(ValueError):
        zero_state_bytes(p, 0, 1, 2)
    kw = dict(sequences=64, prompt_length=256, response_length=256, tp=1, pp=1, dp=8, micro_batch=1)
    z0 = stage_memory(SMALL_1B, TRAIN, **kw)
    z1 = stage_memory(SMALL_1B, TRAIN, zero_stage=1, **kw)
    assert z1.components["optimizer"] < z0.components["optimizer"] / 4
    assert z1.resident_bytes < z0.resident_bytes


def test_the_planner_offers_zero_only_at_tp_pp_1_and_keeps_a_pinned_stage():
    pb = problem(1, "ppo", response=2048)
    opened = Planner(pb, CostModel(pb.site), PlannerOptions(zero_stages=(0, 1, 2))).solve()
    for m, c in opened.plan.items():
        assert c.zero_stage == 0 or (m.stage.value == "training" and (c.tp, c.pp) == (1, 1)), (m, c)
    import dataclasses
    pinned = dataclasses.replace(pb, zero_stages={TRAIN: (2,)})
    got = Planner(pinned, CostModel(pb.site)).solve()
    assert got.plan[TRAIN].zero_stage == 2 and (got.plan[TRAIN].tp, got.plan[TRAIN].pp) == (1, 1)
    assert all(c.zero_stage == 0 for m, c in got.plan.items() if m != TRAIN)
    # ZeRO frees memory, so the planner never does worse with it than without
    closed = Planner(pb, CostModel(pb.site)).solve()
    assert opened.predicted_step_latency_s <= closed.predicted_step_latency_s + 1e-9


def test_l_tran_counts_the_zero_state_moved():
    from nereusd.config.site import load_site
    from nereusd.models import preset
    from nereusd.plan import Plan, Role
    from nereusd.transition import assess_transition, zero_repartitioned

    site = load_site("h200-ib")
    models = {Role.ACTOR: preset("qwen2.5-1.5b")}
    two, four = (0, 1), (0, 1, 2, 3)
    zero0 = assess_transition(Plan({TRAIN: Candidate(1, 1, 2, two)}), Plan({TRAIN: Candidate(1, 1, 4, four)}),
                              models, site)
    cur, tgt = Plan({TRAIN: Candidate(1, 1, 2, two, zero_stage=1)}), Plan({TRAIN: Candidate(1, 1, 4, four, zero_stage=1)})
    assert zero_repartitioned(cur, tgt) == {TRAIN}
    zero1 = assess_transition(cur, tgt, models, site)
    # ZeRO-0 extends two whole bf16 holdings (param 2 + master 4 + moments 8 bytes/element); ZeRO-1
    # extends the parameters (2) and re-partitions: 3 of the 4 new quarters of master and moments
    # (12) come from another device
    elements = zero0.cost.bytes_moved / (2 * 14)
    assert zero1.cost.bytes_moved == pytest.approx(elements * (2 * 2 + 0.75 * 12), rel=1e-6)
    assert zero1.l_tran_s < zero0.l_tran_s
    # leaving ZeRO exports the canonical holding first (a ring all-reduce over the old pair: 12 bytes/element
    # per rank), then
    # extends whole holdings as ZeRO-0 does
    to0 = assess_transition(cur, Plan({TRAIN: Candidate(1, 1, 4, four)}), models, site)
    assert to0.cost.bytes_moved == pytest.approx(zero0.cost.bytes_moved + elements * 2 * 12, rel=1e-6)
    assert to0.l_tran_s > zero0.l_tran_s
    # the export joins the partitioned slots only: master and moments, or the moments in fp32
    from nereusd.plan import ModelStage, Stage
    from nereusd.transition import AdamStateSizes

    gen = ModelStage(Role.ACTOR, Stage.GENERATION)
    assert [AdamStateSizes.for_dtype(d).zero_joined_bytes_per_element(TRAIN) for d in ("bf16", "fp32")] == [12, 8]
    assert AdamStateSizes.for_dtype("bf16").zero_joined_bytes_per_element(gen) == 0
    # untouched ZeRO model-stages export nothing
    same = Plan({TRAIN: Candidate(1, 1, 2, two, zero_stage=1)})
    assert assess_transition(same, same, models, site).l_tran_s == 0.0


def test_a_repartitioning_transition_is_checked_at_zeros_memory():
    """The transition check books a re-partitioned ZeRO model-stage as it is held: parameters per
    replica, ``12·P/dp`` bytes of partition (bf16: master and moments), the DAG moving
    parameter-only holdings, then each new partition allocated while the old ones still exist.
    A ZeRO-1 dp 2 → 4 move fits a limit of 12 bytes/parameter that a ZeRO-0 move (14) cannot."""
    from nereusd.models import preset
    from nereusd.plan import Plan, Role
    from nereusd.transition import (AdamStateSizes, MemoryBudget, StateModel, check_feasibility, plan_transition,
                                    repartitioned_by)

    models = {Role.ACTOR: preset("qwen2.5-1.5b")}
    sizes = AdamStateSizes.for_dtype("bf16")
    two, four = (0, 1), (0, 1, 2, 3)
    cur, tgt = Plan({TRAIN: Candidate(1, 1, 2, two, zero_stage=1)}), Plan({TRAIN: Candidate(1, 1, 4, four, zero_stage=1)})
    state = StateModel(models, sizes, repartitioned_by(cur, tgt))
    assert state.repartitioned == {TRAIN}
    elements = state.elements(TRAIN, cur[TRAIN].layout, (0, 0))
    assert state.plan_bytes(cur)[0] == 2 * elements + state.partition_bytes(TRAIN, cur[TRAIN])
    assert state.partition_bytes(TRAIN, cur[TRAIN]) == -(-elements // 2) * 12
    budget = MemoryBudget(capacity_bytes=int((12 * elements + (128 << 20)) / 0.9), collective_buffer_bytes=64 << 20)
    dag = plan_transition(cur, tgt, models, devices_per_node=8, state=state, budget=budget)
    report = check_feasibility(dag, state, budget)
    assert report.feasible, report.violation
    # an old replica peaks with parameters, its old and its new partition (2 + 6 + 3 bytes per
    # parameter, plus a staging buffer); a joiner ends with parameters and a quarter (2 + 3)
    assert 11 * elements <= report.peak_bytes[0] <= 11 * elements + (64 << 20) + 64
    assert report.final_bytes[2] == pytest.approx(5 * elements, abs=64)
    zero0 = StateModel(models, sizes)
    plain = (Plan({TRAIN: Candidate(1, 1, 2, two)}), Plan({TRAIN: Candidate(1, 1, 4, four)}))
    dag0 = plan_transition(*plain, models, devices_per_node=8, state=zero0, budget=budget)
    assert not check_feasibility(dag0, zero0, budget).feasible


def test_plan_default_zero_stage_is_for_training_and_an_error_names_plan_default(tmp_path):
    job = resolve(write(tmp_path, tiny_job("backends: {actor/training: deepspeed}\nplan: {default: {zero_stage: 2}}\n")))
    assert job.plan[TRAIN].zero_stage == 2 and job.zero_stages == {TRAIN: (2,)}
    assert all(c.zero_stage == 0 for m, c in job.plan.items() if m != TRAIN)
    with pytest.raises(ConfigError, match=r"job.yaml: plan.default.zero_stage: zero_stage 1 needs backends"):
        resolve(write(tmp_path, tiny_job("plan: {default: {zero_stage: 1}, model_stages: {actor/training: {tp: 1}}}\n")))


def test_weight_sync_dags_carry_no_zero_stage():
    from nereusd.plan import Plan
    from nereusd.transition import weight_sync_dags
    from tests.support.specs import TINY_MODELS

    gen = ModelStage.parse("actor/generation")
    plan = Plan({gen: Candidate(1, 1, 2, (0, 1)), TRAIN: Candidate(1, 1, 2, (0, 1), zero_stage=1)})
    dag = weight_sync_dags(plan, TINY_MODELS, devices_per_node=4)[(TRAIN, gen)]
    assert all(c.zero_stage == 0 for c in dag.current.candidates.values())


@pytest.mark.parametrize("forced, match", [
    ("{at_step: 2, model_stages: {actor/training: {zero_stage: 1}}}",
     r"job.yaml: adaptation.forced\[0\].model_stages.actor/training.zero_stage: zero_stage 1 needs backends"),
    ("{at_step: 2, model_stages: {critic/training: {tp: 1}}}",
     r"adaptation.forced\[0\].model_stages.critic/training: not a model-stage of grpo"),
    ("{at_step: 99, model_stages: {actor/training: {tp: 1}}}", r"adaptation.forced\[0\].at_step: 99 is never reached"),
    # two entries for one step: the live boundary took the last, a resume the first
    ("{at_step: 2, model_stages: {actor/training: {tp: 1}}}, {at_step: 2, model_stages: {actor/inference: {tp: 1}}}",
     r"adaptation.forced\[1\].at_step: step 2 already has adaptation.forced\[0\]; give one entry per step"),
    # a layout the model or the devices can never take: refused at launch, not at its step
    ("{at_step: 2, model_stages: {actor/training: {tp: 1, pp: 3, devices: [0, 1, 2]}}}",
     r"adaptation.forced\[0\].model_stages.actor/training: layout tp1·pp3: pp=3 does not divide model num_layers"),
    ("{at_step: 2, model_stages: {actor/training: {tp: 3}}}",
     r"adaptation.forced\[0\].model_stages.actor/training: layout tp3·pp1: tp=3 does not divide"),
    ("{at_step: 2, model_stages: {actor/generation: {pp: 2}}}",
     r"adaptation.forced\[0\].model_stages.actor/generation: layout tp1·pp2: generation needs pp=1"),
    ("{at_step: 2, model_stages: {actor/training: {pp: 2, devices: [1, 1]}}}",
     r"adaptation.forced\[0\].model_stages.actor/training.devices: device listed twice in \[1, 1\]"),
    ("{at_step: 2, model_stages: {actor/training: {tp: 2, devices: [0, 1, 2]}}}",
     r"adaptation.forced\[0\].model_stages.actor/training: 3 devices are not a multiple of tp·pp = 2·1"),
])
def test_forced_entries_are_checked_before_launch(tmp_path, forced, match):
    with pytest.raises(ConfigError, match=match):
        resolve(write(tmp_path, tiny_job(f"steps: 4\nadaptation: {{forced: [{forced}]}}\n")))


@pytest.mark.parametrize("cfg, match", [
    ("{tp: 2}", r"adaptation.forced\[0\].model_stages.actor/training: the deepspeed backend runs tp = pp = 1"),
    ("{zero_stage: 0}", r"adaptation.forced\[0\].model_stages.actor/training.zero_stage: deepspeed runs"),
])
def test_forced_entries_on_a_deepspeed_stage_are_checked_before_launch(tmp_path, cfg, match):
    text = f"steps: 4\nbackends: {{actor/training: deepspeed}}\nadaptation: {{forced: [{{at_step: 2, model_stages: {{actor/training: {cfg}}}}}]}}\n"
    with pytest.raises(ConfigError, match=match):
        resolve(write(tmp_path, tiny_job(text)))
    ok = "steps: 4\nbackends: {actor/training: deepspeed}\nadaptation: {forced: [{at_step: 2, model_stages: {actor/training: {zero_stage: 2}}}]}\n"
    resolve(write(tmp_path, tiny_job(ok)))
