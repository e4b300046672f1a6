"""The control-plane wire protocol: versioned, typed messages between nereusd, agents and workers.

Every message is one JSON object ``{"v": PROTOCOL_VERSION, "type": ..., ...}`` sent as one
ZeroMQ frame. Decoding validates the whole message against its type: an unknown type, a
missing or unknown field, a wrong value type or another version raises :class:`ProtocolError`,
which the receiver answers with an :class:`ErrorReply` (it never drops a message silently and
never dies of one). Tensors never travel here: only commands, metrics and token ids.

Paths of a message:
    agent → nereusd:   RegisterAgent, Heartbeat, WorkerExited, FromWorkers / FromWorker (relay)
    nereusd → agent:   Welcome, SpawnWorkers, ToWorkers / ToWorker (relay), StopWorkers, Shutdown,
                       ErrorReply
    CLI → nereusd:     StatusRequest, PoolRequest;  nereusd → CLI: StatusReply
    worker → agent:    WorkerReady, TaskResult
    agent → worker:    Task, Shutdown
"""

from __future__ import annotations

import base64
import binascii
import json
import zlib
from typing import Annotated, Any, Literal, Mapping, Sequence, Union

import pydantic_core
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, model_validator

from nereusd.errors import ProtocolError
from nereusd.protocol.tasks import TaskArgs

PROTOCOL_VERSION = 1
MAX_FRAME_BYTES = 64 * 2**20
"""Largest ZeroMQ frame nereusd takes in (64 MiB, its socket's ``ZMQ_MAXMSGSIZE``: a larger frame
closes the sender's connection, unread). A longer message travels as the frames of one multipart
message (:func:`frames_of`), joined on receipt (:func:`joined`)."""
MAX_MESSAGE_BYTES = 2**30
"""Largest message, its frames joined (1 GiB): :func:`decode` refuses a longer one unparsed, and
senders refuse to send one, naming it (:func:`check_size`). A task's args and results grow with
its replica's sequences and their tokens, at about 6 bytes of JSON a token id and 20 a float: the
log-probabilities of 1,024 responses of 5,120 tokens (one actor-inference replica at DP 1) are
105 MB, and a train task's four per-token floats for 256 such sequences 105 MB."""


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, ser_json_inf_nan="constants")
    v: int = Field(PROTOCOL_VERSION, strict=True, ge=PROTOCOL_VERSION, le=PROTOCOL_VERSION)
    """The protocol version; strict, so that ``true`` or ``1.0`` on the wire is not version 1."""


MAX_DEVICE_MEMORY_BYTES = 1 << 50
"""Most memory one device may report (1 PiB; the largest GPUs hold 192 GB): an agent claiming
10^30 bytes was accepted and refused only at its join (an adversarial trial, 2026-12-06)."""


class DeviceInfo(BaseModel):
    """One accelerator (or virtual CPU device) seen by an agent."""

    model_config = ConfigDict(extra="forbid", frozen=True, ser_json_inf_nan="constants")
    local_index: int = Field(ge=0)
    kind: Literal["cpu", "cuda", "rocm"]
    name: str
    memory_bytes: int = Field(ge=0, le=MAX_DEVICE_MEMORY_BYTES)


class RegisterAgent(_Message):
    type: Literal["register_agent"] = "register_agent"
    node_id: str
    hostname: str
    pid: int
    devices: list[DeviceInfo]
    slurm_job_id: str | None = None
    """The Slurm allocation the agent runs in (a ``grow`` allocation differs from nereusd's)."""
    kept_devices: list[int] = Field(default_factory=list, max_length=4096)
    """A re-registration with a resumed nereusd after the previous one was lost: the global
    device indices the agent had (one per entry of ``devices``, in order). Empty: a new agent.
    Only ``nereusd --resume`` accepts it
    (:attr:`nereusd.daemon.control_plane.ControlPlane.accept_kept_workers`)."""
    kept_workers: list[int] = Field(default_factory=list, max_length=4096)
    """Of ``kept_devices``, those whose workers the agent kept running, their EMUs in memory."""


class Welcome(_Message):
    """nereusd's answer to a registration: the agent's devices' global indices."""

    type: Literal["welcome"] = "welcome"
    node_id: str
    global_devices: list[int]


class Heartbeat(_Message):
    type: Literal["heartbeat"] = "heartbeat"
    node_id: str
    workers_alive: list[int] = Field(default_factory=list)
    """Global device indices whose worker process is running."""
    waiting_s: dict[int, float] = Field(default_factory=dict, max_length=4096)
    """Workers waiting on peers (blocked in a collective) for at least a second without a break:
    ``{device: seconds}`` (nereusd's straggler rule counts them as arrived at their task)."""


class WorkerSpec(BaseModel):
    """One worker an agent must start."""

    model_config = ConfigDict(extra="forbid", frozen=True, ser_json_inf_nan="constants")
    device: int = Field(ge=0)
    """Global device index."""
    local_index: int = Field(ge=0)
    memory_capacity_bytes: int = Field(ge=1)
    rank: int | None = Field(None, ge=0)
    """torch.distributed rank in the world it joins (default: the device index)."""


class SpawnWorkers(_Message):
    type: Literal["spawn_workers"] = "spawn_workers"
    generation: int = Field(ge=0)
    world_size: int = Field(ge=1)
    store_host: str
    store_port: int = Field(ge=1, le=65535)
    workers: list[WorkerSpec]
    run_dir: str
    threads_per_worker: int = Field(1, ge=1)
    worker_stall_s: float = Field(120.0, gt=0, allow_inf_nan=False)
    """The agent kills a worker whose liveness beat has been silent this long and reports it
    stalled (the site's ``liveness.worker_stall_s``)."""


class StopWorkers(_Message):
    """nereusd → agent: stop the workers of these devices (they leave the pool, as a preempted GPU)."""

    type: Literal["stop_workers"] = "stop_workers"
    devices: list[int]
    reason: str = ""


class PoolRequest(_Message):
    """``nereus-launch pool RUN_DIR --remove N`` → nereusd: release ``remove`` devices at the next
    safe boundary (answered with a :class:`StatusReply`)."""

    type: Literal["pool_request"] = "pool_request"
    remove: int = Field(ge=1, strict=True)
    """Strict, as ``v``: ``true``, ``"1"`` or ``" 2 "`` each queued a real removal (an adversarial trial)."""


class WorkerExited(_Message):
    type: Literal["worker_exited"] = "worker_exited"
    node_id: str
    device: int
    exitcode: int | None
    stalled_s: float | None = Field(None, ge=0, allow_inf_nan=False)
    """Set when the agent killed the worker because its liveness beat was silent this many
    seconds (a stopped or frozen process); ``None``: the worker exited by itself."""


class Task(_Message):
    """A unit of work for one worker: ``args`` is the typed payload of its kind
    (:mod:`nereusd.protocol.tasks`), whose ``kind`` selects the handler."""

    type: Literal["task"] = "task"
    task_id: int = Field(ge=0)
    args: TaskArgs

    @property
    def kind(self) -> str:
        return self.args.kind


class TaskResult(_Message):
    type: Literal["task_result"] = "task_result"
    task_id: int = Field(ge=0)
    device: int
    ok: bool
    result: dict[str, Any] | None = None
    error: str | None = None
    error_kind: str | None = None
    """Exception class name on failure (``DeviceOutOfMemory``, ``PlanError``, ...)."""
    elapsed_s: float = 0.0


class WorkerReady(_Message):
    type: Literal["worker_ready"] = "worker_ready"
    device: int
    pid: int


class ToWorker(_Message):
    type: Literal["to_worker"] = "to_worker"
    device: int
    task: Task


class FromWorker(_Message):
    type: Literal["from_worker"] = "from_worker"
    device: int
    payload: Annotated[Union[WorkerReady, TaskResult], Field(discriminator="type")]


MAX_BATCH_ITEMS = 1024
"""Most relayed items in one :class:`ToWorkers` or :class:`FromWorkers` frame (an agent has at most
64 devices; a worker's results of one poll are few)."""


class ToWorkers(_Message):
    """nereusd → agent: one task per device of this agent, in one frame. A boundary of 8,192
    workers on 1,024 agents is 1,024 frames to encode, send and relay, not 8,192
    (``scripts/bench_control.py``)."""

    type: Literal["to_workers"] = "to_workers"
    items: list[ToWorker] = Field(min_length=1, max_length=MAX_BATCH_ITEMS)
    shared: dict[str, Any] | None = Field(None, exclude_if=lambda v: v is None)
    """(Absent from the frame when ``None``, so frames without it are what agents of the first
    version of this message read.) Args fields every item shares, sent once per frame instead of once per device (a
    transition's communicator plan and plans: 8,192 copies of them made a transition 1.8 GiB).
    The agent sets them in each item's args, validated, before relaying (:func:`with_shared`).
    Above :data:`SHARED_ZLIB_BYTES` they travel compressed, as ``shared_zlib`` (:func:`encode_shared`),
    and are inflated here when the frame is decoded."""

    @model_validator(mode="before")
    @classmethod
    def _inflate_shared(cls, data: Any) -> Any:
        if isinstance(data, dict) and "shared_zlib" in data:
            if data.get("shared") is not None:
                raise ValueError("a frame carries shared or shared_zlib, not both")
            data = {k: v for k, v in data.items() if k != "shared_zlib"} | {"shared": inflate_shared(data["shared_zlib"])}
        return data


SHARED_ZLIB_BYTES = 64 * 2**10
"""Shared fields whose JSON is larger than this (64 KiB) travel zlib-compressed. A transition's
communicator plan and plans at 8,192 devices are 224 KiB, 45 KiB compressed (level 1, 2 ms once
per task): 1,024 agents receive 60 MiB instead of 224 MiB (``scripts/bench_control.py``)."""


def encode_shared(shared: Mapping[str, Any]) -> bytes:
    """The member of a :class:`ToWorkers` frame that carries ``shared`` (JSON values): ``"shared":{...}``,
    or above :data:`SHARED_ZLIB_BYTES` ``"shared_zlib":"<base64 of the zlib-compressed JSON>"``.
    Encoded once per task, whatever the number of agents (:func:`encode_to_workers`)."""
    raw = pydantic_core.to_json(dict(shared))
    if len(raw) <= SHARED_ZLIB_BYTES:
        return b'"shared":' + raw
    return b'"shared_zlib":"' + base64.b64encode(zlib.compress(raw, 1)) + b'"'


def inflate_shared(text: Any) -> dict[str, Any]:
    """The shared fields of a ``shared_zlib`` member, inflated to at most :data:`MAX_MESSAGE_BYTES`.

    Raises:
        ValueError: not base64, not zlib, larger than the message limit inflated (a compression
            bomb), truncated, or not a JSON object (a validation error of the frame).
    """
    if not isinstance(text, str):
        raise ValueError(f"shared_zlib must be a base64 string, got {type(text).__name__}")
    try:
        inflater = zlib.decompressobj()
        raw = inflater.decompress(base64.b64decode(text, validate=True), MAX_MESSAGE_BYTES)
        if inflater.unconsumed_tail:
            raise ValueError(f"shared_zlib inflates past the {MAX_MESSAGE_BYTES}-byte message limit")
        if not inflater.eof:
            raise ValueError("shared_zlib is truncated")
        data = json.loads(raw)
    except (binascii.Error, zlib.error, UnicodeDecodeError, RecursionError) as err:
        raise ValueError(f"shared_zlib is not compressed JSON: {type(err).__name__}: {str(err)[:200]}") from None
    if not isinstance(data, dict):
        raise ValueError(f"shared_zlib must hold a JSON object, got {type(data).__name__}")
    return data


def with_shared(task: Task, shared: dict[str, Any] | None) -> Task:
    """``task`` with ``shared`` (a :class:`ToWorkers` frame's) set in its args, validated.

    Raises:
        ProtocolError: a shared field the task's args do not have, or a bad value (named).
    """
    if not shared:
        return task
    try:
        args = type(task.args).model_validate({**task.args.model_dump(), **shared})
    except ValidationError as err:
        raise ProtocolError(f"shared fields of a to_workers frame do not fit {task.args.kind!r} args: "
                            f"{str(err).splitlines()[0]} ({err.error_count()} errors)") from None
    return task.model_copy(update={"args": args})


class FromWorkers(_Message):
    """agent → nereusd: what the agent's workers sent since its last relay, in one frame."""

    type: Literal["from_workers"] = "from_workers"
    items: list[FromWorker] = Field(min_length=1, max_length=MAX_BATCH_ITEMS)


class Shutdown(_Message):
    type: Literal["shutdown"] = "shutdown"
    reason: str = ""


class StatusRequest(_Message):
    """``nereus-launch status`` asks nereusd for the job's state (needs no registration)."""

    type: Literal["status_request"] = "status_request"


class StatusReply(_Message):
    """Plan, pool, step and last decision, as nereusd sees them now."""

    type: Literal["status_reply"] = "status_reply"
    status: dict[str, Any]


class ErrorReply(_Message):
    """The answer to a message that could not be accepted."""

    type: Literal["error"] = "error"
    reason: str


AnyMessage = Annotated[
    Union[
        RegisterAgent, Welcome, Heartbeat, SpawnWorkers, WorkerExited, Task, TaskResult,
        WorkerReady, ToWorker, FromWorker, ToWorkers, FromWorkers, Shutdown, ErrorReply, StatusRequest,
        StatusReply, StopWorkers, PoolRequest,
    ],
    Field(discriminator="type"),
]
_ADAPTER: TypeAdapter = TypeAdapter(AnyMessage)
_KNOWN_TYPES = {
    "register_agent", "welcome", "heartbeat", "spawn_workers", "worker_exited", "task",
    "task_result", "worker_ready", "to_worker", "from_worker", "to_workers", "from_workers", "shutdown", "error",
    "status_request", "status_reply", "stop_workers", "pool_request",
}


def encode(message: _Message) -> bytes:
    """Serialise a message to one frame (UTF-8 JSON; non-finite floats as ``NaN``/``Infinity``,
    which :func:`decode` reads back — a diverged loss must reach nereusd as a number)."""
    return message.model_dump_json().encode()


BATCH_BYTES = 16 * 2**20
"""A ``ToWorkers`` message is closed once its items pass this size (far below the message limit)."""


def encode_to_workers(task_id: int, items: list[tuple[int, BaseModel]], max_bytes: int = BATCH_BYTES,
                      shared: bytes | None = None) -> list[bytes]:
    """The encoded messages ``ToWorkers(items=[ToWorker(device=d, task=Task(task_id, args)) ...])``, built
    from each args' JSON without building the messages: the same bytes :func:`encode` gives for
    them (``tests/unit/daemon/test_protocol.py``), at a third of the cost for 8,192 devices.

    Args:
        task_id: the task's id (≥ 0).
        items: ``(device, args)`` per device, the args validated task payloads.
        max_bytes: a message holds items up to about this many bytes (and at most
            :data:`MAX_BATCH_ITEMS`); a larger single item travels alone (in several ZeroMQ
            frames past :data:`MAX_FRAME_BYTES`: :func:`frames_of`).
        shared: the member that carries :attr:`ToWorkers.shared`, in every message
            (:func:`encode_shared`, encoded once by the caller, however many messages and agents).

    Returns:
        One message, or several when the items are many or large.

    Raises:
        ProtocolError: the shared fields take over half of :data:`MAX_MESSAGE_BYTES`, or one
            device's task over all of it (naming the kind and the device; nothing is returned).
    """
    head = f'{{"v":{PROTOCOL_VERSION},"type":"to_worker","device":'.encode()
    task = f',"task":{{"v":{PROTOCOL_VERSION},"type":"task","task_id":{int(task_id)},"args":'.encode()
    base = len(shared or b"")   # every message carries the shared fields
    if base > MAX_MESSAGE_BYTES // 2:
        raise ProtocolError(f"shared fields of {base} bytes leave no room in a {MAX_MESSAGE_BYTES}-byte message")
    batches, batch, size = [], [], base
    for d, args in items:
        item = head + str(int(d)).encode() + task + args.model_dump_json().encode() + b"}}"
        check_size(base + len(item), f"the {getattr(args, 'kind', 'task')} task for device {d}", TASK_SIZE_HINT)
        if batch and (size + len(item) > max_bytes or len(batch) >= MAX_BATCH_ITEMS):
            batches.append(batch)
            batch, size = [], base
        batch.append(item)
        size += len(item)
    if batch:
        batches.append(batch)
    opening = f'{{"v":{PROTOCOL_VERSION},"type":"to_workers","items":['.encode()
    closing = b"]}" if shared is None else b"]," + shared + b"}"
    return [opening + b",".join(b) + closing for b in batches]


TASK_SIZE_HINT = ("its replica's sequences are too many or too long for one task: more data-parallel replicas of "
                  "its model-stage, or fewer or shorter sequences a step, make it smaller")
"""What a task or result over :data:`MAX_MESSAGE_BYTES` needs (:func:`check_size`'s ``hint``, where
nereusd encodes a task and where a worker encodes its result)."""


def frames_of(message: bytes) -> list[bytes | memoryview]:
    """``message`` (an encoded message) as the frames of one ZeroMQ multipart message: itself
    when it fits :data:`MAX_FRAME_BYTES`, else consecutive slices of that size (views, not copies).
    :func:`joined` puts them back together."""
    if len(message) <= MAX_FRAME_BYTES:
        return [message]
    view = memoryview(message)
    return [view[i:i + MAX_FRAME_BYTES] for i in range(0, len(message), MAX_FRAME_BYTES)]


def joined(frames: Sequence[bytes]) -> bytes:
    """The message whose frames (:func:`frames_of`) are ``frames`` (a multipart message's parts,
    the ROUTER's identity frame removed).

    Raises:
        ProtocolError: no frame, or more than :data:`MAX_MESSAGE_BYTES` together (nothing is
            copied then).
    """
    if not frames:
        raise ProtocolError("a message with no payload frame")
    if len(frames) == 1:
        return frames[0]
    check_size(sum(len(f) for f in frames), f"a message of {len(frames)} frames")
    return b"".join(frames)


def check_size(size_bytes: int, what: str, hint: str = "") -> None:
    """Refuse a message of ``size_bytes`` over :data:`MAX_MESSAGE_BYTES`, naming ``what`` it is
    and, where given, what would make it smaller (``hint``: :data:`TASK_SIZE_HINT`).

    Raises:
        ProtocolError: ``"<what> is <size> bytes, over the 1073741824-byte message limit[: <hint>]"``.
    """
    if size_bytes > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"{what} is {size_bytes} bytes, over the {MAX_MESSAGE_BYTES}-byte message limit"
                            + (f": {hint}" if hint else ""))


def decode(frame: bytes) -> _Message:
    """Parse and validate one frame.

    Raises:
        ProtocolError: if the frame is too large, not a JSON object, of another protocol
            version, of an unknown type, or does not match its type's fields.
    """
    check_size(len(frame), "the message")
    try:   # the fast path: parse and validate in one pass (half the time of a results frame)
        msg = _ADAPTER.validate_json(frame)
        if "v" in msg.model_fields_set:   # a frame without its version is refused below
            return msg
    except Exception:  # noqa: BLE001 - refused below, by the checks that say why
        pass
    try:
        data = json.loads(frame)
    except (ValueError, RecursionError) as err:   # not UTF-8, not JSON, nested too deep, a huge integer
        raise ProtocolError(f"message is not JSON: {type(err).__name__}: {str(err)[:200]}") from None
    if not isinstance(data, dict):
        raise ProtocolError(f"message must be a JSON object, got {type(data).__name__}")
    version = data.get("v")
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {version!r} is not supported (this side speaks {PROTOCOL_VERSION})")
    kind = data.get("type")
    if not isinstance(kind, str) or kind not in _KNOWN_TYPES:
        raise ProtocolError(f"unknown message type {kind!r}")
    try:
        return _ADAPTER.validate_python(data)
    except RecursionError:
        raise ProtocolError(f"malformed {kind!r} message: nested too deep") from None
    except ValidationError as err:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'][1:]) or '<message>'}: {e['msg']}" for e in err.errors()
        )
        raise ProtocolError(f"malformed {kind!r} message: {problems}") from None
