"""The background join's phases and failures (``nereusd.daemon.joins``), on a stand-in control
plane that records what the join asks of it. The real path, with workers, vLLM engines and the
adoption, runs end to end in ``tests/e2e/test_vllm_generation.py``."""

from __future__ import annotations

from types import SimpleNamespace

from nereusd import protocol as P
from nereusd.daemon.joins import BackgroundJoins
from nereusd.errors import WorkerError
from nereusd.journal import Journal, read_jsonl
from nereusd.plan import ModelStage

GEN = ModelStage.parse("actor/generation")


class StandInControl:
    """What ``BackgroundJoins`` uses of the control plane; tasks finish when a test says so."""

    def __init__(self) -> None:
        self.ready_workers: set[int] = set()
        self.exited_workers: dict[int, int | None] = {}
        self.spawned: list[list[int]] = []
        self.tasks: dict[int, tuple[str, dict]] = {}
        self.finished: set[int] = set()
        self.released: list[tuple[list[int], bool]] = []
        self.abandoned: list[int] = []
        self.failing: set[int] = set()

    def spawn_workers(self, *, world, wait, **_):
        assert not wait
        self.spawned.append(list(world))

    def submit(self, args_by_device):
        task_id = len(self.tasks) + 1
        self.tasks[task_id] = (next(iter(args_by_device.values())).kind, dict(args_by_device))
        return task_id

    def done(self, task_id):
        return task_id in self.finished

    def raise_if_lost(self, task_id):
        pass

    def collect(self, task_id, timeout_s):
        if task_id in self.failing:
            raise WorkerError("prestart_engines failed on device 3: vLLM refused")
        kind, args = self.tasks[task_id]
        result = {"engine_start_s": 7.0} if kind == "prestart_engines" else {}
        return {d: SimpleNamespace(result=result) for d in args}

    def release_devices(self, devices, reason, keep_in_pool=False):
        self.released.append((sorted(devices), keep_in_pool))

    def wait_exited(self, devices, timeout_s=15.0):
        return True

    def abandon_task(self, task_id):
        self.abandoned.append(task_id)


def joins(tmp_path, control, early: bool = True):
    """A ``BackgroundJoins`` whose controller expects generation ``tp1·dp4`` on devices 0–3, two
    sequences a wave, and (``early``) the engines on 2 and 3 to start early
    (:meth:`Controller.early_engines`, whose rule ``tests/unit/control/test_controller.py`` checks)."""
    warm = {GEN: {2: (1, (2,), 2), 3: (1, (3,), 2)}} if early else {}
    controller = SimpleNamespace(early_engines=lambda pool, devices: warm if sorted(devices) == [2, 3] else {},
                                 warm_engines={}, started=[])
    controller.engine_started = controller.started.append
    store = SimpleNamespace(host="127.0.0.1", port=1, generation=0)
    store.next_generation = lambda: 7
    args = P.task_args("build", {"plan": {}, "roles": {}, "train": {"micro_batch": 1, "weight_decay": 0.0},
                                 "lr": {}, "seed": 0})
    return BackgroundJoins(control=control, store=store, controller=controller, build_args=lambda: args,
                           journal=Journal(tmp_path), run_dir=tmp_path, device_memory_bytes=1 << 30), controller


def test_a_join_moves_one_phase_at_a_time_and_hands_over_warm_engines(tmp_path):
    control = StandInControl()
    bj, controller = joins(tmp_path, control)
    assert bj.advance([2, 3], [0, 1], 0) == [] and control.spawned == [[2, 3]] and bj.joining == [2, 3]
    assert bj.advance([], [0, 1], 1) == []   # workers not ready yet
    control.ready_workers |= {2, 3}
    assert bj.advance([], [0, 1], 2) == [] and control.tasks[1][0] == "build"
    control.finished.add(1)
    assert bj.advance([], [0, 1], 3) == []
    kind, args = control.tasks[2]
    assert kind == "prestart_engines" and args[2].world == [2, 3]
    assert [(r.model_stage, r.tp, r.devices, r.max_num_seqs) for r in args[2].replicas] == [
        ("actor/generation", 1, [2], 2), ("actor/generation", 1, [3], 2)]
    assert bj.status()["phase"] == "engines"
    # device 4 arrives while the join runs: it waits, and its own join starts as this one ends
    assert bj.advance([4], [0, 1], 3) == [] and bj.joining == [2, 3]
    control.finished.add(2)
    assert bj.advance([4], [0, 1], 4) == [2, 3] and bj.joining == [4] and control.spawned[-1] == [4]
    assert controller.warm_engines == {GEN: {2: (1, (2,), 2), 3: (1, (3,), 2)}} and controller.started == [7.0]
    [event] = [e for e in read_jsonl(tmp_path / "events.jsonl") if e["event"] == "workers_started"]
    assert event["background"] and event["warm"] == {"actor/generation": [2, 3]} and event["arrived_after_step"] == 0
    assert bj.join.step == 3   # reported from its arrival, not from the start of its join
    control.ready_workers.add(4)
    bj.advance([], [0, 1, 2, 3], 6)
    control.finished.add(3)
    assert bj.advance([], [0, 1, 2, 3], 7) == [4]
    last = [e for e in read_jsonl(tmp_path / "events.jsonl") if e["event"] == "workers_started"][-1]
    assert last["devices"] == [4] and last["arrived_after_step"] == 3 and last["warm"] == {}


def test_a_failed_join_lets_the_failed_devices_go_and_the_others_join_again(tmp_path):
    control = StandInControl()
    bj, _ = joins(tmp_path, control)
    bj.advance([2, 3], [0, 1], 0)
    control.ready_workers |= {2, 3}
    bj.advance([], [0, 1], 1)
    control.exited_workers[3] = -9   # device 3's worker dies while it builds
    assert bj.advance([], [0, 1], 2) == [] and bj.joining == []
    assert control.released == [([3], False), ([2], True)] and control.abandoned == [1]
    [failed] = [e for e in read_jsonl(tmp_path / "events.jsonl") if e["event"] == "join_failed"]
    assert failed["left_pool"] == [3] and failed["join_again"] == [2] and failed["phase"] == "building"
    # a task that fails without an exit: every device of the join leaves (no endless retry)
    control = StandInControl()
    bj, _ = joins(tmp_path / "b", control)
    bj.advance([2, 3], [0, 1], 0)
    control.ready_workers |= {2, 3}
    bj.advance([], [0, 1], 1)
    control.finished.add(1)
    bj.advance([], [0, 1], 2)
    control.finished.add(2)
    control.failing.add(2)
    assert bj.advance([], [0, 1], 3) == [] and control.released == [([2, 3], False)]


def test_a_restart_cancels_a_join_whose_devices_join_again(tmp_path):
    control = StandInControl()
    bj, _ = joins(tmp_path, control)
    assert bj.cancel("nothing") == []
    bj.advance([2, 3], [0, 1], 0)
    control.ready_workers |= {2, 3}
    bj.advance([], [0, 1], 1)
    assert bj.cancel("checkpoint/restart", 1) == [2, 3] and bj.joining == [] and bj.status() is None
    assert control.released == [([2, 3], True)] and control.abandoned == [1]
    [cancelled] = [e for e in read_jsonl(tmp_path / "events.jsonl") if e["event"] == "join_cancelled"]
    assert cancelled["join_again"] == [2, 3] and cancelled["left_pool"] == [] and cancelled["phase"] == "building"


def test_a_removal_of_joining_devices_cancels_the_join_and_the_others_join_again(tmp_path):
    """``nereus-launch pool --remove`` takes joining devices first (``plan_pool``); those leave
    the pool, the rest of the join starts again. A join the job's end abandons is on record."""
    control = StandInControl()
    bj, _ = joins(tmp_path, control)
    bj.advance([2, 3], [0, 1], 0)
    assert bj.cancel("devices [3] removed from the pool while joining", 0, leave=[3]) == [2]
    assert control.released == [([3], False), ([2], True)]
    bj.advance([2], [0, 1], 1)
    bj.abandon("the job ended (succeeded)")
    events = [e for e in read_jsonl(tmp_path / "events.jsonl") if e["event"] == "join_cancelled"]
    assert [(e["devices"], e["left_pool"], e["reason"]) for e in events] == [
        ([2, 3], [3], "devices [3] removed from the pool while joining"), ([2], [], "the job ended (succeeded)")]
    assert bj.joining == []


def test_no_engine_starts_early_where_the_controller_expects_none(tmp_path):
    """The controller expects no engine to start early (generation on the native engine, no
    replica wholly on the joining devices, or a growth that starts engines anyway): the join
    skips its engine phase and hands the devices over after the build."""
    control = StandInControl()
    bj, controller = joins(tmp_path, control, early=False)
    bj.advance([2, 3], [0, 1], 0)
    control.ready_workers |= {2, 3}
    bj.advance([], [0, 1], 1)
    control.finished.add(1)
    assert bj.advance([], [0, 1], 2) == [2, 3] and [kind for kind, _ in control.tasks.values()] == ["build"]
    assert controller.warm_engines == {} and controller.started == []
