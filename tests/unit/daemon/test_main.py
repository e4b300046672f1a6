"""nereusd's own failures: a crash is a failed job with its reason, and the agents always stop.

Faults are injected into the real entry point (:func:`nereusd.daemon.main.run`, in this process,
with no agent registered): an exception nobody expects where the driver is built, and one where
the metrics are summarised at the end. What is checked is what a user sees afterwards —
``summary.json`` and ``events.jsonl`` — and that nereusd told the agents to stop.
"""

from __future__ import annotations

import json
import signal

import pytest

from nereusd.daemon import app, main
from nereusd.daemon.control_plane import ControlPlane
from nereusd.journal import read_jsonl

JOB = """name: crash
steps: 1
devices: 1
models: {actor_config: {vocab_size: 16, hidden_size: 32, intermediate_size: 64, num_layers: 2, num_heads: 4,
                        num_kv_heads: 2, max_position: 64}}
rollout: {prompts_per_step: 2, group_size: 2, max_new_tokens: 8}
train: {global_batch: 4, micro_batch: 2}
adaptation: {enabled: false}
"""


@pytest.fixture
def daemon(tmp_path, monkeypatch):
    """``run(args)`` for a one-device job; records every ``shutdown_agents`` call; restores the
    signal handlers ``run`` installs."""
    job = tmp_path / "job.yaml"
    job.write_text(JOB)
    stops: list[str] = []
    real = ControlPlane.shutdown_agents
    monkeypatch.setattr(ControlPlane, "shutdown_agents", lambda self, reason, wait_s=10.0: (
        stops.append(reason), real(self, reason, 0.0))[1])
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR2)}
    args = main.build_parser().parse_args([str(job), "--run-dir", str(tmp_path / "run"), "--register-timeout-s", "1"])
    yield (lambda: main.run(args)), tmp_path / "run", stops
    for s, h in handlers.items():
        signal.signal(s, h)


def _crash(*args, **kwargs):
    raise RuntimeError("injected fault")


def test_a_crash_is_a_failed_job_and_the_agents_stop(daemon, monkeypatch):
    run, run_dir, stops = daemon
    monkeypatch.setattr(app, "RLDriver", _crash)
    assert run() == 1
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["error_kind"] == "RuntimeError"
    assert "injected fault" in summary["error"]
    failed, = [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "job_failed"]
    assert "RuntimeError" in failed["traceback"]
    assert stops == ["failed"]


def test_a_failing_summary_still_stops_the_agents_and_writes_the_status(daemon, monkeypatch):
    run, run_dir, stops = daemon
    monkeypatch.setattr(app, "summarise_metrics", _crash)
    assert run() == 1   # no agent registers within 1 s: the job fails, and then the summary fails too
    assert stops == ["failed"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and "injected fault" in summary["summary_error"]


def test_an_unwritable_run_directory_is_a_clear_error(tmp_path, capsys):
    (tmp_path / "job.yaml").write_text(JOB)
    (tmp_path / "afile").write_text("")
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        assert main.main([str(tmp_path / "job.yaml"), "--run-dir", str(tmp_path / "afile" / "run")]) == 2
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
    assert "cannot write its journals" in capsys.readouterr().err


def test_a_pool_limit_below_the_slurm_allocation_is_refused_before_anything_starts(tmp_path, capsys):
    """Every Slurm node's agent registers all its GPUs: ``pool.max_devices: 3`` on two nodes of
    four (local site) would refuse the allocation's own second agent."""
    (tmp_path / "job.yaml").write_text(JOB + "pool: {max_devices: 3}\n")
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        assert main.main([str(tmp_path / "job.yaml"), "--run-dir", str(tmp_path / "run"), "--nodes", "2"]) == 2
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
    assert "pool.max_devices: 3 is below the launch allocation's 8 devices (2 nodes x 4)" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("value", ["nan", "inf", "0", "-3", "soon"])
def test_timeouts_are_positive_finite_seconds(tmp_path, value):
    with pytest.raises(SystemExit):
        main.build_parser().parse_args(["job.yaml", "--run-dir", str(tmp_path), "--register-timeout-s", value])


def test_the_summary_names_the_best_step_a_collapse_would_hide(tmp_path):
    """An async run whose reward peaked at 15.9 and fell back to 4 read "reward 3.45 → 4.21";
    the summary now carries the best step too."""
    rewards = [3.0, 5.0, 15.9, 9.0, 4.0, 3.5, 4.2, 4.1, 4.0, 4.3]
    with open(tmp_path / "metrics.jsonl", "w") as f:
        for step, r in enumerate(rewards):
            f.write(json.dumps({"step": step, "reward_mean": r, "response_length_mean": 10.0 + step,
                                "step_latency_s": 1.0, "plan": {}}) + "\n")
    summary: dict = {}
    app.summarise_metrics(tmp_path, summary)
    assert (summary["reward_best"], summary["reward_best_step"]) == (15.9, 2)
    assert summary["reward_first_10pct"] == 3.0 and summary["reward_last_10pct"] == 4.3
    assert "max_new_tokens_first" not in summary   # metrics written before the cap was recorded


def test_the_summary_carries_the_first_and_last_response_cap(tmp_path):
    """``status`` on a finished curriculum run showed the lengths but not the cap they grew
    under (a live job's ``status`` shows it); the summary now carries the first and last step's."""
    with open(tmp_path / "metrics.jsonl", "w") as f:
        for step, cap in enumerate([8, 8, 16, 24]):
            f.write(json.dumps({"step": step, "reward_mean": 0.1, "response_length_mean": 5.0 + step,
                                "step_latency_s": 1.0, "plan": {}, "max_new_tokens": cap}) + "\n")
    summary: dict = {}
    app.summarise_metrics(tmp_path, summary)
    assert (summary["max_new_tokens_first"], summary["max_new_tokens_last"]) == (8, 24)


def test_the_summary_carries_the_held_out_pass_at_1_before_and_after(tmp_path):
    """A job that evaluates (GSM8K) printed its reward only; its held-out pass@1 was in
    ``events.jsonl`` alone. The summary takes the first evaluation (before step 0) and the last;
    a job without evaluations has neither key."""
    with open(tmp_path / "metrics.jsonl", "w") as f:
        for step in range(3):
            f.write(json.dumps({"step": step, "reward_mean": 0.4, "response_length_mean": 10.0,
                                "step_latency_s": 1.0, "plan": {}}) + "\n")
    summary: dict = {}
    app.summarise_metrics(tmp_path, summary)
    assert "eval_pass_at_1_last" not in summary
    with open(tmp_path / "events.jsonl", "w") as f:
        for step, passed in ((-1, 0.34), (1, 0.36), (2, 0.39)):
            f.write(json.dumps({"event": "evaluation", "step": step, "prompts": 100, "pass_at_1": passed}) + "\n")
        f.write(json.dumps({"event": "transition", "step": 1}) + "\n")
    app.summarise_metrics(tmp_path, summary)
    assert (summary["eval_pass_at_1_first"], summary["eval_pass_at_1_last"], summary["eval_prompts"]) == (0.34, 0.39, 100)


def test_a_run_directory_that_cannot_be_written_is_said_not_a_traceback(tmp_path, capsys, monkeypatch):
    """A resume onto a full file system printed nereusd's traceback (``OSError: [Errno 28]``)
    as its reason for exiting before it bound (an adversarial trial, 2026-12-07): the storage
    fault is now one line naming the path, its error and the space left."""
    import errno

    job = tmp_path / "job.yaml"
    job.write_text(JOB)
    announce = tmp_path / "run" / "nereusd.json.tmp"   # where the trial's nereusd failed

    def full(self):
        raise OSError(errno.ENOSPC, "No space left on device", str(announce))

    monkeypatch.setattr(app.Daemon, "_announce", full)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR2)}
    try:
        assert main.main([str(job), "--run-dir", str(tmp_path / "run"), "--register-timeout-s", "1"]) == 1
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
    err = capsys.readouterr().err
    assert f"nereusd: error: cannot write {announce}: No space left on device (" in err, err
    assert "bytes free there" in err and "Traceback" not in err
