"""End to end, a checkpoint the storage refuses (issue 17, item 4): the job stops as a storage
fault, naming the path, the cause and what the next checkpoint needs, and keeps the previous
checkpoint whole. Before, a failed save killed the workers, read as lost devices, and left a
partial checkpoint where a restart would look.

The fault is a file where the checkpoint's directory goes (``NotADirectoryError``): the test
runs as any user, where a full or read-only disk needs a mount (``scripts/chaos.py`` uses one).
"""

from __future__ import annotations

import json

import pytest

from emu.state.checkpoint import verify_checkpoint
from nereusd.journal import read_jsonl
from tests.support.e2e import processes_mentioning, running, wait_for, write_job

pytestmark = pytest.mark.slow

JOB = """
name: e2e-storage-fault
algorithm: grpo
seed: 5
steps: 6
devices: 2
models: {actor: "@WARMSTART@"}
rollout: {prompts_per_step: 2, group_size: 4, max_new_tokens: 8}
train: {global_batch: 8, micro_batch: 2, kl_coef: 0.0}
plan: {default: {tp: 1, pp: 1}}
checkpoint: {every_steps: 2}
"""


def test_a_refused_checkpoint_stops_the_job_and_keeps_the_previous_one(tmp_path):
    run_dir = tmp_path / "run"
    with running(write_job(tmp_path, "job", JOB), run_dir) as proc:
        wait_for("one step", lambda: len(read_jsonl(run_dir / "metrics.jsonl")) >= 1, 180, run_dir)
        (run_dir / "checkpoints").mkdir(exist_ok=True)
        (run_dir / "checkpoints" / "step000004.partial").write_text("in the way")
        out, _ = proc.communicate(timeout=240)
    assert proc.returncode != 0, out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "stopped" and summary["error_kind"] == "StorageFault", summary
    assert "step000004.partial" in summary["error"] and "NotADirectoryError" in summary["error"], summary
    assert "step000002 is kept (" in summary["error"] and "bytes free there" in summary["error"], summary
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")] == [0, 1, 2, 3]
    assert verify_checkpoint(run_dir / "checkpoints" / "step000002" / "actor") > 0
    events = read_jsonl(run_dir / "events.jsonl")
    assert not any(e["event"] in ("device_lost", "worker_exited", "fallback") for e in events), events
    assert [e["dir"].rsplit("/", 1)[1] for e in events if e["event"] == "checkpoint"] == ["step000002"]
    assert "storage fault" in out
    assert processes_mentioning(str(run_dir)) == []
