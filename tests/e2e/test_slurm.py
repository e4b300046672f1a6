"""End to end on a real Slurm cluster (scripts/slurm/start-local-slurm.sh: 3 emulated nodes with
4 fake GPUs each): submit runs to completion; a node set DOWN mid-run leaves the pool and the
job continues; `grow` adds a node that joins; the preemption signal checkpoints and stops, and
`resume` submits the continuation; `cancel` ends everything with no stray process.

Skipped when no cluster answers, unless ``NEREUS_REQUIRE_SLURM=1`` (CI), which makes that a failure.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nereusd.journal import read_jsonl
from tests.support import REPO
from tests.support.e2e import wait_for as _wait_for


def wait_for(what, cond, timeout_s, run_dir=None):
    """Poll Slurm at most four times a second."""
    return _wait_for(what, cond, timeout_s, run_dir, interval_s=0.25)


pytestmark = [pytest.mark.slurm, pytest.mark.slow]

JOB = """
name: {name}
algorithm: grpo
steps: {steps}
devices: 2
site: local
models: {{actor_config: {{vocab_size: 16, hidden_size: 64, intermediate_size: 128, num_layers: 2, num_heads: 4,
                         num_kv_heads: 2, max_position: 96}}}}
rollout: {{prompts_per_step: 2, group_size: 2, max_new_tokens: 8}}
train: {{global_batch: 4, micro_batch: 2}}
checkpoint: {{every_steps: {every}}}
adaptation: {{enabled: false}}   # these tests check what Slurm reports; re-planning on it is tested in tests/e2e/test_adaptive.py
"""


@pytest.fixture(scope="module")
def slurm_env(tmp_path_factory):
    env = dict(os.environ)
    if "SLURM_CONF" not in env:
        conf = Path(os.environ.get("NEREUS_SLURM_DIR", "/tmp/nereus-slurm")) / "etc" / "slurm.conf"
        if conf.is_file():
            env["SLURM_CONF"] = str(conf)
    try:
        ping = subprocess.run(["scontrol", "ping"], env=env, capture_output=True, text=True, timeout=10)
        up = "UP" in ping.stdout
        why = ping.stdout.strip() + ping.stderr.strip()
    except (FileNotFoundError, subprocess.TimeoutExpired) as err:
        up, why = False, str(err)
    if not up:
        message = f"no Slurm cluster reachable ({why}); start one with scripts/slurm/start-local-slurm.sh"
        if os.environ.get("NEREUS_REQUIRE_SLURM") == "1":
            pytest.fail(message)
        pytest.skip(message)
    env["NEREUS_HOME"] = str(tmp_path_factory.mktemp("nereus-home"))
    return env


def cli(env, *args, timeout=60, cwd=REPO):
    proc = subprocess.run([sys.executable, "-m", "launcher.cli", *args], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, f"nereus-launch {args}: {proc.stdout}{proc.stderr}"
    return proc.stdout


def submit(env, tmp_path, name, steps, every=0, nodes=2):
    job = tmp_path / f"{name}.yaml"
    job.write_text(JOB.format(name=name, steps=steps, every=every))
    run_dir = tmp_path / "run"
    out = cli(env, "submit", str(job), "--site", "local", "--nodes", str(nodes), "--run-dir", str(run_dir))
    job_id = out.split("submitted job ")[1].split()[0]
    assert str(run_dir) in out
    return job_id, run_dir




def squeue_states(env, *job_ids):
    out = subprocess.run(["squeue", "-h", "-o", "%i %T"], env=env, capture_output=True, text=True).stdout
    states = dict(line.split() for line in out.splitlines())
    return {j: states.get(j) for j in job_ids}


def events(run_dir, name=None):
    return [e for e in read_jsonl(run_dir / "events.jsonl") if name is None or e["event"] == name]


def processes_mentioning(text):
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if text in cmd and "pytest" not in cmd:
                found.append(cmd)
    return found


def test_submit_runs_to_completion(slurm_env, tmp_path):
    start = time.monotonic()
    job_id, run_dir = submit(slurm_env, tmp_path, "slurm-e2e", steps=3)
    wait_for("the job to end", lambda: squeue_states(slurm_env, job_id)[job_id] is None, 150, run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "succeeded" and summary["steps"] == 3, summary
    registered = {e["node_id"]: e for e in events(run_dir, "agent_registered")}
    assert set(registered) == {"nrs1", "nrs2"}                # nodes named by SLURMD_NODENAME
    assert registered["nrs1"]["devices"] == [0, 1, 2, 3]      # head node first; 4 GPUs seen via Slurm
    started = events(run_dir, "nereusd_started")[0]
    assert started["curve"] is True and started["slurm_job_id"] == job_id
    assert "finished: succeeded after 3 steps" in cli(slurm_env, "status", job_id)
    assert processes_mentioning(str(run_dir)) == []
    print(f"submit -> completed: {time.monotonic() - start:.1f} s")


def test_node_down_grow_status_and_cancel(slurm_env, tmp_path):
    job_id, run_dir = submit(slurm_env, tmp_path, "slurm-elastic", steps=2000)
    down = None
    try:
        wait_for("a first step", lambda: read_jsonl(run_dir / "metrics.jsonl"), 150, run_dir)
        # grow: a second allocation whose agent joins the running nereusd
        out = cli(slurm_env, "grow", job_id, "--nodes", "1")
        grow_id = out.split("grow allocation ")[1].split()[0]
        joined = wait_for("the grown node to join", lambda: [e for e in events(run_dir, "pool_changed")
                                                             if e["kind"] == "joined" and e["node_id"] == "nrs3"],
                          90, run_dir)
        assert joined[0]["verdict"] == "continue"
        status = json.loads(cli(slurm_env, "status", str(run_dir), "--json"))
        live = status["nereusd"]
        assert set(live["pool"]) == {"nrs1", "nrs2", "nrs3"} and live["pool"]["nrs3"]["slurm_job_id"] == grow_id
        assert live["step"] is not None and live["plan"]["actor/training"]["devices"] == [0, 1]
        assert status["slurm"] == {job_id: "RUNNING", grow_id: "RUNNING"}
        # node DOWN: Slurm kills that node's agent; nereusd sees it and goes on with fewer devices
        down = "nrs2"
        steps_before = len(read_jsonl(run_dir / "metrics.jsonl"))
        subprocess.run(["scontrol", "update", f"NodeName={down}", "State=DOWN", "Reason=nereus-test"],
                       env=slurm_env, check=True)
        lost = wait_for("the DOWN node to leave the pool",
                        lambda: [e for e in events(run_dir, "pool_changed") if e["kind"] == "lost"], 60, run_dir)
        assert lost[0]["node_id"] == down and lost[0]["verdict"] == "continue"
        assert lost[0]["cause"].startswith("slurm:") or lost[0]["cause"] in ("heartbeat", "disconnected")
        wait_for("two more steps", lambda: len(read_jsonl(run_dir / "metrics.jsonl")) >= steps_before + 2, 90, run_dir)
        live = json.loads(cli(slurm_env, "status", str(run_dir), "--json"))["nereusd"]
        assert set(live["pool"]) == {"nrs1", "nrs3"} and live["last_decision"]["node_id"] in (down, "nrs3")
        # cancel: the job, the grow allocation and every process go
        cli(slurm_env, "cancel", job_id)
        wait_for("both allocations to end",
                 lambda: squeue_states(slurm_env, job_id, grow_id) == {job_id: None, grow_id: None}, 60, run_dir)
        wait_for("no stray process", lambda: processes_mentioning(str(run_dir)) == [], 30, run_dir)
        # grow an ended job: refused, nothing submitted (its agents would wait for a gone nereusd)
        proc = subprocess.run([sys.executable, "-m", "launcher.cli", "grow", job_id, "--nodes", "1"], env=slurm_env,
                              cwd=REPO, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and "only a running job grows" in proc.stderr, proc.stdout + proc.stderr
        assert json.loads((run_dir / "slurm.json").read_text())["grow_job_ids"] == [grow_id]
    finally:
        subprocess.run(["scancel", job_id], env=slurm_env)
        if down:
            subprocess.run(["scontrol", "update", f"NodeName={down}", "State=RESUME"], env=slurm_env)


def test_preemption_signal_checkpoints_and_stops_then_resume_continues(slurm_env, tmp_path):
    job_id, run_dir = submit(slurm_env, tmp_path, "slurm-preempt", steps=2000, nodes=2)
    try:
        wait_for("a first step", lambda: read_jsonl(run_dir / "metrics.jsonl"), 150, run_dir)
        # kill -9 of nereusd: the batch script starts it again with --resume in the same allocation;
        # the agent keeps its workers for it (on their state, or from the checkpoint: the kill's timing),
        # and the second node's agent, whose devices hold no worker, registers them again (it had
        # exited, and its node left the job: an adversarial trial, 2026-12-07)
        registered = wait_for("both agents", lambda: len(events(run_dir, "agent_registered")) == 2
                              and events(run_dir, "agent_registered"), 60, run_dir)
        nodes = sorted(e["node_id"] for e in registered)   # whichever two nodes Slurm gave it
        os.kill(json.loads((run_dir / "nereusd.json").read_text())["pid"], signal.SIGKILL)
        again = wait_for("nereusd again in the allocation", lambda: events(run_dir, "nereusd_resumed"), 120, run_dir)
        assert again[0]["mode"] in ("kept_workers", "checkpoint") and squeue_states(slurm_env, job_id)[job_id], again
        wait_for("a step after it", lambda: len(read_jsonl(run_dir / "metrics.jsonl")) > again[0]["step"], 120, run_dir)

        def since_restart():
            all_events = events(run_dir)
            last = max(i for i, e in enumerate(all_events) if e["event"] == "nereusd_started")
            return [e["node_id"] for e in all_events[last:] if e["event"] == "agent_registered"]

        assert sorted(wait_for("both nodes registered again", lambda: len(since_restart()) == 2 and since_restart(),
                               60, run_dir)) == nodes
        subprocess.run(["scancel", "--batch", "--signal=USR2", job_id], env=slurm_env, check=True)
        wait_for("the job to end", lambda: squeue_states(slurm_env, job_id)[job_id] is None, 90, run_dir)
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["status"] == "preempted" and "checkpoint saved in" in summary["error"], summary
        checkpoint = Path(summary["error"].split("checkpoint saved in ")[1])
        assert (checkpoint / "actor" / ".metadata").is_file()
        assert processes_mentioning(str(run_dir)) == []
        # resume: a continuation job (mode resume) picks the run up from the preemption checkpoint;
        # given the run directory as a relative path, it records it absolute (`status JOB_ID` from
        # anywhere; a new user's trial found it recorded as given)
        out = cli(slurm_env, "resume", run_dir.name, cwd=run_dir.parent)
        job_id = out.split("submitted job ")[1].split(":")[0]
        recorded = json.loads((Path(slurm_env["NEREUS_HOME"]) / "jobs" / f"{job_id}.json").read_text())
        assert recorded["run_dir"] == str(run_dir), recorded
        resumed = wait_for("the continuation to resume", lambda: events(run_dir, "nereusd_resumed")[1:], 150, run_dir)
        assert resumed[0]["checkpoint"] == str(checkpoint) and (run_dir / "summary.preempted.json").is_file()
        # its head node's agent registered first: the plan's devices are on nereusd's node (the wait
        # for it had ended at once on the earlier allocation's registrations)
        head = (run_dir / "logs" / f"slurm-{job_id}.out").read_text().split("nereusd on ")[1].split()[0]
        assert since_restart()[0] == head, (head, since_restart())
        step = resumed[0]["step"]
        wait_for("two steps after it", lambda: len(read_jsonl(run_dir / "metrics.jsonl")) >= step + 2, 150, run_dir)
        steps = [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")]
        assert steps == list(range(len(steps))), steps   # every step once across both allocations
    finally:
        subprocess.run(["scancel", job_id], env=slurm_env)
