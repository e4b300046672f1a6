"""The wire protocol refuses malformed messages with clear errors; nereusd keeps serving."""

import base64
import json
import math
import zlib

import pytest
import zmq

from nereusd import protocol as P
from nereusd.daemon.control_plane import ControlPlane
from nereusd.errors import ProtocolError


def test_round_trip_of_every_path():
    task = P.Task(task_id=3, args=P.GenerateArgs(model_stage="actor/generation", prompts=[[1, 2, 3]], max_new_tokens=4,
                                                 temperature=1.0, greedy=False, stop_ids=(0,), pad_id=0, seed=1))
    msgs = [
        P.RegisterAgent(node_id="n1", hostname="h", pid=1,
                        devices=[P.DeviceInfo(local_index=0, kind="cpu", name="virtual-cpu", memory_bytes=10)]),
        P.ToWorker(device=2, task=task),
        P.FromWorker(device=2, payload=P.TaskResult(task_id=3, device=2, ok=True, result={"x": [1]})),
        P.FromWorker(device=2, payload=P.WorkerReady(device=2, pid=5)),
        P.Shutdown(reason="done"),
    ]
    for msg in msgs:
        assert P.decode(P.encode(msg)) == msg


def test_a_batch_of_tasks_built_from_its_args_is_the_batch_message():
    """``encode_to_workers`` writes the bytes ``encode`` gives for the same ``ToWorkers``."""
    gen = P.GenerateArgs(model_stage="actor/generation", prompts=[[1, 2], [3]], max_new_tokens=4, temperature=0.5,
                         greedy=False, stop_ids=(0,), pad_id=0, seed=1, seeds=[4, 5])
    items = [(7, gen), (9, P.TransitionRunArgs(ops=["a\"b", "é"])), (0, P.MemoryReportArgs())]
    msg = P.ToWorkers(items=[P.ToWorker(device=d, task=P.Task(task_id=12, args=a)) for d, a in items])
    assert P.encode_to_workers(12, items) == [P.encode(msg)]
    assert P.decode(P.encode_to_workers(12, items)[0]) == msg
    # a byte budget closes frames between items (a larger item travels alone)
    frames = P.encode_to_workers(12, items, max_bytes=1)
    assert [[i.device for i in P.decode(f).items] for f in frames] == [[7], [9], [0]]


def test_shared_fields_travel_once_per_frame_and_reach_every_item_validated():
    """``ToWorkers.shared`` (a transition's communicator plan and plans, once per agent): the
    frame is the message ``encode`` gives, and ``with_shared`` — what the agent does before
    relaying — sets the fields in each item's args, validated; a field the args lack is refused."""
    items = [(d, P.TransitionPrepareArgs(dag=f'{{"ops":[],"d":{d}}}')) for d in (3, 4)]
    shared = {"communicators": [["op1", [3, 4]]], "plans": "{}", "changed": ["actor/training"]}
    frame, = P.encode_to_workers(5, items, shared=P.encode_shared(shared))
    msg = P.decode(frame)
    assert frame == P.encode(P.ToWorkers(items=[P.ToWorker(device=d, task=P.Task(task_id=5, args=a)) for d, a in items],
                                         shared=shared))
    relayed = [P.with_shared(i.task, msg.shared).args for i in msg.items]
    assert [a.dag for a in relayed] == [a.dag for _, a in items]
    assert all(a.communicators == [("op1", [3, 4])] and a.changed == ["actor/training"] for a in relayed)
    with pytest.raises(ProtocolError, match="shared fields"):
        P.with_shared(msg.items[0].task, {"no_such_field": 1})
    with pytest.raises(ProtocolError, match="shared fields"):
        P.with_shared(msg.items[0].task, {"communicators": "not a list"})


def test_large_shared_fields_travel_compressed_and_decode_to_the_same_message(monkeypatch):
    """Shared fields over ``SHARED_ZLIB_BYTES`` (a transition's communicator plan at thousands of
    devices) travel as ``shared_zlib``, a fraction of their size, and decode to the message with
    them uncompressed; a bad, truncated, over-limit or non-object ``shared_zlib`` is refused."""
    items = [(d, P.TransitionPrepareArgs(dag='{"ops":[]}')) for d in (3, 4)]
    shared = {"communicators": [[f"actor/training:extend{i}", [i, i + 4096]] for i in range(4096)],
              "plans": "{}", "changed": ["actor/training"]}
    member = P.encode_shared(shared)
    assert member.startswith(b'"shared_zlib":"')
    assert len(member) < len(json.dumps(shared)) / 3
    frame, = P.encode_to_workers(5, items, shared=member)
    msg = P.decode(frame)
    assert msg == P.ToWorkers(items=[P.ToWorker(device=d, task=P.Task(task_id=5, args=a)) for d, a in items],
                              shared=shared)
    assert P.with_shared(msg.items[1].task, msg.shared).args.communicators[4095] == ("actor/training:extend4095",
                                                                                     [4095, 8191])

    def with_member(text: str) -> bytes:
        return frame[:frame.index(b',"shared_zlib"')] + b',"shared_zlib":' + text.encode() + b"}"

    blob = member[len(b'"shared_zlib":"'):-1]
    from nereusd.protocol import messages

    monkeypatch.setattr(messages, "MAX_MESSAGE_BYTES", 2**20)   # a bomb past 1 GiB takes seconds to build
    bomb = base64.b64encode(zlib.compress(b"[" + b" " * (2**20 + 10) + b"]", 9)).decode()
    for bad, reason in [('"not base64!"', "not compressed JSON"),
                        (f'"{blob[:len(blob) // 2].decode()}"', "truncated|not compressed JSON"),
                        (f'"{bomb}"', "message limit"),
                        (f'"{base64.b64encode(zlib.compress(b"[1, 2]")).decode()}"', "JSON object"),
                        (f'"{base64.b64encode(zlib.compress(b"[" * 100000)).decode()}"', "not compressed JSON"),
                        ("17", "base64 string")]:
        with pytest.raises(ProtocolError, match=reason):
            P.decode(with_member(bad))
    both = frame[:-1] + b',"shared":{}}'
    with pytest.raises(ProtocolError, match="not both"):
        P.decode(both)


@pytest.mark.parametrize("frame, match", [
    (b"\xff\xfe", r"not JSON"),
    (b"[1, 2]", r"must be a JSON object, got list"),
    (json.dumps({"v": 2, "type": "heartbeat", "node_id": "a"}).encode(), r"protocol version 2 is not supported"),
    (json.dumps({"v": 1, "type": "reboot"}).encode(), r"unknown message type 'reboot'"),
    (json.dumps({"v": 1, "type": "heartbeat"}).encode(), r"malformed 'heartbeat' message: node_id: Field required"),
    (json.dumps({"v": 1, "type": "heartbeat", "node_id": "a", "evil": 1}).encode(),
     r"malformed 'heartbeat' message: evil: Extra inputs are not permitted"),
    (json.dumps({"v": 1, "type": "task", "task_id": -1, "args": {"kind": "memory_report"}}).encode(),
     r"task_id: Input should be greater"),
    (json.dumps({"v": 1, "type": "task", "task_id": 1, "args": {"kind": "reboot"}}).encode(),
     r"malformed 'task' message: args: Input tag 'reboot' found using 'kind' does not match"),
    (json.dumps({"v": 1, "type": "task", "task_id": 1, "args": {"kind": "save_checkpoint"}}).encode(),
     r"malformed 'task' message: args.save_checkpoint.dir: Field required"),
    (json.dumps({"v": 1, "type": "task", "task_id": 1, "args": {"kind": "transition_run", "ops": "a"}}).encode(),
     r"args.transition_run.ops: Input should be a valid list"),
    (b'{"v": 1, "type": []}', r"unknown message type \[\]"),
    (b'{"v": true, "type": "heartbeat", "node_id": "a"}', r"protocol version True is not supported"),
    (b'{"v": 1, "type": "pool_request", "remove": ' + b"1" * 5000 + b"}", r"not JSON: ValueError: Exceeds the limit"),
    (b"[" * 1000 + b"]" * 1000, r"not JSON: RecursionError"),
    # each queued a real device removal (an adversarial trial, 2026-12-07)
    (b'{"v": 1, "type": "pool_request", "remove": true}', r"remove: Input should be a valid integer"),
    (b'{"v": 1, "type": "pool_request", "remove": " 2 "}', r"remove: Input should be a valid integer"),
    (b'{"v": 1, "type": "pool_request", "remove": 1.0}', r"remove: Input should be a valid integer"),
    # a device of 10^30 bytes was accepted and refused only at its join (an adversarial trial)
    (json.dumps({"v": 1, "type": "register_agent", "node_id": "a", "hostname": "h", "pid": 1,
                 "devices": [{"local_index": 0, "kind": "cpu", "name": "x", "memory_bytes": 10**30}]}).encode(),
     r"devices.0.memory_bytes: Input should be less than or equal to 1125899906842624"),
])
def test_decode_refuses(frame, match):
    with pytest.raises(ProtocolError, match=match):
        P.decode(frame)


def test_oversized_message_refused(monkeypatch):
    from nereusd.protocol import messages

    monkeypatch.setattr(messages, "MAX_MESSAGE_BYTES", 1000)
    with pytest.raises(ProtocolError, match="the message is 1001 bytes, over the 1000-byte message limit"):
        P.decode(b" " * 1001)
    with pytest.raises(ProtocolError, match="a message of 3 frames is 1200 bytes, over"):
        P.joined([b" " * 400] * 3)
    with pytest.raises(ProtocolError, match="no payload frame"):
        P.joined([])
    # a sender names the task that would be over it, before anything is sent
    big = P.LogprobsArgs(model_stage="actor/inference", sequences=[list(range(300))], prompt_lens=[1])
    with pytest.raises(ProtocolError, match="the logprobs task for device 3 is [0-9]+ bytes, over the 1000-byte .*: its replica"):
        P.encode_to_workers(1, [(2, P.MemoryReportArgs()), (3, big)])


def test_frames_of_splits_at_the_frame_limit_and_joined_restores(monkeypatch):
    from nereusd.protocol import messages

    monkeypatch.setattr(messages, "MAX_FRAME_BYTES", 10)
    data = bytes(range(35))
    frames = P.frames_of(data)
    assert [len(f) for f in frames] == [10, 10, 10, 5] and P.joined(frames) == data
    assert P.frames_of(data[:10]) == [data[:10]]


def test_a_worker_result_over_the_message_limit_becomes_a_failure_that_says_so(monkeypatch):
    from emu.worker.main import result_message
    from nereusd.protocol import messages

    small = P.TaskResult(task_id=4, device=1, ok=True, result={"logprobs": [[-0.5] * 300]}, elapsed_s=2.0)
    assert P.decode(result_message(small, "logprobs")) == small
    monkeypatch.setattr(messages, "MAX_MESSAGE_BYTES", 1000)
    failed = P.decode(result_message(small, "logprobs"))
    assert (failed.task_id, failed.device, failed.ok, failed.error_kind) == (4, 1, False, "ProtocolError")
    assert failed.error.startswith("the result of the logprobs task on device 1 is ")
    assert "more data-parallel replicas" in failed.error


def test_control_plane_joins_a_message_sent_in_several_frames(monkeypatch):
    """nereusd's socket takes frames up to the frame limit (``ZMQ_MAXMSGSIZE``); a longer message
    comes as several frames of one multipart message, joined (and refused past the message limit)."""
    from nereusd.protocol import messages

    monkeypatch.setattr(messages, "MAX_FRAME_BYTES", 256)
    control = ControlPlane()
    sock = _dealer(control.endpoint)
    try:
        register = P.encode(P.RegisterAgent(node_id="n0", hostname="h" * 600, pid=1, devices=[
            P.DeviceInfo(local_index=i, kind="cpu", name="virtual-cpu", memory_bytes=1) for i in range(2)]))
        frames = P.frames_of(register)
        assert len(frames) > 2
        sock.send_multipart(frames)
        welcome = _reply(control, sock)
        assert isinstance(welcome, P.Welcome) and welcome.global_devices == [0, 1]
        monkeypatch.setattr(messages, "MAX_MESSAGE_BYTES", 1000)
        sock.send_multipart([b" " * 250] * 5)
        reply = _reply(control, sock)
        assert isinstance(reply, P.ErrorReply) and "a message of 5 frames is 1250 bytes" in reply.reason
    finally:
        sock.close()
        control.close()


def _dealer(endpoint: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return sock


def _reply(control: ControlPlane, sock: zmq.Socket) -> P._Message:
    for _ in range(50):
        control.poll(0.02)
        if sock.poll(10):
            return P.decode(P.joined(sock.recv_multipart()))
    raise AssertionError("no reply from nereusd")


def test_control_plane_refuses_bad_peers_and_keeps_serving():
    events = []
    control = ControlPlane(on_event=lambda name, fields: events.append(name))
    bad, good = _dealer(control.endpoint), _dealer(control.endpoint)
    try:
        bad.send(b"not json at all")
        assert isinstance(_reply(control, bad), P.ErrorReply)
        bad.send(P.encode(P.Heartbeat(node_id="ghost")))  # never registered
        reply = _reply(control, bad)
        assert isinstance(reply, P.ErrorReply) and "unregistered peer" in reply.reason
        bad.send_multipart([b"two", b"frames"])
        assert isinstance(_reply(control, bad), P.ErrorReply)
        assert control.refused_messages == 3 and events.count("message_refused") == 3

        good.send(P.encode(P.RegisterAgent(node_id="n0", hostname="h", pid=1, devices=[
            P.DeviceInfo(local_index=i, kind="cpu", name="virtual-cpu", memory_bytes=1) for i in range(2)])))
        welcome = _reply(control, good)
        assert isinstance(welcome, P.Welcome) and welcome.global_devices == [0, 1]
        # a second registration of the same node is refused, the first stays
        bad.send(P.encode(P.RegisterAgent(node_id="n0", hostname="h", pid=2, devices=[])))
        assert isinstance(_reply(control, bad), P.ErrorReply)
        assert control.devices() == [0, 1]
        # a registered agent may not relay for a device it does not own
        good.send(P.encode(P.FromWorker(device=5, payload=P.WorkerReady(device=5, pid=9))))
        reply = _reply(control, good)
        assert isinstance(reply, P.ErrorReply) and "does not own" in reply.reason
    finally:
        bad.close()
        good.close()
        control.close()


def test_heartbeat_loss_declares_agent_lost():
    control = ControlPlane(heartbeat_timeout_s=0.2)
    sock = _dealer(control.endpoint)
    try:
        sock.send(P.encode(P.RegisterAgent(node_id="n0", hostname="h", pid=1, devices=[
            P.DeviceInfo(local_index=0, kind="cpu", name="virtual-cpu", memory_bytes=1)])))
        _reply(control, sock)
        control.poll(0.4)
        assert control.lost_agents == ["n0"] and 0 in control.exited_workers
    finally:
        sock.close()
        control.close()


def test_task_payloads_are_typed_per_kind():
    args = P.task_args("train", {"model_stage": "actor/training", "sequences": [[1, 2]], "prompt_lens": [1],
                                 "per_token": {"advantages": [[0.5]]},
                                 "loss": {"kind": "value", "value_clip": 0.2}})
    assert isinstance(args, P.TrainArgs) and isinstance(args.loss, P.ValueLoss)
    with pytest.raises(ProtocolError, match="unknown task kind 'noop'"):
        P.task_args("noop", {})
    with pytest.raises(ProtocolError, match=r"malformed 'generate' task: .*max_new_tokens: Field required"):
        P.task_args("generate", {"model_stage": "actor/generation", "prompts": [[1]]})
    with pytest.raises(ProtocolError, match=r"loss.policy.clip: Field required"):
        P.task_args("train", {"model_stage": "actor/training", "sequences": [], "prompt_lens": [], "per_token": {},
                              "loss": {"kind": "policy"}})


def test_non_finite_numbers_cross_the_wire():
    """A diverged loss or a NaN advantage must arrive as a number, not as a frame the other side
    refuses (which left the task pending)."""
    nan = float("nan")
    result = P.FromWorker(device=0, payload=P.TaskResult(task_id=1, device=0, ok=True, result={"metrics": {"loss": nan}},
                                                         elapsed_s=float("inf")))
    back = P.decode(P.encode(result))
    assert math.isnan(back.payload.result["metrics"]["loss"])
    assert back.payload.elapsed_s == float("inf")
    task = P.task_args("train", {"model_stage": "actor/training", "sequences": [[1]], "prompt_lens": [1],
                                 "per_token": {"advantages": [[nan]]}, "loss": {"kind": "value", "value_clip": 0.2}})
    assert math.isnan(P.decode(P.encode(P.Task(task_id=2, args=task))).args.per_token["advantages"][0][0])


def test_an_agent_may_report_only_its_own_workers_and_not_claim_more_than_a_node():
    """A peer registered with no devices once made nereusd drop a healthy device of another
    agent by sending ``worker_exited`` for it; a fake agent claiming 1,000 devices made the job
    re-plan onto them. Both are refused; the real agent's devices stay."""
    control = ControlPlane(max_devices_per_agent=4)
    real, fake = _dealer(control.endpoint), _dealer(control.endpoint)

    def devices(n):
        return [P.DeviceInfo(local_index=i, kind="cpu", name="virtual-cpu", memory_bytes=1) for i in range(n)]

    try:
        real.send(P.encode(P.RegisterAgent(node_id="n0", hostname="h", pid=1, devices=devices(2))))
        assert isinstance(_reply(control, real), P.Welcome)
        fake.send(P.encode(P.RegisterAgent(node_id="n9", hostname="h", pid=2, devices=devices(1000))))
        reply = _reply(control, fake)
        assert isinstance(reply, P.ErrorReply) and "claims 1000 devices; an agent may register at most 4" in reply.reason
        fake.send(P.encode(P.RegisterAgent(node_id="n1", hostname="h", pid=2, devices=[])))
        assert isinstance(_reply(control, fake), P.Welcome)
        fake.send(P.encode(P.RegisterAgent(node_id="n2", hostname="h", pid=2, devices=[])))
        reply = _reply(control, fake)   # one peer, one agent
        assert isinstance(reply, P.ErrorReply) and "already registered as agent 'n1'" in reply.reason
        fake.send(P.encode(P.WorkerExited(node_id="n1", device=1, exitcode=-9)))
        reply = _reply(control, fake)
        assert isinstance(reply, P.ErrorReply) and "exit of device 1 it does not own" in reply.reason
        assert control.exited_workers == {} and control.devices() == [0, 1]
    finally:
        real.close()
        fake.close()
        control.close()


def test_a_flood_of_bad_frames_is_answered_but_journalled_sparingly(monkeypatch):
    from nereusd.daemon import control_plane as cp

    events = []
    control = ControlPlane(on_event=lambda name, fields: events.append(fields))
    try:
        for _ in range(500):
            control._receive([b"flooder", b"not json"])
        assert control.refused_messages == 500
        assert len(events) == cp.REFUSALS_SHOWN   # 490 counted, not journalled
        monkeypatch.setattr(cp, "REFUSAL_WINDOW_S", 0.0)   # the window ends: one record says how many
        control._receive([b"flooder", b"not json"])
        assert events[cp.REFUSALS_SHOWN] == {"peer": b"flooder".hex(), "suppressed": 490,
                                             "window_s": events[cp.REFUSALS_SHOWN]["window_s"]}
    finally:
        control.close()
