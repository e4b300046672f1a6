"""The transition a live job executes is the one admission assessed, on a site of 8 devices per node.

The shell (:class:`nereusd.daemon.live.LiveAdaptation`) runs with the real controller, driver,
journal and transition runner; :class:`WorkerStand` stands in for the control plane and records
what would reach the workers (the real dispatch is covered end to end in ``tests/e2e``). A forced
switch at the boundary before step 1 adds replicas of ``actor/training`` on devices 2 and 3 next to
those on devices 0 and 8 (nodes 0 and 1): both must be fed from device 0, on their node (a DAG
planned as if every device shared one node feeds device 3 from device 8, the least-used sender).
"""

from __future__ import annotations

import json
from types import SimpleNamespace

from nereusd import protocol as P
from nereusd.config.resolve import load_and_resolve
from nereusd.config.site import load_site
from nereusd.control.jobs import controller_for_job
from nereusd.daemon.live import LiveAdaptation
from nereusd.daemon.pool import PoolController
from nereusd.journal import Journal
from nereusd.plan import ModelStage, Role, Stage
from nereusd.rl.driver import RLDriver
from nereusd.rl.record import StepRecord
from nereusd.transition import OpKind
from nereusd.transition.comms import communicator_plan
from nereusd.transition.ops import TransitionDag

TRAIN = ModelStage(Role.ACTOR, Stage.TRAINING)
JOB = """name: dag-identity
algorithm: grpo
steps: 4
site: h200-ib
devices: 16
models: {actor_config: {vocab_size: 64, hidden_size: 32, intermediate_size: 64, num_layers: 4, num_heads: 8,
                        num_kv_heads: 2, max_position: 64}}
rollout: {prompts_per_step: 4, group_size: 2, max_new_tokens: 8}
train: {global_batch: 8, micro_batch: 1}
plan: {default: {tp: 1, pp: 1, devices: [0, 8]}}
adaptation:
  forced: [{at_step: 1, model_stages: {actor/training: {devices: [0, 8, 2, 3], dp: 4}}}]
"""


class WorkerStand:
    """The control-plane calls the shell and the transition runner make, answered at once; every
    task is recorded as ``(kind, {device: typed args})``."""

    def __init__(self, devices: int) -> None:
        self.registered = list(range(devices))
        self.max_pool_devices = None
        self.exited_workers: dict[int, int] = {}
        self.tasks: list[tuple[str, dict]] = []

    def poll(self, timeout_s): pass
    def devices(self): return list(self.registered)
    def lost_devices(self, devices): return {}
    def done(self, task_id): return True
    def raise_if_lost(self, task_id): pass
    def retire_idle_agents(self): return []   # no agents here

    def submit(self, args, shared=None):   # recorded as the workers get them (the agent sets shared fields)
        args = {d: P.with_shared(P.Task(task_id=0, args=a), shared).args for d, a in args.items()}
        self.tasks.append((next(iter(args.values())).kind, args))
        return len(self.tasks)

    def collect(self, task_id, timeout_s=None):
        return {d: SimpleNamespace(result={}, elapsed_s=0.0) for d in self.tasks[task_id - 1][1]}

    def run(self, args, timeout_s=None, shared=None):
        return self.collect(self.submit(args, shared), timeout_s)


def shell(tmp_path, job_text: str = JOB):
    """The job of ``job_text``, resolved, with the real controller and driver on a
    :class:`WorkerStand`: ``(job, site, control, journal, driver, controller)``."""
    (tmp_path / "job.yaml").write_text(job_text)
    job = load_and_resolve(tmp_path / "job.yaml")
    site = load_site(job.config.site)
    control, journal = WorkerStand(job.devices), Journal(tmp_path / "run")
    driver = RLDriver(job, control, journal, devices_per_node=site.devices_per_node)
    controller = controller_for_job(job, site, driver.plan, driver.prompt_length, pool=tuple(range(job.devices)))
    return job, site, control, journal, driver, controller


def first_boundary(tmp_path, job, control, journal, driver, controller) -> None:
    """The shell's boundary after step 0 (responses of 8 tokens), on the whole pool."""
    pool = PoolController(journal, tmp_path / "run", job.config.name, job.config.steps)
    pool.world_formed(driver.plan.to_dict(), list(range(job.devices)))
    live = LiveAdaptation(job, controller, driver, control, SimpleNamespace(generation=0), journal, tmp_path / "run",
                          pool)
    live.at_boundary(StepRecord(step=0, step_latency_s=1.0, stage_latency_s={}, model_stage_s={}, reward_mean=0.0,
                                response_length_mean=8.0, response_length_max=8, tokens_per_s=1.0,
                                peak_memory_bytes={}, plan=driver.plan, sample_position=0, policy_version=0,
                                staleness=0))


def test_the_executed_dag_is_the_assessed_one(tmp_path):
    job, site, control, journal, driver, controller = shell(tmp_path)
    outcomes = []
    boundary = controller.boundary
    controller.boundary = lambda *a, **kw: outcomes.append(boundary(*a, **kw)) or outcomes[-1]
    first_boundary(tmp_path, job, control, journal, driver, controller)

    decision = outcomes[0].decision
    assert decision.admitted and decision.target.dag is not None
    prepares = [per_device for kind, per_device in control.tasks if kind == "transition_prepare"]
    assert len(prepares) == 1
    executed = decision.target.dag   # each worker gets its slice of the assessed DAG, and its communicators
    assert {d: TransitionDag.from_json(a.dag, a.plans) for d, a in prepares[0].items()} == executed.slices(prepares[0])
    plan = [(op_id, list(devices)) for op_id, devices in communicator_plan(executed)]
    assert all(a.communicators == plan for a in prepares[0].values())
    sliced = {op.id for a in prepares[0].values() for op in TransitionDag.from_json(a.dag, a.plans).ops}
    assert sliced == {op.id for op in executed.ops}
    extends = [op for op in executed.ops if op.kind is OpKind.EXTEND and op.model_stage == TRAIN]
    fed = {r.dst: r.src for op in extends for r in op.routes}
    assert fed == {2: 0, 3: 0}, f"devices 2 and 3 (node 0) must be fed from device 0 (node 0): {fed}"
    assert driver.plan == decision.target.plan and controller.plan == decision.target.plan
    # the weight-sync DAGs handed over with transition_finish were planned with 8 devices per node
    finish = [args for kind, per_device in control.tasks if kind == "transition_finish" for args in per_device.values()]
    assert finish and finish[0].syncs == driver.sync_args(decision.target.plan)


def test_a_removal_requested_while_the_boundary_adds_devices_waits_for_the_next_one(tmp_path):
    """A schedule's add makes the boundary wait for the new agent (``_add_devices`` polls the
    control plane); a ``pool --remove`` accepted meanwhile was wiped with the request the boundary
    had read, and never happened (a helper's run). It stays queued for the next boundary."""
    job, site, control, journal, driver, controller = shell(
        tmp_path, JOB + "pool: {max_devices: 17, schedule: [{at_step: 1, add: 1}]}\n")
    pool = PoolController(journal, tmp_path / "run", job.config.name, job.config.steps)
    pool.world_formed(driver.plan.to_dict(), list(range(job.devices)))
    pool.live = True
    live = LiveAdaptation(job, controller, driver, control, SimpleNamespace(generation=0), journal, tmp_path / "run",
                          pool)
    added = []
    live._add_devices = lambda count, step, sources=(): added.append(count) or pool.request_remove(1)   # meanwhile
    live.at_boundary(StepRecord(step=0, step_latency_s=1.0, stage_latency_s={}, model_stage_s={}, reward_mean=0.0,
                                response_length_mean=8.0, response_length_max=8, tokens_per_s=1.0,
                                peak_memory_bytes={}, plan=driver.plan, sample_position=0, policy_version=0,
                                staleness=0))
    assert added == [1] and pool.pending_remove == 1


def test_an_add_the_job_cannot_take_is_refused_and_the_job_goes_on(tmp_path, monkeypatch):
    """A schedule's add whose agent dies on start-up (a bad install, a killed process) is refused
    at once with its exit status and log, instead of after the 120 s registration wait; one over
    ``pool.max_devices`` is refused before any agent starts; one whose log cannot be opened is
    refused too. Each is journalled (``pool_request_refused``) and the job goes on: it failed the
    whole job, whose devices were fine (an adversarial helper, 2026-12-06). An added agent that
    has exited (retired) is reaped at the next boundary, not left a zombie."""
    import subprocess
    import sys

    from nereusd.daemon import live as live_module
    from nereusd.journal import read_jsonl

    job, site, control, journal, driver, controller = shell(tmp_path)
    pool = PoolController(journal, tmp_path / "run", job.config.name, job.config.steps)
    live = LiveAdaptation(job, controller, driver, control, SimpleNamespace(generation=0), journal, tmp_path / "run",
                          pool)
    control.endpoint = "tcp://127.0.0.1:1"
    started = []

    def dies(*args, **kwargs):
        started.append(args)
        return subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])

    monkeypatch.setattr(live_module, "start_local_agent", dies)
    live._add_devices(2, 5, ("pool.schedule at step 6",))
    control.max_pool_devices = 17   # 16 registered
    live._add_devices(2, 6)
    monkeypatch.setattr(live_module, "start_local_agent", lambda *a, **kw: open(tmp_path))   # IsADirectoryError
    live._add_devices(1, 7)
    journal.close()
    refused = [e for e in read_jsonl(tmp_path / "run" / "events.jsonl") if e["event"] == "pool_request_refused"]
    assert [(e["step"], e["add"]) for e in refused] == [(5, 2), (6, 2), (7, 1)]
    assert "agent local-add1 with 2 devices exited with status 3 before it registered; its log: " in refused[0]["reason"]
    assert refused[0]["reason"].endswith("agent-local-add1.log") and refused[0]["sources"] == ["pool.schedule at step 6"]
    assert refused[1]["reason"] == "the pool holds 16 devices and the job allows 17 (pool.max_devices)"
    assert len(started) == 1   # no agent for the add over the limit
    assert "agent local-add2 could not start: Is a directory" in refused[2]["reason"]
    # an exited agent is reaped (its status collected) and forgotten
    live._reap_agents()
    assert live._agent_procs == {}


def test_a_restore_falls_back_past_unreadable_checkpoints_and_says_when_none_reads(tmp_path):
    """``RLDriver.restore`` with fallbacks: a load the workers report as a ``StorageError``
    (damaged files) moves on to the next older checkpoint, journalled ``checkpoint_unreadable``
    with the metrics dropped from its step; when none reads, ``CheckpointUnreadable`` names them
    (a storage fault had pointed at the disk's free space)."""
    import pytest

    from nereusd.errors import CheckpointUnreadable, WorkerError
    from nereusd.journal import METRICS_FILE, read_jsonl

    job, site, control, journal, driver, controller = shell(tmp_path)
    for step in range(6):
        journal.metric({"step": step})
    unreadable = {str(tmp_path / "c6"), str(tmp_path / "c4")}
    run = control.run

    def loads(args, timeout_s=None, shared=None):
        directory = getattr(next(iter(args.values())), "dir", None)
        if directory in unreadable:
            raise WorkerError(f"checkpoint load in {directory} failed: EOFError", error_kind="StorageError")
        return run(args, timeout_s, shared)

    control.run = loads
    driver._sync_weights = lambda: None
    dropped = driver.restore((str(tmp_path / "c6"), 6, 60), [(str(tmp_path / "c4"), 4, 40), (str(tmp_path / "c2"), 2, 20)])
    assert dropped == [2, 3, 4, 5] and driver.step_index == 2 and driver.last_checkpoint == (str(tmp_path / "c2"), 2, 20)
    falls = [e for e in read_jsonl(tmp_path / "run" / "events.jsonl") if e["event"] == "checkpoint_unreadable"]
    assert [(e["step"], e["dropped_metrics"]) for e in falls] == [(4, [4, 5]), (2, [2, 3])]
    assert [r["step"] for r in read_jsonl(tmp_path / "run" / METRICS_FILE)] == [0, 1]
    unreadable.add(str(tmp_path / "c2"))
    for step in range(2, 6):
        journal.metric({"step": step})
    with pytest.raises(CheckpointUnreadable, match=r"no checkpoint could be read \(tried c6, c4, c2\); the last: "):
        driver.restore((str(tmp_path / "c6"), 6, 60), [(str(tmp_path / "c4"), 4, 40), (str(tmp_path / "c2"), 2, 20)])
    # nothing loaded, so nothing left: a resume that failed had dropped the steps it would re-run
    assert [r["step"] for r in read_jsonl(tmp_path / "run" / METRICS_FILE)] == list(range(6))


def test_a_forced_layout_that_cannot_apply_at_its_step_is_said_and_the_job_goes_on(tmp_path):
    """An ``adaptation.forced`` entry valid on its own (refused at launch otherwise) that does not
    fit the plan its step runs — TP 4 over the 2 devices actor/training holds — failed the job
    at that step, after every step before it had run (an adversarial trial). It is journalled
    as a ``trigger`` that says why it was not applied, and the job keeps its plan."""
    job_text = JOB.replace("{devices: [0, 8, 2, 3], dp: 4}", "{tp: 4}")
    job, site, control, journal, driver, controller = shell(tmp_path, job_text)
    before = driver.plan
    first_boundary(tmp_path, job, control, journal, driver, controller)
    journal.close()
    events = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    said = [e for e in events if e["event"] == "trigger" and e["signal"] == "forced"]
    assert len(said) == 1 and "adaptation.forced for step 1 not applied" in said[0]["detail"], said
    assert "adaptation.forced: actor/training: 2 devices are not a multiple of tp·pp = 4·1" in said[0]["detail"]
    assert driver.plan == before and not [k for k, _ in control.tasks if k == "transition_prepare"]


def test_a_device_lost_while_the_engines_build_or_a_resume_loads_goes_to_recovery(tmp_path):
    """``RLDriver.run`` hands a worker loss during the build or a resume's checkpoint load to
    ``on_failure`` (the live shell's restart) as it does a step's; a restart then must resume
    at the checkpoint being loaded, not at step 0 with the initial weights. An out-of-memory
    build is not a loss, and stands, as does a failure ``on_failure`` does not recover."""
    import pytest

    from nereusd.errors import WorkerError

    job, site, control, journal, driver, controller = shell(tmp_path)
    checkpoint = (str(tmp_path / "c2"), 2, 20)
    failing = {"kind": "load_checkpoint", "error": WorkerError("worker process of device(s) [8] exited")}
    run = control.run

    def answer(args, timeout_s=None, shared=None):
        kind = next(iter(args.values())).kind
        if kind == failing["kind"]:
            raise failing["error"]
        if kind == "build":
            return {d: SimpleNamespace(result={"memory_in_use_bytes": 0}, elapsed_s=0.0) for d in args}
        return run(args, timeout_s, shared)

    class Recovered(Exception):
        pass

    seen = []

    def on_failure(err):
        seen.append((str(err), driver.step_index, driver.last_checkpoint))
        raise Recovered   # the shell would restart here; the test stops at the hand-over

    control.run, driver.on_failure = answer, on_failure
    with pytest.raises(Recovered):
        driver.run(resume=checkpoint)
    assert seen == [("worker process of device(s) [8] exited", 2, checkpoint)]

    failing["kind"] = "build"
    with pytest.raises(Recovered):
        driver.run()
    assert seen[-1][1:] == (2, checkpoint)   # a fresh driver would be at step 0, no checkpoint

    failing["error"] = WorkerError("device 8: out of memory", error_kind="DeviceOutOfMemory")
    with pytest.raises(WorkerError, match="out of memory"):
        driver.run()
    driver.on_failure = lambda err: seen.append(err) and False
    failing["error"] = WorkerError("worker process of device(s) [0] exited")
    with pytest.raises(WorkerError, match=r"device\(s\) \[0\] exited"):
        driver.run()
    assert len(seen) == 3
