"""Each worker's temporary files live in a directory of its own (``$TMPDIR``), which the agent
removes once the worker has exited, however it ended (:mod:`emu.tmpdirs`). Workers end with
``os._exit``, and the agent stops them with ``SIGTERM``/``SIGKILL`` at every restart and device
removal: none of these ran the clean-up, and every worker left its multiprocessing directory, and
its vLLM engines their rendezvous files and sockets, in ``/tmp``."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import zmq

from emu import agent as agent_module
from emu.agent import Agent
from emu import tmpdirs
from emu.tmpdirs import IPC_PATH_MAX_BYTES, MULTIPROCESSING_SOCKET_BYTES, private_dir
from nereusd import protocol as P

# stands in for emu.worker: writes into its $TMPDIR, as multiprocessing and vLLM do, then waits
WORKER = ("import os, pathlib, tempfile, time; "
          "pathlib.Path(tempfile.gettempdir(), 'pymp-x').mkdir(); "
          "pathlib.Path(tempfile.gettempdir(), 'pymp-x', 'listener-y').write_text(os.environ['TMPDIR']); "
          "time.sleep(60)")


def test_a_workers_tmpdir_is_its_own_and_goes_when_the_worker_is_killed(tmp_path, monkeypatch):
    started: list[dict] = []
    real_popen = subprocess.Popen

    def popen(argv, **kw):
        started.append(kw["env"])
        return real_popen([sys.executable, "-c", WORKER], **kw)

    monkeypatch.setattr(agent_module.subprocess, "Popen", popen)
    daemon = zmq.Context.instance().socket(zmq.ROUTER)
    daemon.setsockopt(zmq.LINGER, 0)
    daemon.bind("tcp://127.0.0.1:0")
    devices = [P.DeviceInfo(local_index=i, kind="cpu", name="virtual-cpu", memory_bytes=1 << 30) for i in range(2)]
    agent = Agent(connect=daemon.getsockopt_string(zmq.LAST_ENDPOINT), node_id="n0", devices=devices, run_dir=tmp_path)
    try:
        agent._spawn(P.SpawnWorkers(generation=0, world_size=2, store_host="127.0.0.1", store_port=1, run_dir=str(tmp_path),
                                    workers=[P.WorkerSpec(device=d, local_index=d, memory_capacity_bytes=1 << 30)
                                             for d in (0, 1)]))
        dirs = [Path(env["TMPDIR"]) for env in started]
        assert len(set(dirs)) == 2 and all(d.parent == Path(tempfile.gettempdir()) for d in dirs)
        # torch.compile's cache stays where torch keeps it by default: it outlives the worker
        assert all(Path(env["TORCHINDUCTOR_CACHE_DIR"]).parent == Path(tempfile.gettempdir()) for env in started)
        deadline = time.monotonic() + 20
        while not all((d / "pymp-x" / "listener-y").exists() for d in dirs) and time.monotonic() < deadline:
            time.sleep(0.05)
        agent.stop_devices([0], "removed from the pool")   # SIGTERM: no clean-up of its own runs
        agent._check_workers()
        assert not dirs[0].exists() and dirs[1].exists()   # the live worker's stays
        agent.stop_workers("agent stopping", grace_s=0.1)
    finally:
        agent.close()
        daemon.close()
    assert not dirs[1].exists()


def test_a_private_tmpdir_is_made_only_where_its_sockets_fit(tmp_path, monkeypatch):
    """A Unix socket's path may not exceed 107 bytes: under a long ``$TMPDIR`` the directory goes
    under /tmp (a long ``$TMPDIR`` made every local job fail at the agent's socket: an
    adversarial trial), and where not even that fits, nothing is made and the process keeps the
    system's (a worker's listener under a too-long one failed its weight load, and a TP-2 vLLM
    engine its start, in a first try of this change)."""
    short = private_dir("nereus-t-", MULTIPROCESSING_SOCKET_BYTES)
    assert short is not None and len(short) + MULTIPROCESSING_SOCKET_BYTES <= IPC_PATH_MAX_BYTES
    os.rmdir(short)
    deep = tmp_path / ("d" * max(1, IPC_PATH_MAX_BYTES - len(str(tmp_path)) - 20))
    deep.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    moved = private_dir("nereus-t-", MULTIPROCESSING_SOCKET_BYTES)
    assert moved is not None and os.path.dirname(moved) == tmpdirs.SHORT_TMP and list(deep.iterdir()) == []
    os.rmdir(moved)
    monkeypatch.setattr(tmpdirs, "SHORT_TMP", str(deep))
    assert private_dir("nereus-t-", MULTIPROCESSING_SOCKET_BYTES) is None
    assert list(deep.iterdir()) == []   # nothing left behind


def test_the_directories_of_a_killed_agent_go_when_the_next_agent_starts(tmp_path, monkeypatch):
    """An agent killed with SIGKILL removed neither its socket's directory nor its workers'
    ``$TMPDIR``s: a suite run left two in ``/tmp``, and 75 had gathered over a day of trials. Their
    names carry the agent's pid; the next agent removes those whose agent is gone, and no other."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(tmpdirs, "SHORT_TMP", str(tmp_path))
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    dead = int(gone.stdout)
    orphans = [tmp_path / f"nereus-agent-{dead}-abc", tmp_path / f"nereus-w3-{dead}-def"]
    kept = [tmp_path / f"nereus-agent-{os.getpid()}-ghi", tmp_path / f"nereus-w0-{os.getpid()}-jkl",
            tmp_path / "nereus-agent-xyz", tmp_path / f"other-{dead}-x"]
    for d in orphans + kept:
        d.mkdir()
    (orphans[1] / "pymp-x").mkdir()
    assert sorted(tmpdirs.remove_orphaned_dirs()) == sorted(str(d) for d in orphans)
    assert [d.exists() for d in orphans + kept] == [False, False, True, True, True, True]
    # an agent names its directories so, and sweeps when it starts
    (tmp_path / f"nereus-w1-{dead}-mno").mkdir()
    daemon = zmq.Context.instance().socket(zmq.ROUTER)
    daemon.setsockopt(zmq.LINGER, 0)
    daemon.bind("tcp://127.0.0.1:0")
    agent = Agent(connect=daemon.getsockopt_string(zmq.LAST_ENDPOINT), node_id="n0", devices=[], run_dir=tmp_path)
    try:
        assert not (tmp_path / f"nereus-w1-{dead}-mno").exists()
        assert agent._ipc_dir.name.startswith(f"nereus-agent-{os.getpid()}-")
    finally:
        agent.close()
        daemon.close()
