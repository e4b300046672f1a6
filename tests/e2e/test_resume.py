"""End to end, ``kill -9`` of nereusd, then ``nereus-launch resume`` (issue 17, item 2): the
launcher writes a ``crashed`` summary naming the resume command; ``resume`` stops the dead run's
agent and workers, and a new nereusd continues from the latest committed checkpoint. The steps
after it run again on the same prompts and seeds: their rewards and lengths equal the first
run's, losses within reduction tolerance, and every step is in ``metrics.jsonl`` once. The
controller resumes with the state its checkpoint event journalled (plan, calibration, monitor).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from nereusd.journal import read_jsonl
from tests.support import REPO
from tests.support.e2e import processes_mentioning, start, wait_for, write_job

pytestmark = pytest.mark.slow

JOB = """
name: e2e-resume
algorithm: grpo
seed: 9
steps: 6
devices: 2
models: {actor: "@WARMSTART@"}
rollout: {prompts_per_step: 2, group_size: 4, max_new_tokens: 8}
train: {global_batch: 8, micro_batch: 2, kl_coef: 0.0}
plan: {default: {tp: 1, pp: 1}}
checkpoint: {every_steps: 2}
"""


def test_kill_9_of_nereusd_then_resume_continues_from_the_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    proc = start(write_job(tmp_path, "job", JOB), run_dir)
    try:
        wait_for("the step-2 checkpoint and step 3", lambda: (run_dir / "checkpoints" / "step000002").is_dir()
                 and len(read_jsonl(run_dir / "metrics.jsonl")) >= 3, 180, run_dir)
        pid = json.loads((run_dir / "nereusd.json").read_text())["pid"]
        os.kill(pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1 and "nereus-launch resume" in out, out
    crashed = json.loads((run_dir / "summary.json").read_text())
    assert crashed["status"] == "crashed" and "SIGKILL" in crashed["error"], crashed
    before = {r["step"]: r for r in read_jsonl(run_dir / "metrics.jsonl")}
    assert len(before) >= 3

    resumed = subprocess.run([sys.executable, "-m", "launcher.cli", "resume", str(run_dir), "--quiet"],
                             capture_output=True, text=True, cwd=REPO, timeout=300)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "succeeded" and summary["steps"] == 6, summary
    records = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(6))
    events = read_jsonl(run_dir / "events.jsonl")
    resumes = [e for e in events if e["event"] == "nereusd_resumed"]
    assert len(resumes) == 1 and resumes[0]["step"] == 2 and resumes[0]["checkpoint"].endswith("step000002")
    # the controller continues with what it had learned, on the plan it had (no planner solve)
    saved = next(e for e in events if e["event"] == "checkpoint" and e["dir"].endswith("step000002"))
    assert saved["controller"]["calibration"]["samples"] and resumes[0]["controller_state"] is True
    launch = [e for e in events if e["event"] == "launch_plan"][-1]
    assert launch["source"] == "resumed: the plan of the checkpoint" and launch["plan"] == saved["controller"]["plan"]
    for r in records[2:len(before)]:   # run twice: the same samples and rewards
        b = before[r["step"]]
        assert r["sample_position"] == b["sample_position"] and r["reward_mean"] == b["reward_mean"], r["step"]
        assert r["train/actor/loss"] == pytest.approx(b["train/actor/loss"], rel=1e-4, abs=1e-6)
    assert (run_dir / "summary.crashed.json").is_file()
    assert processes_mentioning(str(run_dir)) == []
