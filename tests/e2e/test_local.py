"""End to end: `nereus-launch local` runs the real nereusd, agent and workers for a few steps of
each algorithm, on colocated and disjoint placements, and writes the documented files."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from nereusd.journal import read_jsonl

from tests.support import REPO
from tests.support.e2e import WARMSTART, processes_mentioning

pytestmark = pytest.mark.slow

METRIC_KEYS = {"step", "step_latency_s", "stage_latency_s", "reward_mean", "response_length_mean",
               "response_length_max", "tokens_per_s", "peak_memory_bytes", "plan"}


def launch(tmp_path: Path, job: str, timeout_s: float = 300.0, extra: tuple[str, ...] = ()
           ) -> tuple[subprocess.CompletedProcess, Path]:
    job_path = tmp_path / "job.yaml"
    job_path.write_text(job.replace("@WARMSTART@", str(WARMSTART)))
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "launcher.cli", "local", str(job_path), "--run-dir", str(run_dir),
                           "--quiet", *extra], capture_output=True, text=True, timeout=timeout_s, cwd=REPO)
    return proc, run_dir


def check_run(proc, run_dir: Path, steps: int, devices: int) -> list[dict]:
    assert proc.returncode == 0, proc.stdout + proc.stderr + (run_dir / "logs" / "nereusd.log").read_text()
    records = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(steps))
    for rec in records:
        assert METRIC_KEYS <= set(rec)
        assert set(rec["peak_memory_bytes"]) == {str(d) for d in range(devices)}
        assert all(v > 0 for v in rec["peak_memory_bytes"].values())
        assert rec["response_length_mean"] >= 1
        assert set(rec["stage_latency_s"]) >= {"generation", "inference", "training"}
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "succeeded" and summary["steps"] == steps
    events = [e["event"] for e in read_jsonl(run_dir / "events.jsonl")]
    for name in ("nereusd_started", "agent_registered", "world_formed", "build", "checkpoint", "nereusd_stopped"):
        assert name in events
    assert (run_dir / "checkpoints" / "final" / "actor" / ".metadata").is_file()
    assert "succeeded" in proc.stdout
    assert processes_mentioning(str(run_dir)) == []  # torn down on success
    return records


GRPO_2 = """
algorithm: grpo
steps: 2
devices: 2
models: {actor: "@WARMSTART@"}
rollout: {prompts_per_step: 4, group_size: 4, max_new_tokens: 24}
train: {global_batch: 16, micro_batch: 4}
"""
"""Two GRPO steps of the warm-start model on 2 devices: the jobs below add a name and what they test."""


def test_grpo_colocated_tp2(tmp_path):
    proc, run_dir = launch(tmp_path, "name: e2e-grpo" + GRPO_2 + "plan: {default: {tp: 2, pp: 1}}\n")
    records = check_run(proc, run_dir, steps=2, devices=2)
    assert records[0]["plan"]["actor/training"]["tp"] == 2

    # the DCP checkpoint holds the trained actor's slices and their Adam state (emu/state/checkpoint.py)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    out = tmp_path / "actor.pt"
    dcp_to_torch_save(run_dir / "checkpoints" / "final" / "actor", out)
    import torch
    state = torch.load(out)
    assert any(k.startswith("actor/training/model.embed_tokens.weight/param@") for k in state)
    assert any("/exp_avg@" in k for k in state) and "actor/training/logical" in state
    del dcp

    plots = subprocess.run([sys.executable, "-m", "launcher.cli", "report", str(run_dir)], capture_output=True,
                           text=True, cwd=REPO)
    assert plots.returncode == 0, plots.stderr
    assert (run_dir / "plots" / "reward.png").stat().st_size > 1000


def test_ppo_disjoint_critic_and_pp2(tmp_path):
    proc, run_dir = launch(tmp_path, """
name: e2e-ppo
algorithm: ppo
steps: 2
devices: 4
models: {actor: "@WARMSTART@"}
rollout: {prompts_per_step: 8, group_size: 1, max_new_tokens: 24}
train: {global_batch: 8, micro_batch: 2}
plan:
  default: {tp: 1, pp: 1, devices: [0, 1]}
  model_stages:
    actor/training: {pp: 2, dp: 1}
    critic/inference: {devices: [2, 3]}
    critic/training: {tp: 2, devices: [2, 3]}
""")
    records = check_run(proc, run_dir, steps=2, devices=4)
    assert "train/critic/value_loss" in records[-1]


def test_remax(tmp_path):
    proc, run_dir = launch(tmp_path, """
name: e2e-remax
algorithm: remax
steps: 2
devices: 2
models: {actor: "@WARMSTART@"}
rollout: {prompts_per_step: 4, group_size: 2, max_new_tokens: 24}
train: {global_batch: 8, micro_batch: 2}
""")
    records = check_run(proc, run_dir, steps=2, devices=2)
    assert "greedy_reward_mean" in records[0]


OOM_JOB = "name: e2e-oom" + GRPO_2 + "memory_gib: 0.017\n"
"""17.4 MiB a device: above the 16 MiB workspace a worker books, below what the model needs."""


def test_a_plan_over_memory_is_refused_before_its_workers_start(tmp_path):
    """A job's own plan that its devices cannot hold is refused with the device, its model-stages
    and the predicted bytes, and the planner's account when no plan fits either, before a worker
    starts (``control.problem.choose_launch``). Until 2026-12-07 the workers built it and failed
    with a raw out-of-memory error (``out of memory on device 0 … capacity 18253611 bytes``)."""
    proc, run_dir = launch(tmp_path, OOM_JOB + "plan: {default: {tp: 1, pp: 1}}\n", timeout_s=120)
    assert proc.returncode == 1
    assert re.search(r"the job's plan does not fit: its device \d \(actor/generation, .*\) is predicted to need "
                     r"[\d.]+ MiB at response length 24, over the device's 17.4 MiB, and no plan fits this job",
                     proc.stderr), proc.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["error_kind"] == "ConfigError"
    events = [e["event"] for e in read_jsonl(run_dir / "events.jsonl")]
    assert "workers_started" not in events and "build" not in events
    assert processes_mentioning(str(run_dir)) == []  # nothing hangs after an error


def test_a_job_no_plan_fits_is_refused_before_its_workers_start(tmp_path):
    """Without a plan in the job the planner chooses one; where even the smallest peak exceeds the
    whole device, no plan can run: nereusd says so and starts no worker (it ran the default plan,
    which failed building; an adversarial trial, 2026-12-06)."""
    proc, run_dir = launch(tmp_path, OOM_JOB, timeout_s=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "failed: no plan fits this job: no launch plan fits 2 devices" in proc.stderr
    assert "smallest peak over every layout" in proc.stderr
    events = [e["event"] for e in read_jsonl(run_dir / "events.jsonl")]
    assert "workers_started" not in events and "build" not in events
    assert processes_mentioning(str(run_dir)) == []


def test_bad_job_fails_before_anything_starts(tmp_path):
    proc, run_dir = launch(tmp_path, "steps: 0\n", timeout_s=60)
    assert proc.returncode == 2
    assert "job.yaml: steps: Input should be greater than or equal to 1" in proc.stderr
    assert not run_dir.exists()


def test_an_agent_that_dies_before_registering_fails_the_job_at_once(tmp_path, monkeypatch):
    """An agent that exits at start-up (it was ``--gpus`` on a machine without a GPU, which the
    launcher now refuses itself): the launcher said nothing for nereusd's 120 s registration wait,
    then "only 0 of 4 devices registered"; it now stops the job at once with the agent's own error
    (2026-12-06, a new user's trial). The failure is injected into the agent's interpreter alone,
    by a ``sitecustomize`` that exits where the command line runs ``emu.agent``."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import os, sys\n"
        "if 'emu.agent' in sys.orig_argv:\n"
        "    print('RuntimeError: injected: this agent cannot start', file=sys.stderr, flush=True)\n"
        "    os._exit(1)\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])))
    proc, run_dir = launch(tmp_path, "name: e2e-no-agent" + GRPO_2, timeout_s=90)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert ("failed: the agent exited with status 1 before it registered: RuntimeError: injected: this agent "
            "cannot start") in proc.stderr, proc.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["error_kind"] == "AgentFailed"
    assert processes_mentioning(str(run_dir)) == []


def _interruptible(tmp_path: Path, steps: int) -> tuple[subprocess.Popen, Path]:
    """``local`` of a tiny job of ``steps`` steps, started so that SIGINT reaches it as a
    terminal's Ctrl-C does: a test run in the background of a shell without job control inherits
    SIGINT ignored (POSIX), and so would the launcher, which then ran all its steps."""
    import signal

    job_path = tmp_path / "job.yaml"
    job_path.write_text(f"""
name: e2e-interrupt
algorithm: grpo
steps: {steps}
devices: 2
models: {{actor: "{WARMSTART}"}}
rollout: {{prompts_per_step: 2, group_size: 2, max_new_tokens: 8}}
train: {{global_batch: 4, micro_batch: 2}}
""")
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "launcher.cli", "local", str(job_path), "--run-dir", str(run_dir),
                             "--quiet"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    return proc, run_dir


@pytest.mark.parametrize("signame", ["SIGINT twice", "SIGTERM"])
def test_ctrl_c_tears_everything_down(tmp_path, signame):
    # SIGINT: Ctrl-C, pressed twice (the first starts the teardown; a second once cut it short and
    # left nereusd, the agent and the workers running); SIGTERM: `kill`, `timeout`, a batch system
    import os
    import signal
    import time

    proc, run_dir = _interruptible(tmp_path, 500)
    deadline = time.monotonic() + 180
    while not read_jsonl(run_dir / "metrics.jsonl"):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "no step within 180 s"
        time.sleep(0.2)
    pids = {json.loads((run_dir / "nereusd.json").read_text())["pid"]}
    proc.send_signal(getattr(signal, signame.split()[0]))
    if signame.endswith("twice"):
        time.sleep(0.5)   # the teardown has begun
        proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, out + err
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "interrupted"
    said = "Ctrl-C" if signame.startswith("SIGINT") else "SIGTERM to nereus-launch"
    assert summary["error"] == f"{said} (nereus-launch stopped nereusd with SIGTERM)", summary
    assert f"`nereus-launch resume {run_dir}` " in err, err
    events = [e["event"] for e in read_jsonl(run_dir / "events.jsonl")]
    assert "job_interrupted" in events and "nereusd_stopped" in events
    # nereusd, the agent and every worker are gone
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert processes_mentioning(str(run_dir)) == []




def test_ctrl_c_while_nereusd_starts_is_an_interruption_not_a_crash(tmp_path):
    """Ctrl-C as nereusd starts (its SIGTERM from the launcher lands while it imports, before its
    handlers): the summary said ``crashed`` and told the user the agent and workers waited for a
    resume (an adversarial trial). It is ``interrupted``, exit 130, and nothing is left running."""
    import signal
    import time

    proc, run_dir = _interruptible(tmp_path, 2)
    deadline = time.monotonic() + 60
    while not (run_dir / "logs" / "nereusd.log").exists():   # the launcher has started nereusd
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, out + err
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "interrupted", summary
    assert "crashed" not in err
    assert processes_mentioning(str(run_dir)) == []
