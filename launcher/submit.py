"""``nereus-launch submit | status | grow | shrink | cancel | render``: Nereus jobs on Slurm.

``submit`` validates the job against the site (schema, plan, site ``slurm:``) before it calls
``sbatch``, writes the rendered script and the job's CURVE keys into the run directory, and
prints the Slurm job id and the run directory. A job is named afterwards by its Slurm job id or
its run directory: ``RUN_DIR/slurm.json`` records the main and ``grow`` allocations, and
``$NEREUS_HOME/jobs/<id>.json`` (default ``~/.nereus``) maps ids to run directories.
``status`` asks the running nereusd over the CURVE-secured control plane (plan, pool, step, last
decision) and falls back to ``summary.json`` and ``squeue`` when it is not running.
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

import zmq

from launcher.render import RenderRequest, load_template, render
from nereusd import protocol as P
from nereusd.config.job import load_job
from nereusd.errors import ConfigError, NereusError, SlurmError
from nereusd.config.resolve import resolve_job
from nereusd.journal import (ENDPOINT_FILE, SUMMARY_FILE, check_resume_steps, clear_run_dir, is_simulation_summary,
                             to_json)
from nereusd.daemon.security import KEYS_DIR, init_keys, load_keys, make_client
from nereusd.config.site import SiteConfig, load_site, require_site
from nereusd.plan import MAX_DEVICES
from nereusd.slurm import SlurmClient

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
        "status", help="plan, pool, step, the last step's reward and lengths, and last decision of a job "
                       "(all jobs without JOB)",
        description="Ask a job's nereusd (over its CURVE-secured control plane) for its step, plan, pool and last "
                    "decision; when it is not running, print the run's summary. JOB is a Slurm job id submitted "
                    "from this account or a run directory (a local run's too). Without JOB, list the jobs "
                    "submitted from this account with their Slurm state.")
    p.add_argument("job", nargs="?", help="Slurm job id or run directory")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_status)

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
    if args.time:
        from nereusd.config.site_slurm import _TIME
        if not _TIME.match(args.time):
            raise ConfigError(f"--time: expected MM, MM:SS, HH:MM:SS or D-HH[:MM[:SS]], got {args.time!r}")
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


def resolve_run_dir(job: str) -> Path:
    """A run directory from a Slurm job id (via ``$NEREUS_HOME/jobs``) or a path.

    Raises:
        NereusError: neither a known job id nor a submitted run directory.
    """
    if Path(job).is_dir():
        return Path(job).resolve()
    if not job.isdigit():
        raise NereusError(f"{job!r}: no such run directory (a Slurm job id is a number)")
    entry = _home() / "jobs" / f"{job}.json"
    if entry.is_file():
        return Path(json.loads(entry.read_text())["run_dir"])
    raise NereusError(f"{job!r} is not a job id submitted from here ({entry} not found)")


def ask_nereusd(run_dir: Path, timeout_s: float = 5.0) -> dict[str, Any] | None:
    """nereusd's live status over the control plane, or ``None`` when it does not answer.

    Raises:
        NereusError: the run's ``nereusd.json`` is not a nereusd record (damaged or foreign).
    """
    from launcher.pool_cmd import endpoint_record

    try:
        info = json.loads((run_dir / ENDPOINT_FILE).read_text())
    except (OSError, ValueError):   # ValueError: JSON or UTF-8 damage
        return None
    info = endpoint_record(info, run_dir / ENDPOINT_FILE)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        if info.get("curve"):
            make_client(sock, load_keys(run_dir / KEYS_DIR, "client"))
        sock.connect(info["endpoint"])
        sock.send(P.encode(P.StatusRequest()))
        if not sock.poll(int(timeout_s * 1000)):
            return None
        reply = P.decode(sock.recv())
        return reply.status if isinstance(reply, P.StatusReply) else None
    finally:
        sock.close(0)


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


def cmd_status(args: argparse.Namespace) -> int:
    if not args.job:
        index = _home() / "jobs"
        rows = []
        for entry in sorted(index.glob("*.json")) if index.is_dir() else []:
            rows.append({"job_id": entry.stem, "state": _slurm_states([entry.stem])[0][entry.stem],
                         "run_dir": json.loads(entry.read_text())["run_dir"]})
        print(json.dumps(rows, indent=1) if args.json else
              "\n".join(f"{r['job_id']:>8} {r['state']:<12} {r['run_dir']}" for r in rows)
              or "no Slurm jobs submitted from here (a local run: nereus-launch status RUN_DIR)")
        return 0
    run_dir = resolve_run_dir(args.job)
    if (run_dir / RECORD_FILE).is_file():
        record = _read_record(run_dir)
        slurm, unreachable = _slurm_states([record["job_id"], *record["grow_job_ids"]])
    elif (run_dir / ENDPOINT_FILE).is_file() or (run_dir / SUMMARY_FILE).is_file():
        slurm, unreachable = {}, ""   # a local run (nereus-launch local): no allocation to ask Slurm about
    else:
        raise NereusError(f"{run_dir}: not a Nereus run directory (no {RECORD_FILE}, {ENDPOINT_FILE} or "
                          f"{SUMMARY_FILE}; has the job started?)")
    summary, malformed = None, ""
    if (run_dir / SUMMARY_FILE).is_file():
        try:
            summary = json.loads((run_dir / SUMMARY_FILE).read_text(encoding="utf-8"))
        except (OSError, ValueError, RecursionError) as err:   # UnicodeDecodeError is a ValueError
            malformed = f"{run_dir / SUMMARY_FILE}: unreadable ({type(err).__name__})"
        if summary is not None and not isinstance(summary, dict):
            summary, malformed = None, f"{run_dir / SUMMARY_FILE}: expected a JSON object"
        if is_simulation_summary(summary) and not (run_dir / ENDPOINT_FILE).is_file() \
                and not (run_dir / RECORD_FILE).is_file():
            raise NereusError(f"{run_dir}: the output of nereus-launch simulate, not a job's run directory "
                              f"(its results are in {run_dir / 'table.txt'})")
    ended = isinstance(summary, dict) and summary.get("status") not in (None, "running")
    # an ended job's nereusd is gone: asking it only waits out the timeout (5 s)
    out: dict[str, Any] = {"run_dir": str(run_dir), "slurm": slurm, "slurm_error": unreachable or None,
                           "nereusd": None if ended else ask_nereusd(run_dir), "summary": summary}
    if args.json:   # strict JSON: a summary's NaN reads back as Python's NaN, which json.dumps writes bare
        print(to_json(out, indent=1))
        return 0
    print(f"run {run_dir}: " + ("Slurm " + ", ".join(f"{j} {s}" for j, s in slurm.items()) if slurm else "local"))
    if unreachable:
        print(f"nereus: Slurm did not answer, so the state below is the run directory's ({unreachable})")
    live = out["nereusd"]
    if live:
        plan = ", ".join(f"{ms} tp{c['tp']} pp{c['pp']} dp{c['dp']}" for ms, c in live["plan"].items())
        done = ("no step done yet" if live["step"] is None   # start-up: workers, engines, step 0
                else f"{live['step'] + 1} steps done (last: step {live['step']})")
        print(f"{done} of {live['steps']} ({live['state']}); plan: {plan or 'not formed yet'}")
        for node, agent in sorted(live["pool"].items()):
            where = f" (allocation {agent['slurm_job_id']})" if agent.get("slurm_job_id") else ""
            print(f"  node {node}: devices {agent['devices']}{where}")
        if live.get("joining"):
            j = live["joining"]
            waiting = f"; devices {j['waiting']} wait for the next join" if j.get("waiting") else ""
            print(f"  joining in the background: devices {j['devices']} ({j['phase']}, {j['elapsed_s']:.0f} s so far)"
                  + waiting)
        step = live.get("last_metrics") or {}
        if step.get("response_length_mean") is not None:
            cap = f" (cap {step['max_new_tokens']})" if step.get("max_new_tokens") is not None else ""
            print(f"last step: reward {step['reward_mean']:.2f}, response length {step['response_length_mean']:.1f} "
                  f"mean, {step.get('response_length_max')} longest{cap}, {step['step_latency_s']:.1f} s")
        if live["last_decision"]:
            print(f"last decision: {live['last_decision']['reason']} -> {live['last_decision']['verdict']}")
    elif ended:
        print(_finished_lines(out["summary"]))
    else:
        print("nereusd is not answering (starting, or gone); see the logs in " + str(run_dir / "logs")
              + (f"; {malformed}" if malformed else ""))
    return 0


def _slurm_states(job_ids: list[str]) -> tuple[dict[str, str], str]:
    """``({job id: squeue state, or GONE once Slurm has forgotten it}, "")``; where squeue fails
    (Slurm down or unreachable from here) every state is ``UNKNOWN`` and the second item says why
    (the run directory still tells how the job went)."""
    client = SlurmClient()
    try:
        return {jid: (info.state if (info := client.job(jid)) else "GONE") for jid in job_ids}, ""
    except SlurmError as err:
        return {jid: "UNKNOWN" for jid in job_ids}, str(err)[:300]


def _cap_text(caps: list[float]) -> str:
    """`` (cap 24)``, or `` (cap 8 → 24)`` where a length curriculum raised the cap."""
    first, last = (int(c) for c in caps)
    return f" (cap {last})" if first == last else f" (cap {first} → {last})"


def _finished_lines(s: dict) -> str:
    """What ``status`` prints for a job that has ended, from its ``summary.json``: the outcome,
    and where the summary has them (each figure a finite number, else its line is left out),
    reward, response length and its cap, held-out pass@1, switches and the final plan (``summarise_metrics``
    in ``nereusd/daemon/app.py`` writes them)."""
    def num(*keys: str) -> list[float] | None:
        values = [s.get(k) for k in keys]
        ok = all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in values)
        return values if ok else None

    wall, steps = num("wall_time_s"), num("steps_completed")
    lines = [f"finished: {s.get('status')} after {int(steps[0]) if steps else 0} steps"
             + (f" in {wall[0]:.0f} s" if wall else "") + (f": {s['error']}" if s.get("error") else "")]
    reward, best, length = (num("reward_first_10pct", "reward_last_10pct"), num("reward_best", "reward_best_step"),
                            num("response_length_first_10pct", "response_length_last_10pct"))
    caps = num("max_new_tokens_first", "max_new_tokens_last")
    if reward:
        lines.append(f"reward {reward[0]:.2f} → {reward[1]:.2f}"
                     + (f" (best {best[0]:.2f} at step {best[1]:.0f})" if best else "")
                     + (f"; response length {length[0]:.1f} → {length[1]:.1f} tokens" if length else "")
                     + (_cap_text(caps) if length and caps else ""))
    passed = num("eval_pass_at_1_first", "eval_pass_at_1_last")
    if passed:
        lines.append(f"held-out pass@1 {passed[0]:.2f} → {passed[1]:.2f}")
    switches, restarts = num("switches"), num("restarts")
    if switches:
        lines.append(f"layout switches: {switches[0]:.0f}"
                     + (f" (of which {restarts[0]:.0f} checkpoint/restart(s))" if restarts and restarts[0] else ""))
    plan = s.get("final_plan")
    if isinstance(plan, dict) and plan and all(isinstance(c, dict) for c in plan.values()):
        lines.append("final plan: " + ", ".join(f"{ms} tp{c.get('tp')} pp{c.get('pp')} dp{c.get('dp')}"
                                                for ms, c in plan.items()))
    return "\n".join(lines)


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
    if old is not None and old.state in ("RUNNING", "PENDING", "CONFIGURING", "COMPLETING", "SUSPENDED"):
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
    for job_id in [*record["grow_job_ids"], record["job_id"]]:
        client.cancel(job_id)
    print(f"nereus: cancelled job {record['job_id']}" +
          (f" and grow allocations {record['grow_job_ids']}" if record["grow_job_ids"] else ""))
    return 0
