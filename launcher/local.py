"""``nereus-launch local JOB.yaml``: the whole system on this machine.

Starts ``nereusd`` and one ``nereus-agent`` whose workers are virtual CPU devices (or, with
``--gpus``, this machine's GPUs), follows the job's progress from ``metrics.jsonl``, and tears
everything down on success, error or Ctrl-C. The processes, messages and primitives are the
ones a cluster runs; only the transport of the data plane differs (gloo instead of NCCL).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from nereusd.errors import NereusError
from nereusd.jobspec import ResolvedJob, load_and_resolve
from nereusd.journal import EVENTS_FILE, METRICS_FILE, SUMMARY_FILE, read_jsonl

ENDPOINT_FILE = "nereusd.json"


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "local", help="run a job on this machine (nereusd + one agent + one worker per device)",
        description=(
            "Run JOB.yaml on this machine: nereusd, one agent and one worker process per virtual device "
            "(memory capacity from the site config, enforced by the workers' accounting). The run "
            "directory receives metrics.jsonl, events.jsonl, summary.json, logs/ and a DCP checkpoint."
        ),
    )
    parser.add_argument("job", help="job YAML, e.g. examples/counting_grpo.yaml")
    parser.add_argument("--run-dir", help="run directory (default: runs/<job name>-<timestamp>)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing run directory")
    parser.add_argument("--gpus", action="store_true", help="use this machine's GPUs instead of virtual CPU devices")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.set_defaults(func=run_local)


def _prepare_run_dir(job: ResolvedJob, run_dir: str | None, overwrite: bool) -> Path:
    path = Path(run_dir) if run_dir else Path("runs") / f"{job.config.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    if path.exists() and any(path.iterdir()):
        if not overwrite:
            raise NereusError(f"run directory {path} exists and is not empty; pass --overwrite or another --run-dir")
        shutil.rmtree(path)
    (path / "logs").mkdir(parents=True, exist_ok=True)
    return path


def _start(argv: list[str], log_path: Path) -> subprocess.Popen:
    with open(log_path, "ab") as log_file:
        return subprocess.Popen(argv, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log)"


def _wait_endpoint(run_dir: Path, daemon: subprocess.Popen, timeout_s: float = 120.0) -> str:
    deadline = time.monotonic() + timeout_s
    path = run_dir / ENDPOINT_FILE
    while time.monotonic() < deadline:
        if path.exists():
            try:
                return json.loads(path.read_text())["endpoint"]
            except (json.JSONDecodeError, KeyError):
                pass
        if daemon.poll() is not None:
            raise NereusError(f"nereusd exited with {daemon.returncode} before binding:\n"
                              f"{_tail(run_dir / 'logs' / 'nereusd.log')}")
        time.sleep(0.05)
    raise NereusError(f"nereusd did not bind within {timeout_s:.0f} s")


def _stop(proc: subprocess.Popen | None, grace_s: float) -> None:
    """SIGTERM the process group, wait ``grace_s``, then SIGKILL it."""
    if proc is None:
        return
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        if proc.poll() is not None:
            try:  # children of an exited leader may still be in its group
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            return
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            continue


def compact_plan(plan: dict) -> str:
    """``actor/training: {tp: 2, pp: 1, dp: 2}`` → ``aT2·1·2`` (role initial, stage initial upper-case)."""
    parts = []
    for name, cand in plan.items():
        role, _, stage = name.partition("/")
        parts.append(f"{role[:1]}{stage[:1].upper()}{cand['tp']}·{cand['pp']}·{cand['dp']}")
    return " ".join(parts)


def describe_event(ev: dict) -> str | None:
    """One progress line for an admitted switch, a fallback or a pool change; else ``None``."""
    kind = ev.get("event")
    if kind == "admission" and ev.get("verdict") == "admit":
        why = ", ".join(f"{t['signal']}{' (urgent)' if t['urgent'] else ''}" for t in ev.get("triggers", []))
        changed = [f"{ms} tp{c['tp']}·pp{c['pp']}·dp{c['dp']}" for ms, c in (ev.get("target_plan") or {}).items()
                   if c != (ev.get("current_plan") or {}).get(ms)]
        gain = ev.get("delta_l_s")
        return (f"nereus: step {ev['step']}: switch admitted [{why}]: {'; '.join(changed) or 'placement'}"
                + (f" (ΔL {gain:+.2f} s/step, L_tran {ev.get('l_tran_s') or 0:.2f} s)" if gain is not None else ""))
    if kind == "launch_plan" and ev.get("source") == "planner":
        plan = "; ".join(f"{ms} tp{c['tp']}·pp{c['pp']}·dp{c['dp']}" for ms, c in ev["plan"].items())
        return f"nereus: planner's launch plan: {plan}"
    if kind == "fallback":
        return f"nereus: step {ev['step']}: fallback {ev.get('action')}: {ev.get('reason')}"
    if kind == "pool_changed" and "step" in ev:
        return (f"nereus: step {ev['step']}: pool change (joined {ev.get('joined')}, leaving {ev.get('leaving')}) "
                f"-> {len(ev.get('pool_devices', []))} devices")
    return None


class _Progress:
    """A tqdm bar fed from ``metrics.jsonl``."""

    def __init__(self, total: int, quiet: bool) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=total, unit="step", disable=quiet, dynamic_ncols=True, desc="nereus")
        self.seen = 0
        self.events_seen = 0
        self.switches = 0
        self.quiet = quiet

    def update(self, run_dir: Path) -> None:
        records = read_jsonl(run_dir / METRICS_FILE)
        for rec in records[self.seen:]:
            self.bar.set_postfix_str(
                f"reward {rec['reward_mean']:.2f} len {rec['response_length_mean']:.1f} "
                f"step {rec['step_latency_s']:.1f}s plan {compact_plan(rec.get('plan', {}))} "
                f"switches {self.switches}", refresh=False)
            self.bar.update(1)
        self.seen = len(records)
        events = read_jsonl(run_dir / EVENTS_FILE)
        for ev in events[self.events_seen:]:
            if ev.get("event") == "admission" and ev.get("verdict") == "admit":
                self.switches += 1
            line = describe_event(ev)
            if line and not self.quiet:
                self.bar.write(line)
        self.events_seen = len(events)

    def close(self) -> None:
        self.bar.close()


def run_local(args: argparse.Namespace) -> int:
    job = load_and_resolve(args.job)  # every check before a process starts
    run_dir = _prepare_run_dir(job, args.run_dir, args.overwrite)
    shutil.copyfile(args.job, run_dir / "job.yaml")
    logs = run_dir / "logs"
    print(f"nereus: job {job.config.name!r} ({job.config.algorithm.value}, {job.config.steps} steps) on "
          f"{job.devices} {'GPU' if args.gpus else 'virtual CPU'} devices; run directory {run_dir}")
    if job.config.adaptation.enabled and "plan" not in job.config.model_fields_set:
        print("nereus: launch plan: chosen by the planner for the initial conditions (no plan in the job)")
    else:
        print(f"nereus: launch plan: {job.plan.describe()}")
    daemon = agent = None
    progress = _Progress(job.config.steps, args.quiet)
    interrupted = False
    try:
        daemon = _start([sys.executable, "-m", "nereusd.daemon_main", str(Path(args.job).resolve()),
                         "--run-dir", str(run_dir.resolve())], logs / "nereusd.log")
        endpoint = _wait_endpoint(run_dir, daemon)
        agent_argv = [sys.executable, "-m", "emu.agent", "--connect", endpoint, "--node-id", "local0",
                      "--run-dir", str(run_dir.resolve())]
        if not args.gpus:
            agent_argv += ["--cpu-devices", str(job.devices), "--cpu-memory-bytes", str(job.device_memory_bytes)]
        agent = _start(agent_argv, logs / "agent.log")
        while daemon.poll() is None:
            progress.update(run_dir)
            if agent.poll() is not None and daemon.poll() is None:
                time.sleep(1.0)  # nereusd notices the lost agent by heartbeat and stops the job
            time.sleep(0.25)
        progress.update(run_dir)
    except KeyboardInterrupt:
        interrupted = True
        print("\nnereus: interrupted; stopping nereusd, the agent and the workers", file=sys.stderr)
    finally:
        progress.close()
        _stop(daemon, grace_s=20.0)
        _stop(agent, grace_s=10.0)
    return _report(run_dir, interrupted)


def _report(run_dir: Path, interrupted: bool) -> int:
    try:
        summary = json.loads((run_dir / SUMMARY_FILE).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        print(f"nereus: no summary was written; see {run_dir / 'logs'}:\n{_tail(run_dir / 'logs' / 'nereusd.log')}",
              file=sys.stderr)
        return 130 if interrupted else 1
    status = summary.get("status")
    if status == "succeeded":
        print(f"nereus: succeeded: {summary.get('steps')} steps in {summary.get('wall_time_s', 0):.0f} s; "
              f"reward {summary.get('reward_first_10pct', 0):.2f} → {summary.get('reward_last_10pct', 0):.2f}, "
              f"response length {summary.get('response_length_first_10pct', 0):.1f} → "
              f"{summary.get('response_length_last_10pct', 0):.1f} tokens "
              f"({summary.get('response_length_growth', 0):.1f}×); layout switches: {summary.get('switches', 0)}")
        print(f"nereus: results in {run_dir} (plots: nereus-launch report {run_dir})")
        return 0
    print(f"nereus: {status}: {summary.get('error', 'see logs')}", file=sys.stderr)
    print(f"nereus: logs in {run_dir / 'logs'}", file=sys.stderr)
    return 130 if status == "interrupted" or interrupted else 1
