"""``nereus-launch pool RUN --add N`` (``launcher/pool_cmd.py``) against a stand-in nereusd: the
agent it starts must register before it says the devices join (the end-to-end run is
``tests/e2e/test_pool_cmd.py``)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

from launcher import pool_cmd
from nereusd.errors import NereusError


@pytest.fixture
def stand(monkeypatch, tmp_path):
    """A running local job's record and status answers; the agents ``--add`` starts run
    ``agent["code"]`` (and are killed at the end)."""
    pool = {"local0": {"devices": [0, 1]}}
    agent = {"code": "raise SystemExit(3)", "nodes": [], "procs": []}
    monkeypatch.setattr(pool_cmd, "_endpoint", lambda run_dir: {"endpoint": "tcp://127.0.0.1:1", "curve": False})
    monkeypatch.setattr(pool_cmd, "_ask", lambda run_dir, request, timeout_s: {"pool": dict(pool), "pool_devices": 2})

    def start(endpoint, run_dir, devices, memory, node, keys_dir=None):
        agent["nodes"].append(node)
        agent["procs"].append(subprocess.Popen([sys.executable, "-c", agent["code"]]))
        return agent["procs"][-1]

    monkeypatch.setattr(pool_cmd, "start_local_agent", start)
    yield argparse.Namespace(run_dir=str(tmp_path), remove=None, add=2, timeout_s=5.0), pool, agent
    for proc in agent["procs"]:
        proc.kill()
        proc.wait()


def test_an_agent_that_exits_before_it_registers_is_reported(stand):
    """It printed "joins" and exited 0 while the agent had died (an adversarial helper, 2026-12-06)."""
    args, _, agent = stand
    with pytest.raises(NereusError, match=r"--add: agent local-cli\d+ exited with status 3 before it registered; "
                                          r"its log: .*agent-local-cli\d+\.log"):
        pool_cmd.run(args)
    assert agent["nodes"] == [f"local-cli{os.getpid()}"]   # two CLIs in one second shared a time-based id


def test_an_agent_that_registers_joins(stand, capsys, monkeypatch):
    args, pool, agent = stand
    agent["code"] = "import time; time.sleep(60)"
    monkeypatch.setattr(pool_cmd.time, "sleep",   # nereusd sees the agent after the CLI's first wait
                        lambda seconds: pool.setdefault(agent["nodes"][0], {"devices": [2, 3]}))
    assert pool_cmd.run(args) == 0
    assert "registered and joins" in capsys.readouterr().out
