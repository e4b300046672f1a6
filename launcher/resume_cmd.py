"""``nereus-launch resume RUN_DIR``: continue a job that did not finish — its nereusd died
(``kill -9``, a crash, the machine's OOM killer), it stopped on a storage fault (free the space
first) or on a lost pool, or it was interrupted — on the workers' state in memory when the dead
run's agent still holds it (local runs), else from its latest committed checkpoint.

It refuses a run directory a live nereusd still owns (the run-directory lock) and a job that
succeeded. A Slurm run (time limit, preemption, a crash) is submitted again in mode ``resume``:
same job, site and node count, and it continues on whatever nodes the new allocation gets.
Locally, nereusd starts with ``--resume`` and the job's original job file (the path its first
nereusd recorded; ``RUN_DIR/job.yaml`` if that is gone). The dead run's agent waits the site's
``liveness.resume_grace_s`` for it with its workers and their EMUs in memory: it re-registers, and
when that state is where the journal is (``nereusd.daemon.kept``) the job continues at the next
step with nothing re-run — the default, because it is the cheaper way (``scripts/bench_resume.py``).
Otherwise (or with ``--restart``, which stops the leftover agents and workers first, or when the
job file changed since the run's last nereusd started, which it says) the job continues from the
latest checkpoint: the steps after it leave ``metrics.jsonl`` and run again, on
the same prompts and sampling seeds, so every step is there once.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import sys
from pathlib import Path

from launcher.cli import run_directory
from launcher.local import JOB_COPY_HEADER, check_gpus, supervise
from launcher.progress import launch_plan_line
from launcher.submit import RECORD_FILE
from launcher.procs import run_processes, stop_run_processes
from nereusd.checkpoints import check_resume_checkpoints, check_resume_models, resume_record
from nereusd.config.resolve import load_and_resolve
from nereusd.control.jobs import job_fingerprint
from nereusd.daemon.kept import started_job_sha256
from nereusd.errors import ConfigError, NereusError
from nereusd.journal import EVENTS_FILE, SUMMARY_FILE, Event, check_resume_steps, read_jsonl
from nereusd.rundir import LaunchLock, run_dir_owner


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("resume", help="continue a job that did not finish (local or Slurm): on the workers' "
                              "state in memory when the dead run's agent kept it, else from its latest checkpoint",
                              description=__doc__.split("\n\n")[0].replace("``", "'"))
    p.add_argument("run_dir", help="the job's run directory")
    p.add_argument("--gpus", action="store_true", help="use this machine's GPUs (as the job's 'local --gpus')")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--restart", action="store_true",
                   help="stop the dead run's leftover agent and workers and restart from the latest checkpoint, "
                        "instead of continuing on the workers' state in memory (local runs)")
    p.set_defaults(func=run)


def job_file(run_dir: Path) -> Path:
    """The job file the run was started with: the one its first nereusd recorded, else the one
    ``RUN_DIR/job.yaml``'s header names (:data:`~launcher.local.JOB_COPY_HEADER`: a run
    interrupted before nereusd started), else ``RUN_DIR/job.yaml`` itself.

    Raises:
        NereusError: none of them exists.
    """
    for record in read_jsonl(run_dir / EVENTS_FILE):
        if record.get("event") == Event.NEREUSD_STARTED.value and record.get("job_file"):
            path = Path(record["job_file"])
            if path.is_file():
                return path
            break
    fallback = run_dir / "job.yaml"
    if not fallback.is_file():
        raise NereusError(f"{run_dir}: no job file to resume with (neither the recorded one nor job.yaml)")
    with open(fallback, "rb") as fh:
        first = fh.readline().decode(errors="replace").rstrip("\n")
    original = Path(first[len(JOB_COPY_HEADER):]) if first.startswith(JOB_COPY_HEADER) else None
    return original if original is not None and original.is_file() else fallback


def _set_aside_summary(run_dir: Path, status: str) -> Path | None:
    """Keep the stopped run's summary as ``summary.<status>.json`` (``summary.<status>.2.json``
    and on for later ones), out of the resumed job's way; returns where (``None``: it had none)."""
    status = re.sub(r"[^A-Za-z0-9_-]", "_", status)[:32] or "unknown"   # a file name, whatever the summary says
    if not (run_dir / SUMMARY_FILE).exists():
        return None
    names = (f"summary.{status}.json" if n == 1 else f"summary.{status}.{n}.json" for n in itertools.count(1))
    aside = next(run_dir / name for name in names if not (run_dir / name).exists())
    os.replace(run_dir / SUMMARY_FILE, aside)
    return aside


def _journalled_status(run_dir: Path) -> str:
    """The status the run's latest nereusd journalled as it stopped (``nereusd_stopped``), or
    ``"running"`` when it stopped without (killed)."""
    status = "running"
    for record in read_jsonl(run_dir / EVENTS_FILE):
        if record.get("event") == Event.NEREUSD_STARTED.value:
            status = "running"
        elif record.get("event") == Event.NEREUSD_STOPPED.value and isinstance(record.get("status"), str):
            status = record["status"]
    return status


def run(args: argparse.Namespace) -> int:
    run_dir = run_directory(args.run_dir)   # resolved: recorded for `status JOB_ID` and written into the batch script
    if not (run_dir / EVENTS_FILE).is_file():
        if (run_dir / RECORD_FILE).is_file():   # submitted, but its allocation ended before nereusd ran
            raise NereusError(f"{run_dir}: its Slurm job never started nereusd (cancelled or failed while pending?): "
                              f"nothing to resume; submit it again with `nereus-launch submit JOB_YAML --run-dir "
                              f"{run_dir} --overwrite`")
        raise NereusError(f"{run_dir}: not a run directory (no {EVENTS_FILE}; did the job start?)")
    # two resumes at once: the second waits here until the first's nereusd owns the directory,
    # then refuses below, before it moves a summary or touches a process
    launching = LaunchLock(run_dir)
    try:
        return _resume(args, run_dir, launching)
    finally:
        launching.release()


def _resume(args: argparse.Namespace, run_dir: Path, launching: LaunchLock) -> int:
    owner = run_dir_owner(run_dir)
    if owner is not None:
        raise NereusError(f"{run_dir}: nereusd (pid {owner}) is still running this job; nothing to resume")
    try:
        summary = json.loads((run_dir / SUMMARY_FILE).read_text())
    except (OSError, ValueError):   # ValueError: JSON or UTF-8 damage
        summary = None
    # no readable summary: the job died before writing one, or it was damaged: then the journal's
    # last nereusd says how it stopped (a damaged summary of a job that succeeded was resumed)
    status = summary.get("status", "running") if isinstance(summary, dict) else None
    if not isinstance(status, str):
        status = _journalled_status(run_dir)
    if status == "succeeded":
        raise NereusError(f"{run_dir}: the job succeeded; nothing to resume (start a new run)")
    if any(r.get("slurm_job_id") for r in read_jsonl(run_dir / EVENTS_FILE)
           if r.get("event") == Event.NEREUSD_STARTED.value):
        from launcher.submit import submit_resume

        job_id = submit_resume(run_dir)
        _set_aside_summary(run_dir, status)
        print(f"nereus: submitted job {job_id}: it resumes {run_dir} from its latest checkpoint (was {status}); "
              f"watch it with `nereus-launch status {job_id}`")
        return 0
    path = job_file(run_dir)
    try:
        job = load_and_resolve(path)
    except ConfigError as err:
        if path != run_dir / "job.yaml":
            raise
        raise ConfigError(f"{err}\n(the job file the run was started with is gone, and this copy's relative paths "
                          "are read relative to the run directory: restore that file, or make the copy's paths "
                          "absolute)") from None
    check_resume_steps(run_dir, job.config.steps)
    if args.gpus:
        check_gpus()
    recorded = started_job_sha256(run_dir)
    changed = recorded is not None and recorded != job_fingerprint(job)
    if changed:
        print(f"nereus: warning: {path} changed since the run's last nereusd started; resuming with the file as it "
              "is now, from the latest checkpoint (the waiting workers were built from the old one)", file=sys.stderr)
    kept = [] if args.restart or changed else sorted(run_processes(run_dir, ("emu.agent",)))
    if not kept:   # the workers' state in memory needs no checkpoint
        check_resume_checkpoints(run_dir)
        check_resume_models(resume_record(run_dir), job)
    stopped = [] if kept else stop_run_processes(run_dir)
    aside = _set_aside_summary(run_dir, status)
    print(f"nereus: resuming job {job.config.name!r} in {run_dir} (was {status}; job file {path}"
          + (f"; stopped {len(stopped)} leftover process(es)" if stopped else "") + ")")
    if not job.config.adaptation.enabled:   # an adaptive job's launch plan is printed as nereusd journals it
        print(launch_plan_line(job))
    try:
        return supervise(job, path.resolve(), run_dir, gpus=args.gpus, quiet=args.quiet, resume=True,
                         kept_agents=kept, launching=launching)
    finally:   # nereusd wrote no summary (it stopped before it started the job, a full disk): the run's stays
        if aside is not None and not (run_dir / SUMMARY_FILE).exists():
            os.replace(aside, run_dir / SUMMARY_FILE)
