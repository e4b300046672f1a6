"""Keeping a lost nereusd's workers (issue 17, item 2; :mod:`nereusd.daemon.kept`): who may
offer them, and when their state counts as the journal's. The end-to-end run is
``tests/e2e/test_resume.py``."""

from __future__ import annotations

import json

import pytest
import zmq

from nereusd import protocol as P
from nereusd.daemon.control_plane import ControlPlane
from nereusd.daemon.kept import NotKept, check_described, committed_steps, keep_workers, started_job_sha256
from nereusd.journal import EVENTS_FILE, METRICS_FILE
from nereusd.plan import Candidate, ModelStage, Plan


def _register(control: ControlPlane, node_id: str, devices: int, kept: list[int], workers: list[int] | None = None):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(control.endpoint)
    sock.send(P.encode(P.RegisterAgent(node_id=node_id, hostname="h", pid=1, kept_devices=kept,
                                       kept_workers=kept[:1] if workers is None else workers, devices=[
        P.DeviceInfo(local_index=i, kind="cpu", name="virtual-cpu", memory_bytes=1) for i in range(devices)])))
    for _ in range(100):
        control.poll(0.02)
        if sock.poll(10):
            return sock, P.decode(sock.recv())
    raise AssertionError("no answer")


def test_only_a_resumed_nereusd_takes_kept_workers_and_only_free_indices_within_the_pool():
    control = ControlPlane(max_pool_devices=8)
    socks = []
    try:
        sock, reply = _register(control, "n0", 2, [4, 5])   # a new job in the run directory: not its workers
        socks.append(sock)
        assert isinstance(reply, P.ErrorReply) and "not started with --resume" in reply.reason
        assert control.devices() == [] and not control.kept_workers
        control.accept_kept_workers = True
        for node, count, kept, why in (("n1", 2, [4], "one distinct global index"),
                                       ("n2", 2, [3, 3], "one distinct global index"),
                                       ("n3", 1, [1 << 16], "beyond the largest device index 65535")):
            sock, reply = _register(control, node, count, kept)
            socks.append(sock)
            assert isinstance(reply, P.ErrorReply) and why in reply.reason, (kept, reply)
        sock, reply = _register(control, "n7", 2, [4, 5], workers=[6])
        socks.append(sock)
        assert isinstance(reply, P.ErrorReply) and "not among its kept devices" in reply.reason
        sock, reply = _register(control, "n4", 2, [4, 5])
        socks.append(sock)
        assert isinstance(reply, P.Welcome) and reply.global_devices == [4, 5]
        assert control.kept_workers == {4} and 4 in control.ready_workers and 5 not in control.ready_workers
        sock, reply = _register(control, "n5", 1, [5])
        socks.append(sock)
        assert isinstance(reply, P.ErrorReply) and "registered already" in reply.reason
        sock, reply = _register(control, "n6", 2, [])   # a new agent numbers after the kept ones
        socks.append(sock)
        assert isinstance(reply, P.Welcome) and reply.global_devices == [6, 7]
        # an index past the pool's size (devices joined after others left): the count is what is bounded
        sock, reply = _register(control, "n8", 1, [9])
        socks.append(sock)
        assert isinstance(reply, P.Welcome) and reply.global_devices == [9], reply
        sock, reply = _register(control, "n9", 4, [10, 11, 12, 13])
        socks.append(sock)
        assert isinstance(reply, P.ErrorReply) and "would bring the pool to 9 devices" in reply.reason, reply
    finally:
        for sock in socks:
            sock.close()
        control.close()


def test_task_ids_of_a_later_nereusd_never_meet_an_earlier_ones():
    """A kept worker may still send a result of its lost nereusd's task: ids start from the wall
    clock in microseconds, so a nereusd started 10 ms after one that issued 1,000 tasks starts
    above all of them."""
    import time

    first = ControlPlane()
    last_old = first._next_task_id + 1000
    first.close()
    time.sleep(0.01)
    second = ControlPlane()
    try:
        assert second._next_task_id > last_old
    finally:
        second.close()


def _rows(tmp_path, steps: list[int], position_step: int = 2) -> None:
    (tmp_path / METRICS_FILE).write_text("".join(json.dumps({"step": s, "sample_position": s * position_step}) + "\n"
                                                 for s in steps))


def test_committed_steps_and_the_next_sample_position(tmp_path):
    assert committed_steps(tmp_path, 2) == (0, 0)
    _rows(tmp_path, [0, 1, 2])
    assert committed_steps(tmp_path, 2) == (3, 6)
    _rows(tmp_path, [0, 1, 1])
    with pytest.raises(NotKept, match="once each"):
        committed_steps(tmp_path, 2)


PLAN = Plan({ModelStage.parse("actor/generation"): Candidate(tp=1, pp=1, dp=2, devices=(0, 1)),
             ModelStage.parse("actor/training"): Candidate(tp=2, pp=1, dp=1, devices=(0, 1))})


def _described(steps: dict[int, int], stages=("actor/generation", "actor/training"), plan=PLAN) -> dict[int, dict]:
    return {d: {"plan": plan.to_dict(), "model_stages": list(stages), "trained_steps": {"actor/training": n}}
            for d, n in steps.items()}


def test_kept_state_must_be_the_journals_on_every_device():
    assert check_described(_described({0: 3, 1: 3}), [0, 1], 3) == PLAN
    cases = [
        (_described({0: -1, 1: 3}), [0, 1], "holds part of a step"),         # killed between a step's updates
        (_described({0: 4, 1: 4}), [0, 1], "holds 4 steps; metrics.jsonl committed 3"),   # trained, not journalled
        (_described({0: 3, 1: 3}, stages=("actor/training",)), [0, 1], "a transition was under way"),
        (_described({0: 3, 1: 3}), [0], "not in the world"),
        ({**_described({0: 3}), 1: {"plan": None, "model_stages": [], "trained_steps": {}}}, [0, 1], "different plans"),
    ]
    for described, world, why in cases:
        with pytest.raises(NotKept, match=why):
            check_described(described, world, 3)


def test_workers_built_from_another_job_file_are_not_kept(tmp_path):
    """The lost nereusd journalled its job's fingerprint when it started; a resumed nereusd whose
    job file differs does not keep its workers (their engines were built from the old file)."""
    events = tmp_path / EVENTS_FILE
    events.write_text("".join(json.dumps(r) + "\n" for r in (
        {"event": "nereusd_started", "job_sha256": "old"},
        {"event": "step", "step": 0},
        {"event": "nereusd_started", "job_sha256": "new"})))
    assert started_job_sha256(tmp_path) == "new" and started_job_sha256(tmp_path, back=1) == "old"
    assert started_job_sha256(tmp_path, back=2) is None
    with pytest.raises(NotKept, match="the job file changed"):   # refused before any worker is asked
        keep_workers(None, None, None, [0, 1], tmp_path, "new")
