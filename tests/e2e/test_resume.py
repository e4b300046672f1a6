"""End to end, ``kill -9`` of nereusd, then ``nereus-launch resume`` (issue 17, item 2), both ways,
in one job:

1. nereusd is killed while a step runs (after a periodic checkpoint, which the test then turns
   back into the ``.partial`` directory a kill during the write leaves). The launcher writes a
   ``crashed`` summary naming the resume command and leaves the agent and workers waiting (the
   site's ``liveness.resume_grace_s``). Two ``resume`` commands start at once: one starts a
   nereusd that takes them back with their EMUs in memory (the job continues at the next step,
   nothing re-runs, no worker restarts, and the interrupted checkpoint is written first); the
   other refuses and touches nothing (it once stopped the winner's workers on its way out).
2. nereusd is killed again, and the checkpoint the first resumed nereusd wrote is damaged (a
   truncated file); ``resume --restart`` stops the leftovers, cannot read that checkpoint and
   falls back to the one before it. The steps after it run again on the same
   prompts and seeds: their rewards and lengths equal what the kept workers produced, losses within
   reduction tolerance. So the kept path continued exactly where a checkpoint says the job was.

Every step is in ``metrics.jsonl`` once, and the controller resumes with the state its
checkpoint event journalled (plan, calibration, monitor).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from nereusd.journal import read_jsonl
from tests.support import REPO
from tests.support.e2e import processes_mentioning, start, wait_for, write_job

pytestmark = pytest.mark.slow

JOB = """
name: e2e-resume
algorithm: grpo
seed: 9
steps: 8
devices: 2
models: {actor: "@WARMSTART@"}
rollout: {prompts_per_step: 2, group_size: 4, max_new_tokens: 8}
train: {global_batch: 8, micro_batch: 2, kl_coef: 0.0}
plan: {default: {tp: 1, pp: 1}}
checkpoint: {every_steps: 2}
"""


def _kill_nereusd_after(run_dir, rows: int, checkpoint: str) -> None:
    """SIGKILL nereusd as soon as ``metrics.jsonl`` has ``rows`` rows and ``checkpoint`` is
    committed: early in the next step (its generation), before that step's training."""
    path = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while not (path.exists() and len(read_jsonl(path)) >= rows and (run_dir / "checkpoints" / checkpoint).is_dir()):
        assert time.monotonic() < deadline, (run_dir / "logs" / "nereusd.log").read_text()[-3000:]
        time.sleep(0.02)
    os.kill(json.loads((run_dir / "nereusd.json").read_text())["pid"], signal.SIGKILL)


def _resume(run_dir, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "launcher.cli", "resume", str(run_dir), "--quiet", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)


def test_kill_9_of_nereusd_then_resume_keeps_the_workers_or_restarts_from_the_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    proc = start(write_job(tmp_path, "job", JOB), run_dir)
    try:
        _kill_nereusd_after(run_dir, 4, "step000004")
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 1 and "nereus-launch resume" in out, out
        crashed = json.loads((run_dir / "summary.json").read_text())
        assert crashed["status"] == "crashed" and "SIGKILL" in crashed["error"], crashed
        workers = sorted(p for p in processes_mentioning(str(run_dir)) if "emu.worker" in p)
        assert len(workers) == 2, "the agent and its workers wait for the resume"
        kept_at = len(read_jsonl(run_dir / "metrics.jsonl"))
        assert kept_at == 4, kept_at   # killed in step 4, which takes seconds
        # as if killed while writing the boundary's checkpoint
        os.replace(run_dir / "checkpoints" / "step000004", run_dir / "checkpoints" / "step000004.partial")

        proc, rival = _resume(run_dir), _resume(run_dir)   # 1: on the kept workers; two at once
        written = kept_at   # the first checkpoint the kept run writes: the interrupted one, again
        _kill_nereusd_after(run_dir, written + 1, f"step{written:06d}")
        (out, _), (rival_out, _) = proc.communicate(timeout=120), rival.communicate(timeout=120)
        if proc.returncode == 2:
            out, rival_out = rival_out, out
        # one resume ran the job; the other waited for its nereusd, then refused and touched nothing
        assert sorted((proc.returncode, rival.returncode)) == [1, 2], (out, rival_out)
        assert "is still running this job; nothing to resume" in rival_out, rival_out
        events = read_jsonl(run_dir / "events.jsonl")
        resumed = [e for e in events if e["event"] == "nereusd_resumed"]
        kept = [e for e in events if e["event"] == "workers_kept"]
        assert resumed[0]["mode"] == "kept_workers" and resumed[0]["step"] == kept_at, (resumed, kept)
        assert kept[0]["kept"] is True and kept[0]["devices"] == [0, 1], kept
        assert not [e for e in events if e["event"] in ("workers_stopped", "fallback")]
        saved = next(e for e in events if e["event"] == "checkpoint" and e["dir"].endswith("step000002"))
        assert not list((run_dir / "checkpoints").glob("*.partial"))   # the interrupted one was written again
        assert saved["controller"]["calibration"]["samples"] and resumed[0]["controller_state"] is True
        first = {r["step"]: r for r in read_jsonl(run_dir / "metrics.jsonl")}
        assert sorted(first) == list(range(len(first))) and len(first) >= written + 1

        # the checkpoint the kept run wrote, damaged: the restart falls back to the one before it
        # (a truncated file stopped every resume as a storage fault, 2026-12-06)
        damaged = sorted((run_dir / "checkpoints" / f"step{written:06d}" / "actor").glob("*.distcp"))[0]
        os.truncate(damaged, 1000)
        proc = _resume(run_dir, "--restart")   # 2: from the checkpoint before the one the kept run wrote
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, out
    finally:
        if proc.poll() is None:
            proc.kill()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "succeeded" and summary["steps"] == 8, summary
    # the job's figures over its three nereusds: one resume from the checkpoint, its steps re-run
    fallback = written - 2
    assert (summary["resumes"], summary["restarts"], summary["lost_steps"]) == (2, 1, len(first) - fallback), summary
    records = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(8))
    events = read_jsonl(run_dir / "events.jsonl")
    restart = [e for e in events if e["event"] == "nereusd_resumed"][1]
    assert restart["mode"] == "checkpoint" and restart["step"] == written, restart
    [unreadable] = [e for e in events if e["event"] == "checkpoint_unreadable"]
    assert unreadable["step"] == fallback and unreadable["fallback"].endswith(f"step{fallback:06d}"), unreadable
    assert "damaged or incomplete" in unreadable["error"] and unreadable["dropped_metrics"] == [fallback, fallback + 1]
    for r in records[fallback:len(first)]:   # run twice: on kept workers, then from the checkpoint
        b = first[r["step"]]
        assert r["sample_position"] == b["sample_position"] and r["reward_mean"] == b["reward_mean"], r["step"]
        assert r["train/actor/loss"] == pytest.approx(b["train/actor/loss"], rel=1e-4, abs=1e-6)
    assert (run_dir / "summary.crashed.json").is_file() and (run_dir / "summary.crashed.2.json").is_file()
    assert processes_mentioning(str(run_dir)) == []
