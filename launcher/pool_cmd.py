"""``nereus-launch pool RUN_DIR --remove N | --add N``: change the device pool of a running local job.

``--remove N`` asks nereusd (over the control plane, like ``status``) to release ``N`` devices at
the next safe boundary: the plan moves off them, their workers are stopped, and the survivors
re-form the world. ``--add N`` starts another ``nereus-agent`` with ``N`` virtual devices that
registers with the job's nereusd; at the next safe boundary their workers join the world and
the job re-plans: payback admission uses them where that repays the transition, else they
stay spares until a later replan does. Both are journalled in ``RUN_DIR/events.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import time
from pathlib import Path

import psutil
import zmq

from launcher.cli import run_directory
from nereusd import protocol as P
from nereusd.errors import NereusError
from nereusd.journal import ENDPOINT_FILE
from nereusd.daemon.local_agents import agent_log_path, start_local_agent, wait_registered
from nereusd.daemon.security import KEYS_DIR, load_keys, make_client


REGISTER_WAIT_S = 60.0
"""How long ``--add`` waits for its agent to register with nereusd (it starts in a few seconds)."""


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("pool", help="remove or add devices of a running local job",
                              description="Change the device pool of a running local job (nereus-launch local; "
                                          "on Slurm use grow/shrink). Changes take effect at the next safe "
                                          "boundary and are journalled in RUN_DIR/events.jsonl.")
    p.add_argument("run_dir", help="the job's run directory")
    group = p.add_mutually_exclusive_group(required=True)
    group.add_argument("--remove", type=int, metavar="N", help="devices to release at the next safe boundary")
    group.add_argument("--add", type=int, metavar="N",
                       help="virtual devices to add: starts a new local agent and waits (up to 60 s) until it "
                            "registered with nereusd; an agent that exits or does not register is reported")
    p.add_argument("--timeout-s", type=_timeout_s, default=10.0,
                   help="how long to wait for nereusd's answer, 0.5 to 3600 s (default: %(default)s)")
    p.set_defaults(func=run)


def _timeout_s(text: str) -> float:
    """``--timeout-s``: seconds, finite, in [0.5, 3600] (checked before anything is sent: a shorter
    wait gave up while nereusd still applied the request)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not (math.isfinite(value) and 0.5 <= value <= 3600):
        raise argparse.ArgumentTypeError(f"expected seconds in [0.5, 3600], got {text!r}")
    return value


def _endpoint(run_dir: Path) -> dict:
    """The running job's ``nereusd.json``.

    Raises:
        NereusError: no such file, the job has finished, or its nereusd process is gone.
    """
    try:
        info = json.loads((run_dir / ENDPOINT_FILE).read_text())
    except (OSError, ValueError) as err:   # ValueError: JSON or UTF-8 damage
        raise NereusError(f"{run_dir}: no running nereusd ({err})") from None
    info = endpoint_record(info, run_dir / ENDPOINT_FILE)
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        summary = {}
    status = summary.get("status") if isinstance(summary, dict) else None
    if status not in (None, "running"):
        raise NereusError(f"{run_dir}: the job has ended (status {status}); its pool cannot change")
    pid = info.get("pid")
    if pid is not None and not psutil.pid_exists(pid):
        raise NereusError(f"{run_dir}: nereusd (pid {pid}) is not running")
    return info


ENDPOINT = re.compile(r"tcp://(\[[0-9A-Fa-f:.]+\]|[^\s:/\[\]]+):\d{1,5}")
"""The ``endpoint`` nereusd writes into ``nereusd.json``: ZeroMQ TCP, host and port."""


def endpoint_record(info: object, path: Path) -> dict:
    """``info`` read from a run's ``nereusd.json``, checked: a JSON object whose ``endpoint`` is a
    string and whose ``pid``, when present, a positive integer.

    Raises:
        NereusError: naming ``path``, for anything else (a damaged or foreign file).
    """
    if not (isinstance(info, dict) and isinstance(info.get("endpoint"), str)
            and ENDPOINT.fullmatch(info["endpoint"])
            and (info.get("pid") is None or (type(info["pid"]) is int and info["pid"] > 0))):
        raise NereusError(f"{path}: not a nereusd record (expected a JSON object with an endpoint such as "
                          "tcp://HOST:PORT and a process id)")
    return info


def request_remove(run_dir: Path, count: int, timeout_s: float = 10.0) -> dict:
    """Ask the job's nereusd to release ``count`` devices; returns its answer.

    Raises:
        NereusError: nereusd does not answer within ``timeout_s`` or refuses.
    """
    return _ask(run_dir, P.PoolRequest(remove=count), timeout_s)


def exchange(run_dir: Path, info: dict, request: P._Message, timeout_s: float) -> P._Message | None:
    """Send ``request`` to the nereusd of ``info`` (its ``nereusd.json``, :func:`endpoint_record`;
    with the job's client key where it uses CURVE) and return its answer, or ``None`` when none
    comes within ``timeout_s``.

    Raises:
        ProtocolError: the answer is not a message.
    """
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        if info.get("curve"):
            make_client(sock, load_keys(run_dir / KEYS_DIR, "client"))
        sock.connect(info["endpoint"])
        sock.send_multipart(P.frames_of(P.encode(request)))
        return P.decode(P.joined(sock.recv_multipart())) if sock.poll(int(timeout_s * 1000)) else None
    finally:
        sock.close(0)


def _ask(run_dir: Path, request: P._Message, timeout_s: float) -> dict:
    """Send ``request`` to the job's nereusd (with the job's client key) and return the status
    dict it answers with.

    Raises:
        NereusError: nereusd does not answer within ``timeout_s`` or refuses.
    """
    info = _endpoint(run_dir)
    reply = exchange(run_dir, info, request, timeout_s)
    if reply is None:
        raise NereusError(f"nereusd at {info['endpoint']} did not answer within {timeout_s:g} s; the request may "
                          f"still reach it: see {run_dir / 'events.jsonl'} or 'nereus-launch status {run_dir}'")
    if isinstance(reply, P.ErrorReply):
        raise NereusError(f"nereusd refused: {reply.reason}")
    status = reply.status if isinstance(reply, P.StatusReply) else {}
    if "error" in status:
        raise NereusError(f"nereusd refused: {status['error']}")
    return status


def run(args: argparse.Namespace) -> int:
    run_dir = run_directory(args.run_dir)
    if args.remove is not None:
        if args.remove < 1:
            raise NereusError(f"--remove: expected a positive count, got {args.remove}")
        status = request_remove(run_dir, args.remove, args.timeout_s)
        print(f"nereus: {args.remove} device(s) leave at the next safe boundary "
              f"(pool before the change: {status.get('pool')})")
        return 0
    if args.add < 1:
        raise NereusError(f"--add: expected a positive count, got {args.add}")
    info = _endpoint(run_dir)
    if info.get("slurm_job_id"):
        raise NereusError("--add starts an agent on this machine; this is a Slurm job: use 'nereus-launch grow'")
    limit = info.get("max_devices_per_agent")
    if limit is not None and args.add > limit:
        raise NereusError(f"--add: {args.add} devices, but an agent may register at most {limit}: add them "
                          f"in steps of at most {limit}")
    pool_limit = info.get("max_pool_devices")
    if pool_limit is not None:
        have = int(_ask(run_dir, P.StatusRequest(), args.timeout_s).get("pool_devices", 0))   # as nereusd counts
        if have + args.add > pool_limit:
            raise NereusError(f"--add: the pool holds {have} devices and the job allows {pool_limit} "
                              f"(the job file's pool.max_devices, by default 4 × its devices): at most "
                              f"{max(0, pool_limit - have)} more")
    memory = int(info.get("device_memory_bytes") or 2**30)
    node = f"local-cli{os.getpid()}"   # unique among running CLIs (two in one second shared a time-based id)
    log_path = agent_log_path(run_dir, node)
    try:
        proc = start_local_agent(info["endpoint"], run_dir, args.add, memory, node,
                                 keys_dir=run_dir.resolve() / KEYS_DIR if info.get("curve") else None)
    except OSError as err:
        raise NereusError(f"--add: cannot start the agent: {err.strerror or err} ({err.filename or log_path})") from None
    why = wait_registered(proc, lambda: node in _ask(run_dir, P.StatusRequest(), args.timeout_s).get("pool", {}),
                          lambda s: time.sleep(5 * s), REGISTER_WAIT_S, f"agent {node}", log_path)
    if why is not None:
        raise NereusError(f"--add: {why}")
    print(f"nereus: agent {node} (pid {proc.pid}) with {args.add} device(s) registered and joins; they are used "
          "from the next safe boundary")
    return 0

