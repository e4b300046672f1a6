"""Slurm without a cluster: node lists, Slurm's variables, GPU visibility, the typed client's
errors, the allocation watcher's events and back-off, and the pool-change verdicts."""

from __future__ import annotations

import subprocess
import threading

import pytest

from nereusd.errors import SlurmError
from nereusd.daemon.pool_events import PoolChange, PoolChangeKind, PoolVerdict, assess
from nereusd.slurm import (SLURM_ENV, AllocationWatcher, JobInfo, NodeInfo, SlurmClient, SlurmContext,
                           parse_nodelist, visible_gpus)


@pytest.mark.parametrize("text, expected", [
    ("gpu[001-003,007]", ["gpu001", "gpu002", "gpu003", "gpu007"]),
    ("nrs1", ["nrs1"]),
    ("nrs[1-2],login5", ["nrs1", "nrs2", "login5"]),
    ("r[1-2]n[08-09]", ["r1n08", "r1n09", "r2n08", "r2n09"]),
    ("frontier[00010-00011]", ["frontier00010", "frontier00011"]),
    ("a-b[9-10].c", ["a-b9.c", "a-b10.c"]),
    ("", []),
    ("(null)", []),
])
def test_parse_nodelist(text, expected):
    assert parse_nodelist(text) == expected


@pytest.mark.parametrize("text, message", [
    ("gpu[1-2", r"unbalanced brackets"),
    ("gpu[3-1]", r"range '3-1' runs backwards"),
    ("gpu[a-b]", r"bad range 'a-b'"),
    ("a,,b", r"empty name"),
])
def test_parse_nodelist_errors(text, message):
    with pytest.raises(SlurmError, match=message):
        parse_nodelist(text)


def test_context_from_env():
    ctx = SlurmContext.from_env({"SLURM_JOB_ID": "42", "SLURMD_NODENAME": "gpu002", "SLURM_NODEID": "1",
                                 "SLURM_JOB_NODELIST": "gpu[001-002]"})
    assert (ctx.job_id, ctx.node_name, ctx.node_id, ctx.nodes) == ("42", "gpu002", 1, ("gpu001", "gpu002"))
    assert SlurmContext.from_env({}).node_id is None
    with pytest.raises(SlurmError, match=r"SLURM_NODEID='x' is not an integer"):
        SlurmContext.from_env({"SLURM_NODEID": "x"})
    assert "SLURMD_NODENAME" in SLURM_ENV and "CUDA_VISIBLE_DEVICES" in SLURM_ENV


@pytest.mark.parametrize("env, count, source", [
    ({"CUDA_VISIBLE_DEVICES": "4,5,6,7", "SLURM_JOB_GPUS": "4,5,6,7"}, 4, "CUDA_VISIBLE_DEVICES"),  # global ids
    ({"CUDA_VISIBLE_DEVICES": "0,1"}, 2, "CUDA_VISIBLE_DEVICES"),                                   # per-job ids
    ({"CUDA_VISIBLE_DEVICES": "GPU-1a2b,GPU-3c4d"}, 2, "CUDA_VISIBLE_DEVICES"),                     # UUIDs
    ({"ROCR_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}, 8, "ROCR_VISIBLE_DEVICES"),
    ({"SLURM_STEP_GPUS": "2"}, 1, "SLURM_STEP_GPUS"),
    ({"SLURM_GPUS_ON_NODE": "3"}, 3, "SLURM_GPUS_ON_NODE"),
    ({"CUDA_VISIBLE_DEVICES": "NoDevFiles"}, 0, ""),
    ({}, 0, ""),
])
def test_visible_gpus(env, count, source):
    gpus = visible_gpus(env)
    assert (gpus.count, gpus.source) == (count, source)


def _runner(returncode=0, stdout="", stderr=""):
    calls = []

    def run(argv, **kwargs):
        calls.append(argv)
        return subprocess.CompletedProcess(argv, returncode, stdout, stderr)
    run.calls = calls
    return run


def test_client_errors_carry_argv_code_stderr():
    client = SlurmClient(runner=_runner(1, "", "sbatch: error: invalid partition specified: gpux"))
    with pytest.raises(SlurmError, match=r"\['sbatch', '--parsable'\] failed with exit code 1: .*invalid partition"):
        client.sbatch("#!/bin/bash\n")

    def missing(argv, **kwargs):
        raise FileNotFoundError(argv[0])
    with pytest.raises(SlurmError, match=r"squeue: command not found"):
        SlurmClient(runner=missing).job("1")
    with pytest.raises(SlurmError, match=r"printed 'Submitted', expected a job id"):
        SlurmClient(runner=_runner(0, "Submitted\n")).sbatch("x")
    assert SlurmClient(runner=_runner(0, "123;cluster\n")).sbatch("x") == "123"


def test_client_parses_with_separators():
    client = SlurmClient(runner=_runner(0, "7|RUNNING|2|nrs1|nrs[1-2]|None\n"))
    assert client.job("7") == JobInfo("7", "RUNNING", 2, "nrs1", ("nrs1", "nrs2"), "None")
    assert SlurmClient(runner=_runner(1, "", "slurm_load_jobs error: Invalid job id specified")).job("9") is None
    with pytest.raises(SlurmError, match=r"expected 6 '\|'-separated fields"):
        SlurmClient(runner=_runner(0, "7 RUNNING\n")).job("7")
    nodes = SlurmClient(runner=_runner(0, "nrs1|mixed|none\nnrs2|down*|Not responding\nnrs3|drained|maint\n"))
    states = nodes.nodes(["nrs1", "nrs2", "nrs3"])
    assert not states["nrs1"].down and states["nrs2"].down and states["nrs3"].draining


class FakeSlurm:
    def __init__(self):
        self.jobs = {"10": JobInfo("10", "RUNNING", 3, "n1", ("n1", "n2", "n3"), "None")}
        self.states = {n: NodeInfo(n, "allocated", "none") for n in ("n1", "n2", "n3", "n4")}
        self.fail = False

    def job(self, job_id):
        if self.fail:
            raise SlurmError("['squeue'] failed with exit code 1: slurmctld down")
        return self.jobs.get(job_id)

    def nodes(self, names):
        return {n: self.states[n] for n in names}


def test_watcher_reports_each_change_once():
    fake, seen = FakeSlurm(), []
    watcher = AllocationWatcher(fake, ["10"], seen.append)
    assert watcher.poll_once() == []
    fake.states["n2"] = NodeInfo("n2", "down", "test")
    fake.jobs["10"] = JobInfo("10", "RUNNING", 2, "n1", ("n1", "n3"), "None")  # --no-kill drops it at once
    fake.states["n3"] = NodeInfo("n3", "draining", "maintenance")
    events = watcher.poll_once()
    assert [(e.kind, e.node) for e in events] == [("node_down", "n2"), ("node_drain", "n3")]
    assert watcher.poll_once() == []
    fake.jobs["10"] = JobInfo("10", "RUNNING", 1, "n1", ("n1",), "None")  # n3 leaves: reported as drain already
    assert watcher.poll_once() == []
    watcher.add_job("11")
    fake.jobs["11"] = JobInfo("11", "RUNNING", 1, "n4", ("n4",), "None")
    watcher.poll_once()
    del fake.jobs["11"]
    assert [(e.kind, e.job_id) for e in watcher.poll_once()] == [("job_ending", "11")]
    assert len(seen) == len({(e.kind, e.node or e.job_id) for e in seen})


def test_watcher_reports_shrink():
    fake, seen = FakeSlurm(), []
    watcher = AllocationWatcher(fake, ["10"], seen.append)
    watcher.poll_once()
    fake.jobs["10"] = JobInfo("10", "RUNNING", 2, "n1", ("n1", "n2"), "None")  # scontrol update NumNodes=2
    assert [(e.kind, e.node) for e in watcher.poll_once()] == [("node_released", "n3")]
    fake.jobs["10"] = JobInfo("10", "CANCELLED", 2, "n1", ("n1", "n2"), "None")
    assert [e.kind for e in watcher.poll_once()] == ["job_ending"]


def test_watcher_backs_off():
    watcher = AllocationWatcher(FakeSlurm(), ["10"], lambda e: None, min_interval_s=1, max_interval_s=8, factor=2)
    quiet = [watcher._next_interval(False, False) / 1.0 for _ in range(5)]
    assert quiet[0] == pytest.approx(2, rel=0.11) and quiet[-1] == pytest.approx(8, rel=0.11)
    assert watcher._next_interval(True, False) == pytest.approx(1, rel=0.11)
    assert watcher._next_interval(False, True) == pytest.approx(2, rel=0.11)  # failure doubles


def test_watcher_thread_survives_failures():
    """Slurm down, then output nobody expected (a bug's ValueError): the thread keeps polling and
    reports the node that goes down afterwards."""
    fake = FakeSlurm()
    fake.fail = True
    calls = {"n": 0}
    real_job = fake.job

    def job(job_id):
        calls["n"] += 1
        if calls["n"] == 3:
            raise ValueError("invalid literal for int() with base 10: 'N/A'")
        if calls["n"] == 4:
            fake.fail = False
            fake.states["n2"] = NodeInfo("n2", "down", "test")
        return real_job(job_id)

    fake.job = job
    seen = threading.Event()
    watcher = AllocationWatcher(fake, ["10"], lambda e: seen.set() if e.node == "n2" else None,
                                min_interval_s=0.001, max_interval_s=0.002)
    watcher.start()
    try:
        assert seen.wait(30), (watcher.failures, watcher.last_error)
    finally:
        watcher.stop()
    assert watcher.failures == 3 and watcher.polls >= 1


def test_a_round_that_fails_part_way_is_seen_again_whole():
    fake, seen = FakeSlurm(), []
    watcher = AllocationWatcher(fake, ["10"], seen.append)
    watcher.poll_once()
    fake.jobs["10"] = JobInfo("10", "RUNNING", 2, "n1", ("n1", "n2"), "None")   # n3 released ...
    real_nodes = fake.nodes
    fake.nodes = lambda names: (_ for _ in ()).throw(SlurmError("['sinfo'] failed with exit code 1"))
    with pytest.raises(SlurmError):
        watcher.poll_once()                                                      # ... but sinfo fails
    fake.nodes = real_nodes
    assert [(e.kind, e.node) for e in watcher.poll_once()] == [("node_released", "n3")]
    # an on_event that fails for the first of two events: both come again next round
    fake.states["n1"] = NodeInfo("n1", "down", "x")
    fake.states["n2"] = NodeInfo("n2", "down", "y")
    calls = []

    def flaky(event):
        calls.append(event.node)
        if len(calls) == 1:
            raise RuntimeError("queue full")
    watcher.on_event = flaky
    with pytest.raises(RuntimeError):
        watcher.poll_once()
    watcher.poll_once()
    assert calls == ["n1", "n1", "n2"]


def test_client_refuses_a_node_count_that_is_no_integer():
    with pytest.raises(SlurmError, match=r"node count 'N/A' is not an integer"):
        SlurmClient(runner=_runner(0, "7|RUNNING|N/A|nrs1|nrs[1-2]|None\n")).job("7")


def test_assess():
    lost_spare = PoolChange(PoolChangeKind.LOST, "slurm:node_down", "n2", (4, 5, 6, 7), "node n2 is down")
    assert assess(lost_spare, [0, 1])[0] == PoolVerdict.CONTINUE
    verdict, reason = assess(PoolChange(PoolChangeKind.LOST, "heartbeat", "n1", (0, 1, 2, 3), "n1 silent"), [0, 1])
    assert verdict == PoolVerdict.STOP and "the plan uses devices [0, 1]" in reason
    joined = PoolChange(PoolChangeKind.JOINED, "registration", "n3", (8, 9), "node n3 joined")
    assert assess(joined, [0, 1])[0] == PoolVerdict.CONTINUE
    pre = PoolChange(PoolChangeKind.PREEMPTION, "signal:SIGUSR2", None, (), "USR2")
    assert assess(pre, [0])[0] == PoolVerdict.CHECKPOINT_AND_STOP
