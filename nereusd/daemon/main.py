"""``nereusd``: the controller daemon's entry point.

It validates the job, binds the control plane, serves the rendezvous store, waits for agents to
register the job's devices, starts the workers, runs the RL driver and writes the run
directory (``metrics.jsonl``, ``events.jsonl``, ``summary.json``, ``checkpoints/``). On
SIGTERM/SIGINT or any failure it stops every agent and worker before exiting. The objects are
built in :mod:`nereusd.daemon.app` (the composition root); this module is the command line.

Under Slurm (``--slurm-job-id``) it follows the allocation (:class:`nereusd.slurm.AllocationWatcher`)
and reacts to pool changes through :class:`nereusd.daemon.pool.PoolController`; ``SIGUSR2`` (the
preemption warning) makes it checkpoint at the next step boundary and stop. A control plane
reachable from other hosts needs the job's CURVE keys (``--keys-dir``).
"""

from __future__ import annotations

import argparse
import logging
import math
import signal
import sys

from nereusd.checkpoints import free_space_note
from nereusd.daemon.app import STOP, Daemon
from nereusd.errors import NereusError

log = logging.getLogger(__name__)


_on_signal = STOP.handler


def _seconds(text: str) -> float:
    """A positive, finite number of seconds (NaN would make a deadline that never passes)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"expected a positive, finite number of seconds, got {text!r}")
    return value


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
    parser.add_argument("--register-timeout-s", type=_seconds, default=120.0, metavar="S",
                        help="how long to wait for agents to register the job's devices (default 120)")
    parser.add_argument("--heartbeat-timeout-s", type=_seconds, default=15.0, metavar="S",
                        help="an agent silent this long leaves the pool (default 15)")
    parser.add_argument("--advertise-host", default=None,
                        help="address agents reach nereusd on, written to nereusd.json (default: the bound address)")
    parser.add_argument("--keys-dir", default=None, help="the job's CURVE keys (RUN_DIR/keys); required unless --bind "
                        "is a loopback address")
    parser.add_argument("--slurm-job-id", default=None, help="follow this Slurm allocation (node DOWN/DRAIN, shrink)")
    parser.add_argument("--nodes", type=int, default=None,
                        help="nodes of the launch allocation (journalled; with the site's devices per node it "
                        "sets the default pool.max_devices)")
    parser.add_argument("--resume", action="store_true",
                        help="continue the run in RUN_DIR after nereusd crashed: on the workers its agents kept "
                        "(their state in memory, when it is where the journal is), else from its latest committed "
                        "checkpoint (steps after it run again and leave metrics.jsonl first), or from step 0")
    parser.add_argument("--metrics-host", default="127.0.0.1",
                        help="address of the Prometheus endpoint (default 127.0.0.1; it has no authentication)")
    parser.add_argument("--metrics-port", type=int, default=0, metavar="PORT",
                        help="port of the Prometheus endpoint /metrics (default 0: a free port, written to "
                        "nereusd.json)")
    parser.add_argument("--no-metrics", action="store_true", help="serve no Prometheus endpoint")
    parser.add_argument("--no-tensorboard", action="store_true", help="write no TensorBoard scalars")
    return parser


def run(args: argparse.Namespace) -> int:
    """Build the daemon (:class:`nereusd.daemon.app.Daemon`, the composition root) and run the job.

    Raises:
        NereusError: the job is invalid (nothing was started).
    """
    return Daemon(args).run()


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
    except OSError as err:   # the run directory's storage (full, read-only) before the job started: said, not a traceback
        where = err.filename or args.run_dir
        message = f"cannot write {where}: {err.strerror or err}{free_space_note(where)}"
        log.error("%s", message)
        print(f"nereusd: error: {message}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
