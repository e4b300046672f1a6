"""The safe boundary as pure plans (nereusd.daemon.boundary), without processes or sockets."""

from __future__ import annotations

import pytest

from nereusd.config.pool_schedule import PoolEvent
from nereusd.control.admission import Decision, Target, Verdict
from nereusd.control.monitor import GPU_POOL, Trigger
from nereusd.daemon.boundary import ActionKind, plan_actions, plan_pool
from nereusd.plan import Candidate, ModelStage, Plan, Role, Stage
from nereusd.transition import plan_transition
from tests.support.specs import TINY_MODELS

MS = ModelStage(Role.ACTOR, Stage.TRAINING)
ON_0123 = Plan({MS: Candidate(1, 1, 4, (0, 1, 2, 3))})
ON_012 = Plan({MS: Candidate(1, 1, 3, (0, 1, 2))})
ON_01 = Plan({MS: Candidate(1, 1, 2, (0, 1))})


def decision(verdict: Verdict, target: Plan | None = None, current: Plan = ON_01) -> Decision:
    tgt = None if target is None else Target(target, 1.0, 0.5, dag=plan_transition(
        current, target, TINY_MODELS, devices_per_node=4))
    return Decision(step=3, verdict=verdict, urgent=True, triggers=(Trigger(GPU_POOL, True, 3, 4),),
                    current_step_latency_s=2.0, payback_margin=0.5, horizon_steps=1.0, target=tgt,
                    l_tran_s=0.5 if tgt else None, reason=f"{verdict}")


def test_removals_take_the_highest_numbered_devices_and_never_the_last():
    due = [PoolEvent(remove=1, add=0, source="pool.schedule[0]")]
    actions = plan_pool(world=[0, 1, 2, 3], registered=[0, 1, 2, 3], lost={}, plan_devices=[0, 1],
                        pending_remove=1, due=due)
    assert actions.leaving == (2, 3) and actions.add == 0 and actions.refused_remove == 0
    assert actions.sources == ("pool.schedule[0]", "nereus-launch pool --remove 1")
    refused = plan_pool(world=[0], registered=[0], lost={}, plan_devices=[0], pending_remove=1, due=[])
    assert refused.leaving == () and refused.refused_remove == 1


def test_removals_take_devices_that_have_not_joined_first():
    """Devices registered but not in the world yet (waiting for a background join, or in one)
    hold nothing of the job: a removal takes them before the world's. ``pool --remove`` during a
    join was counted against them on arrival and then refused at the boundary."""
    joining = dict(world=[0, 1], registered=[0, 1, 2, 3], lost={}, plan_devices=[0, 1], due=[], min_devices=2)
    one = plan_pool(pending_remove=1, **joining)
    assert one.leaving_outside == (3,) and one.leaving == () and one.refused_remove == 0
    two = plan_pool(pending_remove=2, **joining)
    assert two.leaving_outside == (2, 3) and two.leaving == ()
    three = plan_pool(pending_remove=3, **joining)   # would leave one device: refused whole
    assert three.refused_remove == 3 and three.leaving == three.leaving_outside == ()
    spare = plan_pool(pending_remove=3, **(joining | {"min_devices": 1}))
    assert spare.leaving_outside == (2, 3) and spare.leaving == (1,)


def test_a_lost_spare_leaves_and_a_lost_plan_device_plans_nothing_but_the_joins():
    lost = {3: {"cause": "worker_exited"}}
    spare = plan_pool(world=[0, 1, 2, 3], registered=[0, 1, 2, 3], lost=lost, plan_devices=[0, 1],
                      pending_remove=0, due=[])
    assert spare.leaving == (3,) and spare.lost_spares == lost and spare.lost_plan_devices == ()
    hit = plan_pool(world=[0, 1, 2, 3], registered=[0, 1, 2, 3], lost=lost, plan_devices=[0, 1, 2, 3],
                    pending_remove=2, due=[PoolEvent(remove=0, add=2, source="trace")])
    assert hit.lost_plan_devices == (3,) and hit.leaving == () and hit.add == 2


def test_an_admitted_transition_runs_admissions_own_dag_then_releases():
    d = decision(Verdict.ADMIT, ON_01, current=ON_0123)
    actions = plan_actions(d, plan=ON_0123, leaving=[2, 3], joined=[])
    assert [a.kind for a in actions] == [ActionKind.TRANSITION, ActionKind.RELEASE]
    assert actions[0].dag is d.target.dag and actions[0].target == ON_01 and actions[0].predicted_s == 0.5
    assert actions[1].devices == (2, 3)


@pytest.mark.parametrize("verdict", [Verdict.KEEP, Verdict.RESTART])
def test_devices_that_leave_under_the_plan_restart_it(verdict):
    actions = plan_actions(decision(verdict), plan=ON_0123, leaving=[3], joined=[])
    assert [a.kind for a in actions] == [ActionKind.RESTART] and actions[0].devices == (3,)


def test_joined_devices_rebuild_unless_a_transition_ran():
    assert [a.kind for a in plan_actions(decision(Verdict.KEEP), plan=ON_01, leaving=[], joined=[2])] == \
        [ActionKind.REBUILD]
    admitted = plan_actions(decision(Verdict.ADMIT, ON_012), plan=ON_01, leaving=[], joined=[2])
    assert [a.kind for a in admitted] == [ActionKind.TRANSITION]
    assert plan_actions(None, plan=ON_01, leaving=[], joined=[]) == ()
    with pytest.raises(ValueError, match="uses devices \\[2\\] that leave"):
        plan_actions(decision(Verdict.ADMIT, ON_012), plan=ON_01, leaving=[2], joined=[])


def test_a_negative_removal_is_refused():
    with pytest.raises(ValueError, match="pending_remove must be >= 0"):
        plan_pool(world=[0, 1], registered=[0, 1], lost={}, plan_devices=[0], pending_remove=-1, due=[])


def test_a_pool_request_for_the_whole_pool_is_refused_on_arrival(tmp_path):
    """``pool --remove 1000`` on a 4-device job printed success and was refused only at the
    boundary, together with any request queued beside it; nereusd now refuses it on arrival, and
    requests that together would leave no device too."""
    from nereusd.daemon.pool import PoolController
    from nereusd.journal import Journal

    pool = PoolController(Journal(tmp_path), tmp_path, "j", steps=10)
    pool.live = True
    pool.world_formed({}, [0, 1, 2, 3])
    assert "the pool holds 4 devices" in pool.request_remove(1000)["error"]
    assert pool.request_remove(2) == {"queued_remove": 2, "pool": []}   # no control plane here: no pool list
    refused = pool.request_remove(2)
    assert "2 already leaving" in refused["error"] and pool.pending_remove == 2
    assert pool.request_remove(1)["queued_remove"] == 3
    pool.pending_remove, pool.min_devices = 0, 2   # GRPO: actor and reference inference at once
    assert "the job needs at least 2" in pool.request_remove(3)["error"]
    assert pool.request_remove(2)["queued_remove"] == 2
    # status says a restart runs (it showed the plan being left as if it ran; a helper, 2026-12-05)
    assert pool.status()["state"] == "running"
    pool.restarting = "devices [2] lost (worker_exited)"
    assert pool.status()["state"] == "restarting: devices [2] lost (worker_exited)"
    # the join line is read when status is asked: a restart's cancelled join, or its time so far,
    # shows at once (it was the value set at the last boundary)
    assert pool.status()["joining"] is None
    join = {"devices": [4], "phase": "engines", "elapsed_s": 3.0, "waiting": []}
    pool.joining = lambda: join
    assert pool.status()["joining"]["elapsed_s"] == 3.0
    join["elapsed_s"] = 9.0
    assert pool.status()["joining"]["elapsed_s"] == 9.0
    pool.joining = lambda: None   # cancelled by the restart
    assert pool.status()["joining"] is None
    pool.journal.close()


def test_a_removal_below_the_jobs_minimum_or_onto_a_pool_no_plan_fits_is_refused():
    """``pool --remove 3`` of a 4-device GRPO job (which needs 2 devices) was accepted and the
    job failed at its restart, 97 steps in (an adversarial helper, 2026-12-05): a removal is
    refused below the job's minimum, and onto a pool the controller finds no plan for."""
    args = dict(world=[0, 1, 2, 3], registered=[0, 1, 2, 3], lost={}, plan_devices=[0, 1, 2, 3], due=[])
    low = plan_pool(**args, pending_remove=3, min_devices=2)
    assert low.leaving == () and low.refused_remove == 3 and "at least 2 device(s)" in low.refused_reason
    asked = []
    unfit = plan_pool(**args, pending_remove=2, min_devices=2,
                      unfit=lambda pool: asked.append(pool) or "no plan fits the 2 device(s) left")
    assert asked == [(0, 1)] and unfit.leaving == () and unfit.refused_reason.startswith("no plan fits")
    ok = plan_pool(**args, pending_remove=2, min_devices=2, unfit=lambda pool: None)
    assert ok.leaving == (2, 3) and ok.refused_remove == 0


def test_status_lists_only_the_devices_still_in_the_pool(tmp_path):
    """After ``pool --remove`` the node still listed the released device (a helper, 2026-12-05)."""
    from tests.support.protocol_fuzz import make_target

    target = make_target(tmp_path)
    try:
        assert target.pool.status()["pool"]["n0"]["devices"] == [0, 1]
        target.control.release_devices([1], "removed from the local pool")
        status = target.pool.status()
        assert status["pool"]["n0"]["devices"] == [0] and status["pool_devices"] == 1
    finally:
        target.close()
