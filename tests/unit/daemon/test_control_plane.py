"""Task dispatch of the control plane with a registered peer speaking the agent protocol."""

from __future__ import annotations

import pytest
import zmq

from nereusd import protocol as P
from nereusd.daemon.control_plane import ControlPlane
from nereusd.errors import WorkerError
from tests.support.agents import fake_agent


def test_a_task_with_a_device_without_agent_is_sent_to_no_device():
    """Devices 0 and 1 have an agent, device 5 none: the task must not reach 0 and 1 either —
    a half-sent collective task leaves its receivers blocked."""
    control = ControlPlane()
    agent = fake_agent(control, "n0", 2)
    try:
        report = P.MemoryReportArgs()
        with pytest.raises(WorkerError, match=r"devices \[5\] have no live agent; nothing was sent"):
            control.submit({0: report, 1: report, 5: report})
        task = control.submit({0: report})
        first = P.decode(agent.recv())   # per-connection order: the first task sent comes first
        assert isinstance(first, P.ToWorkers) and [(i.task.task_id, i.device) for i in first.items] == [(task, 0)]
    finally:
        agent.close()
        control.close()


def test_a_task_goes_to_each_agent_in_one_frame_and_batched_results_are_taken_item_by_item():
    """One ``ToWorkers`` frame per agent; a ``FromWorkers`` batch with a device the agent does not
    own is refused for that item only, the others are taken."""
    control = ControlPlane()
    a0, a1 = fake_agent(control, "n0", 2), fake_agent(control, "n1", 2)
    try:
        task = control.submit({d: P.MemoryReportArgs() for d in range(4)})
        got = {}
        for sock in (a0, a1):
            frame = P.decode(sock.recv())
            assert isinstance(frame, P.ToWorkers)
            got[sock] = sorted(i.device for i in frame.items)
            assert not sock.poll(100)   # nothing else: one frame for both devices
        assert sorted(got.values()) == [[0, 1], [2, 3]]
        mine = got[a0]
        a0.send(P.encode(P.FromWorkers(items=[
            P.FromWorker(device=d, payload=P.TaskResult(task_id=task, device=d, ok=True, result={})) for d in mine + [got[a1][0]]])))
        control.poll(0.5)
        reply = P.decode(a0.recv())
        assert isinstance(reply, P.ErrorReply) and "does not own" in reply.reason
        assert control.refused_messages == 1
        assert not control.done(task)
        a1.send(P.encode(P.FromWorkers(items=[
            P.FromWorker(device=d, payload=P.TaskResult(task_id=task, device=d, ok=True, result={"d": d}))
            for d in got[a1]])))
        results = control.collect(task, timeout_s=5)
        assert sorted(results) == [0, 1, 2, 3] and results[got[a1][1]].result == {"d": got[a1][1]}
    finally:
        a0.close()
        a1.close()
        control.close()


def test_an_agent_whose_connection_drops_is_lost_within_the_grace_not_the_heartbeat_timeout(monkeypatch):
    """A killed agent's socket is closed by its kernel: nereusd reads the disconnect from its
    socket monitor and declares the node lost (cause ``disconnected``) after the grace, long
    before a 60 s heartbeat timeout. A live agent that keeps talking is not."""
    import time

    from nereusd.daemon import registry

    monkeypatch.setattr(registry, "DISCONNECT_GRACE_S", 0.5)
    lost = []
    control = ControlPlane(heartbeat_timeout_s=60.0, on_pool_change=lost.append)
    gone, live = fake_agent(control, "gone", 1), fake_agent(control, "live", 1)
    try:
        control.poll(0.1)
        gone.close(linger=0)
        start = time.monotonic()
        while "gone" in control.agents and time.monotonic() - start < 10:
            live.send(P.encode(P.Heartbeat(node_id="live")))
            control.poll(0.1)
        took = time.monotonic() - start
        assert "gone" not in control.agents and "live" in control.agents
        assert 0.5 <= took < 5, took
        assert control.lost_devices([0]) == {0: {"node_id": "gone", "cause": "disconnected",
                                                 "detail": control.device_losses[0]["detail"]}}
        assert "dropped its connection" in control.device_losses[0]["detail"]
        assert [(c.node_id, c.cause) for c in lost] == [("gone", "disconnected")]
    finally:
        live.close()
        control.close()


def test_a_lost_agent_loses_only_the_devices_it_still_held(monkeypatch):
    """Device 1 of agent ``n0`` left the pool (a removal) before the agent was killed: the loss
    names device 0 alone (it named both, and device 1 as lost)."""
    import time

    from nereusd.daemon import registry

    monkeypatch.setattr(registry, "DISCONNECT_GRACE_S", 0.2)
    lost, events = [], []
    control = ControlPlane(heartbeat_timeout_s=60.0, on_pool_change=lost.append,
                           on_event=lambda name, fields: events.append((name, fields)))
    agent = fake_agent(control, "n0", 2)
    try:
        control.release_devices([1], "removed from the pool")
        agent.close(linger=0)
        start = time.monotonic()
        while "n0" in control.agents and time.monotonic() - start < 10:
            control.poll(0.1)
        assert [c.devices for c in lost] == [(0,)]
        assert [f["devices"] for name, f in events if name == "agent_lost"] == [[0]]
        assert sorted(control.device_losses) == [0]
    finally:
        control.close()


def test_registrations_beyond_the_jobs_pool_limit_are_refused():
    """``pool.max_devices``: an agent that would take the pool past it gets an error reply and
    no devices; the pool and the agents already there are unchanged (issue 17: 10,000 added
    devices spawned workers until the machine stalled)."""
    control = ControlPlane(max_pool_devices=5)
    first = fake_agent(control, "n0", 4)
    late = zmq.Context.instance().socket(zmq.DEALER)
    late.setsockopt(zmq.LINGER, 0)
    late.connect(control.endpoint)
    try:
        late.send(P.encode(P.RegisterAgent(node_id="n1", hostname="h", pid=2, devices=[
            P.DeviceInfo(local_index=i, kind="cpu", name="virtual-cpu", memory_bytes=1) for i in range(2)])))
        for _ in range(50):
            control.poll(0.02)
            if late.poll(10):
                break
        reply = P.decode(late.recv())
        assert isinstance(reply, P.ErrorReply) and "would bring the pool to 6 devices; the job allows 5" in reply.reason
        assert control.devices() == [0, 1, 2, 3] and sorted(control.agents) == ["n0"]
    finally:
        first.close()
        late.close()
        control.close()


def _answering_agent(sock: zmq.Socket, answer: set[int], delay_s: dict[int, list[float]], stop,
                     waiting: dict[int, float] | None = None):
    """An agent loop in a thread: answers ``answer``'s share of every task, each device its tasks
    in order (the next ``delay_s[d]`` seconds after it is free, or at once), never the others',
    and reports a worker it is told to stop as exited (``SIGTERM``), as the real agent does.
    ``waiting``: devices whose workers its heartbeats (every 0.1 s) say wait on peers, for that
    many seconds more than when the loop started."""
    import threading
    import time

    def loop():
        due: list[tuple[float, int, int]] = []
        free: dict[int, float] = {}
        start = time.monotonic()
        next_beat = 0.0
        while not stop.is_set():
            if waiting is not None and time.monotonic() >= next_beat:
                next_beat = time.monotonic() + 0.1
                sock.send(P.encode(P.Heartbeat(node_id="n0", workers_alive=[0, 1, 2, 3], waiting_s={
                    d: s + time.monotonic() - start for d, s in waiting.items()})))
            if sock.poll(20):
                msg = P.decode(sock.recv())
                if isinstance(msg, P.StopWorkers) and waiting is not None:
                    for d in msg.devices:
                        waiting.pop(d, None)
                if isinstance(msg, P.ToWorkers):
                    for i in msg.items:
                        if i.device in answer:
                            delays = delay_s.get(i.device, [])
                            at = max(time.monotonic(), free.get(i.device, 0.0)) + (delays.pop(0) if delays else 0.0)
                            free[i.device] = at
                            due.append((at, i.device, i.task.task_id))
                elif isinstance(msg, P.StopWorkers):
                    for d in msg.devices:
                        sock.send(P.encode(P.WorkerExited(node_id="n0", device=d, exitcode=-15)))
            for item in sorted(x for x in due if x[0] <= time.monotonic()):
                due.remove(item)
                sock.send(P.encode(P.FromWorkers(items=[P.FromWorker(device=item[1], payload=P.TaskResult(
                    task_id=item[2], device=item[1], ok=True, result={}))])))

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    return thread


def _generate(devices) -> dict[int, P.GenerateArgs]:
    return {d: P.GenerateArgs(model_stage="actor/generation", prompts=[[1]], max_new_tokens=1, temperature=1.0,
                              greedy=False, stop_ids=(0,), pad_id=0, seed=d) for d in devices}


def test_a_worker_without_a_result_long_after_half_its_task_returned_is_stopped_as_stalled():
    """The straggler rule (site ``liveness.straggler_*``): devices 0-2 answer, device 3 beats but
    never answers (a live-locked worker, a hung vLLM engine). At max(min, factor × t_half) after
    it could start, it is stopped, its exit fails the task, and it is lost with cause
    ``worker_stalled``. Left alone: a slow but healthy worker within the bound; a worker that
    starts late because it was busy with an earlier task; a task nobody answered yet; tasks of
    uneven kinds (a checkpoint is verified by one device)."""
    import threading

    events: list[tuple[str, dict]] = []
    control = ControlPlane(straggler_factor=4.0, straggler_min_s=0.6, on_event=lambda e, f: events.append((e, f)))
    sock = fake_agent(control, "n0", 4)
    stop = threading.Event()
    # device 2: 0.3 s on its first generate task; device 1: 2 s on a memory report (past the 1.2 s bound), then
    # its generate at once
    thread = _answering_agent(sock, answer={0, 1, 2}, delay_s={2: [0.3], 1: [2.0]}, stop=stop)
    try:
        report = control.submit({1: P.MemoryReportArgs()})   # device 1 is busy with it for 2 s
        assert set(control.run(_generate(range(3)), timeout_s=10)) == {0, 1, 2} and control.stalled_workers == {}
        control.collect(report, timeout_s=5)
        with pytest.raises(WorkerError, match=r"device\(s\) \[3\] exited"):
            control.run(_generate(range(4)), timeout_s=10)
        assert control.lost_devices([0, 1, 2, 3]) == {3: {"cause": "worker_stalled", "node_id": "n0", "exitcode": -15,
                                                           "stalled_s": control.stalled_workers[3]}}
        assert 0.6 <= control.stalled_workers[3] < 3.0
        straggling, = [f for e, f in events if e == "worker_straggling"]
        assert straggling["devices"] == [3] and straggling["bound_s"] == 0.6
        silent = fake_agent(control, "n1", 2)   # devices 4, 5: nothing answers
        with pytest.raises(WorkerError, match=r"no result from devices \[4, 5\] within 1 s"):
            control.run(_generate([4, 5]), timeout_s=1.0)   # none returned: not judged
        with pytest.raises(WorkerError, match=r"no result from devices \[4\] within 1 s"):
            control.run({d: P.SaveCheckpointArgs(dir="/x") for d in (0, 1, 2, 4)}, timeout_s=1.0)   # uneven: not judged
        silent.close()
        assert sum(e == "worker_straggling" for e, _ in events) == 1 and 4 not in control.stalled_workers
    finally:
        stop.set()
        thread.join(5)
        sock.close()
        control.close()


def test_workers_waiting_on_peers_count_as_arrived_and_any_task_has_a_bound():
    """A hang that holds its peers in a collective (issue 17, item 5): device 2 waits on peers
    (its beats say so) and device 3 never answers; with 0 and 1 returned, 3 of 4 arrived, so 3
    is the straggler — not 2. A two-worker task where one waits on the other: 1 of 2 arrived,
    the other is stopped (before, no result meant not judged). A one-worker task of any kind
    (here a checkpoint) is stopped after ``task_max_s``."""
    import threading

    events: list[tuple[str, dict]] = []
    control = ControlPlane(straggler_factor=4.0, straggler_min_s=0.6, task_max_s=1.5,
                           on_event=lambda e, f: events.append((e, f)))
    sock = fake_agent(control, "n0", 4)
    stop = threading.Event()
    waiting = {2: 10.0}
    answer = {0, 1}
    thread = _answering_agent(sock, answer=answer, delay_s={}, stop=stop, waiting=waiting)
    try:
        with pytest.raises(WorkerError, match=r"device\(s\) \[3\] exited"):
            control.run(_generate(range(4)), timeout_s=10)
        first = [f for e, f in events if e == "worker_straggling"][-1]
        assert first["devices"] == [3] and first["waiting_on_peers"] == [2] and first["bound_s"] == 0.6
        assert 2 not in control.stalled_workers
        answer.clear()
        waiting[0] = 10.0   # device 0 waits on device 1 inside a two-worker task; neither returns
        with pytest.raises(WorkerError, match=r"device\(s\) \[1\] exited"):
            control.run({d: _generate([d])[d] for d in (0, 1)}, timeout_s=10)
        assert [f for e, f in events if e == "worker_straggling"][-1]["devices"] == [1]
        waiting.clear()
        silent = fake_agent(control, "n1", 1)   # device 4: a one-worker checkpoint that never ends
        with pytest.raises(WorkerError, match=r"no result from devices \[4\] within 3 s"):
            control.run({4: P.SaveCheckpointArgs(dir="/x")}, timeout_s=3.0)
        last = [f for e, f in events if e == "worker_straggling"][-1]
        assert last["devices"] == [4] and last["bound_s"] == 1.5 and last["task"] == "save_checkpoint"
        silent.close()
    finally:
        stop.set()
        thread.join(5)
        sock.close()
        control.close()


def test_an_agent_whose_devices_all_left_the_pool_is_told_to_exit_and_not_lost(monkeypatch):
    """Devices 2 and 3 of agent ``added`` leave the pool (a removal): once its workers are gone it
    is told to exit (``agent_retired``), and its connection dropping then is no loss. ``base``
    keeps device 0 and stays; an agent with a worker still alive waits."""
    import time

    from nereusd.daemon import registry

    monkeypatch.setattr(registry, "DISCONNECT_GRACE_S", 0.2)
    events, lost = [], []
    control = ControlPlane(heartbeat_timeout_s=60.0, on_event=lambda name, fields: events.append((name, fields)),
                           on_pool_change=lost.append)
    base, added = fake_agent(control, "base", 2), fake_agent(control, "added", 2)
    try:
        control.release_devices([1, 2, 3], "removed from the pool")
        for sock in (base, added):
            assert isinstance(P.decode(sock.recv()), P.StopWorkers)
        added.send(P.encode(P.Heartbeat(node_id="added", workers_alive=[3])))   # its worker 3 still runs
        control.poll(0.2)
        assert isinstance(P.decode(added.recv()), P.Heartbeat)
        assert control.retire_idle_agents() == []
        added.send(P.encode(P.Heartbeat(node_id="added", workers_alive=[])))
        control.poll(0.2)
        added.recv()
        assert control.retire_idle_agents() == ["added"] and sorted(control.agents) == ["base"]
        bye = P.decode(added.recv())
        assert isinstance(bye, P.Shutdown) and "left the pool" in bye.reason
        assert [f for name, f in events if name == "agent_retired"] == [
            {"node_id": "added", "devices": [2, 3], "slurm_job_id": None}]
        added.send(P.encode(P.Heartbeat(node_id="added", workers_alive=[])))   # sent before it read Shutdown
        added.close(linger=0)
        start = time.monotonic()
        while time.monotonic() - start < 1.0:
            base.send(P.encode(P.Heartbeat(node_id="base")))
            control.poll(0.1)
        assert lost == [] and control.refused_messages == 0 and control.lost_devices([2, 3]) == {}
        assert control.devices() == [0] and control.retire_idle_agents() == []
    finally:
        base.close()
        control.close()
