"""Agents a local job starts itself (``pool.schedule`` adds, ``nereus-launch pool --add``): the
``nereus-agent`` process with virtual CPU devices, its log's path, and the wait for its
registration (:class:`nereusd.daemon.live.LiveAdaptation` and :mod:`launcher.pool_cmd` use them)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

AGENT_REGISTER_S = 120.0
"""How long an agent a schedule's add starts may take to register (:meth:`nereusd.daemon.live.LiveAdaptation._add_devices`)."""


def agent_log_path(run_dir: Path, node_id: str) -> Path:
    """Where :func:`start_local_agent` writes the log of agent ``node_id``."""
    return Path(run_dir) / "logs" / f"agent-{node_id}.log"


def start_local_agent(endpoint: str, run_dir: Path, devices: int, memory_bytes: int, node_id: str,
                      keys_dir: Path | None = None) -> subprocess.Popen:
    """Start a ``nereus-agent`` with ``devices`` virtual CPU devices that joins the job at ``endpoint``
    (its own session; it exits when nereusd tells it to or goes silent), with the job's CURVE
    client key from ``keys_dir`` when the job has keys. Log: ``logs/agent-<node_id>.log``."""
    log_path = agent_log_path(run_dir, node_id)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "emu.agent", "--connect", endpoint, "--node-id", node_id,
            "--run-dir", str(Path(run_dir).resolve()), "--cpu-devices", str(devices),
            "--cpu-memory-bytes", str(memory_bytes)]
    if keys_dir is not None:
        argv += ["--keys-dir", str(keys_dir)]
    with open(log_path, "ab") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env=dict(os.environ))


def wait_registered(proc: subprocess.Popen, registered: Callable[[], bool], wait: Callable[[float], object],
                    timeout_s: float, what: str, log_path: Path) -> str | None:
    """Wait until ``registered()`` holds for the agent ``proc`` that :func:`start_local_agent`
    started, calling ``wait(seconds)`` between checks (polling the control plane, or sleeping).

    Returns:
        ``None`` once it registered; else why not — it exited first (its status), or it did not
        register within ``timeout_s`` (then it is killed: its own session, no workers yet) — with
        its log's path. ``what`` names it in the reason (``"agent local-add1 with 2 devices"``).
    """
    deadline = time.monotonic() + timeout_s
    while not registered():
        if proc.poll() is not None:
            return f"{what} exited with status {proc.returncode} before it registered; its log: {log_path}"
        if time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            return f"{what} did not register within {timeout_s:g} s and was stopped; its log: {log_path}"
        wait(0.1)
    return None
