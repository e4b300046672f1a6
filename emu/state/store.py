"""This device's holdings (:class:`HoldingStore`), booked on its memory accounting, and what
happens to one when an op replaces it: its booking released if the op fails before the new one
is whole (:func:`released_on_error`), or — a holding the op stages in host memory
(:attr:`nereusd.transition.ops.Op.host_staged`, :mod:`nereusd.transition.memory`) — copied to
host memory and freed on the device first (:func:`stage_out`), put back if the op fails
(:func:`restored_on_error`), dropped once it succeeded (:func:`drop_host`); :func:`staged_in_host`
is the three together. The primitives that
use them are in :mod:`emu.state.primitives`.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch

from emu.state.devmem import DeviceMemory
from emu.state.unit import EmuShard, LogicalState, nbytes_of
from nereusd.errors import NereusError
from nereusd.models import ModelSpec
from nereusd.plan import Layout, ModelStage
from nereusd.shards import Position
from nereusd.transition.ops import Op

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


def stage_out(store: HoldingStore, own: EmuShard, op: Op, me: int) -> EmuShard:
    """Copy the holding ``own`` to host memory (pinned when it is on a GPU), unregister it, release
    its booking and free its device buffer (``own`` is left empty; engines were detached from
    their holdings before the transition); returns the host copy.

    Raises:
        NereusError: if ``op`` names another size for it than it has (a corrupt DAG), before
            anything is copied.
    """
    if op.staged_elements[me] != own.numel_per_slot:
        raise NereusError(f"op {op.id}: device {me} stages {op.staged_elements[me]} parameter elements, but "
                          f"{own.describe()} has {own.numel_per_slot}")
    pinned = own.buffer.device.type == "cuda"
    host = torch.empty(own.numel, dtype=torch.float32, pin_memory=pinned)
    host.copy_(own.buffer)
    copy = EmuShard(own.model_stage, own.spec, own.value_head, own.layout, own.position, own.slots,
                    buffer=host, logical=own.logical)
    store.pop(own.model_stage, own.layout, own.position)
    own.buffer = own.buffer.new_empty(0)   # whoever still refers to ``own`` holds no device memory
    return copy


@contextlib.contextmanager
def staged_in_host(store: HoldingStore, own: EmuShard, op: Op, me: int) -> Iterator[EmuShard]:
    """The life of a holding that ``op`` stages in host memory: :func:`stage_out` on entry, yielding
    the host copy for the op to read; :func:`restored_on_error` if the op fails; :func:`drop_host`
    on exit either way."""
    host = stage_out(store, own, op, me)
    try:
        with restored_on_error(store, host):
            yield host
    finally:
        drop_host(host)


def drop_host(host: EmuShard) -> None:
    """Free the host copy of a staged holding now, and give pinned pages back to the system
    (PyTorch's caching host allocator keeps freed pinned blocks otherwise)."""
    pinned = host.buffer.is_pinned() if host.buffer.numel() else False
    host.buffer = host.buffer.new_empty(0)
    if pinned and hasattr(torch._C, "_host_emptyCache"):
        torch._C._host_emptyCache()


@contextlib.contextmanager
def restored_on_error(store: HoldingStore, host: EmuShard) -> Iterator[None]:
    """Put the host copy ``host`` of a staged holding back on the device if the block raises (a
    peer lost mid-Split), so that the device keeps the state it had before the op; its memory is
    free again, the new holding's booking having been released (:func:`released_on_error`)."""
    try:
        yield
    except BaseException:
        if not store.has(host.model_stage, host.layout, host.position):
            back = store.allocate(host, host.layout, host.position, host.logical)
            back.buffer.copy_(host.buffer)
            store.put(back)
        raise


@contextlib.contextmanager
def released_on_error(store: HoldingStore, new: Optional[EmuShard]) -> Iterator[None]:
    """Release the booking of ``new`` (allocated, not yet registered) if the block raises — a
    peer lost mid-exchange — so that the device's accounting keeps only what it holds."""
    try:
        yield
    except BaseException:
        if new is not None:
            store.memory.free(str(new.model_stage), holding_entry(new.layout, new.position))
            # the traceback keeps the frames that hold ``new``: free its buffer now, so that a
            # staged holding restored next (:func:`restored_on_error`) finds the memory free
            new.buffer = new.buffer.new_empty(0)
        raise
