"""``nereusd``: the controller daemon's entry point.

It validates the job, binds the control plane, serves the rendezvous store, waits for agents to
register the job's devices, starts the workers, runs the RL driver and writes the run
directory (``metrics.jsonl``, ``events.jsonl``, ``summary.json``, ``checkpoints/``). On
SIGTERM/SIGINT or any failure it stops every agent and worker before exiting.

Under Slurm (``--slurm-job-id``) it follows the allocation (:class:`nereusd.slurm.AllocationWatcher`)
and reacts to pool changes through :class:`nereusd.daemon.pool.PoolController`; ``SIGUSR2`` (the
preemption warning) makes it checkpoint at the next step boundary and stop. A control plane
reachable from other hosts needs the job's CURVE keys (``--keys-dir``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
import traceback
from pathlib import Path

from nereusd.control.controller import controller_for_job, launch_plan
from nereusd.daemon.control_plane import ControlPlane
from nereusd.rl.driver import RLDriver
from nereusd.rl.record import StepRecord
from nereusd.daemon.live import LiveAdaptation
from nereusd.errors import NereusError, WorkerError
from nereusd.config.resolve import load_and_resolve
from nereusd.journal import Event, Journal, METRICS_FILE, read_jsonl
from nereusd.planner.search import Infeasible
from nereusd.daemon.pool import PoolController, PoolStop
from nereusd.daemon.rendezvous import RendezvousStore
from nereusd.daemon.security import load_keys
from nereusd.config.site import load_site
from nereusd.slurm import AllocationWatcher, SlurmClient

log = logging.getLogger(__name__)

ENDPOINT_FILE = "nereusd.json"


class _Terminated(Exception):
    pass


def _on_signal(signum: int, _frame: object) -> None:
    raise _Terminated(signal.Signals(signum).name)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nereusd",
        description="Nereus controller daemon: runs one RL post-training job across the agents that register.",
    )
    parser.add_argument("job", help="job YAML")
    parser.add_argument("--run-dir", required=True, help="directory for metrics, events, logs and checkpoints")
    parser.add_argument("--bind", default="tcp://127.0.0.1:0",
                        help="control-plane endpoint agents connect to (default tcp://127.0.0.1:0, a free port)")
    parser.add_argument("--store-host", default="127.0.0.1", help="address workers reach the rendezvous store on")
    parser.add_argument("--register-timeout-s", type=float, default=120.0,
                        help="how long to wait for agents to register the job's devices")
    parser.add_argument("--heartbeat-timeout-s", type=float, default=15.0)
    parser.add_argument("--advertise-host", default=None,
                        help="address agents reach nereusd on, written to nereusd.json (default: the bound address)")
    parser.add_argument("--keys-dir", default=None, help="the job's CURVE keys (RUN_DIR/keys); required unless --bind "
                        "is a loopback address")
    parser.add_argument("--slurm-job-id", default=None, help="follow this Slurm allocation (node DOWN/DRAIN, shrink)")
    parser.add_argument("--nodes", type=int, default=None, help="nodes of the allocation (journal only)")
    return parser


def _loopback(bind: str) -> bool:
    return bind.startswith(("tcp://127.", "tcp://localhost:", "ipc://", "inproc://"))


def run(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    job = load_and_resolve(args.job)
    keys = load_keys(args.keys_dir, "server") if args.keys_dir else None
    if keys is None and not _loopback(args.bind):
        raise NereusError(f"--bind {args.bind} is reachable from other hosts: pass --keys-dir with the job's CURVE keys")
    journal = Journal(run_dir)
    controller = PoolController(journal, run_dir, job.config.name, job.config.steps, args.slurm_job_id)
    adaptive = job.config.adaptation.enabled
    controller.live = adaptive
    live: list[LiveAdaptation] = []   # set once the world is formed

    def on_pool_request(remove: int) -> dict:
        if not live:
            return {"error": "live adaptation is off or the world is not formed yet"}
        return live[0].request_remove(remove)

    control = ControlPlane(args.bind, heartbeat_timeout_s=args.heartbeat_timeout_s, on_event=journal.event,
                           keys=keys, on_pool_change=controller.on_pool_change, status=controller.status,
                           on_pool_request=on_pool_request)
    controller.control = control
    endpoint = control.endpoint
    if args.advertise_host:
        endpoint = f"tcp://{args.advertise_host}:{endpoint.rsplit(':', 1)[1]}"
    signal.signal(signal.SIGUSR2, lambda signum, frame: controller.request_preemption("SIGUSR2"))
    watcher = None
    if args.slurm_job_id:
        watcher = AllocationWatcher(SlurmClient(), [args.slurm_job_id],
                                    on_event=lambda ev: control.call_soon(lambda: controller.on_slurm_event(ev)))
        controller.watcher = watcher
        watcher.start()
    store = RendezvousStore(args.store_host)
    tmp = run_dir / (ENDPOINT_FILE + ".tmp")
    tmp.write_text(json.dumps({"endpoint": endpoint, "pid": os.getpid(), "store": f"{store.host}:{store.port}",
                               "curve": keys is not None, "slurm_job_id": args.slurm_job_id,
                               "device_memory_bytes": job.device_memory_bytes}))
    os.replace(tmp, run_dir / ENDPOINT_FILE)
    journal.event(Event.NEREUSD_STARTED, {"endpoint": endpoint, "job": job.config.name,
                                      "algorithm": job.config.algorithm.value, "devices": job.devices,
                                      "curve": keys is not None, "adaptive": adaptive,
                                      "slurm_job_id": args.slurm_job_id, "nodes": args.nodes})
    started = time.time()
    summary: dict = {"job": job.config.name, "algorithm": job.config.algorithm.value, "status": "running"}
    code = 1
    try:
        site = load_site(job.config.site)
        driver = RLDriver(job, control, journal, devices_per_node=site.devices_per_node)
        why = "the job's plan"
        if adaptive and "plan" not in job.config.model_fields_set:
            try:
                chosen = launch_plan(job, site, driver.prompt_length)
                driver.plan, why = chosen.plan, "planner"
                journal.event(Event.LAUNCH_PLAN, {"plan": chosen.plan.to_dict(), "source": why,
                                              "predicted_step_latency_s": chosen.predicted_step_latency_s,
                                              "response_length": job.config.adaptation.launch_response_length
                                              or job.config.rollout.max_new_tokens})
            except Infeasible as err:   # run the default plan: the workers say what does not fit
                why = f"the job's default plan (the planner found none: {err})"
        if why != "planner":
            journal.event(Event.LAUNCH_PLAN, {"plan": driver.plan.to_dict(), "source": why})
        world = control.wait_for_devices(job.devices, args.register_timeout_s)
        control.spawn_workers(generation=store.generation, world=world, store_host=store.host,
                              store_port=store.port, memory_capacity_bytes=job.device_memory_bytes,
                              run_dir=str(run_dir.resolve()))
        journal.event(Event.WORLD_FORMED, {"generation": store.generation, "devices": world})
        controller.world_formed(driver.plan.to_dict(), world)
        if adaptive:
            decisions = controller_for_job(job, site, driver.plan, driver.prompt_length, pool=tuple(world))
            live.append(LiveAdaptation(job, decisions, driver, control, store, journal, run_dir, world))

        def on_step(record: StepRecord) -> None:
            controller.after_step(record, driver.save_checkpoint)
            if live:
                live[0].at_boundary(record)
                controller.world_formed(driver.plan.to_dict(), live[0].world)
                controller.last_decision = live[0].last_decision or controller.last_decision

        def on_failure(err: Exception) -> bool:
            if not live[0].recover(err):
                return False
            controller.recovered(driver.plan.to_dict(), live[0].world)
            return True

        driver.on_step = on_step
        if live:
            driver.on_failure = on_failure
        records = driver.run()
        summary.update(status="succeeded", steps=len(records))
        code = 0
    except PoolStop as err:
        summary.update(status="preempted", error=str(err), error_kind="Preempted")
        journal.event(Event.JOB_PREEMPTED, {"reason": str(err)})
        log.warning("job stopped: %s", err)
        code = 0
    except WorkerError as err:
        pool_reason = controller.explain_failure(err)
        kind = "PoolShrunk" if pool_reason else (err.error_kind or "WorkerError")
        message = pool_reason or str(err)
        summary.update(status="stopped" if pool_reason else "failed", error=message, error_kind=kind)
        journal.event(Event.JOB_STOPPED if pool_reason else "job_failed", {"error": message, "error_kind": kind})
        log.error("job %s: %s", summary["status"], message)
    except NereusError as err:
        summary.update(status="failed", error=str(err), error_kind=type(err).__name__)
        journal.event(Event.JOB_FAILED, {"error": str(err), "error_kind": type(err).__name__})
        log.error("job failed: %s", err)
    except _Terminated as err:
        summary.update(status="interrupted", error=f"nereusd received {err}")
        journal.event(Event.JOB_INTERRUPTED, {"signal": str(err)})
        code = 130
    except Exception as err:  # noqa: BLE001 - a bug in nereusd: record it as a failure, then stop everything
        log.exception("nereusd crashed")
        summary.update(status="failed", error=f"nereusd crashed: {type(err).__name__}: {err}",
                       error_kind=type(err).__name__)
        journal.event(Event.JOB_FAILED, {"error": summary["error"], "error_kind": type(err).__name__,
                                     "traceback": traceback.format_exc(limit=20)})
    finally:
        # the agents and workers stop first: nothing below may leave them running
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        if watcher is not None:
            watcher.stop()
        control.shutdown_agents(summary["status"])
        summary["wall_time_s"] = round(time.time() - started, 3)
        if live:
            summary.update(switches=live[0].switches, restarts=live[0].restarts, lost_steps=live[0].lost_steps)
        try:
            _summarise_metrics(run_dir, summary)
        except Exception as err:  # noqa: BLE001 - the summary is still written, with why its figures are missing
            log.exception("cannot summarise %s", run_dir / METRICS_FILE)
            summary["summary_error"] = f"{type(err).__name__}: {err}"
        journal.summary(summary)
        journal.event(Event.NEREUSD_STOPPED, {"status": summary["status"]})
        journal.close()
        control.close()
    return code


def _summarise_metrics(run_dir: Path, summary: dict) -> None:
    records = read_jsonl(run_dir / METRICS_FILE)
    if not records:
        return
    k = max(1, len(records) // 10)
    first, last = records[:k], records[-k:]

    def mean(rs: list, key: str) -> float:
        return sum(r[key] for r in rs) / len(rs)

    summary.update(
        steps_completed=len(records),
        reward_first_10pct=mean(first, "reward_mean"), reward_last_10pct=mean(last, "reward_mean"),
        response_length_first_10pct=mean(first, "response_length_mean"),
        response_length_last_10pct=mean(last, "response_length_mean"),
        mean_step_latency_s=mean(records, "step_latency_s"),
        final_plan=records[-1]["plan"],
    )
    summary["response_length_growth"] = summary["response_length_last_10pct"] / max(
        summary["response_length_first_10pct"], 1e-9)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s nereusd %(name)s: %(message)s")
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    try:
        return run(args)
    except NereusError as err:  # invalid job: nothing started yet
        log.error("%s", err)
        print(f"nereusd: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
