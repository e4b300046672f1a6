"""End to end, live adaptation with the real nereusd, agents and workers (`nereus-launch local`):

- a job whose responses grow past what its launch layout can hold switches layout before it runs
  out of memory, survives the removal and the re-addition of a device (its worker really stopped,
  a new one really started; the world re-formed each time) and finishes; its decision log
  explains each switch;
- forced layout switches (training, inference and generation: TP, PP, DP and generation waves)
  train exactly like no switches: the same samples, and per-step rewards and losses of the same
  seed agree within floating-point reduction tolerance over 20 steps.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nereusd.control.problem import job_problem
from nereusd.cost.model import CostModel
from nereusd.config.resolve import load_and_resolve
from nereusd.journal import read_jsonl
from nereusd.cost.memory import usable_bytes
from nereusd.planner.search import Planner
from nereusd.planner.space import evaluate
from nereusd.config.site import load_site
from tests.support.e2e import processes_mentioning

from tests.support.e2e import (assert_join_decided, assert_trains_alike, finish, run_fixed_and_switched, start,
                                write_job)
pytestmark = pytest.mark.slow

GROWING = """
name: e2e-adaptive
algorithm: grpo
seed: 3
steps: 8
devices: 4
memory_gib: @MEMORY@
models: {actor: "@WARMSTART@"}
rollout: {prompts_per_step: 4, group_size: 4, max_new_tokens: 64}
train: {global_batch: 16, micro_batch: 4, kl_coef: 0.0}
plan:
  default: {tp: 1, pp: 1}
  model_stages:
    actor/training: {tp: 1, pp: 1}
pool:
  join: immediate   # device 4 joins at the boundary it arrives at (the background join: test_vllm_generation)
  schedule:
    - {at_step: 5, remove: 1}
    - {at_step: 6, add: 1}
"""








def capacity_between(job_path: Path) -> float:
    """A device capacity (GiB) under which the launch plan fits a 24-token response but not the
    longest one (64 tokens), while the planner still finds a plan for 64 tokens — computed with
    the project's own memory model, so the test follows the model if it changes."""
    job = load_and_resolve(job_path)
    site = load_site(job.config.site)

    def peak(length: int, gib: float) -> tuple[int, int]:
        import dataclasses

        j = dataclasses.replace(job, device_memory_bytes=int(gib * 2**30))
        problem = job_problem(j, site, tuple(range(4)), length, 5)
        return max(evaluate(problem, job.plan, CostModel(problem.site)).peak_bytes.values()), \
            problem.site.device_memory_bytes

    high, _ = peak(64, 1.0)
    gib = high / 0.9 * 0.96 / 2**30
    low, capacity = peak(24, gib)
    assert low <= usable_bytes(capacity), "launch plan should fit short responses"
    import dataclasses
    problem = job_problem(dataclasses.replace(job, device_memory_bytes=capacity), site, tuple(range(4)), 64, 5)
    Planner(problem, CostModel(problem.site)).solve()   # raises Infeasible if nothing holds 64 tokens
    return round(gib, 5)


def test_growth_switches_before_oom_and_survives_pool_changes(tmp_path):
    probe = write_job(tmp_path, "probe", GROWING.replace("@MEMORY@", "0.5"))
    job = write_job(tmp_path, "job", GROWING.replace("@MEMORY@", str(capacity_between(probe))))
    run_dir = tmp_path / "run"
    out = finish(start(job, run_dir), run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "succeeded" and summary["steps"] == 8 and summary["switches"] >= 2
    events = read_jsonl(run_dir / "events.jsonl")
    kinds = [e["event"] for e in events]
    assert "job_failed" not in kinds and not any("OutOfMemory" in json.dumps(e) for e in events)
    admitted = [e for e in events if e["event"] == "admission" and e["verdict"] == "admit"]
    growth = [e for e in admitted if any(t["signal"] == "peak_memory" for t in e["triggers"])]
    assert growth and growth[0]["step"] < 5, "the growth switch must come from the job's own lengths"
    for e in admitted:   # the decision log explains every switch
        assert e["reason"] and e["triggers"] and e["target_plan"]
        for key in ("delta_l_s", "l_tran_s", "h_x", "payback_margin", "alternatives", "current_step_latency_s"):
            assert key in e
    transitions = [e for e in events if e["event"] == "transition"]
    assert len(transitions) >= len(admitted) and all("op_timings" in e for e in transitions)
    for e in transitions:   # where each transition's time went, seen from nereusd and the workers
        assert {"prepare", "ops", "finish", "setup", "detach", "rebuild", "collect"} <= set(e["phases_s"])
        assert e["phases_s"]["prepare"] + e["phases_s"]["ops"] + e["phases_s"]["finish"] <= e["elapsed_s"] + 1e-6
    # device 3 left (its worker stopped), device 4 joined (a new worker); the world re-formed twice
    changes = [e for e in events if e["event"] == "pool_changed" and "step" in e]
    assert [c["leaving"] for c in changes] == [[3], []] and [c["joined"] for c in changes] == [[], [4]]
    assert any(e["event"] == "worker_exited" and e["device"] == 3 for e in events)
    generations = [e["generation"] for e in events if e["event"] == "world_formed"]
    assert len(generations) >= 3 and generations == sorted(generations)
    records = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(8))
    assert all("3" not in r["peak_memory_bytes"] for r in records[5:])
    assert_join_decided(events, records, 4)
    assert any(e["event"] == "step_prediction" and e["predicted_step_latency_s"] for e in events)
    assert (run_dir / "checkpoints" / "final" / "actor" / ".metadata").is_file()
    assert "switch admitted" not in out  # --quiet
    assert processes_mentioning(str(run_dir)) == []


CURRICULUM = """
name: e2e-curriculum
algorithm: grpo
seed: 3
steps: 5
devices: 2
models: {actor: "@WARMSTART@"}
rollout:
  prompts_per_step: 4
  group_size: 2
  max_new_tokens: 24
  max_new_tokens_schedule: [{at_step: 0, max_new_tokens: 6}, {at_step: 3, max_new_tokens: 24}]
train: {global_batch: 8, micro_batch: 4, kl_coef: 0.0}
backends: {actor/generation: native}
"""


def test_a_length_curriculum_caps_each_stage_and_the_controller_plans_for_the_next(tmp_path):
    """``rollout.max_new_tokens_schedule``: steps 0–2 generate at most 6 tokens (the warm start
    writes longer: they are cut), steps 3–4 up to 24. The controller plans step 0 for its stage's
    cap, and after step 2, cut at 6, plans step 3 for the new stage's whole cap (a cut response
    says only that it wanted more), before that step, not after it."""
    job = write_job(tmp_path, "job", CURRICULUM)
    run_dir = tmp_path / "run"
    finish(start(job, run_dir), run_dir)
    records = read_jsonl(run_dir / "metrics.jsonl")
    longest = [r["response_length_max"] for r in records]
    assert [r["step"] for r in records] == list(range(5))
    assert [r["max_new_tokens"] for r in records] == [6, 6, 6, 24, 24]   # each step's cap, on record
    assert longest[:3] == [6, 6, 6] and all(x <= 24 for x in longest[3:]) and max(longest[3:]) > 6, longest
    events = read_jsonl(run_dir / "events.jsonl")
    launch = next(e for e in events if e["event"] == "launch_plan")
    assert launch["source"] == "planner" and launch["response_length"] == 6   # step 0's cap
    planned = {e["step"]: e["planned_length"] for e in events if e["event"] == "step_prediction"}
    assert planned[0] == 6 and planned[1] == 6 and planned[2] == 24, planned


EQUIV = """
name: e2e-equiv
algorithm: grpo
seed: 11
steps: 20
devices: 2
models: {actor: "@WARMSTART@"}
rollout: {prompts_per_step: 2, group_size: 4, max_new_tokens: 12}
train: {global_batch: 8, micro_batch: 4, kl_coef: 0.05}
plan: {default: {tp: 1, pp: 1}}
adaptation:
  enabled: @ENABLED@
  payback_margin: 0.0
  forced: @FORCED@
"""
FORCED = """
    - {at_step: 4, model_stages: {actor/training: {tp: 2}}}
    - {at_step: 8, model_stages: {actor/training: {tp: 1, pp: 2}, reference/inference: {tp: 2}}}
    - {at_step: 12, model_stages: {actor/training: {tp: 1, pp: 1}, actor/inference: {pp: 2},
                                   actor/generation: {tp: 2, micro_batch: 2}}}
    - {at_step: 16, model_stages: {actor/training: {tp: 2, pp: 1}}}"""






def test_forced_switches_train_like_no_switches(tmp_path):
    a, b = run_fixed_and_switched(tmp_path, EQUIV, FORCED)
    assert len(a) == len(b) == 20
    layouts = {json.dumps(r["plan"]["actor/training"]) for r in b}
    assert len(layouts) >= 3, "the forced switches did not happen"
    assert len({json.dumps(r["plan"]["actor/training"]) for r in a}) == 1
    assert_trains_alike(a, b)
    events = read_jsonl(tmp_path / "switched" / "events.jsonl")
    assert sum(e["event"] == "transition" for e in events) == 4
