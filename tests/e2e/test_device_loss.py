"""End to end, abrupt device loss with live adaptation (`nereus-launch local`, real nereusd, agent
and workers): a worker process is SIGKILLed in the middle of a step; nereusd takes its device
out of the world and the pool, restarts the survivors on a plan for them from the latest
checkpoint, re-runs the lost steps and finishes. Every step appears once in ``metrics.jsonl``.
"""

from __future__ import annotations

import json
import os
import signal

import pytest

from nereusd.journal import read_jsonl
from tests.support.deepspeed import requires_deepspeed
from tests.support.e2e import finish, processes_mentioning, running, wait_for, worker_pid, write_job

pytestmark = pytest.mark.slow

JOB = """
name: e2e-device-loss
algorithm: grpo
seed: 5
steps: 6
devices: 3
models: {actor: "@WARMSTART@"}
rollout: {prompts_per_step: 3, group_size: 4, max_new_tokens: 12}
train: {global_batch: 12, micro_batch: 2, kl_coef: 0.0}
plan: {default: {tp: 1, pp: 1}}
checkpoint: {every_steps: 2}
"""






@pytest.mark.parametrize("backend", ["native", pytest.param("deepspeed", marks=requires_deepspeed)])
def test_worker_killed_mid_step_recovers_from_checkpoint(tmp_path, backend):
    # deepspeed: actor training on ZeRO-1 at dp 3 loses a replica with its optimizer partition;
    # the survivors restart at dp 2 from the (canonical) DCP checkpoint
    run_dir = tmp_path / "run"
    with running(write_job(tmp_path, "job", JOB + f"backends: {{actor/training: {backend}}}\n"), run_dir) as proc:
        # steps 0-2 done (checkpoint step000002 taken after step 1): kill device 2 at once. The
        # kill lands at the boundary after step 2 (the registry knows the loss: recovery) or
        # inside step 3 (its task fails: recovery); both restart from step000002 at step 3
        wait_for("two steps", lambda: len(read_jsonl(run_dir / "metrics.jsonl")) >= 2, 120, run_dir)
        pid = worker_pid(run_dir, 2)
        wait_for("three steps", lambda: len(read_jsonl(run_dir / "metrics.jsonl")) >= 3, 120, run_dir)
        os.kill(pid, signal.SIGKILL)
        assert len(read_jsonl(run_dir / "metrics.jsonl")) == 3, "step 3 ended before the kill (machine too slow)"
        finish(proc, run_dir, timeout_s=180)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "succeeded" and summary["steps"] == 6, summary
    assert summary["restarts"] == 1 and summary["lost_steps"] == 1, summary
    events = read_jsonl(run_dir / "events.jsonl")
    lost = [e for e in events if e["event"] == "device_lost"]
    assert len(lost) == 1 and lost[0]["devices"] == [2] and lost[0]["cause"] == "worker_exited", lost
    assert lost[0]["step"] == 3 and lost[0]["survivors"] == [0, 1]
    fallback = [e for e in events if e["event"] == "fallback"]
    assert len(fallback) == 1 and fallback[0]["action"] == "checkpoint_restart", fallback
    assert fallback[0]["resume_step"] == 2 and fallback[0]["lost_steps"] == 1
    assert fallback[0]["checkpoint"].endswith("step000002") and fallback[0]["lost_devices"] == [2]
    assert fallback[0]["dropped_metrics"] == [2]
    # the restart's reason is journalled when it starts (a fault during it would fail the job)
    started = [i for i, e in enumerate(events) if e["event"] == "restart_started"]
    assert len(started) == 1 and started[0] < events.index(fallback[0]), started
    assert events[started[0]]["world"] == [0, 1] and events[started[0]]["reason"] == fallback[0]["reason"]
    assert any(e["event"] == "worker_exited" and e["device"] == 2 and e["exitcode"] == -9 for e in events)
    # every step once; the re-run ones on the survivors only; device 2 never came back
    records = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(6))
    assert all(set(r["peak_memory_bytes"]) == {"0", "1", "2"} for r in records[:2])
    assert all(set(r["peak_memory_bytes"]) == {"0", "1"} for r in records[2:])
    formed = [e for e in events if e["event"] == "world_formed"]
    assert formed[-1]["devices"] == [0, 1]
    assert not any(e["event"] == "job_failed" for e in events)
    assert (run_dir / "checkpoints" / "final" / "actor" / ".metadata").is_file()
    assert processes_mentioning(str(run_dir)) == []
    if backend == "deepspeed":
        train = [r["plan"]["actor/training"] for r in records]
        assert train[0]["dp"] == 3 and train[-1]["dp"] == 2 and all(p.get("zero_stage") == 1 for p in train)


def test_a_worker_killed_without_live_adaptation_stops_the_job_naming_it(tmp_path):
    """With ``adaptation.enabled: false`` a worker killed mid-step failed the job with a
    survivor's gloo error (``Connection reset by peer``) and its traceback, naming neither the
    device nor the cause (an adversarial trial). The job stops naming the device, the cause, the
    latest checkpoint and the resume command."""
    run_dir = tmp_path / "run"
    with running(write_job(tmp_path, "job", JOB + "adaptation: {enabled: false}\n"), run_dir) as proc:
        wait_for("two steps", lambda: len(read_jsonl(run_dir / "metrics.jsonl")) >= 2, 120, run_dir)
        os.kill(worker_pid(run_dir, 2), signal.SIGKILL)
        out, _ = proc.communicate(timeout=180)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "stopped" and summary["error_kind"] == "DeviceLost", summary
    error = summary["error"]
    assert error.startswith("lost device 2: worker_exited (exit code -9)"), error
    assert "live adaptation is off (adaptation.enabled: false)" in error and "latest checkpoint: " in error
    assert f"`nereus-launch resume {run_dir}`" in error and "Traceback" not in error
    assert processes_mentioning(str(run_dir)) == []


def test_a_device_lost_during_the_restart_restarts_once_more_without_it(tmp_path):
    """The restart after a loss starts new workers and loads the checkpoint; a worker killed
    then failed the job (an adversarial helper, 2026-12-05). The checkpoint still holds the
    state: nereusd restarts once more on the devices left, and the job finishes."""
    run_dir = tmp_path / "run"

    def new_worker(device, old):
        try:
            pid = worker_pid(run_dir, device)
        except AssertionError:
            return None
        return pid if pid != old else None

    with running(write_job(tmp_path, "job", JOB.replace("devices: 3", "devices: 4")), run_dir) as proc:
        wait_for("two steps", lambda: len(read_jsonl(run_dir / "metrics.jsonl")) >= 2, 120, run_dir)
        first = worker_pid(run_dir, 1)
        os.kill(worker_pid(run_dir, 2), signal.SIGKILL)
        wait_for("the restart", lambda: any(e["event"] == "restart_started"
                                            for e in read_jsonl(run_dir / "events.jsonl")), 60, run_dir)
        os.kill(wait_for("device 1's new worker", lambda: new_worker(1, first), 60, run_dir), signal.SIGKILL)
        finish(proc, run_dir, timeout_s=180)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "succeeded" and summary["steps"] == 6, summary
    events = read_jsonl(run_dir / "events.jsonl")
    lost = [e for e in events if e["event"] == "device_lost"]
    assert [e["devices"] for e in lost] == [[2], [1]] and lost[1]["during"] == "restart", lost
    fallback = [e for e in events if e["event"] == "fallback"]
    assert len(fallback) == 1 and fallback[0]["lost_devices"] == [1, 2], fallback
    assert "then devices [1] lost during the restart" in fallback[0]["reason"]
    assert [e["world"] for e in events if e["event"] == "restart_started"] == [[0, 1, 3], [0, 3]]
    records = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(6))
    assert set(records[-1]["peak_memory_bytes"]) == {"0", "3"}
    assert processes_mentioning(str(run_dir)) == []


SPARE = JOB.replace("plan: {default: {tp: 1, pp: 1}}", "plan: {default: {tp: 1, pp: 1, devices: [0, 1]}}\n"
                    "adaptation: {payback_margin: 0.0}")


def test_spare_device_lost_leaves_the_world_without_a_restart(tmp_path):
    # device 2 holds no model-stage: losing it costs a world re-formation, not a checkpoint/restart
    run_dir = tmp_path / "run"
    with running(write_job(tmp_path, "job", SPARE), run_dir) as proc:
        wait_for("two steps", lambda: len(read_jsonl(run_dir / "metrics.jsonl")) >= 2, 120, run_dir)
        os.kill(worker_pid(run_dir, 2), signal.SIGKILL)
        finish(proc, run_dir, timeout_s=180)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "succeeded" and summary["steps"] == 6, summary
    events = read_jsonl(run_dir / "events.jsonl")
    lost = [e for e in events if e["event"] == "device_lost"]
    assert len(lost) == 1 and lost[0]["devices"] == [2] and lost[0]["spare"] and lost[0]["survivors"] == [0, 1]
    assert not any(e["event"] == "fallback" for e in events)
    assert [e["devices"] for e in events if e["event"] == "world_formed"][-1] == [0, 1]
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")] == list(range(6))
    assert processes_mentioning(str(run_dir)) == []


ZERO_MOVE = JOB.replace("plan: {default: {tp: 1, pp: 1}}\n", """plan:
  default: {tp: 1, pp: 1}
  model_stages: {actor/training: {devices: [0, 1], zero_stage: 1}}
""") + """backends: {actor/training: deepspeed}
adaptation:
  policy: frozen
  forced:
    - {at_step: 3, model_stages: {actor/training: {devices: [0, 1, 2]}}}
"""


@requires_deepspeed
def test_zero_replica_killed_while_its_partition_moves_restarts_from_the_checkpoint(tmp_path):
    """A ZeRO-1 pair on devices 0, 1 is forced to dp 3 on 0, 1, 2 (a re-partition: each old replica
    holds the only copy of its optimizer partition until the new replicas received theirs). The
    worker of device 1 is killed as soon as nereusd journals the admitted switch, so the kill lands
    in the transition or, on a slow machine, in the step after it; either way its partition's only
    copy died with it and the survivors (devices 0 and 2) restart from the checkpoint. The test
    says which of the two it saw. (It found that the forced switch, met again when the restart
    re-ran its step, named the lost device: a forced layout outside the pool is now refused.)"""
    run_dir = tmp_path / "run"

    def switch_admitted():
        return any(e["event"] == "admission" and (e.get("target_plan") or {}).get("actor/training", {})
                   .get("devices") == [0, 1, 2] for e in read_jsonl(run_dir / "events.jsonl"))

    with running(write_job(tmp_path, "job", ZERO_MOVE), run_dir) as proc:
        wait_for("a step", lambda: len(read_jsonl(run_dir / "metrics.jsonl")) >= 1, 180, run_dir)
        pid = worker_pid(run_dir, 1)
        wait_for("the forced switch admitted", switch_admitted, 180, run_dir, interval_s=0.01)
        os.kill(pid, signal.SIGKILL)
        finish(proc, run_dir, timeout_s=240)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "succeeded" and summary["steps"] == 6 and summary["restarts"] == 1, summary
    events = read_jsonl(run_dir / "events.jsonl")
    fallback = [e for e in events if e["event"] == "fallback"]
    assert len(fallback) == 1 and fallback[0]["action"] == "checkpoint_restart", fallback
    assert fallback[0]["lost_devices"] == [1]
    moved = [e for e in events if e["event"] == "transition" and e["to_plan"]["actor/training"]["devices"] == [0, 1, 2]]
    where = "after the transition, in the next step" if moved else "in the transition (re-partition interrupted)"
    print(f"device 1 was killed {where}; restarted from {fallback[0]['checkpoint']}")
    lost = [e for e in events if e["event"] == "device_lost"]
    assert len(lost) == 1 and lost[0]["devices"] == [1], lost
    if not moved:   # the runner named the model-stage whose partition's only copy died
        assert lost[0]["error"].startswith("transition interrupted"), lost[0]
        assert "no complete unit of ['actor/training']" in lost[0]["error"], lost[0]
    records = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(6))
    last = records[-1]["plan"]["actor/training"]   # the frozen policy rescales its launch pair: dp 1 on device 0
    assert set(last["devices"]) <= {0, 2} and last.get("zero_stage") == 1, last
    assert processes_mentioning(str(run_dir)) == []


def test_a_worker_killed_during_the_build_restarts_on_the_survivors(tmp_path):
    """A worker killed while the engines are built (before step 0) failed the job with live
    adaptation on: recovery ran only around the steps (an adversarial trial, 2026-12-07). The
    build now recovers as a step does: the survivors restart from the initial weights (no
    checkpoint yet), nothing is lost, and the job runs every step on them."""
    run_dir = tmp_path / "run"
    with running(write_job(tmp_path, "job", JOB), run_dir) as proc:
        wait_for("the world", lambda: any(e["event"] == "world_formed"
                                          for e in read_jsonl(run_dir / "events.jsonl")), 120, run_dir)
        os.kill(worker_pid(run_dir, 2), signal.SIGKILL)
        finish(proc, run_dir, timeout_s=180)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "succeeded" and summary["steps"] == 6, summary
    assert summary["restarts"] == 1 and summary["lost_steps"] == 0, summary
    events = read_jsonl(run_dir / "events.jsonl")
    names = [e["event"] for e in events]
    lost = [e for e in events if e["event"] == "device_lost"]
    assert len(lost) == 1 and lost[0]["devices"] == [2] and lost[0]["step"] == 0, lost
    assert names.index("device_lost") < names.index("build"), "the kill landed after the build (machine too slow)"
    fallback, = [e for e in events if e["event"] == "fallback"]
    assert fallback["action"] == "checkpoint_restart" and fallback["checkpoint"] is None, fallback
    assert fallback["resume_step"] == 0 and fallback["lost_steps"] == 0 and fallback["lost_devices"] == [2]
    records = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(6))
    assert all(set(r["peak_memory_bytes"]) == {"0", "1"} for r in records)
    assert processes_mentioning(str(run_dir)) == []
