"""The controller side of a transition when workers die: what it raises and what it says survived.

:class:`ScriptedControl` stands in for :class:`nereusd.daemon.control_plane.ControlPlane`: it
answers the runner's calls from a script (which task fails, which workers exited) so that each
failure case is exact; the real control plane under a real transition is exercised by
``tests/e2e/test_device_loss.py`` and ``tests/distributed/test_executor_fault.py``.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from nereusd.errors import WorkerError
from nereusd.plan import Candidate, ModelStage, Plan, Role, Stage
from nereusd.transition import plan_transition
from nereusd.transition.runner import TransitionInterrupted, TransitionProgress, TransitionRunner

MS = ModelStage(Role.ACTOR, Stage.TRAINING)


class ScriptedControl:
    """The control-plane calls :class:`TransitionRunner` makes; the first task that runs ops —
    ``transition_prepare`` with the first ready set, or a ``transition_run`` — fails with the
    workers of ``dead`` exited."""

    def __init__(self, dead: dict[int, int], error_kind: str | None = None) -> None:
        self.dead, self.error_kind = dead, error_kind
        self.exited_workers: dict[int, int] = {}
        self.kinds: list[str] = []

    def run(self, args, timeout_s=None, shared=None):
        self.kinds.append(next(iter(args.values())).kind)
        if any(getattr(a, "ops", None) for a in args.values()):
            return self.collect(len(self.kinds))
        return {d: SimpleNamespace(result={"setup_s": 0.0}) for d in args}

    def submit(self, args):
        self.kinds.append(next(iter(args.values())).kind)
        return len(self.kinds)

    def done(self, task_id):
        return True

    def collect(self, task_id, timeout_s=None):
        self.exited_workers.update(self.dead)
        raise WorkerError(f"worker process of device(s) {sorted(self.dead)} exited", error_kind=self.error_kind)

    def poll(self, timeout_s):
        pass

    def raise_if_lost(self, task_id):
        pass


def test_every_holder_dead_is_a_worker_error_naming_the_lost_model_stage(tiny_models):
    """Both devices of the only unit die: no copy is left in memory. The runner must raise what
    the driver recovers from (a WorkerError: checkpoint/restart), not a plain error that fails
    the job."""
    current = Plan({MS: Candidate(2, 1, 1, (0, 1))})
    target = Plan({MS: Candidate(1, 1, 2, (2, 3))})
    dag = plan_transition(current, target, tiny_models, devices_per_node=4)
    control = ScriptedControl(dead={0: -9, 1: -9})
    with pytest.raises(TransitionInterrupted, match=r"no complete unit of \['actor/training'\]") as info:
        TransitionRunner(control, [0, 1, 2, 3]).run(dag)
    err = info.value
    assert isinstance(err, WorkerError)
    assert err.lost == (MS,) and MS not in err.units and err.intact == set()


def test_one_holder_of_two_replicas_dead_keeps_the_other_unit(tiny_models):
    current = Plan({MS: Candidate(1, 1, 2, (0, 1))})
    target = Plan({MS: Candidate(2, 1, 1, (2, 3))})
    dag = plan_transition(current, target, tiny_models, devices_per_node=4)
    with pytest.raises(TransitionInterrupted) as info:
        TransitionRunner(ScriptedControl(dead={0: -9}), [0, 1, 2, 3]).run(dag)
    err = info.value
    assert err.lost == () and err.units[MS].devices == (1,)
    assert "no complete unit" not in str(err)


def test_one_replica_of_a_repartitioned_zero_set_dead_loses_the_model_stage(tiny_models):
    """ZeRO keeps one copy of each optimizer partition: a transition that moves them straight
    between replica sets (``zero_repartitioned``) loses the model-stage with any old replica,
    though its other replica still holds the parameters (a ZeRO-0 pair would keep that unit)."""
    current = Plan({MS: Candidate(1, 1, 2, (0, 1), zero_stage=1)})
    target = Plan({MS: Candidate(1, 1, 4, (0, 1, 2, 3), zero_stage=1)})
    dag = plan_transition(current, target, tiny_models, devices_per_node=4)
    with pytest.raises(TransitionInterrupted, match=r"no complete unit of \['actor/training'\]") as info:
        TransitionRunner(ScriptedControl(dead={0: -9}), [0, 1, 2, 3]).run(dag)
    assert info.value.lost == (MS,) and MS not in info.value.units
    # a device outside the old set dead: the partitions are intact
    with pytest.raises(TransitionInterrupted) as info:
        TransitionRunner(ScriptedControl(dead={3: -9}), [0, 1, 2, 3]).run(dag)
    assert info.value.lost == ()


def test_an_out_of_memory_transition_stays_an_out_of_memory_failure(tiny_models):
    """Recovery restarts every device after an out-of-memory failure: the kind must survive."""
    dag = plan_transition(Plan({MS: Candidate(1, 1, 2, (0, 1))}), Plan({MS: Candidate(2, 1, 1, (2, 3))}), tiny_models,
                          devices_per_node=4)
    with pytest.raises(TransitionInterrupted) as info:
        TransitionRunner(ScriptedControl(dead={}, error_kind="DeviceOutOfMemory"), [0, 1, 2, 3]).run(dag)
    assert info.value.error_kind == "DeviceOutOfMemory"


def test_the_terms_a_transition_prices_apart_are_its_ops_span_rebuilds_syncs_and_engine_starts():
    timings = {"a": {"start_s": 10.0, "end_s": 10.5}, "b": {"start_s": 10.2, "end_s": 11.0}}
    phases = {"detach": 0.2, "rebuild": 0.3, "engine_start": 2.0, "collect": 0.1, "prepare": 0.4, "ops": 0.7}
    assert TransitionProgress(timings=timings, phases_s=phases).terms_s() == pytest.approx(0.2 + 1.0 + 0.3 + 2.0)
    # a ZeRO re-partition (zero_state_cost), the DAG's communicators (its makespan) and the
    # weight-sync groups (Controller.sync_groups_set_up) are priced apart too
    more = {**phases, "repartition": 0.4, "setup": 0.05, "sync_setup": 0.07}
    assert TransitionProgress(timings=timings, phases_s=more).terms_s() == \
        pytest.approx(0.2 + 1.0 + 0.3 + 0.4 + 0.05 + 0.07 + 2.0)
    # workers' clocks (other nodes) are trusted only as far as nereusd's own prepare + ops
    skewed = {**timings, "b": {"start_s": 10.2, "end_s": 15.0}}
    assert TransitionProgress(timings=skewed, phases_s=phases).terms_s() == pytest.approx(0.2 + 1.1 + 0.3 + 2.0)
    assert TransitionProgress(phases_s={"rebuild": 0.2}).terms_s() == pytest.approx(0.2)
    # of those, the DAG's own price covers the detach, set-up, ops and re-partition
    assert TransitionProgress(timings=timings, phases_s=more).dag_terms_s() == pytest.approx(0.2 + 1.0 + 0.4 + 0.05)
