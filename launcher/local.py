"""``nereus-launch local JOB.yaml``: the whole system on this machine.

Starts ``nereusd`` and one ``nereus-agent`` whose workers are virtual CPU devices (or, with
``--gpus``, this machine's GPUs), follows the job's progress from ``metrics.jsonl``, and tears
everything down on success, error or Ctrl-C. The processes, messages and primitives are the
ones a cluster runs; only the transport of the data plane differs (gloo instead of NCCL).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from nereusd.config.job import load_yaml_mapping, parse_job
from nereusd.errors import NereusError
from nereusd.stop import SignalStop
from nereusd.config.resolve import ResolvedJob, load_and_resolve
from nereusd.config.site import load_site
from nereusd.journal import (ENDPOINT_FILE, EVENTS_FILE, METRICS_FILE, SUMMARY_FILE, Event, read_jsonl,
                             write_summary)
from nereusd.rundir import LaunchLock, clear_run_dir
from nereusd.summary import crash_summary, job_figures
from launcher.local_devices import check_gpus, site_mismatch
from launcher.pool_trace import describe_pool_schedule, pool_trace_override
from launcher.procs import stop_run_processes
from launcher.progress import Progress, duration_text, launch_plan_line, resume_hint, switches_text
from nereusd.daemon.security import init_keys


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "local", help="run a job on this machine (nereusd + one agent + one worker per device)",
        description=(
            "Run JOB.yaml on this machine: nereusd, one agent and one worker process per virtual device "
            "(memory capacity from the job's memory_gib, else the site config, enforced by the workers' "
            "accounting). The run directory receives metrics.jsonl, events.jsonl, summary.json, logs/, "
            "checkpoints/ (DCP), plots/ (nereus-launch report), tensorboard/, keys/, job.yaml (the job as run), "
            "nereusd.json and nereusd.lock."
        ),
    )
    parser.add_argument("job", help="job YAML, e.g. examples/counting_grpo.yaml")
    parser.add_argument("--run-dir", help="run directory (default: runs/<job name>-<timestamp>)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an existing run directory (one that holds only what a run writes)")
    parser.add_argument("--gpus", action="store_true", help="use this machine's GPUs instead of virtual CPU devices")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    trace = parser.add_argument_group(
        "pool trace", "Replay a spot-availability trace on the local pool (sets or overrides the job's pool.trace; "
        "virtual-CPU devices only). The trace's full availability is the job's devices; at each trace hour the "
        "pool holds round(devices x available fraction) devices, never fewer than min_devices (the job's "
        "pool.trace.min_devices; default: the fewest the job runs on, e.g. 2 for GRPO's concurrent actor and "
        "reference inference) nor more than the job's devices. Devices leave (the highest-numbered) "
        "and join (a new local agent) at the first safe boundary at or after the trace time of the change. "
        "Trace hour 0 is the trace's first sample with every instance available.")
    trace.add_argument("--pool-trace", metavar="NAME",
                       help="us-east-2b or us-west-2a (16-node AWS spot availability, one sample per 5 min; "
                            "nereusd/data/traces/SOURCES.md), or a trace file of that format")
    base = trace.add_mutually_exclusive_group()
    base.add_argument("--trace-hour-s", type=float, metavar="S",
                      help="wall-clock seconds of the job per trace hour (e.g. 60: ten trace hours in ten minutes)")
    base.add_argument("--trace-hour-steps", type=float, metavar="N",
                      help="RL steps per trace hour (e.g. 12: one step per 5-minute sample)")
    trace.add_argument("--trace-start-hour", type=float, metavar="H",
                       help="trace hour at which the first step starts (default: the job's, else 0)")
    parser.set_defaults(func=run_local)


class _DeferredStop:
    """A block that the signals which stop the launcher (SIGINT, SIGTERM, SIGHUP) do not
    interrupt: one that comes meanwhile is raised again when the block ends, and then acts as it
    would have (``KeyboardInterrupt``, :class:`_Terminated`, or nothing where it is ignored).
    Around the start of a process and the assignment of its handle: a Ctrl-C that landed while
    ``subprocess.Popen`` returned, the child already running, left nereusd running with no
    handle to stop it (a suite failure of
    ``test_ctrl_c_while_nereusd_starts_is_an_interruption_not_a_crash``, 2026-12-07)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __enter__(self) -> "_DeferredStop":
        self.caught: list[int] = []
        self.previous = {sig: signal.signal(sig, self._catch) for sig in self.SIGNALS}
        return self

    def _catch(self, signum: int, _frame: object) -> None:
        self.caught.append(signum)

    def __exit__(self, *exc: object) -> bool:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        if self.caught:
            signal.raise_signal(self.caught[0])   # now handled as it would have been
        return False


def _start(argv: list[str], log_path: Path) -> subprocess.Popen:
    with open(log_path, "ab") as log_file:
        return subprocess.Popen(argv, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)


def _tail(path: Path, lines: int = 15, start: int = 0) -> str:
    """The last ``lines`` lines of ``path`` from byte ``start`` on."""
    try:
        with open(path, "rb") as fh:
            fh.seek(start)
            return "\n".join(fh.read().decode(errors="replace").splitlines()[-lines:]) or "(empty log)"
    except FileNotFoundError:
        return "(no log)"


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _wait_endpoint(run_dir: Path, daemon: subprocess.Popen, log_from: int = 0, timeout_s: float = 120.0) -> str:
    """The endpoint ``daemon`` binds (``RUN_DIR/nereusd.json`` with its pid).

    Raises:
        NereusError: it exits first (with its log from byte ``log_from``: its own lines), or
            does not bind within ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    path = run_dir / ENDPOINT_FILE
    while time.monotonic() < deadline:
        if path.exists():
            try:
                info = json.loads(path.read_text())
                if info.get("pid") == daemon.pid:   # not a dead nereusd's file (a resumed run)
                    return info["endpoint"]
            except (json.JSONDecodeError, KeyError):
                pass
        if daemon.poll() is not None:
            raise NereusError(f"nereusd exited with {daemon.returncode} before binding:\n"
                              f"{_tail(run_dir / 'logs' / 'nereusd.log', start=log_from)}")
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


class _Terminated(BaseException):
    """SIGTERM or SIGHUP reached the launcher (``kill``, ``timeout``, a closed terminal). A
    ``BaseException``, as ``KeyboardInterrupt`` is: code the signal interrupts that catches
    ``Exception`` must not swallow it. tqdm's constructor does, around the start of its monitor
    thread: a SIGTERM that came while the progress bar started was lost and the job ran on to
    ``succeeded`` (a CI failure of ``test_ctrl_c_tears_everything_down[SIGTERM]``)."""


_STOP = SignalStop(_Terminated)
"""The launcher's SIGTERM/SIGHUP handler; :func:`supervise`'s loop raises a stop whose exception
was lost."""
_raise_terminated = _STOP.handler


JOB_COPY_HEADER = "# nereus-launch local: a copy of "
"""The first line of ``RUN_DIR/job.yaml``, then the job file's absolute path: ``resume`` starts
from that file when no nereusd recorded one (interrupted before it started), since the copy's
relative model and dataset paths would be read relative to the run directory."""


def run_local(args: argparse.Namespace) -> int:
    job = load_and_resolve(args.job)  # every check before a process starts
    job_path = Path(args.job).resolve()
    effective = pool_trace_override(args, dict(load_yaml_mapping(Path(args.job))))
    if effective is not None:
        if args.gpus:
            raise NereusError("--pool-trace: a trace adds local agents of virtual CPU devices; not with --gpus")
        job = dataclasses.replace(job, config=parse_job(effective, source=f"{Path(args.job).name} with --pool-trace"))
    pool_lines = describe_pool_schedule(job)   # checks min_devices against the job's devices
    if args.gpus:
        check_gpus()
    run_dir = Path(args.run_dir) if args.run_dir else Path("runs") / f"{job.config.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    launching = LaunchLock(run_dir)   # held until this job's nereusd owns the directory
    try:
        clear_run_dir(run_dir, args.overwrite)
    except BaseException:
        launching.release()
        raise
    if effective is None:   # the header names the original: relative paths in it are relative to the original
        (run_dir / "job.yaml").write_bytes(f"{JOB_COPY_HEADER}{job_path}\n".encode() + job_path.read_bytes())
    else:   # the job as run: the daemon reads it (model directories made absolute)
        job_path = (run_dir / "job.yaml").resolve()
        job_path.write_text(f"# {Path(args.job).resolve()} with the pool trace of the command line\n"
                            + yaml.safe_dump(effective, sort_keys=False))
        job = load_and_resolve(job_path)
    print(f"nereus: job {job.config.name!r} ({job.config.algorithm.value}, {job.config.steps} steps) on "
          f"{job.devices} {'GPU' if args.gpus else 'virtual CPU'} devices; run directory {run_dir}")
    mismatch = site_mismatch(load_site(job.config.site), args.gpus)
    if mismatch:
        print(f"nereus: warning: {mismatch}", file=sys.stderr)
    print(launch_plan_line(job))
    for line in pool_lines:
        print(line)
    return supervise(job, job_path, run_dir, gpus=args.gpus, quiet=args.quiet, launching=launching)


def supervise(job: ResolvedJob, job_path: Path, run_dir: Path, *, gpus: bool, quiet: bool,
              resume: bool = False, launching: LaunchLock | None = None, kept_agents: list[int] | None = None) -> int:
    """Start nereusd (``--resume`` with ``resume``) and one agent for ``job`` in ``run_dir``, show
    progress until nereusd exits, stop everything, and report; returns the exit code. A nereusd
    that dies without a summary (``kill -9``, a crash) gets one written here, status ``crashed``,
    with the command that resumes it; its agent and workers are left to wait the site's
    ``liveness.resume_grace_s`` for that resume (they stop by themselves after it).
    ``kept_agents``: pids of such agents (a resume): they re-register with the new nereusd,
    workers and EMUs kept, and no agent is started unless they exit before one registered.
    ``launching`` is released once nereusd owns ``run_dir``."""
    logs = run_dir / "logs"
    daemon = agent = None
    crashed = owned = False   # owned: this launcher's nereusd held the run directory
    progress = Progress(job.config.steps, quiet, run_dir if resume else None)
    interrupted, signal_text = False, ""
    agent_error = None   # why the agent exited before it registered
    handlers = {sig: signal.signal(sig, _raise_terminated) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        keys = str(init_keys(run_dir.resolve()))   # CURVE as on Slurm: status and pool need the run dir's keys
        log_from = _size(logs / "nereusd.log")   # a resumed run's log holds earlier nereusds' lines
        with _DeferredStop():   # the handle exists before a Ctrl-C can stop the launcher
            daemon = _start([sys.executable, "-m", "nereusd.daemon.main", str(job_path),
                             "--run-dir", str(run_dir.resolve()), "--keys-dir", keys,
                             *(["--resume"] if resume else [])], logs / "nereusd.log")
        endpoint = _wait_endpoint(run_dir, daemon, log_from)
        owned = True
        if launching is not None:
            launching.release()   # nereusd holds the run directory's own lock now
        metrics = json.loads((run_dir / ENDPOINT_FILE).read_text()).get("metrics")
        if metrics and not quiet:
            viewer = "" if importlib.util.find_spec("tensorboard") else " (the viewer: pip install tensorboard)"
            print(f"nereus: Prometheus metrics at {metrics}; TensorBoard: tensorboard --logdir "
                  f"{run_dir / 'tensorboard'}{viewer}")
        grace_s = load_site(job.config.site).liveness.resume_grace_s
        agent_argv = [sys.executable, "-m", "emu.agent", "--connect", endpoint, "--node-id", "local0",
                      "--run-dir", str(run_dir.resolve()), "--keys-dir", keys, "--daemon-timeout-s", f"{grace_s:g}"]
        if not gpus:
            agent_argv += ["--cpu-devices", str(job.devices), "--cpu-memory-bytes", str(job.device_memory_bytes)]
        kept = [pid for pid in kept_agents or () if Path(f"/proc/{pid}").exists()]
        if kept:
            print(f"nereus: the crashed run's agent (pid {', '.join(map(str, kept))}) re-registers with its workers "
                  "and their state; nothing re-runs if that state is where the journal is")
        else:
            agent_log_from = _size(logs / "agent.log")
            with _DeferredStop():
                agent = _start(agent_argv, logs / "agent.log")
            if not quiet:
                print("nereus: starting the workers and building their engines" + ("" if gpus else
                      " (vLLM's take tens of seconds on CPU)") + "; the progress bar starts once they are built",
                      flush=True)
        while daemon.poll() is None:
            _STOP.raise_pending()
            progress.update(run_dir)
            if kept and not any(Path(f"/proc/{pid}").exists() for pid in kept):
                if not _registered_since_start(run_dir):
                    print("nereus: the kept agent stopped before it registered; starting a new one", file=sys.stderr)
                    with _DeferredStop():
                        agent = _start(agent_argv, logs / "agent.log")
                kept = []   # gone: nothing more to watch (one that had registered is nereusd's to miss)
            if agent is not None and agent.poll() is not None and daemon.poll() is None:
                if not _registered_since_start(run_dir):   # nereusd would wait out its registration timeout
                    agent_error = (f"the agent exited with status {agent.returncode} before it registered: "
                                   f"{_last_line(logs / 'agent.log', agent_log_from)} (its log: {logs / 'agent.log'})"
                                   + ("; without --gpus the job runs on virtual CPU devices" if gpus else ""))
                    break
                time.sleep(1.0)  # nereusd notices the lost agent by heartbeat and stops the job
            time.sleep(0.25)
        progress.update(run_dir)
        crashed = crash_summary(run_dir, daemon.returncode, write=False) is not None and grace_s > 0
    except (KeyboardInterrupt, _Terminated) as err:
        _STOP.taken()
        interrupted = True
        signal_text = f"{err} to nereus-launch" if isinstance(err, _Terminated) else "Ctrl-C"
        print(f"\nnereus: {signal_text}; stopping nereusd, the agent and the workers", file=sys.stderr)
    finally:
        # a second signal must not cut the teardown short: a second Ctrl-C (SIGINT) included, which
        # once left nereusd, the agent and the workers running when it came during the teardown
        sigint = signal.signal(signal.SIGINT, signal.SIG_IGN)
        for sig in handlers:
            signal.signal(sig, signal.SIG_IGN)
        if launching is not None:
            launching.release()
        progress.close()
        _stop(daemon, grace_s=20.0)
        if not crashed or interrupted:
            _stop(agent, grace_s=10.0)
        if owned and (not crashed or interrupted):
            # agents of pool additions run in sessions of their own: nereusd told them to stop;
            # none may outlive the job. Not when this nereusd never held the directory (another
            # launcher's job does): those processes are that job's
            stop_run_processes(run_dir, wait_s=10.0)
        # an interrupted launcher exits next and keeps ignoring signals: a second Ctrl-C after a
        # teardown that took under 0.5 s found SIGINT's handler restored and turned exit status
        # 130 into a KeyboardInterrupt (-2)
        if not interrupted:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
            signal.signal(signal.SIGINT, sigint)
    if agent_error is not None and not interrupted:
        record = _read_summary(run_dir)
        write_summary(run_dir, {**record, "status": "failed", "error": agent_error, "error_kind": "AgentFailed"})
        print(f"nereus: failed: {agent_error}", file=sys.stderr)
        return 1
    return _report(run_dir, signal_text if interrupted else None, daemon.returncode if daemon is not None else None)


def _read_summary(run_dir: Path) -> dict:
    """``summary.json`` of ``run_dir`` (``{}`` when missing or unreadable)."""
    try:
        record = json.loads((run_dir / SUMMARY_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def _last_line(path: Path, start: int = 0) -> str:
    """The last non-empty line of ``path`` from byte ``start`` on (a traceback's: its exception)."""
    lines = [line for line in _tail(path, 50, start).splitlines() if line.strip()]
    return lines[-1].strip() if lines else "(empty log)"


def _registered_since_start(run_dir: Path) -> bool:
    """Whether an agent registered with the run's latest nereusd (``events.jsonl``)."""
    registered = False
    for record in read_jsonl(run_dir / EVENTS_FILE) if (run_dir / EVENTS_FILE).exists() else []:
        if record.get("event") == Event.NEREUSD_STARTED.value:
            registered = False
        elif record.get("event") == Event.AGENT_REGISTERED.value:
            registered = True
    return registered


def _report(run_dir: Path, interrupted: str | None, returncode: int | None = None) -> int:
    """Print the job's outcome from ``summary.json`` (writing it where nereusd could not) and
    return the launcher's exit status. ``interrupted``: what stopped the launcher (``"Ctrl-C"``,
    ``"SIGTERM to nereus-launch"``), or ``None``."""
    if interrupted and crash_summary(run_dir, returncode, write=False) is not None:
        # the user's Ctrl-C reached nereusd before its handlers (while it imported): no crash
        steps = len(read_jsonl(run_dir / METRICS_FILE)) if (run_dir / METRICS_FILE).exists() else 0
        why = f"{interrupted} (before nereusd could write its summary)"
        write_summary(run_dir, {**_read_summary(run_dir), **job_figures(run_dir), "status": "interrupted",
                                "error_kind": "Interrupted", "error": why, "steps_completed": steps})
        if (run_dir / EVENTS_FILE).exists():
            print(f"nereus: interrupted after {steps} step(s): {why}\nnereus: {resume_hint(run_dir, 'interrupted')}",
                  file=sys.stderr)
        else:
            print("nereus: interrupted before the job started: nothing to resume (start it again)", file=sys.stderr)
        return 130
    crashed = crash_summary(run_dir, returncode)
    if crashed is not None:
        print(f"nereus: crashed: {crashed['error']} after {crashed['steps_completed']} step(s); the latest "
              f"checkpoint is kept: continue with `{crashed['resume']}` (within the site's liveness.resume_grace_s the agent "
              f"and workers wait for it, their state in memory: then no step re-runs)\n{_tail(run_dir / 'logs' / 'nereusd.log')}",
              file=sys.stderr)
        return 130 if interrupted else 1
    summary = json.loads((run_dir / SUMMARY_FILE).read_text())
    status = summary.get("status")
    if status == "succeeded":
        print(f"nereus: succeeded: {summary.get('steps')} steps" + duration_text(summary) + "; "
              f"reward {summary.get('reward_first_10pct', 0):.2f} → {summary.get('reward_last_10pct', 0):.2f}"
              + (f" (best {summary['reward_best']:.2f} at step {summary['reward_best_step']})"
                 if "reward_best" in summary else "") + ", "
              f"response length {summary.get('response_length_first_10pct', 0):.1f} → "
              f"{summary.get('response_length_last_10pct', 0):.1f} tokens "
              f"({summary.get('response_length_growth', 0):.1f}×); "
              + (f"held-out pass@1 {summary['eval_pass_at_1_first']:.2f} → {summary['eval_pass_at_1_last']:.2f} "
                 f"({summary.get('eval_prompts')} prompts); " if "eval_pass_at_1_last" in summary else "")
              + switches_text(summary))
        print(f"nereus: results in {run_dir} (plots: nereus-launch report {run_dir})")
        return 0
    if status == "interrupted" and interrupted and str(summary.get("error", "")).startswith("nereusd received"):
        # nereusd saw the SIGTERM the launcher forwards; the user pressed Ctrl-C (a new user's trial)
        forwarded = summary["error"][len("nereusd received "):]
        summary["error"] = f"{interrupted} (nereus-launch stopped nereusd with {forwarded})"
        write_summary(run_dir, summary)
    done = summary.get("steps_completed")
    # interrupted: always how far (three Ctrl-Cs had read three ways); failed: once steps ran
    told = isinstance(done, int) and (status == "interrupted" or done > 0 and status == "failed")
    where = f" after {done} step(s)" if told else ""
    print(f"nereus: {status}{where}: {summary.get('error', 'see logs')}", file=sys.stderr)
    print(f"nereus: {resume_hint(run_dir, status)}", file=sys.stderr)
    print(f"nereus: logs in {run_dir / 'logs'}", file=sys.stderr)
    return 130 if status == "interrupted" or interrupted else 1
