"""End to end, ``nereus-launch pool RUN_DIR --remove N`` and ``--add N`` on a running local job:
the request goes to nereusd over the control plane (removal) or starts another local agent
(addition); both take effect at the next safe boundary and are journalled."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request

import pytest

from nereusd.journal import read_jsonl
from tests.support import REPO
from tests.support.deepspeed import requires_deepspeed
from tests.support.e2e import finish, processes_mentioning, running, wait_for, write_job

pytestmark = pytest.mark.slow

JOB = """
name: e2e-pool-cmd
algorithm: grpo
seed: 2
steps: 250
devices: 3
models: {actor: "@WARMSTART@"}
rollout: {prompts_per_step: 2, group_size: 4, max_new_tokens: 12}
train: {global_batch: 8, micro_batch: 4, kl_coef: 0.0}
checkpoint: {every_steps: 0}
pool: {max_devices: 4}
"""


def pool(run_dir, *args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "launcher.cli", "pool", str(run_dir), *args],
                         capture_output=True, text=True, cwd=REPO, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def test_pool_command_removes_and_adds_devices_of_a_running_job(tmp_path):
    # 250 steps (~0.3 s each here; 150 before a second join was added): the added agent needs a few seconds to start, register and join
    # at a re-formation; with 9 steps a loaded machine finished the job before the agent registered
    # (CI, 2026-12-01), with 30 an idle one before it joined (here, 2026-12-03), with 80 a loaded
    # one before the test asked to add the device (here, beside a benchmark, 2026-12-05)
    run_dir = tmp_path / "run"
    with running(write_job(tmp_path, "job", JOB), run_dir) as proc:
        wait_for("a step", lambda: read_jsonl(run_dir / "metrics.jsonl"), 180, run_dir)
        # local mode has CURVE keys as on Slurm: a peer without the run directory's client key
        # gets no answer (before, any local user could ask for status or remove devices)
        assert (run_dir / "keys" / "client.json").stat().st_mode & 0o077 == 0
        assert _unauthenticated_status(run_dir) is None
        # the Prometheus endpoint nereusd.json names answers while the job runs
        metrics = json.loads((run_dir / "nereusd.json").read_text())["metrics"]
        assert "nereus_step_latency_seconds_count" in urllib.request.urlopen(metrics, timeout=10).read().decode()
        # the pool holds 3 of the job's pool.max_devices 4: two more are refused, before any agent
        # starts (asked first, while the job surely runs: after the join a fast machine could
        # finish the job before the request arrived; CI, 2026-12-03)
        out = subprocess.run([sys.executable, "-m", "launcher.cli", "pool", str(run_dir), "--add", "2"],
                             capture_output=True, text=True, cwd=REPO, timeout=60)
        assert out.returncode != 0 and "the pool holds 3 devices and the job allows 4" in out.stderr, out.stderr
        assert "leave at the next safe boundary" in pool(run_dir, "--remove", "1")

        def left():
            return [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "pool_changed" and e.get("leaving")]
        wait_for("the removal", left, 120, run_dir)
        # two devices join in the background; a removal while they join takes one of them (it holds
        # nothing of the job), not a device of the world, and the other joins. Before, nereusd
        # counted joining devices when the request came and refused it at the boundary, or took
        # device 1 from the world. (Should the join finish before the request lands, the removal
        # takes device 4 from the world: the outcome is the same.)
        assert "joins" in pool(run_dir, "--add", "2")
        wait_for("the join", lambda: any(e["event"] == "join_started" for e in read_jsonl(run_dir / "events.jsonl")),
                 120, run_dir)
        assert "leave at the next safe boundary" in pool(run_dir, "--remove", "1")
        wait_for("device 3 joined", lambda: any(e["event"] == "world_formed" and 3 in e["devices"]
                                                for e in read_jsonl(run_dir / "events.jsonl")), 180, run_dir)
        # device 3, the added agent's last, leaves too: the agent is told to exit, not left idle
        assert "leave at the next safe boundary" in pool(run_dir, "--remove", "1")
        wait_for("the added agent retired", lambda: any(e["event"] == "agent_retired"
                                                        for e in read_jsonl(run_dir / "events.jsonl")), 180, run_dir)
        finish(proc, run_dir, timeout_s=240)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "succeeded" and summary["steps"] == 250, summary
    events = read_jsonl(run_dir / "events.jsonl")
    assert [e["remove"] for e in events if e["event"] == "pool_request"] == [1, 1, 1]
    assert not any(e["event"] in ("pool_request_refused", "agent_lost", "message_refused") for e in events)
    changes = [e for e in events if e["event"] == "pool_changed" and "step" in e and "leaving" in e]
    assert sorted(d for c in changes for d in c["leaving"]) == [2, 3, 4], changes
    assert changes[0]["leaving"] == [2] and any("nereus-launch pool --remove 1" in s for s in changes[0]["sources"])
    assert any(e["event"] == "worker_exited" and e["device"] == 2 for e in events)
    formed = [e["devices"] for e in events if e["event"] == "world_formed"]
    assert any(3 in f for f in formed) and formed[-1] == [0, 1]
    [retired] = [e for e in events if e["event"] == "agent_retired"]
    assert retired["devices"] == [3, 4] and retired["node_id"] != "local0"
    # the run has ended: the pool can no longer change
    out = subprocess.run([sys.executable, "-m", "launcher.cli", "pool", str(run_dir), "--add", "1"],
                         capture_output=True, text=True, cwd=REPO, timeout=60)
    assert out.returncode != 0 and "the job has ended" in out.stderr
    assert processes_mentioning(str(run_dir)) == []


def _unauthenticated_status(run_dir):
    """What a plain (keyless) ZeroMQ peer gets for a status request: ``None`` when nothing."""
    import zmq

    from nereusd import protocol as P

    endpoint = json.loads((run_dir / "nereusd.json").read_text())["endpoint"]
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        sock.send(P.encode(P.StatusRequest()))
        return P.decode(sock.recv()) if sock.poll(2000) else None
    finally:
        sock.close(0)


ZERO_JOB = JOB.replace("steps: 250", "steps: 100").replace("devices: 3", "devices: 2").replace(
    "max_devices: 4", "max_devices: 3, join: immediate") + """\
backends: {actor/training: deepspeed}
plan: {default: {tp: 1, pp: 1}}
adaptation: {policy: frozen}
"""


@requires_deepspeed
def test_a_device_added_to_a_zero_job_joins_after_the_world_re_forms(tmp_path):
    """A device joins a job whose training model-stage is on ZeRO-1. The world re-forms first
    (every engine exported to canonical holdings), so the move of the ZeRO model-stage that
    follows runs on full holdings, on every worker alike: the old workers once chose to
    re-partition there while the new one, with no plan yet, did not, and the re-partition's
    collective would have waited for it forever."""
    # 100 steps (~0.3 s each here): the added agent and its worker take ~14 s to start and join;
    # with 30 steps the device joined at step 25, with 50 at step 46 (2026-12-03)
    run_dir = tmp_path / "run"
    with running(write_job(tmp_path, "job", ZERO_JOB), run_dir) as proc:
        wait_for("a step", lambda: read_jsonl(run_dir / "metrics.jsonl"), 180, run_dir)
        assert "joins" in pool(run_dir, "--add", "1")
        finish(proc, run_dir, timeout_s=240)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "succeeded" and summary["steps"] == 100 and summary["restarts"] == 0, summary
    events = read_jsonl(run_dir / "events.jsonl")
    assert [e["devices"] for e in events if e["event"] == "world_formed"][-1] == [0, 1, 2]
    # the frozen policy's rescale moves the ZeRO-1 training model-stage after the re-formation
    # (its DP and devices change): full holdings, no re-partition
    moves = [e for e in events if e["event"] == "transition" and e["to_plan"]["actor/training"]["devices"]
             != e["from_plan"]["actor/training"]["devices"]]
    assert moves and all(e["to_plan"]["actor/training"].get("zero_stage") == 1 for e in moves), moves
    assert all(e["phases_s"].get("repartition", 0.0) == 0.0 for e in moves), [e["phases_s"] for e in moves]
    assert processes_mentioning(str(run_dir)) == []
