"""The agent's relay between nereusd and its workers: one ``ToWorkers`` message fans out to the
workers, what the workers sent goes up in ``FromWorkers`` messages closed at the byte budget, and
a message past the protocol's frame limit travels in several frames (one frame past it would close
the connection at nereusd's socket). A real :class:`emu.agent.Agent` with its sockets; the workers
and nereusd are plain ZeroMQ peers speaking the protocol."""

from __future__ import annotations

import time

import zmq

from emu import agent as agent_module
from emu.agent import Agent
from nereusd import protocol as P


def _recv_all(sock: zmq.Socket, timeout_s: float = 2.0) -> list[list[bytes]]:
    out, deadline = [], time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if sock.poll(50):
            out.append(sock.recv_multipart())
        elif out:
            break
    return out


def test_relay_fans_out_a_batch_and_batches_results_under_the_byte_budget(tmp_path, monkeypatch):
    monkeypatch.setattr(agent_module, "RELAY_BATCH_BYTES", 4 * 2**20)
    ctx = zmq.Context.instance()
    daemon = ctx.socket(zmq.ROUTER)
    daemon.setsockopt(zmq.LINGER, 0)
    daemon.bind("tcp://127.0.0.1:0")
    agent = Agent(connect=daemon.getsockopt_string(zmq.LAST_ENDPOINT), node_id="n0", devices=[], run_dir=tmp_path)
    agent.workers = {0: None, 1: None, 2: None}   # the relay checks membership only
    workers = {}
    try:
        for d in agent.workers:
            sock = workers[d] = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IDENTITY, str(d).encode())
            sock.connect(agent.ipc_endpoint)
            sock.send(P.encode(P.WorkerReady(device=d, pid=1)))   # the agent's ROUTER learns each identity
        time.sleep(0.3)
        agent._relay_up()
        ready = [P.decode(f[-1]) for f in _recv_all(daemon)]
        assert len(ready) == 1 and sorted(i.device for i in ready[0].items) == [0, 1, 2]
        # nereusd → agent: one frame, three tasks, each reaches its worker
        frames = P.encode_to_workers(5, [(d, P.MemoryReportArgs()) for d in (0, 1, 2)])
        assert len(frames) == 1
        agent._on_daemon([frames[0]])
        for d, sock in workers.items():
            assert sock.poll(2000)
            assert P.decode(sock.recv()).task_id == 5
        # workers → nereusd: two 3 MiB results and a small one; the 4 MiB budget closes frames
        big = "x" * (3 * 2**20)
        for d, sock in workers.items():
            result = {"blob": big} if d < 2 else {"ok": 1}
            sock.send(P.encode(P.TaskResult(task_id=5, device=d, ok=True, result=result)))
        time.sleep(0.5)
        agent._relay_up()
        got = [P.decode(f[-1]) for f in _recv_all(daemon)]
        assert all(isinstance(m, P.FromWorkers) for m in got)
        assert sorted(i.device for m in got for i in m.items) == [0, 1, 2]
        assert len(got) == 2   # the second big result starts a new frame, the small one joins it
    finally:
        for sock in workers.values():
            sock.close(0)
        agent.close()
        daemon.close(0)


def test_messages_past_the_frame_limit_travel_in_frames_both_ways(tmp_path, monkeypatch):
    """A task of about 230 KiB and a result of about 600 KiB, with the frame limit at 64 KiB (nereusd's socket
    refuses a longer frame, as ``ZMQ_MAXMSGSIZE`` does at 64 MiB): the task reaches its worker
    whole, and the result reaches nereusd in frames within the limit, whole once joined."""
    from nereusd.protocol import messages

    limit = 64 * 1024
    monkeypatch.setattr(messages, "MAX_FRAME_BYTES", limit)
    ctx = zmq.Context.instance()
    daemon = ctx.socket(zmq.ROUTER)
    daemon.setsockopt(zmq.LINGER, 0)
    daemon.setsockopt(zmq.MAXMSGSIZE, limit)
    daemon.bind("tcp://127.0.0.1:0")
    agent = Agent(connect=daemon.getsockopt_string(zmq.LAST_ENDPOINT), node_id="n0", devices=[], run_dir=tmp_path)
    agent.workers = {0: None}
    worker = ctx.socket(zmq.DEALER)
    worker.setsockopt(zmq.LINGER, 0)
    worker.setsockopt(zmq.IDENTITY, b"0")
    try:
        worker.connect(agent.ipc_endpoint)
        worker.send_multipart(P.frames_of(P.encode(P.WorkerReady(device=0, pid=1))))
        time.sleep(0.3)
        agent._relay_up()
        [[identity, ready]] = _recv_all(daemon)
        assert isinstance(P.decode(ready), P.FromWorkers)
        sequences = [list(range(i, i + 4000)) for i in range(12)]   # ~230 KiB of token ids
        args = P.LogprobsArgs(model_stage="actor/inference", sequences=sequences, prompt_lens=[10] * 12)
        [message] = P.encode_to_workers(9, [(0, args)])
        assert len(message) > 3 * limit
        daemon.send_multipart([identity, *P.frames_of(message)])
        assert agent._up.poll(2000)
        agent._on_daemon(agent._up.recv_multipart())
        assert worker.poll(2000)
        task = P.decode(P.joined(worker.recv_multipart()))
        assert task.task_id == 9 and task.args.sequences == sequences
        logprobs = [[-0.123456789 * j for j in range(3990)] for _ in range(8)]   # ~600 KiB of JSON floats
        worker.send_multipart(P.frames_of(P.encode(P.TaskResult(task_id=9, device=0, ok=True,
                                                                result={"logprobs": logprobs}))))
        time.sleep(0.3)
        agent._relay_up()
        [[_, *frames]] = _recv_all(daemon)
        assert len(frames) > 3 and all(len(f) <= limit for f in frames)
        [item] = P.decode(P.joined(frames)).items
        assert item.payload.result["logprobs"] == logprobs
    finally:
        worker.close(0)
        agent.close()
        daemon.close(0)


def test_a_beat_pipe_tells_since_when_its_worker_waits_on_peers():
    """The agent reads the worker's beats: the last byte of a read says whether it waits on peers
    (``c``); the wait counts from the first such beat and ends at a ``.``."""
    import os

    from emu.agent import _Beat

    read_fd, write_fd = os.pipe()
    os.set_blocking(read_fd, False)
    try:
        beat = _Beat(read_fd, 0.0)
        os.write(write_fd, b"..c")
        beat.drain(10.0)
        os.write(write_fd, b"c")
        beat.drain(12.0)
        assert beat.last_s == 12.0 and beat.waiting_s(13.0) == 3.0
        os.write(write_fd, b"c.")
        beat.drain(14.0)
        assert beat.waiting_s(15.0) == 0.0
    finally:
        os.close(read_fd)
        os.close(write_fd)
