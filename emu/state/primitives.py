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
  When that would stage more than the DAG's ``staging_bytes`` on some member (holdings of a
  real model: gigabytes), the receivers allocate their new holding first and the pieces it
  needs move straight into it, in rounds of pairwise exchanges, one chunk at a time.
  A receiver the op stages in host memory (:attr:`Op.host_staged`) first copies its ``T``
  holding there and frees it, then allocates the new one, copies its own parts back into it and
  sends its peers their pieces from it (a ``T_sub`` holding contains its ``T`` holding); the
  host copy is dropped at the end, or put back on the device if the Split fails.
* **Extend** — rank-aligned broadcast on one communicator per ``(source, target)`` pair: the
  source's flat buffer is sent once, as one contiguous buffer, straight into the target's new
  holding (plus the 5 integers of :class:`emu.state.unit.LogicalState`).
* **Merge** — local slicing of the resident ``T_sub`` holding into the ``T*`` holding; only
  pieces a device lacks (k/v projections replicated by ``T*``) travel, point-to-point on a pair
  communicator, in chunks of at most ``staging_bytes``. A device the op stages in host memory
  frees its ``T_sub`` holding first and slices (and sends) from the host copy.
* **Destroy** — drop a holding and release its booked memory; no collective.
* **Create** — a zeroed holding for a model-stage that joins the plan.

Memory: every holding and staging buffer is booked on the worker's
:class:`emu.state.devmem.DeviceMemory` before it is allocated (entries ``emu <tp>x<pp> <pp_rank>,<tp_rank>``
and ``staging <op id>``), so a transition that does not fit fails with
:class:`nereusd.errors.DeviceOutOfMemory` before allocating, exactly where a GPU would.
Staging never exceeds the DAG's ``staging_bytes`` (:attr:`TransitionDag.staging_bytes`, what the
memory model counts, :mod:`nereusd.transition.memory`) as long as that is at least two indices of
a parameter's sliced dimension (a chunk holds one at least, and an exchange moves one chunk each
way): under 2 MB for any model here, against the 64 MiB default. A peer lost mid-exchange leaves
no booking behind for the new holding it was filling.
"""

from __future__ import annotations

import logging
from typing import Mapping, Optional

import torch
import torch.distributed as dist

from emu.liveness import peer_wait
from emu.state.communicators import Communicators, create_communicators  # noqa: F401 (re-exported)
from emu.state.store import HoldingStore, holding_entry, released_on_error, staged_in_host  # noqa: F401 (re-exported)
from emu.state.unit import EmuShard, LogicalState, narrow_piece, nbytes_of, shard_shape
from nereusd.errors import NereusError
from nereusd.models import ModelSpec
from nereusd.plan import ModelStage
from nereusd.shards import Position, Shard, shards_of
from nereusd.transition.comms import gather_groups, op_communicators  # noqa: F401 (re-exported)
from nereusd.transition.memory import split_all_gathers, split_staging_elements
from nereusd.transition.ops import STAGING_BYTES, Op, OpKind

log = logging.getLogger(__name__)

#: ``dist.all_gather_single`` (torch ≥ 2.13, where ``all_gather_into_tensor`` became its deprecated
#: alias) or, on the older torch a GPU cluster's vLLM pins, ``all_gather_into_tensor``: same
#: signature ``(output, input, group=None, async_op=False)``.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

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


def split(op: Op, me: int, store: HoldingStore, comms: Communicators, staging_bytes: int = STAGING_BYTES) -> None:
    """This device's part of a Split (module docstring). When some member of this device's gather
    group would stage more than ``staging_bytes`` at once, the group moves the pieces one chunk at
    a time instead (:func:`_split_chunked`)."""
    ms, T = op.model_stage, op.source_layout
    pos_of = dict(zip(op.source_devices, op.source_positions))
    receivers = set(op.target_devices)
    mine = next((g for g in gather_groups(op) if me in g), None)
    if mine is None:
        return
    own = store.get(ms, T, pos_of[me])
    group = comms.get(op.id, mine)
    def elements(p: Position) -> int:   # fp32 elements of the holding at T position p
        return nbytes_of(own.spec, own.value_head, T, p, len(own.slots)) // 4

    sizes = {y: elements(pos_of[y]) for y in mine}
    gathers = split_all_gathers([(y, pos_of[y]) for y in mine], receivers, elements)
    staged = split_staging_elements(op, elements)   # what the memory model counts, capped by it
    # the same choice on every member: a host-staged receiver needs the chunked exchange
    if op.host_staged or max(4 * staged.get(y, 0) for y in mine) > staging_bytes:
        if me in op.staged_elements:
            with staged_in_host(store, own, op, me) as host:
                _split_chunked(op, me, mine, host, store, group, comms, staging_bytes)
        else:
            _split_chunked(op, me, mine, own, store, group, comms, staging_bytes)
        return
    staging = f"staging {op.id}"
    try:
        _split_whole(op, me, mine, own, store, group, comms, gathers, sizes, staging)
    finally:
        store.memory.free(str(ms), staging)


def _split_whole(op: Op, me: int, mine: list[int], own: EmuShard, store: HoldingStore, group: dist.ProcessGroup,
                 comms: Communicators, gathers: bool, sizes: dict[int, int], staging: str) -> None:
    """A Split that stages every piece at once: one all-gather of the flat buffers, or each
    sender's whole buffer to each receiver; then the receivers assemble their new holding."""
    ms, T, S = op.model_stage, op.source_layout, op.target_layout
    pos_of = dict(zip(op.source_devices, op.source_positions))
    sub_of = dict(zip(op.target_devices, op.target_positions))
    receivers = set(op.target_devices)
    peers: list[EmuShard] = []
    if gathers:
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
        p2p = []
        for y in mine:  # deterministic order on both ends of every pair
            if y == me:
                continue
            if y in receivers:
                p2p.append(dist.P2POp(dist.isend, own.buffer, comms.rank_of(y), group))
            if me in receivers:
                buf = torch.empty(sizes[y], dtype=torch.float32, device=own.buffer.device)
                peers.append(EmuShard(ms, own.spec, own.value_head, T, pos_of[y], own.slots, buffer=buf))
                p2p.append(dist.P2POp(dist.irecv, buf, comms.rank_of(y), group))
        _wait_all(p2p)
    if me in receivers:
        new = store.allocate(own, S, sub_of[me], own.logical)
        with released_on_error(store, new):
            _assemble(new, [own, *peers])
        del peers
        store.pop(ms, T, pos_of[me])
        store.put(new)


def split_pieces(op: Op, members: list[int], spec: ModelSpec, value_head: bool) -> list[tuple[int, int, Shard]]:
    """``(src, dst, piece)`` that fill the new holdings of the receivers among ``members`` (one
    gather group of the Split ``op``): per receiver in group order, its own holding's parts first,
    then its peers' in group order, each part taken once (as :func:`_assemble` takes them). Every
    member computes the same list, which fixes the order of the transfers.

    Raises:
        NereusError: if the group's holdings do not cover a receiver's new holding.
    """
    T, S = op.source_layout, op.target_layout
    pos_of = dict(zip(op.source_devices, op.source_positions))
    sub_of = dict(zip(op.target_devices, op.target_positions))
    out: list[tuple[int, int, Shard]] = []
    for dst in (x for x in members if x in sub_of):
        need = {s.name: s for s in shards_of(spec, S, sub_of[dst], value_head)}
        filled: dict[str, list[Shard]] = {}
        for src in [dst, *(y for y in members if y != dst)]:
            for s in shards_of(spec, T, pos_of[src], value_head):
                m = need.get(s.name)
                if m is None:
                    continue
                piece = m if s.contains(m) else s if m.contains(s) else None
                if piece is None or _covered(filled, piece):
                    continue
                out.append((src, dst, piece))
                filled.setdefault(s.name, []).append(piece)
        for m in need.values():
            if not _covered(filled, m) and not _union_covers(filled.get(m.name, []), m):
                raise NereusError(f"{op.id}: device {dst} would not receive {m.name}[{m.start}:{m.stop}]")
    return out


def _split_chunked(op: Op, me: int, members: list[int], own: EmuShard, store: HoldingStore,
                   group: dist.ProcessGroup, comms: Communicators, staging_bytes: int) -> None:
    """A Split whose exchange would stage more than ``staging_bytes``: a receiver allocates its new
    holding first and fills its own parts; then, in rounds ``r = 1 … k−1`` over the ``k``
    members, each member sends to the member ``r`` after it and receives from the one ``r``
    before it, at once, the pieces of :func:`split_pieces` between them, one chunk of at most
    ``staging_bytes / 2`` each way at a time (:func:`_exchange`); the ``T`` holding is freed at
    the end. Rounds keep every link busy as the all-gather would: a member sends and receives
    ``k − 1`` holdings' worth in ``k − 1`` rounds."""
    ms = op.model_stage
    sub_of = dict(zip(op.target_devices, op.target_positions))
    staged = me in op.staged_elements   # ``own`` is the host copy (:func:`staged_in_host`), not in the store
    pieces = split_pieces(op, members, own.spec, own.value_head)
    new = store.allocate(own, op.target_layout, sub_of[me], own.logical) if me in sub_of else None
    with released_on_error(store, new):
        # every member calls one collective first: a member may have nothing to send or receive
        # in round 1, and NCCL needs all ranks in a group's first batched point-to-point call
        dist.all_reduce(torch.zeros(1, device=store.device), group=group)
        for src, dst, piece in pieces:
            if src == dst == me:
                new.fill_from(own, piece)
        sends_from = new if staged else own   # a staged member's own parts are in its new holding now
        k, at, n_slots = len(members), members.index(me), len(own.slots)
        for r in range(1, k):
            to, frm = members[(at + r) % k], members[(at - r) % k]
            out = [c for s, d, p in pieces if s == me and d == to for c in _chunks(p, n_slots, staging_bytes // 2)]
            inc = [c for s, d, p in pieces if s == frm and d == me for c in _chunks(p, n_slots, staging_bytes // 2)]
            _exchange(op.id, out, to, inc, frm, sends_from, new, group, comms, store)
    if new is not None:
        if not staged:
            store.pop(ms, own.layout, own.position)
        store.put(new)


def _exchange(op_id: str, out: list[Shard], to: int, inc: list[Shard], frm: int, holding: EmuShard,
              into: Optional[EmuShard], group: dist.ProcessGroup, comms: Communicators,
              store: HoldingStore) -> None:
    """Send the chunks ``out`` of ``holding`` to ``to`` while receiving the chunks ``inc`` from
    ``frm`` into ``into``: the ``j``-th of each at once, both booked as ``staging <op id>`` while
    live. Both ends of a pair list the same chunks, so their ``j``-th sends and receives match."""
    ms, staging, n_slots = str(holding.model_stage), f"staging {op_id}", len(holding.slots)
    for j in range(max(len(out), len(inc))):
        send = out[j] if j < len(out) else None
        recv = inc[j] if j < len(inc) else None
        store.memory.allocate(ms, staging, 4 * n_slots * sum(c.numel for c in (send, recv) if c is not None))
        try:
            p2p, buf = [], None
            if send is not None:   # a staged holding's piece is copied to the device (booked above)
                data = _piece(holding, send).to(store.device).contiguous()
                p2p.append(dist.P2POp(dist.isend, data, comms.rank_of(to), group))
            if recv is not None:
                buf = torch.empty(n_slots, *shard_shape(recv), dtype=torch.float32, device=into.buffer.device)
                p2p.append(dist.P2POp(dist.irecv, buf, comms.rank_of(frm), group))
            _wait_all(p2p)
            if recv is not None:
                into.fill_from(into, recv, buf)
        finally:
            store.memory.free(ms, staging)


def _wait_all(p2p: list) -> None:
    """Post ``p2p`` (``dist.P2POp`` sends and receives) as one batch and wait for all of them.
    One batch, because NCCL progresses a send and a receive between the same two ranks only when
    they are issued in one group (NCCL user guide, "Point-to-point communication": calls that
    must progress concurrently are merged); apart they could wait on each other."""
    if not p2p:
        return
    works = dist.batch_isend_irecv(p2p)
    with peer_wait():
        for w in works:
            w.wait()


def _chunks(piece: Shard, n_slots: int, staging_bytes: int) -> list[Shard]:
    """``piece`` cut along its dimension into slices of at most ``staging_bytes`` of fp32 data over
    ``n_slots`` slots (at least one index of that dimension each)."""
    length = piece.stop - piece.start
    per_index = 4 * n_slots * (piece.numel // max(1, length))
    step = max(1, staging_bytes // max(1, per_index))
    if step >= length:
        return [piece]
    return [Shard(piece.name, piece.dim, a, min(a + step, piece.stop), piece.full_shape)
            for a in range(piece.start, piece.stop, step)]


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


def merge(op: Op, me: int, store: HoldingStore, comms: Communicators, staging_bytes: int = STAGING_BYTES) -> None:
    """This device's part of a Merge: allocate the ``T*`` holding, slice the resident ``T_sub``
    holding into it, and receive what is lacking (routes in their order, chunk by chunk:
    :func:`_exchange` in one direction); then free the ``T_sub`` holding."""
    if me not in op.source_devices:
        return
    ms, S = op.model_stage, op.source_layout
    src_pos = dict(zip(op.source_devices, op.source_positions))
    own = store.get(ms, S, src_pos[me])
    if me in op.staged_elements:   # slice and send from a host copy; the device one is freed first
        with staged_in_host(store, own, op, me) as host:
            _merge_into_new(op, me, host, store, comms, staging_bytes)
    else:
        _merge_into_new(op, me, own, store, comms, staging_bytes)
        store.pop(ms, S, src_pos[me])


def _merge_into_new(op: Op, me: int, own: EmuShard, store: HoldingStore, comms: Communicators,
                    staging_bytes: int) -> None:
    """Allocate and fill this device's ``T*`` holding of a Merge from ``own`` (on the device, or its
    host copy) and the routes' pieces, then register it."""
    new = store.allocate(own, op.target_layout, dict(zip(op.target_devices, op.target_positions))[me], own.logical)
    with released_on_error(store, new):
        for r in op.routes:  # route order is the same on every device: both ends meet on each route
            if r.src == r.dst == me:
                new.fill_from(own, r.shard)
            elif me in (r.src, r.dst):
                chunks = _chunks(r.shard, len(own.slots), staging_bytes)
                sent, received = (chunks, []) if me == r.src else ([], chunks)
                _exchange(op.id, sent, r.dst, received, r.src, own, new, comms.get(op.id, (r.src, r.dst)), comms,
                          store)
    store.put(new)


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


def run_op(op: Op, me: int, store: HoldingStore, comms: Communicators, specs: Specs,
           staging_bytes: int = STAGING_BYTES) -> None:
    """Run this device's part of ``op`` (no-op when the device is not in it), staging at most
    ``staging_bytes`` at a time in a Split or Merge (:attr:`TransitionDag.staging_bytes`)."""
    if me not in op.devices and not any(me in (r.src, r.dst) for r in op.routes):
        return
    if op.kind is OpKind.SPLIT:
        split(op, me, store, comms, staging_bytes)
    elif op.kind is OpKind.EXTEND:
        extend(op, me, store, comms, specs)
    elif op.kind is OpKind.MERGE:
        merge(op, me, store, comms, staging_bytes)
    elif op.kind is OpKind.DESTROY:
        destroy(op, me, store)
    else:
        create(op, me, store, specs)


__all__ = ["Communicators", "HoldingStore", "Specs", "create", "create_communicators", "destroy", "extend",
           "gather_groups", "holding_entry", "merge", "op_communicators", "run_op", "split"]
