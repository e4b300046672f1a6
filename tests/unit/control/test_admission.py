"""Monitor and admission semantics per DESIGN.md (triggers, reset, H_x, payback, urgent path)."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings, strategies as st

from nereusd.control.admission import ADMIT, KEEP, REJECT, RESTART, Target, admit, urgent_replan
from nereusd.cost.model import CostModel
from nereusd.models import preset
from nereusd.control.monitor import FORCED, GPU_POOL, PEAK_MEMORY, SEQUENCE_LENGTH, Monitor, Trigger
from nereusd.plan import Candidate, ModelStage, Plan, Role
from nereusd.planner.space import PlanProblem
from nereusd.config.site import load_site
from nereusd.workflow import Workload, build_workflow

PLAN = Plan({ModelStage.parse("actor/training"): Candidate(1, 1, 1, (0,))})
DRIFT = Trigger(SEQUENCE_LENGTH, False, 1400.0, 1000.0)
POOL = Trigger(GPU_POOL, True, 8, 16)


def test_first_value_sets_reference_only():
    mon = Monitor()
    assert mon.observe(0, signals={SEQUENCE_LENGTH: 1000}) == []
    assert mon.reference(SEQUENCE_LENGTH) == 1000
    assert mon.horizon(SEQUENCE_LENGTH) == 1.0


def test_drift_threshold_30_percent():
    mon = Monitor()
    mon.observe(0, signals={SEQUENCE_LENGTH: 1000})
    assert mon.observe(1, signals={SEQUENCE_LENGTH: 1300}) == []        # exactly 30 %: no
    (t,) = mon.observe(2, signals={SEQUENCE_LENGTH: 1301})
    assert t.signal == SEQUENCE_LENGTH and not t.urgent and t.reference == 1000


def test_reset_after_replan_stops_retrigger_and_horizon_ema():
    mon = Monitor(ema_alpha=0.5)
    mon.observe(0, signals={SEQUENCE_LENGTH: 1000})
    assert mon.observe(3, signals={SEQUENCE_LENGTH: 1400})
    mon.replanned({SEQUENCE_LENGTH: 1400})                                  # even if rejected
    assert mon.observe(4, signals={SEQUENCE_LENGTH: 1400}) == []
    assert mon.horizon(SEQUENCE_LENGTH) == 1.0                             # one crossing: no interval
    assert mon.observe(7, signals={SEQUENCE_LENGTH: 1900})                 # interval 4
    mon.replanned({SEQUENCE_LENGTH: 1900})
    assert mon.horizon(SEQUENCE_LENGTH) == 4.0
    assert mon.observe(9, signals={SEQUENCE_LENGTH: 2500})                 # interval 2 -> 0.5*2+0.5*4
    assert mon.horizon(SEQUENCE_LENGTH) == 3.0


def test_without_reset_persistent_deviation_retriggers():
    mon = Monitor()
    mon.observe(0, signals={SEQUENCE_LENGTH: 1000})
    assert mon.observe(1, signals={SEQUENCE_LENGTH: 2000})
    assert mon.observe(2, signals={SEQUENCE_LENGTH: 2000})


def test_urgent_triggers_pool_and_memory():
    mon = Monitor()
    assert mon.observe(0, signals={}, pool=(0, 1, 2, 3)) == []
    (t,) = mon.observe(1, signals={}, pool=(0, 1))
    assert t.signal == GPU_POOL and t.urgent
    (m,) = mon.observe(2, signals={}, pool=(0, 1), predicted_peak_bytes=11, usable_bytes=10)
    assert m.signal == PEAK_MEMORY and m.urgent


def test_monitor_state_round_trip():
    mon = Monitor()
    mon.observe(0, signals={SEQUENCE_LENGTH: 1000}, pool=(0, 1))
    mon.observe(5, signals={SEQUENCE_LENGTH: 2000})
    back = Monitor.from_json(json.loads(json.dumps(mon.to_json())))
    assert back.reference(SEQUENCE_LENGTH) == 1000 and back.to_json() == mon.to_json()


def target(latency, tran, feasible=True):
    return Target(PLAN, latency, tran, feasible, "" if feasible else "Extend does not fit")


@settings(max_examples=200, deadline=None)
@given(cur=st.floats(1, 100), new=st.floats(1, 100), tran=st.floats(0, 500), h=st.floats(1, 50),
       gamma=st.floats(0, 1))
def test_payback_rule(cur, new, tran, h, gamma):
    d = admit(step=1, triggers=[DRIFT], current_step_latency_s=cur, targets=[target(new, tran)],
              horizon_steps=h, payback_margin=gamma)
    delta = cur - new
    expected = gamma > 0 and delta > 0 and tran / delta <= gamma * h
    assert d.admitted == expected
    rec = json.loads(d.to_json_line())
    assert rec["payback_margin"] == gamma and rec["h_x"] == h and rec["verdict"] in (ADMIT, REJECT)
    if d.admitted:
        assert rec["delta_l_s"] == pytest.approx(delta) and rec["l_tran_s"] == tran


def test_feasibility_falls_back_to_slower_cheaper_target():
    d = admit(step=3, triggers=[DRIFT], current_step_latency_s=10.0,
              targets=[target(6.0, 1.0, feasible=False), target(8.0, 0.5)], horizon_steps=2.0)
    assert d.admitted and d.target.step_latency_s == 8.0
    assert d.alternatives[0]["verdict"] == "infeasible"


def test_urgent_waives_profitability_and_restart():
    d = admit(step=1, triggers=[POOL], current_step_latency_s=math.inf, targets=[target(50.0, 999.0)],
              horizon_steps=1.0, payback_margin=0.0, current_valid=False)
    assert d.admitted and d.urgent
    none = admit(step=1, triggers=[POOL], current_step_latency_s=1.0, targets=[], horizon_steps=1.0,
                 current_valid=False)
    assert none.verdict == RESTART
    keep = admit(step=1, triggers=[POOL], current_step_latency_s=1.0, targets=[target(2.0, 1.0, False)],
                 horizon_steps=1.0)
    assert keep.verdict == KEEP


def test_a_target_only_a_restart_reaches_is_restarted_into_when_the_restart_repays_itself():
    """A plan that fits but whose transition does not (``restartable``): with a learned restart
    cost, checkpoint/restart into it when ``L̂_restart / ΔL ≤ γ·H_x``; a feasible target that pays
    back goes first; an unknown restart cost (0) or a plan over memory never restarts."""
    only = Target(PLAN, 40.0, 20.0, False, "Extend does not fit", restartable=True)
    d = admit(step=5, triggers=[DRIFT], current_step_latency_s=56.0, targets=[only], horizon_steps=30.0,
              restart_s=190.0)   # 190 / 16 = 11.9 steps <= 0.5 · 30
    assert d.verdict == RESTART and d.target is only and d.l_tran_s == 190.0
    assert d.payback_steps == pytest.approx(190.0 / 16.0)
    assert admit(step=5, triggers=[DRIFT], current_step_latency_s=56.0, targets=[only], horizon_steps=20.0,
                 restart_s=190.0).verdict == REJECT   # 11.9 > 10
    assert admit(step=5, triggers=[DRIFT], current_step_latency_s=56.0, targets=[only],
                 horizon_steps=30.0).verdict == REJECT   # nothing measured yet
    over = Target(PLAN, 40.0, 20.0, False, "predicted peak over usable memory")
    assert admit(step=5, triggers=[DRIFT], current_step_latency_s=56.0, targets=[over], horizon_steps=30.0,
                 restart_s=190.0).verdict == REJECT
    cheap = target(50.0, 1.0)
    assert admit(step=5, triggers=[DRIFT], current_step_latency_s=56.0, targets=[only, cheap], horizon_steps=30.0,
                 restart_s=190.0).target is cheap
    # urgent and still running (devices joined): weighed against keeping over H_x (56·30 >
    # 40·30 + 190), test_urgent_weighs_a_restart_into_a_target_whose_transition_does_not_fit
    assert admit(step=5, triggers=[POOL], current_step_latency_s=56.0, targets=[only], horizon_steps=30.0,
                 restart_s=190.0).verdict == RESTART


def test_urgent_takes_the_feasible_target_cheapest_over_the_horizon():
    """An urgent switch waives profitability, not cost: after devices were lost, S* 0.1 s/step
    faster whose transition starts vLLM engines (15 s) loses to the DP rescale over a 10-step
    horizon and wins over 1,000 steps; an infeasible cheaper target is never taken; equal costs
    keep S*."""
    fast, cheap = target(2.4, 15.6), target(2.5, 0.6)
    lost = dict(triggers=[POOL], current_step_latency_s=math.inf, current_valid=False)
    short = admit(step=19, targets=[fast, cheap], horizon_steps=10.0, **lost)
    assert short.admitted and short.target is cheap
    assert [a["verdict"] for a in short.alternatives] == ["costlier"]
    assert admit(step=19, targets=[fast, cheap], horizon_steps=1000.0, **lost).target is fast
    assert admit(step=19, targets=[fast, target(2.5, 0.6, feasible=False)], horizon_steps=10.0, **lost).target is fast
    tie = target(2.4, 15.6)
    assert admit(step=19, targets=[fast, tie], horizon_steps=10.0, **lost).target is fast
    # the faster target passed over is asked again once the plan lasts long enough to repay its
    # 15.6 s over the 0.1 s/step it gains on the plan taken (156 steps); greedy and γ = 0 ask nothing
    assert short.rejected_payback_steps == pytest.approx(15.6 / 0.1)
    # once the rescale runs, S* may be nearer than from the current plan (the caller knows)
    moves = []
    near = admit(step=19, targets=[fast, cheap], horizon_steps=10.0,
                 move=lambda a, b: moves.append((a, b)) or target(2.4, 1.0), **lost)
    assert near.target is cheap and moves == [(cheap, fast)] and near.rejected_payback_steps == pytest.approx(10.0)
    assert admit(step=19, targets=[fast, cheap], horizon_steps=10.0, move=lambda a, b: target(2.4, 1.0, False),
                 **lost).rejected_payback_steps is None   # out of reach from there (no restart measured)
    assert admit(step=19, targets=[fast, cheap], horizon_steps=1000.0, **lost).rejected_payback_steps is None
    for gamma in (0.0, math.inf):
        assert admit(step=19, targets=[fast, cheap], horizon_steps=10.0, payback_margin=gamma,
                     **lost).rejected_payback_steps is None


def test_urgent_weighs_a_restart_into_a_target_whose_transition_does_not_fit():
    """The MI250X ramp's pool change (``scripts/bench_sim.py``, seed 0, step 946): devices lost,
    the DP rescale at 345.9 s/step is reachable, S* at 281.4 s/step only by a 203 s restart, and
    the pool has changed every ~100 steps. Over that horizon the restart is cheaper; over one
    step the rescale is, and S* is then asked again once the rescale has run long enough to repay
    the restart (203 / 64.5 steps). Greedy weighs it too; an unknown restart cost does not."""
    only = Target(PLAN, 281.4, 7.8, False, "transition does not fit memory", restartable=True)
    rescale = target(345.9, 0.0)
    lost = dict(triggers=[POOL], current_step_latency_s=math.inf, current_valid=False, restart_s=203.0)
    d = admit(step=946, targets=[only, rescale], horizon_steps=99.9, **lost)
    assert d.verdict == RESTART and d.target is only and d.l_tran_s == 203.0 and "checkpoint/restart" in d.reason
    assert [a["verdict"] for a in d.alternatives] == ["costlier"]
    short = admit(step=946, targets=[only, rescale], horizon_steps=1.0, **lost)
    assert short.admitted and short.target is rescale
    assert short.rejected_payback_steps == pytest.approx(203.0 / (345.9 - 281.4))
    assert admit(step=946, targets=[only, rescale], horizon_steps=99.9, payback_margin=math.inf,
                 **lost).verdict == RESTART
    assert admit(step=946, targets=[only, rescale], horizon_steps=99.9,
                 **(lost | {"restart_s": 0.0})).target is rescale
    # still running at 300 s/step: keeping it costs 300·H, the restart 281.4·H + 203; a keep is
    # not undone by the opportunistic restart rule, whatever γ (203 / 18.6 = 10.9 ≤ 2·6)
    running = dict(triggers=[POOL], current_step_latency_s=300.0, restart_s=203.0)
    kept = admit(step=946, targets=[only], horizon_steps=5.0, **running)
    assert kept.verdict == KEEP and kept.rejected_payback_steps == pytest.approx(203.0 / 18.6)
    assert [a["verdict"] for a in kept.alternatives] == ["costlier"]
    assert admit(step=946, targets=[only], horizon_steps=6.0, payback_margin=2.0, **running).verdict == KEEP
    assert admit(step=946, targets=[only], horizon_steps=99.9, **running).verdict == RESTART
    # a forced layout that only a restart reaches is restarted into (to it, not to the planner's
    # plan: Controller.restart_plan), whatever the restart costs or gains, even unmeasured; one
    # that fits no memory at all is not, and the current plan is kept
    forced = Trigger(FORCED, True, 946, None, "layout forced")
    for cur, restart_s in ((300.0, 203.0), (250.0, 203.0), (300.0, 0.0)):
        d = admit(step=946, triggers=[forced], current_step_latency_s=cur, targets=[only], horizon_steps=99.9,
                  restart_s=restart_s)
        assert d.verdict == RESTART and d.target is only and "layout forced" in d.reason, d
    assert "not yet measured" in d.reason
    unfit = Target(PLAN, 281.4, 7.8, False, "over memory", restartable=False)
    assert admit(step=946, triggers=[forced], current_step_latency_s=300.0, targets=[unfit], horizon_steps=99.9,
                 restart_s=203.0).verdict == KEEP


def test_urgent_keeps_a_plan_that_still_runs_when_that_is_cheapest_over_the_horizon():
    """Devices joined (the current plan still runs): using them at 2.0 s/step instead of 2.4 costs
    a 30 s engine start-up, which a 10-step horizon does not repay (24 < 20 + 30) and a 1,000-step
    one does; a tie keeps the plan; a forced layout is always taken."""
    joined = target(2.0, 30.0)
    short = admit(step=7, triggers=[POOL], current_step_latency_s=2.4, targets=[joined], horizon_steps=10.0)
    assert short.verdict == KEEP and short.urgent and "cheapest over H_x" in short.reason
    assert [a["verdict"] for a in short.alternatives] == ["costlier"]
    assert short.rejected_payback_steps == pytest.approx(30.0 / 0.4)   # asked again if the pool stays
    assert admit(step=7, triggers=[POOL], current_step_latency_s=2.4, targets=[joined],
                 horizon_steps=1000.0).target is joined
    assert admit(step=7, triggers=[POOL], current_step_latency_s=2.4, targets=[target(2.0, 4.0)],
                 horizon_steps=10.0).verdict == KEEP   # 24 = 20 + 4
    assert admit(step=7, triggers=[POOL], current_step_latency_s=2.4, targets=[joined], horizon_steps=10.0,
                 current_valid=False).target is joined   # over memory: it does not run
    forced = Trigger(FORCED, True, 7, None, "layout forced")
    assert admit(step=7, triggers=[forced], current_step_latency_s=2.4, targets=[joined],
                 horizon_steps=10.0).target is joined


def test_urgent_replan_widens_to_recompute():
    site = load_site("a100-ib").with_nodes(1)
    spec = preset("llama-3.1-8b")
    wl = Workload(prompt_length=512, response_length=4096, global_batch=64, micro_batch=4)
    pb = PlanProblem(build_workflow("grpo", reward_model=False), {r: spec for r in Role}, wl, site, tuple(range(4)))
    result, attempts = urgent_replan(pb, CostModel(site))
    assert attempts[0].startswith("job settings")
    if result is not None:
        assert max(result.peak_bytes.values()) <= result.usable_bytes


def test_only_a_payback_policy_keeps_a_rejection_to_ask_again():
    """``rejected_payback_steps`` (what the controller's recheck waits on) is set for
    ``0 < γ < ∞`` only: ``γ = 0`` admits urgent switches only and would store a question it
    never asks (a fault search found it in the controller's state)."""
    from nereusd.control.admission import Target, admit, recheck_due
    from nereusd.control.monitor import EFFICIENCY, Trigger
    from nereusd.plan import Plan

    trigger = Trigger(EFFICIENCY, False, 1.0, 1.3)
    target = Target(Plan({}), step_latency_s=9.0, transition_s=10.0)   # pays back in 10 steps
    for gamma, expected in ((0.5, 10.0), (0.0, None)):
        d = admit(step=1, triggers=[trigger], current_step_latency_s=10.0, targets=[target], horizon_steps=1.0,
                  payback_margin=gamma)
        assert d.verdict == "reject" and d.rejected_payback_steps == expected, (gamma, d.to_dict())
    assert not recheck_due(10.0, 10**6, 0.0) and not recheck_due(10.0, 10**6, float("inf"))
    assert recheck_due(10.0, 20, 0.5) and not recheck_due(10.0, 19, 0.5)
