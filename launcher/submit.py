"""``nereus-launch submit | grow | shrink | cancel | render``: Nereus jobs on Slurm.

``submit`` validates the job against the site (schema, plan, site ``slurm:``) before it calls
``sbatch``, writes the rendered script and the job's CURVE keys into the run directory, and
prints the Slurm job id and the run directory. A job is named afterwards by its Slurm job id or
its run directory: ``RUN_DIR/slurm.json`` records the main and ``grow`` allocations, and
``$NEREUS_HOME/jobs/<id>.json`` (default ``~/.nereus``) maps ids to run directories.
``status`` (:mod:`launcher.status_cmd`) reads both.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from launcher.cli import run_directory
from launcher.render import RenderRequest, load_template, render
from nereusd.config.job import load_job
from nereusd.errors import ConfigError, NereusError, SlurmError
from nereusd.config.resolve import resolve_job
from nereusd.journal import ENDPOINT_FILE, check_resume_steps
from nereusd.rundir import clear_run_dir
from nereusd.daemon.security import init_keys
from nereusd.config.site import SiteConfig, load_site, require_site
from nereusd.plan import MAX_DEVICES
from nereusd.slurm import ACTIVE_STATES, SlurmClient

RECORD_FILE = "slurm.json"


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "submit", help="validate a job and submit it to Slurm (sbatch)",
        description="Validate a job against a site (schema, launch plan, the site's slurm: section), render the "
                    "batch script, write it and the job's CURVE keys into the run directory and submit it with "
                    "sbatch. Prints the Slurm job id and the run directory; name the job afterwards by either. "
                    "Nothing is left behind when sbatch refuses the job.")
    _job_args(p)
    p.add_argument("--run-dir", help="run directory on a shared file system (default: runs/<name>-<timestamp>)")
    p.add_argument("--overwrite", action="store_true",
                        help="replace an existing run directory (one that holds only what a run writes)")
    p.set_defaults(func=cmd_submit)

    p = subparsers.add_parser(
        "render", help="print the batch script submit would use, without submitting",
        description="Validate a job as submit does and print the batch script it would submit (or, with --grow, "
                    "the script of a grow allocation), without calling Slurm or writing anything.")
    _job_args(p)
    p.add_argument("--run-dir", default="/path/to/run", help="run directory to render into the script")
    p.add_argument("--grow", action="store_true", help="render the script of a grow allocation")
    p.set_defaults(func=cmd_render)

    p = subparsers.add_parser(
        "grow", help="add nodes: a new allocation whose agents join the running nereusd",
        description="Submit a second Slurm allocation of --nodes nodes whose agents join the running job's "
                    "nereusd; the controller then re-plans onto the larger pool. The job must be running.")
    p.add_argument("job", help="Slurm job id or run directory")
    p.add_argument("--nodes", type=int, required=True, help="nodes to add")
    p.set_defaults(func=cmd_grow)

    p = subparsers.add_parser(
        "shrink", help="give nodes back to Slurm",
        description="Give nodes back while the job runs: --nodes N keeps N nodes of the main allocation "
                    "(scontrol update NumNodes), --grow-job ID cancels one grow allocation. The devices that "
                    "leave are drained first, so no state is lost.")
    p.add_argument("job", help="Slurm job id or run directory")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--nodes", type=int, help="keep this many nodes of the main allocation (scontrol update NumNodes)")
    g.add_argument("--grow-job", help="cancel this grow allocation")
    p.set_defaults(func=cmd_shrink)

    p = subparsers.add_parser(
        "cancel", help="cancel a job and all its grow allocations (scancel)",
        description="Cancel a submitted job's main allocation and every grow allocation (scancel). The run "
                    "directory and its checkpoints stay; 'resume' continues from the latest checkpoint.")
    p.add_argument("job", help="Slurm job id or run directory")
    p.set_defaults(func=cmd_cancel)


def _job_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("job_yaml", help="job YAML")
    p.add_argument("--site", help="site name or YAML (default: the job's site:)")
    p.add_argument("--nodes", type=int, help="nodes to allocate (default: enough for the job's devices)")
    p.add_argument("--account", default="", help="override the site's slurm.account")
    p.add_argument("--time", default="", help="override the site's slurm.time_limit")


# ------------------------------------------------------------------------------- helpers
def _prepare(args: argparse.Namespace, run_dir: str, mode: str = "main") -> tuple[SiteConfig, RenderRequest]:
    """Validate job and site together; everything a user can get wrong fails here."""
    job_path = Path(args.job_yaml).resolve()
    job = load_job(job_path)
    require_site(args.site or job.site, "--site" if args.site else f"{job_path}: site")
    site = load_site(args.site or job.site)
    if job.memory_gib and site.name != load_site(job.site).name:
        print(f"nereus: warning: {job_path.name}: memory_gib {job.memory_gib:g} GiB (written for site {job.site!r}) "
              f"overrides site {site.name}'s {site.device.memory_gib:g} GiB per device", file=sys.stderr)
    if site.slurm is None:
        raise ConfigError(f"{Path(site.source).name}: no slurm: section; site {site.name!r} cannot be submitted to")
    devices = job.devices or site.total_devices
    if args.nodes is not None and not 1 <= args.nodes <= MAX_DEVICES // site.devices_per_node:
        raise ConfigError(f"--nodes: expected 1..{MAX_DEVICES // site.devices_per_node:,} nodes of "
                          f"{site.devices_per_node} devices (at most {MAX_DEVICES:,} devices), got {args.nodes}")
    nodes = args.nodes or max(1, math.ceil(devices / site.devices_per_node))
    if args.account:
        from nereusd.config.site_slurm import _WORD
        if not _WORD.match(args.account):   # written into '#SBATCH --account=...' as the site's would be
            raise ConfigError(f"--account: expected letters, digits and ._+- only, got {args.account!r}")
    sized = site.with_nodes(nodes)
    resolved = resolve_job(job, source=job_path.name, base_dir=job_path.parent, site_devices=sized.total_devices,
                           site_memory_bytes=sized.device_memory_bytes, site_name=sized.name,
                           device_kind=sized.device_kind)
    if mode == "main":   # a plan that runs, as nereusd will choose it (a resume continues a journalled one)
        from nereusd.control.problem import choose_launch

        choice = choose_launch(resolved, sized, resolved.max_prompt_tokens)   # ConfigError: no plan runs
        if choice.warning:
            print(f"nereus: warning: {job_path.name}: {choice.warning}", file=sys.stderr)
    if args.time:
        from nereusd.config.site_slurm import _TIME, check_preempt_signal
        if not _TIME.match(args.time):
            raise ConfigError(f"--time: expected MM, MM:SS, HH:MM:SS or D-HH[:MM[:SS]], got {args.time!r}")
        check_preempt_signal(site.slurm.preempt_signal_s, args.time,
                             f"--time {args.time} with site {site.name!r}'s slurm.preempt_signal_s")
    req = RenderRequest(job_path=str(job_path), run_dir=run_dir, job_name=job.name, nodes=nodes,
                        python=sys.executable, mode=mode, cpu_memory_bytes=resolved.device_memory_bytes,
                        account=args.account, time_limit=args.time)
    return sized, req


def _home() -> Path:
    return Path(os.environ.get("NEREUS_HOME") or Path.home() / ".nereus")


def _read_record(run_dir: Path) -> dict[str, Any]:
    try:
        return json.loads((run_dir / RECORD_FILE).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise NereusError(f"{run_dir / RECORD_FILE}: not a submitted Nereus run directory ({err})") from None


def _write_record(run_dir: Path, record: dict[str, Any]) -> None:
    tmp = run_dir / (RECORD_FILE + ".tmp")
    tmp.write_text(json.dumps(record, indent=1))
    os.replace(tmp, run_dir / RECORD_FILE)
    index = _home() / "jobs"
    index.mkdir(parents=True, exist_ok=True)
    (index / f"{record['job_id']}.json").write_text(json.dumps({"run_dir": str(run_dir)}))
    for grow_id in record["grow_job_ids"]:   # `status GROW_ID` too (it was "not a job id submitted from here")
        (index / f"{grow_id}.json").write_text(json.dumps({"run_dir": str(run_dir), "grow_of": record["job_id"]}))


def resolve_run_dir(job: str) -> Path:
    """A run directory from a Slurm job id (via ``$NEREUS_HOME/jobs``) or a path.

    Raises:
        NereusError: neither a known job id nor a submitted run directory.
    """
    if not job.isdigit():
        return run_directory(job)
    if Path(job).is_dir():
        return Path(job).resolve()
    entry = _home() / "jobs" / f"{job}.json"
    if entry.is_file():
        return Path(json.loads(entry.read_text())["run_dir"])
    raise NereusError(f"{job!r} is not a job id submitted from here ({entry} not found)")


# ------------------------------------------------------------------------------- commands
def cmd_render(args: argparse.Namespace) -> int:
    site, req = _prepare(args, str(Path(args.run_dir).resolve()), "grow" if args.grow else "main")
    sys.stdout.write(render(load_template(), site, req))
    return 0


def cmd_submit(args: argparse.Namespace) -> int:
    name = load_job(Path(args.job_yaml)).name
    run_dir = Path(args.run_dir or Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    site, req = _prepare(args, str(run_dir))
    script = render(load_template(), site, req)
    existed = run_dir.exists()
    clear_run_dir(run_dir, args.overwrite)
    init_keys(run_dir)
    (run_dir / "nereus.sbatch").write_text(script)
    try:
        job_id = SlurmClient().sbatch(script)
    except SlurmError as err:
        if err.refused:
            # sbatch said no, so nothing is queued: leave no half-made run directory behind, so
            # that the same command can be run again once the cause is fixed (without
            # --overwrite). A timeout or an unreadable answer may have queued the job, whose
            # logs, keys and script live here: then everything stays.
            if existed:   # the user's directory (emptied by --overwrite): keep it, with its mode, empty
                for child in run_dir.iterdir():
                    shutil.rmtree(child) if child.is_dir() else child.unlink()
            else:
                shutil.rmtree(run_dir, ignore_errors=True)
        else:
            err.args = (f"{err} -- the job may have been queued: check squeue before submitting again; its run "
                        f"directory {run_dir} is kept",)
        raise
    _write_record(run_dir, {"job_id": job_id, "grow_job_ids": [], "site": site.source, "job": req.job_path,
                            "nodes": req.nodes, "submitted_s": time.time()})
    print(f"nereus: submitted job {job_id} ({req.nodes} node(s) on site {site.name}); run directory {run_dir}")
    print(f"nereus: watch it with `nereus-launch status {job_id}`; logs in {run_dir / 'logs'}")
    return 0


def cmd_grow(args: argparse.Namespace) -> int:
    run_dir = resolve_run_dir(args.job)
    record = _read_record(run_dir)
    if not (run_dir / ENDPOINT_FILE).is_file():
        raise NereusError(f"{run_dir}: nereusd has not started yet (no nereusd.json); grow a running job")
    client = SlurmClient()
    _running(client, record, "grows")   # a grow allocation's agents would wait for a nereusd that is gone
    ns = argparse.Namespace(job_yaml=record["job"], site=record["site"], nodes=args.nodes, account="", time="")
    site, req = _prepare(ns, str(run_dir), "grow")
    job_id = client.sbatch(render(load_template(), site, req))
    record["grow_job_ids"].append(job_id)
    _write_record(run_dir, record)
    print(f"nereus: grow allocation {job_id} ({args.nodes} node(s)) submitted; its agents join nereusd of "
          f"job {record['job_id']}")
    return 0


def _running(client: SlurmClient, record: dict[str, Any], verb: str):
    """The main allocation of ``record`` as squeue sees it.

    Raises:
        NereusError: it is not running (``only a running job <verb>``).
    """
    info = client.job(record["job_id"])
    if info is None or info.state != "RUNNING":
        raise NereusError(f"job {record['job_id']} is {info.state if info else 'gone'}; only a running job {verb}")
    return info


def submit_resume(run_dir: Path) -> str:
    """Submit the continuation of a Slurm run that stopped (time limit, preemption, a crash):
    the same job, site and node count, in mode ``resume`` (nereusd ``--resume`` continues from the
    latest checkpoint, on whatever nodes the new allocation has). Returns the new job id.

    Raises:
        NereusError: not a submitted run directory, or its allocation still runs.
    """
    record = _read_record(run_dir)
    client = SlurmClient()
    old = client.job(record["job_id"])
    if old is not None and old.state in ACTIVE_STATES:
        raise NereusError(f"{run_dir}: Slurm job {record['job_id']} is still {old.state}; cancel it or let it end")
    ns = argparse.Namespace(job_yaml=record["job"], site=record["site"], nodes=record["nodes"], account="", time="")
    site, req = _prepare(ns, str(run_dir), "resume")
    check_resume_steps(run_dir, load_job(Path(record["job"])).steps)
    script = render(load_template(), site, req)
    (run_dir / "nereus.sbatch").write_text(script)
    job_id = client.sbatch(script)
    record.setdefault("previous_job_ids", []).append(record["job_id"])
    record.update(job_id=job_id, grow_job_ids=[], submitted_s=time.time())
    _write_record(run_dir, record)
    return job_id


def cmd_shrink(args: argparse.Namespace) -> int:
    run_dir = resolve_run_dir(args.job)
    record = _read_record(run_dir)
    client = SlurmClient()
    if args.grow_job:
        if args.grow_job not in record["grow_job_ids"]:
            raise NereusError(f"{args.grow_job} is not a grow allocation of job {record['job_id']} "
                              f"(known: {record['grow_job_ids']})")
        client.cancel(args.grow_job)
        print(f"nereus: cancelled grow allocation {args.grow_job}; its nodes leave the pool")
        return 0
    info = _running(client, record, "shrinks")
    if not 1 <= args.nodes < info.num_nodes:
        raise NereusError(f"--nodes: expected 1..{info.num_nodes - 1} (the job has {info.num_nodes}), got {args.nodes}")
    client.resize(record["job_id"], args.nodes)
    print(f"nereus: job {record['job_id']} shrinks from {info.num_nodes} to {args.nodes} node(s)")
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    run_dir = resolve_run_dir(args.job)
    record = _read_record(run_dir)
    client = SlurmClient()
    states = {j: (info.state if (info := client.job(j)) else "GONE")
              for j in [*record["grow_job_ids"], record["job_id"]]}
    active = [j for j, state in states.items() if state in ACTIVE_STATES]
    if not active:   # it said "cancelled" of a job that had ended (an adversarial trial on Slurm, 2026-12-07)
        print(f"nereus: job {record['job_id']} has already ended ({states[record['job_id']]}); nothing to cancel")
        return 0
    for job_id in active:
        client.cancel(job_id)
    grown = [j for j in active if j != record["job_id"]]
    what = ([f"job {record['job_id']}"] if record["job_id"] in active else []) + (
        [f"grow allocations {grown}"] if grown else [])
    print("nereus: cancelled " + " and ".join(what))
    return 0
