"""The EMU primitives over torch.distributed: Split, Merge, Extend, Destroy (paper §5.2, §6.2).

Each function runs *this device's part* of one :class:`nereusd.transition.ops.Op` on the
holdings of this worker (:class:`HoldingStore`), using communicators created for the
transition, a set of its own per op (:class:`Communicators`). Semantics of an op, device by
device, are those of :mod:`nereusd.transition.ops`:

* **Split** — a receiver's ``T`` holding becomes its ``T_sub`` holding with the shards of its
  *gather group* (the devices of its unit with the same ``T_sub`` position: the smallest
  enclosing TP/PP group). When every member receives and all holdings have one size this is one
  ``all_gather_single`` (all-gather into one tensor) of the flat buffers on the group's communicator; otherwise each
  sender sends its flat buffer to each receiver point-to-point on that communicator. Receivers
  then copy the pieces into place; the ``T`` holding is freed only after the new one is whole.
* **Extend** — rank-aligned broadcast on one communicator per ``(source, target)`` pair: the
  source's flat buffer is sent once, as one contiguous buffer, straight into the target's new
  holding (plus the 5 integers of :class:`emu.state.unit.LogicalState`).
* **Merge** — local slicing of the resident ``T_sub`` holding into the ``T*`` holding; only
  pieces a device lacks (k/v projections replicated by ``T*``) travel, point-to-point on a pair
  communicator.
* **Destroy** — drop a holding and release its booked memory; no collective.
* **Create** — a zeroed holding for a model-stage that joins the plan.

Memory: every holding and staging buffer is booked on the worker's
:class:`emu.state.devmem.DeviceMemory` before it is allocated (entries ``emu <tp>x<pp> <pp_rank>,<tp_rank>``
and ``staging <op id>``), so a transition that does not fit fails with
:class:`nereusd.errors.DeviceOutOfMemory` before allocating, exactly where a GPU would.
Staging is the bytes received by the op (not chunked).
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Iterable, Mapping, Optional

import torch
import torch.distributed as dist

from emu.liveness import peer_wait
from emu.state.devmem import DeviceMemory
from emu.state.groups import GroupPool, destroy_group
from emu.state.unit import EmuShard, LogicalState, narrow_piece, nbytes_of, shard_shape
from nereusd.errors import NereusError
from nereusd.models import ModelSpec
from nereusd.plan import Layout, ModelStage
from nereusd.shards import Position, Shard
from nereusd.transition.comms import communicator_plan, gather_groups, op_communicators  # noqa: F401 (re-exported)
from nereusd.transition.memory import split_all_gathers
from nereusd.transition.ops import Op, OpKind, TransitionDag

log = logging.getLogger(__name__)

#: ``dist.all_gather_single`` (torch ≥ 2.13, where ``all_gather_into_tensor`` became its deprecated
#: alias) or, on the older torch a GPU cluster's vLLM pins, ``all_gather_into_tensor``: same
#: signature ``(output, input, group=None, async_op=False)``.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

HoldingKey = tuple[ModelStage, Layout, Position]


def holding_entry(layout: Layout, position: Position) -> str:
    """The :class:`DeviceMemory` entry name of a holding."""
    return f"emu {layout.tp}x{layout.pp} {position[0]},{position[1]}"


class HoldingStore:
    """This device's holdings, with their memory booked on ``memory``.

    Raises (from :meth:`get`): NereusError if a holding is not here.
    """

    def __init__(self, memory: DeviceMemory, device: torch.device | str = "cpu") -> None:
        self.memory, self.device = memory, torch.device(device)
        self.items: dict[HoldingKey, EmuShard] = {}
        self._spare: dict[HoldingKey, torch.Tensor] = {}

    def preallocate(self, model_stage: ModelStage, layout: Layout, position: Position, numel: int) -> None:
        """Allocate and touch the buffer a later :meth:`allocate` of this key will use.

        docs/platform.md: receiving into untouched pages was 3× slower than into touched ones; a new
        worker can touch its receive buffers while communicators come up. Booked at :meth:`allocate`.
        """
        buf = torch.empty(numel, dtype=torch.float32, device=self.device)
        buf.zero_()
        self._spare[(model_stage, layout, tuple(position))] = buf

    def get(self, model_stage: ModelStage, layout: Layout, position: Position) -> EmuShard:
        key = (model_stage, layout, tuple(position))
        if key not in self.items:
            raise NereusError(f"device {self.memory.device} holds no {model_stage} at tp{layout.tp}·pp{layout.pp} "
                              f"{tuple(position)} (holds {[h.describe() for h in self.items.values()]})")
        return self.items[key]

    def has(self, model_stage: ModelStage, layout: Layout, position: Position) -> bool:
        return (model_stage, layout, tuple(position)) in self.items

    def allocate(self, like: EmuShard | tuple[ModelStage, ModelSpec, bool, tuple[str, ...]], layout: Layout,
                 position: Position, logical: LogicalState) -> EmuShard:
        """Book and allocate an (untouched) holding; not yet registered (see :meth:`put`)."""
        if isinstance(like, EmuShard):
            ms, spec, vh, slots = like.model_stage, like.spec, like.value_head, like.slots
        else:
            ms, spec, vh, slots = like
        self.memory.allocate(str(ms), holding_entry(layout, position), nbytes_of(spec, vh, layout, position,
                                                                                 len(slots)))
        buffer = self._spare.pop((ms, layout, tuple(position)), None)
        return EmuShard(ms, spec, vh, layout, position, slots, buffer=buffer, device=self.device, logical=logical)

    def put(self, shard: EmuShard, *, book: bool = False) -> None:
        """Register ``shard`` (booking its bytes first when ``book``).

        Raises:
            NereusError: if a holding with the same key is already here.
        """
        if shard.key in self.items:
            raise NereusError(f"device {self.memory.device}: {shard.describe()} is already held")
        if book:
            self.memory.allocate(str(shard.model_stage), holding_entry(shard.layout, shard.position), shard.nbytes)
        self.items[shard.key] = shard

    def pop(self, model_stage: ModelStage, layout: Layout, position: Position) -> EmuShard:
        """Unregister a holding and release its booking (the caller drops the tensor)."""
        shard = self.get(model_stage, layout, position)
        del self.items[shard.key]
        self.memory.free(str(model_stage), holding_entry(layout, position))
        return shard

    def of(self, model_stage: ModelStage) -> list[EmuShard]:
        return [h for k, h in self.items.items() if k[0] == model_stage]


class Communicators:
    """Process groups created for one transition, one per ``(op id, world ranks)``.

    Ops of one DAG level run concurrently on a worker, one thread each
    (:class:`emu.state.executor.TransitionExecutor`), and each issues its collectives in its own
    order. On a process group a collective is paired with the collective issued at the same
    position on every other member, so two ops sharing a group — e.g. two model-stages whose
    ops span the same ranks — would pair one op's all-gather or send on one rank with the other
    op's on another (gloo: size mismatch, or pieces delivered to the wrong op). A group per op
    rules this out: within one op a thread issues its collectives in the same order on every
    member (module docstring), and distinct ops never meet on a group. An op that uses one rank
    set twice (an Extend with pairs ``(a, b)`` and ``(b, a)``) gets one group for both.

    :meth:`create` is collective over the whole world (``torch.distributed.new_group``):
    every rank must call it with the same ``(op id, rank set)`` pairs in the same order
    (:func:`create_communicators` walks the DAG's ops in their stored order, which is the same
    on every rank). Non-members get no group. ``setup_s`` accumulates the wall time spent
    creating groups (counted in the transition).
    """

    def __init__(self, rank_of: Callable[[int], int] = lambda d: d, backend: Optional[str] = None,
                 pool: Optional[GroupPool] = None) -> None:
        self.rank_of = rank_of
        self.backend = backend
        self.pool = pool
        self.groups: dict[tuple[str, tuple[int, ...]], Optional[dist.ProcessGroup]] = {}
        self.setup_s = 0.0

    def _key(self, op_id: str, devices: Iterable[int]) -> tuple[str, tuple[int, ...]]:
        return op_id, tuple(sorted(self.rank_of(d) for d in set(devices)))

    def create(self, op_id: str, devices: Iterable[int]) -> None:
        """Create op ``op_id``'s group over global ``devices`` (collective; no-op if it exists or
        has fewer than 2 members)."""
        key = self._key(op_id, devices)
        if len(key[1]) < 2 or key in self.groups:
            return
        start = time.perf_counter()
        self.groups[key] = (self.pool.acquire(key[1], self.backend) if self.pool is not None
                            else dist.new_group(list(key[1]), backend=self.backend))
        self.setup_s += time.perf_counter() - start

    def get(self, op_id: str, devices: Iterable[int]) -> dist.ProcessGroup:
        """Op ``op_id``'s group over global ``devices``.

        Raises:
            NereusError: if :meth:`create` did not create it.
        """
        key = self._key(op_id, devices)
        group = self.groups.get(key)
        if group is None:
            raise NereusError(f"no communicator of op {op_id} for devices {sorted(set(devices))} "
                              f"(ranks {key[1]})")
        return group

    def destroy(self) -> None:
        """Destroy every group this rank is a member of (best effort on a broken world), or with a
        :class:`~emu.state.groups.GroupPool`, hand every group back to it (every rank: the pools stay alike)."""
        for (_, ranks), group in self.groups.items():
            if self.pool is not None:
                self.pool.release(ranks, self.backend, group)
            else:
                destroy_group(group)
        self.groups.clear()


def create_communicators(dag: TransitionDag, comms: Communicators,
                          plan: Iterable[tuple[str, Iterable[int]]] | None = None) -> None:
    """Create every communicator of ``dag``, one set per op (collective: every world rank calls
    it, and creates the groups in the order of ``dag.ops``). ``plan``: the whole DAG's
    :func:`~nereusd.transition.comms.communicator_plan`, when ``dag`` is only this device's slice."""
    for op_id, devices in (plan if plan is not None else communicator_plan(dag)):
        comms.create(op_id, devices)


# --------------------------------------------------------------------------- primitives


Specs = Mapping[ModelStage, tuple[ModelSpec, bool, tuple[str, ...]]]
"""Per model-stage: model shapes, value head, slots — for holdings this device does not hold yet."""


def _covered(filled: dict[str, list[Shard]], piece: Shard) -> bool:
    return any(f.contains(piece) for f in filled.get(piece.name, ()))


def _assemble(new: EmuShard, sources: list[EmuShard]) -> None:
    """Fill ``new`` from holdings whose shards nest with it (each part copied once)."""
    filled: dict[str, list[Shard]] = {}
    for src in sources:
        for s in src.shards:
            try:
                mine = new.shard(s.name)
            except NereusError:
                continue
            piece = mine if s.contains(mine) else s if mine.contains(s) else None
            if piece is None or _covered(filled, piece):
                continue
            new.fill_from(src, piece)
            filled.setdefault(s.name, []).append(piece)
    for s in new.shards:
        if not _covered(filled, s) and not _union_covers(filled.get(s.name, []), s):
            raise NereusError(f"{new.describe()}: {s.name}[{s.start}:{s.stop}] was not received")


def _union_covers(pieces: list[Shard], need: Shard) -> bool:
    dims = {p.dim for p in pieces if not p.is_full} | ({need.dim} if not need.is_full else set())
    if len(dims) > 1:
        return False
    need = need.along(dims.pop()) if dims else need
    spans = sorted((p.along(need.dim).start, p.along(need.dim).stop) for p in pieces)
    reach = need.start
    for a, b in spans:
        if a > reach:
            break
        reach = max(reach, b)
    return reach >= need.stop


def split(op: Op, me: int, store: HoldingStore, comms: Communicators) -> None:
    """This device's part of a Split (module docstring)."""
    ms, T, S = op.model_stage, op.source_layout, op.target_layout
    pos_of = dict(zip(op.source_devices, op.source_positions))
    sub_of = dict(zip(op.target_devices, op.target_positions))
    receivers = set(op.target_devices)
    mine = next((g for g in gather_groups(op) if me in g), None)
    if mine is None:
        return
    own = store.get(ms, T, pos_of[me])
    group = comms.get(op.id, mine)
    sizes = {y: nbytes_of(own.spec, own.value_head, T, pos_of[y], len(own.slots)) // 4 for y in mine}
    peers: list[EmuShard] = []
    staging = f"staging {op.id}"
    if split_all_gathers([(y, pos_of[y]) for y in mine], receivers, lambda p: sizes[_dev_at(pos_of, p)]):
        store.memory.allocate(str(ms), staging, own.nbytes * len(mine))
        out = torch.empty(own.numel * len(mine), dtype=torch.float32, device=own.buffer.device)
        all_gather_single(out, own.buffer, group=group)
        order = sorted(mine, key=comms.rank_of)  # all_gather places by group rank = sorted world rank
        for j, y in enumerate(order):
            if y != me:
                peers.append(EmuShard(ms, own.spec, own.value_head, T, pos_of[y], own.slots,
                                      buffer=out[j * own.numel:(j + 1) * own.numel]))
    else:
        recv_from = [y for y in mine if y != me] if me in receivers else []
        store.memory.allocate(str(ms), staging, 4 * sum(sizes[y] for y in recv_from))
        works = []
        for y in mine:  # deterministic order on both ends of every pair
            if y == me:
                continue
            if y in receivers:
                works.append(dist.isend(own.buffer, dst=comms.rank_of(y), group=group))
            if me in receivers:
                buf = torch.empty(sizes[y], dtype=torch.float32, device=own.buffer.device)
                peers.append(EmuShard(ms, own.spec, own.value_head, T, pos_of[y], own.slots, buffer=buf))
                works.append(dist.irecv(buf, src=comms.rank_of(y), group=group))
        with peer_wait():
            for w in works:
                w.wait()
    try:
        if me in receivers:
            new = store.allocate(own, S, sub_of[me], own.logical)
            _assemble(new, [own, *peers])
            del peers
            store.pop(ms, T, pos_of[me])
            store.put(new)
    finally:
        store.memory.free(str(ms), staging)


def extend(op: Op, me: int, store: HoldingStore, comms: Communicators, specs: Specs) -> None:
    """This device's part of an Extend: one broadcast per rank-aligned pair it is in."""
    ms, S = op.model_stage, op.source_layout
    works, new_ones = [], []
    for src, dst, pos in zip(op.source_devices, op.target_devices, op.target_positions):
        if me not in (src, dst):
            continue
        group = comms.get(op.id, (src, dst))
        if me == src:
            shard = store.get(ms, S, pos)
            header = shard.logical.to_tensor()
        else:
            spec, vh, slots = specs[ms]
            shard = store.allocate((ms, spec, vh, slots), S, pos, LogicalState())
            header = torch.zeros(len(LogicalState.FIELDS), dtype=torch.int64)
            new_ones.append((shard, header))
        root = comms.rank_of(src)
        works.append(dist.broadcast(header, src=root, group=group, async_op=True))
        works.append(dist.broadcast(shard.buffer, src=root, group=group, async_op=True))
    with peer_wait():
        for w in works:
            w.wait()
    for shard, header in new_ones:
        shard.logical = LogicalState.from_tensor(header)
        store.put(shard)


def merge(op: Op, me: int, store: HoldingStore, comms: Communicators) -> None:
    """This device's part of a Merge: slice the resident ``T_sub`` holding, receive what is lacking."""
    if me not in op.source_devices:
        return
    ms, S, Tt = op.model_stage, op.source_layout, op.target_layout
    src_pos = dict(zip(op.source_devices, op.source_positions))
    own = store.get(ms, S, src_pos[me])
    remote = [r for r in op.routes if r.src != r.dst and me in (r.src, r.dst)]
    staging = f"staging {op.id}"
    n_slots = len(own.slots)
    store.memory.allocate(str(ms), staging, 4 * n_slots * sum(r.shard.numel for r in remote if r.dst == me))
    try:
        works, received = [], []
        for r in remote:  # route order is the same on both ends
            group = comms.get(op.id, (r.src, r.dst))
            if r.src == me:
                data = _piece(own, r.shard).contiguous()
                works.append(dist.isend(data, dst=comms.rank_of(r.dst), group=group))
                received.append(data)  # keep alive until sent
            else:
                buf = torch.empty(n_slots, *shard_shape(r.shard), dtype=torch.float32, device=own.buffer.device)
                works.append(dist.irecv(buf, src=comms.rank_of(r.src), group=group))
                received.append((r.shard, buf))
        with peer_wait():
            for w in works:
                w.wait()
        new = store.allocate(own, Tt, dict(zip(op.target_devices, op.target_positions))[me], own.logical)
        for r in op.routes:
            if r.src == r.dst == me:
                new.fill_from(own, r.shard)
        for item in received:
            if isinstance(item, tuple):
                new.fill_from(own, item[0], item[1])
        store.pop(ms, S, src_pos[me])
        store.put(new)
    finally:
        store.memory.free(str(ms), staging)


def _dev_at(pos_of: dict[int, Position], position: Position) -> int:
    return next(x for x, p in pos_of.items() if p == position)


def _piece(holding: EmuShard, piece: Shard) -> torch.Tensor:
    return narrow_piece(holding.block(piece.name), holding.shard(piece.name), piece)


def destroy(op: Op, me: int, store: HoldingStore) -> None:
    """Free this device's holdings named by a Destroy (the planner never names a last copy)."""
    for x, pos in zip(op.source_devices, op.source_positions):
        if x == me:
            store.pop(op.model_stage, op.source_layout, pos)


def create(op: Op, me: int, store: HoldingStore, specs: Specs) -> None:
    """A zeroed holding for each target position on this device (content comes from outside)."""
    for x, pos in zip(op.target_devices, op.target_positions):
        if x == me:
            spec, vh, slots = specs[op.model_stage]
            shard = store.allocate((op.model_stage, spec, vh, slots), op.target_layout, pos, LogicalState())
            shard.buffer.zero_()
            store.put(shard)


def run_op(op: Op, me: int, store: HoldingStore, comms: Communicators, specs: Specs) -> None:
    """Run this device's part of ``op`` (no-op when the device is not in it)."""
    if me not in op.devices and not any(me in (r.src, r.dst) for r in op.routes):
        return
    if op.kind is OpKind.SPLIT:
        split(op, me, store, comms)
    elif op.kind is OpKind.EXTEND:
        extend(op, me, store, comms, specs)
    elif op.kind is OpKind.MERGE:
        merge(op, me, store, comms)
    elif op.kind is OpKind.DESTROY:
        destroy(op, me, store)
    else:
        create(op, me, store, specs)


__all__ = ["Communicators", "HoldingStore", "Specs", "create", "create_communicators", "destroy", "extend",
           "gather_groups", "holding_entry", "merge", "op_communicators", "run_op", "split"]
