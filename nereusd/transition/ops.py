"""Frozen plan objects of a transition: EMUs, primitive ops, edges and the DAG, with JSON.

Vocabulary of the Nereus paper §5–§6 and DESIGN.md ("EMU state and primitives"). A transition
DAG is built by :func:`nereusd.transition.plan_transition`; this module only defines the
objects, so that a worker can execute a DAG it received over the control plane and a test can
check one without processes.

What each :class:`Op` kind means, device by device (``holding`` = the state of one
model-stage at one ``(layout, position)`` on one device):

``split``
    ``source_*``: all devices of one current EMU at layout ``T`` with their positions;
    ``target_*``: the devices that *receive* (a subset, same order) with their positions in
    ``T_sub``. Each receiver's ``T`` holding becomes its ``T_sub`` holding by a position-wise
    all-gather inside its gather group (the devices of the EMU with the same ``T_sub``
    position); the other devices only send and keep their ``T`` holding.
    ``host_staged`` lists receivers that copy their ``T`` holding to host memory and free it
    *before* allocating the ``T_sub`` one, so that the device never holds both: a Split that
    would not fit memory otherwise (:func:`nereusd.transition.memory.stage_in_host`).
``destroy``
    ``source_*``: the holdings freed (layout, devices, positions); no target.
    ``discard`` is set only when the model-stage leaves the plan (its state is dropped on
    purpose); otherwise a Destroy never frees the last copy.
``extend``
    ``source_devices[i]`` sends its whole ``T_sub`` holding at ``source_positions[i]`` to
    ``target_devices[i]`` (rank-aligned pairs, ``source_positions == target_positions``).
``merge``
    ``source_*``: the devices of one target EMU with their ``T_sub`` positions;
    ``target_*``: the same devices, same order, with their positions in ``T*``. Each device
    keeps its slice of what it holds; routes with ``src == dst`` are such local slices, routes
    with ``src != dst`` are the few pieces a replicated parameter still needs (k/v projections
    when ``T*`` replicates them, ``tp* > num_kv_heads``). ``host_staged`` devices copy their
    ``T_sub`` holding to host memory and free it before allocating the ``T*`` one, and slice (and
    send) from the host copy.
``create``
    ``target_*``: a new model-stage's EMUs at ``T*``. Their content comes from outside the
    transition (initial weights or the next weight synchronisation); nothing is copied here.

Routes are ``(src device, dst device, shard)`` with a :class:`~nereusd.shards.Shard` naming the
parameter slice (and the same slice of its optimizer tensors).
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Mapping, Sequence

from nereusd.errors import PlanError
from nereusd.plan import Candidate, Layout, ModelStage, Plan
from nereusd.shards import Position, Shard

SCHEMA_VERSION = 1
"""Version of the JSON form of :class:`TransitionDag`; a reader refuses any other."""

MAX_ELEMENTS = 10**15
"""More parameter elements than any holding has (a 1,000× larger model than the largest today):
a count above it in a DAG is a corrupt one."""

STAGING_BYTES = 64 << 20
"""Default :attr:`TransitionDag.staging_bytes`: the most one op stages on one device at a time
(``nereusd.transition.memory.MemoryBudget.collective_buffer_bytes``)."""


class OpKind(str, enum.Enum):
    """The primitives of paper §5.2, plus ``create`` for a model-stage that joins the plan."""

    SPLIT = "split"
    DESTROY = "destroy"
    EXTEND = "extend"
    MERGE = "merge"
    CREATE = "create"

    def __str__(self) -> str:
        return self.value


class EdgeReason(str, enum.Enum):
    """Why an edge exists: a state dependency of a local DAG, or release-before-acquire."""

    STATE = "state"
    RESOURCE = "resource"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Emu:
    """One Elastic Model Unit: one DP replica of one model-stage (paper §5.1).

    ``devices`` are in ``(pp_rank, tp_rank)`` order, ``devices[pp_rank * tp + tp_rank]``.
    """

    model_stage: ModelStage
    layout: Layout
    dp_rank: int
    devices: tuple[int, ...]

    def position_of(self, device: int) -> Position:
        """``(pp_rank, tp_rank)`` of ``device`` in this unit.

        Raises:
            PlanError: if ``device`` is not in the unit.
        """
        try:
            i = self.devices.index(device)
        except ValueError:
            raise PlanError(f"device {device} is not in EMU {self.model_stage}#{self.dp_rank} "
                            f"{list(self.devices)}") from None
        return (i // self.layout.tp, i % self.layout.tp)


def emu_collection(model_stage: ModelStage, candidate: Candidate) -> tuple[Emu, ...]:
    """``E_M = Φ(π_M)``: one EMU per DP replica of ``candidate`` (paper §6.1)."""
    return tuple(
        Emu(model_stage, candidate.layout, d, candidate.replica_devices(d)) for d in range(candidate.dp)
    )


def emu_collections(plan: Plan) -> dict[ModelStage, tuple[Emu, ...]]:
    """``E(S)``: the EMU collection of every model-stage of ``plan``, in canonical order."""
    return {m: emu_collection(m, c) for m, c in plan.items()}


@dataclass(frozen=True)
class Route:
    """``shard`` moves (or, for a Merge with ``src == dst``, is sliced) from ``src`` to ``dst``."""

    src: int
    dst: int
    shard: Shard

    def to_list(self) -> list[Any]:
        return [self.src, self.dst, self.shard.to_list()]

    @classmethod
    def from_list(cls, data: Sequence[Any]) -> "Route":
        """Raises: PlanError if ``data`` is not ``[src, dst, shard]``."""
        try:
            src, dst, shard = data
            return cls(int(src), int(dst), Shard.from_list(shard))
        except (TypeError, ValueError):
            raise PlanError(f"route: expected [src, dst, shard], got {data!r}") from None


@dataclass(frozen=True)
class Op:
    """One primitive of a transition (see the module docstring for each kind).

    Attributes:
        id: unique in its DAG, ``"<role>/<stage>:<kind><n>"``.
        kind: the primitive.
        model_stage: whose state it acts on.
        source_layout, source_devices, source_positions: holdings read or freed
            (``None``/empty for ``create``); positions are ``(pp_rank, tp_rank)``.
        target_layout, target_devices, target_positions: holdings written (``None``/empty for
            ``destroy``).
        routes: what moves, ``(src, dst, shard)``; empty for ``destroy`` and ``create``.
        discard: ``destroy`` of a model-stage that leaves the plan.
        host_staged: ``split`` and ``merge``: ``(device, parameter elements of the holding it
            frees)`` of the receivers that stage that holding in host memory (module docstring),
            sorted.
    """

    id: str
    kind: OpKind
    model_stage: ModelStage
    source_layout: Layout | None
    source_devices: tuple[int, ...]
    source_positions: tuple[Position, ...]
    target_layout: Layout | None
    target_devices: tuple[int, ...]
    target_positions: tuple[Position, ...]
    routes: tuple[Route, ...] = ()
    discard: bool = False
    host_staged: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        for entry in self.host_staged:
            if not (isinstance(entry, (tuple, list)) and len(entry) == 2 and all(
                    isinstance(v, int) and not isinstance(v, bool) for v in entry)):
                raise PlanError(f"op {self.id}: host_staged entries must be [device, elements] integer pairs, "
                                f"got {entry!r}")
        object.__setattr__(self, "host_staged", tuple(sorted((x, n) for x, n in self.host_staged)))
        if self.host_staged:
            staged = [x for x, _ in self.host_staged]
            if self.kind not in (OpKind.SPLIT, OpKind.MERGE):
                raise PlanError(f"op {self.id}: only a Split or a Merge stages holdings in host memory")
            if len(set(staged)) != len(staged) or not set(staged) <= set(int(d) for d in self.target_devices):
                raise PlanError(f"op {self.id}: host-staged devices {staged} must be distinct receivers")
            if any(not 0 < n <= MAX_ELEMENTS for _, n in self.host_staged):
                raise PlanError(f"op {self.id}: a host-staged holding must have 1 to {MAX_ELEMENTS:.0e} elements")
        object.__setattr__(self, "source_devices", tuple(int(d) for d in self.source_devices))
        object.__setattr__(self, "target_devices", tuple(int(d) for d in self.target_devices))
        for name in ("source_positions", "target_positions"):
            object.__setattr__(self, name, tuple((int(p), int(t)) for p, t in getattr(self, name)))
        object.__setattr__(self, "routes", tuple(self.routes))
        if len(self.source_devices) != len(self.source_positions):
            raise PlanError(f"op {self.id}: {len(self.source_devices)} source devices but "
                            f"{len(self.source_positions)} positions")
        if len(self.target_devices) != len(self.target_positions):
            raise PlanError(f"op {self.id}: {len(self.target_devices)} target devices but "
                            f"{len(self.target_positions)} positions")

    @property
    def staged_elements(self) -> dict[int, int]:
        """``{device: parameter elements}`` of the holdings this op stages in host memory."""
        return dict(self.host_staged)

    @property
    def devices(self) -> tuple[int, ...]:
        """Every device the op touches, sorted."""
        return tuple(sorted(set(self.source_devices) | set(self.target_devices)))

    @property
    def participants(self) -> frozenset[int]:
        """Every device that takes part: holds, receives, sends or frees for it (its
        :attr:`devices` and both ends of every route)."""
        return frozenset(self.source_devices) | frozenset(self.target_devices) | {
            x for r in self.routes for x in (r.src, r.dst)}

    def describe(self) -> str:
        """Short text, e.g. ``actor/training:extend0 tp2·pp1 [0,1]→[4,5]``."""
        lay = self.target_layout or self.source_layout
        src = ",".join(map(str, self.source_devices))
        dst = ",".join(map(str, self.target_devices))
        return f"{self.id} tp{lay.tp}·pp{lay.pp} [{src}]→[{dst}]"

    def to_dict(self) -> dict[str, Any]:
        def lay(layout: Layout | None) -> list[int] | None:
            return None if layout is None else [layout.tp, layout.pp]

        return {
            "id": self.id,
            "kind": self.kind.value,
            "model_stage": str(self.model_stage),
            "source_layout": lay(self.source_layout),
            "source_devices": list(self.source_devices),
            "source_positions": [list(p) for p in self.source_positions],
            "target_layout": lay(self.target_layout),
            "target_devices": list(self.target_devices),
            "target_positions": [list(p) for p in self.target_positions],
            "routes": [r.to_list() for r in self.routes],
            "discard": self.discard,
            **({"host_staged": [list(h) for h in self.host_staged]} if self.host_staged else {}),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Op":
        """Inverse of :meth:`to_dict`.

        Raises:
            PlanError: naming the op and the field on a missing, unknown or bad field.
        """
        allowed = {"id", "kind", "model_stage", "source_layout", "source_devices", "source_positions",
                   "target_layout", "target_devices", "target_positions", "routes", "discard"}
        optional = {"host_staged"}   # absent: nothing staged (and in DAGs written before it existed)
        ident = data.get("id", "?") if isinstance(data, Mapping) else "?"
        if not isinstance(data, Mapping):
            raise PlanError(f"op: expected an object, got {data!r}")
        unknown = sorted(set(data) - allowed - optional)
        if unknown:
            raise PlanError(f"op {ident}: unknown field {unknown[0]!r}")
        missing = sorted(allowed - set(data))
        if missing:
            raise PlanError(f"op {ident}: missing field {missing[0]!r}")

        def lay(value: Any) -> Layout | None:
            return None if value is None else Layout(int(value[0]), int(value[1]))

        try:
            kind = OpKind(data["kind"])
        except ValueError:
            raise PlanError(f"op {ident}: unknown kind {data['kind']!r}") from None
        try:
            return cls(
                id=str(data["id"]),
                kind=kind,
                model_stage=ModelStage.parse(data["model_stage"]),
                source_layout=lay(data["source_layout"]),
                source_devices=tuple(data["source_devices"]),
                source_positions=tuple(tuple(p) for p in data["source_positions"]),
                target_layout=lay(data["target_layout"]),
                target_devices=tuple(data["target_devices"]),
                target_positions=tuple(tuple(p) for p in data["target_positions"]),
                routes=tuple(Route.from_list(r) for r in data["routes"]),
                discard=bool(data["discard"]),
                host_staged=tuple((x, n) for x, n in data.get("host_staged", ())),
            )
        except (TypeError, ValueError, IndexError, OverflowError) as err:
            raise PlanError(f"op {ident}: malformed field: {err}") from None


@dataclass(frozen=True)
class Edge:
    """``src`` must complete before ``dst`` starts."""

    src: str
    dst: str
    reason: EdgeReason = EdgeReason.STATE


@dataclass(frozen=True)
class TransitionDag:
    """The global transition DAG from ``current`` to ``target`` (paper §6.1).

    ``ops`` are in construction order (model-stages in canonical order, each local DAG in
    Split → Destroy → Extend → Destroy → Merge order); ``edges`` hold the local state
    dependencies and the release-before-acquire edges between them. ``staging_bytes`` bounds
    the buffers one op stages on one device at a time: the executor moves larger exchanges in
    chunks (``emu.state.primitives``), and the memory check counts at most this much
    (:func:`nereusd.transition.memory.check_feasibility`); :func:`nereusd.transition.plan_transition`
    sets it from the budget's ``collective_buffer_bytes``.

    Raises:
        PlanError: on an op id used twice, an edge naming an unknown op, or a negative
            ``staging_bytes``.
    """

    current: Plan
    target: Plan
    ops: tuple[Op, ...]
    edges: tuple[Edge, ...]
    staging_bytes: int = STAGING_BYTES
    _index: Mapping[str, int] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.staging_bytes, bool) or not isinstance(self.staging_bytes, int) or self.staging_bytes < 0:
            raise PlanError(f"transition DAG: staging_bytes must be an integer >= 0, got {self.staging_bytes!r}")
        index: dict[str, int] = {}
        for i, op in enumerate(self.ops):
            if op.id in index:
                raise PlanError(f"transition DAG: op id {op.id!r} is used twice")
            index[op.id] = i
        for e in self.edges:
            for end in (e.src, e.dst):
                if end not in index:
                    raise PlanError(f"transition DAG: edge {e.src} → {e.dst} names unknown op {end!r}")
        object.__setattr__(self, "_index", index)

    def __len__(self) -> int:
        return len(self.ops)

    def __iter__(self) -> Iterator[Op]:
        return iter(self.ops)

    def op(self, op_id: str) -> Op:
        """The op with id ``op_id``.

        Raises:
            PlanError: if there is none.
        """
        try:
            return self.ops[self._index[op_id]]
        except KeyError:
            raise PlanError(f"transition DAG: no op {op_id!r}") from None

    def index_of(self, op_id: str) -> int:
        return self._index[op_id]

    def predecessors(self, op_id: str) -> list[str]:
        return [e.src for e in self.edges if e.dst == op_id]

    def successors(self, op_id: str) -> list[str]:
        return [e.dst for e in self.edges if e.src == op_id]

    def slices(self, devices: Iterable[int]) -> dict[int, "TransitionDag"]:
        """Per device of ``devices``: the DAG of the ops it takes part in
        (:attr:`Op.participants`) and the edges between them, with both plans. What a worker
        executes; the ready sets nereusd dispatches keep the order across devices. Linear in the
        ops' participants and the edges, not in devices × ops."""
        wanted = set(devices)
        mine: dict[int, list[Op]] = {d: [] for d in wanted}
        for op in self.ops:
            for d in op.participants & wanted:
                mine[d].append(op)
        by_src: dict[str, list[Edge]] = {}
        for e in self.edges:
            by_src.setdefault(e.src, []).append(e)
        out = {}
        for d, ops in mine.items():
            ids = {op.id for op in ops}
            edges = tuple(e for op in ops for e in by_src.get(op.id, ()) if e.dst in ids)
            out[d] = TransitionDag(current=self.current, target=self.target, ops=tuple(ops), edges=edges,
                                   staging_bytes=self.staging_bytes)
        return out

    def ops_of(self, model_stage: ModelStage) -> list[Op]:
        return [op for op in self.ops if op.model_stage == model_stage]

    def summary(self) -> str:
        """One line per op with its predecessors, for logs."""
        lines = []
        for op in self.ops:
            preds = self.predecessors(op.id)
            lines.append(op.describe() + (f" after {', '.join(preds)}" if preds else ""))
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": SCHEMA_VERSION,
            "current": self.current.to_dict(),
            "target": self.target.to_dict(),
            "ops": [op.to_dict() for op in self.ops],
            "edges": [[e.src, e.dst, e.reason.value] for e in self.edges],
            "staging_bytes": self.staging_bytes,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "TransitionDag":
        """Inverse of :meth:`to_dict`.

        ``staging_bytes`` may be absent (a DAG written before it existed): :data:`STAGING_BYTES`.

        Raises:
            PlanError: on another schema version, unknown or missing fields, or bad values.
        """
        if not isinstance(data, Mapping):
            raise PlanError(f"transition DAG: expected an object, got {type(data).__name__}")
        if data.get("version") != SCHEMA_VERSION:
            raise PlanError(f"transition DAG: schema version {data.get('version')!r}, "
                            f"expected {SCHEMA_VERSION}")
        unknown = sorted(set(data) - {"version", "current", "target", "ops", "edges", "staging_bytes"})
        if unknown:
            raise PlanError(f"transition DAG: unknown field {unknown[0]!r}")
        try:
            edges = tuple(Edge(str(s), str(d), EdgeReason(r)) for s, d, r in data["edges"])
            return cls(
                current=Plan.from_dict(data["current"]),
                target=Plan.from_dict(data["target"]),
                ops=tuple(Op.from_dict(o) for o in data["ops"]),
                edges=edges,
                staging_bytes=data.get("staging_bytes", STAGING_BYTES),
            )
        except KeyError as err:
            raise PlanError(f"transition DAG: missing field {err}") from None
        except (TypeError, ValueError) as err:
            raise PlanError(f"transition DAG: malformed: {err}") from None

    def to_json(self, plans: bool = True, op_cache: dict[str, str] | None = None) -> str:
        """Compact JSON text (what travels to workers over the control plane). ``plans=False``
        leaves out ``current`` and ``target`` (a slice whose plans travel once per agent frame,
        :meth:`plans_json`; with 8,192 devices they were 60 KiB of each worker's slice).
        ``op_cache`` (op id → its JSON) lets the slices of one DAG encode each op once, though
        every participant's slice holds it; the text is the same."""
        if plans:
            return json.dumps(self.to_dict(), separators=(",", ":"), sort_keys=True)
        cache = {} if op_cache is None else op_cache
        ops = ",".join(cache[op.id] if op.id in cache else cache.setdefault(
            op.id, json.dumps(op.to_dict(), separators=(",", ":"), sort_keys=True)) for op in self.ops)
        edges = json.dumps([[e.src, e.dst, e.reason.value] for e in self.edges], separators=(",", ":"))
        return (f'{{"edges":{edges},"ops":[{ops}],"staging_bytes":{int(self.staging_bytes)},'
                f'"version":{json.dumps(SCHEMA_VERSION)}}}')


    def plans_json(self) -> str:
        """``{"current": ..., "target": ...}`` as JSON: what :meth:`to_json` left out with ``plans=False``."""
        return json.dumps({"current": self.current.to_dict(), "target": self.target.to_dict()},
                          separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_json(cls, text: str, plans: str | None = None) -> "TransitionDag":
        """The DAG of ``text``; ``plans``: :meth:`plans_json` for a ``to_json(plans=False)`` text.

        Raises:
            PlanError: if a text is not valid JSON of a DAG (or of its plans).
        """
        try:
            data = json.loads(text)
            if plans is not None:
                extra = json.loads(plans)
                if not isinstance(data, dict) or not isinstance(extra, dict) or set(extra) != {"current", "target"}:
                    raise PlanError("transition DAG: plans must be an object of current and target")
                data.update(extra)
        except ValueError as err:   # JSONDecodeError, or an integer literal past Python's digit limit
            raise PlanError(f"transition DAG: not valid JSON: {err}") from None
        return cls.from_dict(data)


def rebuilt_model_stages(current: Plan, target: Plan, moved: set[ModelStage]) -> set[ModelStage]:
    """The model-stages whose engines a transition ``current → target`` detaches at
    ``transition_prepare`` and builds again at ``transition_finish``: those with ops in its DAG
    (``moved``) and those ``target`` runs at another ZeRO stage (another engine class, though no
    op moves their state). The one rule of the workers (``TransitionTasks``), the ZeRO state's
    price and the controller's rebuild term of ``L̂_tran``. After a re-formation of the world the
    workers rebuild every model-stage instead."""
    return set(moved) | {ms for ms in target if ms in current and current[ms].zero_stage != target[ms].zero_stage}
