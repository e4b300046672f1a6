"""Elastic Model Units on a worker: one device's share of one model-stage's logical state.

An EMU is one DP replica of one model-stage (DESIGN.md "EMU state and primitives", paper §5.1);
on a worker it is seen as a *holding*: the state of one model-stage at one ``(layout,
position)`` on this device, :class:`EmuShard`. Its logical state ``Λ = (θ, ω, c, v, p)`` is

* ``θ, ω`` — the canonical per-parameter shards of :func:`nereusd.shards.shards_of` (the same
  slice for the parameter and each of its optimizer tensors), held in **one flat contiguous
  fp32 buffer** per holding, slot-major: slot ``k`` (``param``, then Adam ``exp_avg``,
  ``exp_avg_sq`` for a training model-stage) is ``buffer[k·n : (k+1)·n]`` with ``n`` the
  holding's parameter elements, and shard ``i`` sits at ``[off_i, off_i + numel_i)`` of every
  slot. The parameters alone are thus a prefix (weight synchronisation sends them without a copy). A holding is therefore sent as one contiguous buffer (docs/platform.md: one
  flat buffer is 2× faster than per-tensor sends) and never packed at transition time;
* ``c, v, p`` and the seed of RNG/dataloader state — :class:`LogicalState`, a few integers that
  travel with the holding.

An engine (:class:`emu.engine.stage.StageEngine`) *binds* to a holding (:func:`bind_engine`): its
parameters and Adam tensors become views into the holding's buffer, so exporting an engine's
state to a transition, or building an engine from a holding a transition produced, copies
nothing.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, replace
from typing import Optional

import torch

from nereusd.errors import NereusError
from nereusd.models import ModelSpec
from nereusd.plan import Layout, ModelStage, Stage
from nereusd.shards import Position, Shard, shards_of

TRAIN_SLOTS = ("param", "exp_avg", "exp_avg_sq")
"""Tensors per parameter element of a training model-stage (ZeRO-0 fp32 Adam)."""
PARAM_SLOTS = ("param",)
"""Tensors per parameter element of a generation or inference model-stage."""


def slots_for(model_stage: ModelStage) -> tuple[str, ...]:
    """:data:`TRAIN_SLOTS` for a training model-stage, else :data:`PARAM_SLOTS`."""
    return TRAIN_SLOTS if model_stage.stage is Stage.TRAINING else PARAM_SLOTS


def derived_seed(*parts: int) -> int:
    """A 63-bit seed from integers (SHA-256; stable across processes and Python versions)."""
    digest = hashlib.sha256(",".join(str(int(p)) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


@dataclass(frozen=True)
class LogicalState:
    """The scalar part of ``Λ`` plus the seed of RNG and dataloader state (paper §6.2).

    Attributes:
        step: ``c``, optimizer updates applied (Adam's ``step``).
        version: ``v``, model-stage version. Of a training model-stage: the RL steps whose
            updates its state holds (set by the step's last update, :func:`mark_trained`; −1
            between that step's updates), what a resumed nereusd checks before it keeps a
            worker's EMUs (``Daemon._keep_workers``).
        policy_version: ``v``, policy version the state was trained from.
        position: ``p``, samples of the global sample order consumed by the last completed update.
        seed: job seed from which replicas derive RNG and dataloader state.
    """

    step: int = 0
    version: int = 0
    policy_version: int = 0
    position: int = 0
    seed: int = 0

    FIELDS = ("step", "version", "policy_version", "position", "seed")

    def to_tensor(self) -> torch.Tensor:
        """``int64 [5]`` in :attr:`FIELDS` order (what Extend sends beside the buffer)."""
        return torch.tensor([getattr(self, f) for f in self.FIELDS], dtype=torch.int64)

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> "LogicalState":
        return cls(*(int(v) for v in t.tolist()))

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "LogicalState":
        """Raises: NereusError on unknown or missing fields."""
        if set(data) != set(cls.FIELDS):
            raise NereusError(f"logical state: expected fields {list(cls.FIELDS)}, got {sorted(data)}")
        return cls(**{k: int(v) for k, v in data.items()})

    def advanced(self, samples: int) -> "LogicalState":
        """The state after one update that consumed ``samples`` samples."""
        return replace(self, step=self.step + 1, position=self.position + samples)

    def replica_samples(self, dp: int, dp_rank: int, micro_batch: int, grad_accum: int) -> range:
        """Global sample indices replica ``dp_rank`` of ``dp`` trains on in the next update.

        The global batch ``dp · micro_batch · grad_accum`` is one contiguous block of the global
        sample order starting at :attr:`position`, cut into ``dp`` equal contiguous shares; a DP
        change that keeps the global batch therefore neither repeats nor skips a sample.
        """
        if not 0 <= dp_rank < dp or micro_batch < 1 or grad_accum < 1:
            raise NereusError(f"replica_samples: bad dp={dp} dp_rank={dp_rank} micro_batch={micro_batch} "
                              f"grad_accum={grad_accum}")
        share = micro_batch * grad_accum
        start = self.position + dp_rank * share
        return range(start, start + share)

    def replica_rng(self, dp_rank: int) -> torch.Generator:
        """RNG of replica ``dp_rank`` for the next update: derived from ``(seed, position, dp_rank)``."""
        return torch.Generator().manual_seed(derived_seed(self.seed, self.position, dp_rank))


def shard_shape(shard: Shard) -> tuple[int, ...]:
    """Shape of ``shard``'s slice: its full shape with ``dim`` cut to ``stop − start``."""
    shape = list(shard.full_shape)
    shape[shard.dim] = shard.stop - shard.start
    return tuple(shape)


class EmuShard:
    """This device's holding of one model-stage at ``(layout, position)`` (module docstring).

    Args:
        model_stage, spec, value_head: whose state and its model shapes.
        layout, position: where in an EMU this holding sits.
        slots: tensors per parameter (:func:`slots_for`).
        buffer: the flat fp32 buffer (``[numel]``); allocated, untouched, when ``None``.
        logical: the scalar logical state.

    Raises:
        NereusError: if ``buffer`` has the wrong size or dtype.
    """

    def __init__(self, model_stage: ModelStage, spec: ModelSpec, value_head: bool, layout: Layout,
                 position: Position, slots: tuple[str, ...], *, buffer: Optional[torch.Tensor] = None,
                 device: torch.device | str = "cpu", logical: LogicalState = LogicalState()) -> None:
        self.model_stage, self.spec, self.value_head = model_stage, spec, value_head
        self.layout, self.position, self.slots = layout, tuple(position), tuple(slots)
        self.shards: tuple[Shard, ...] = shards_of(spec, layout, self.position, value_head)
        self.offsets: dict[str, int] = {}
        off = 0
        for s in self.shards:
            self.offsets[s.name] = off
            off += s.numel
        self.numel_per_slot = off
        self.numel = off * len(self.slots)
        if buffer is None:
            buffer = torch.empty(self.numel, dtype=torch.float32, device=device)
        if buffer.dtype != torch.float32 or buffer.dim() != 1 or buffer.numel() != self.numel:
            raise NereusError(f"{model_stage} tp{layout.tp}·pp{layout.pp} {self.position}: buffer must be "
                              f"fp32 [{self.numel}], got {buffer.dtype} {list(buffer.shape)}")
        self.buffer = buffer
        self.logical = logical
        self._by_name = {s.name: s for s in self.shards}

    # ------------------------------------------------------------------ views
    @property
    def nbytes(self) -> int:
        return self.numel * 4

    @property
    def key(self) -> tuple[ModelStage, Layout, Position]:
        return (self.model_stage, self.layout, self.position)

    def shard(self, name: str) -> Shard:
        """The :class:`Shard` of parameter ``name``. Raises: NereusError if not held."""
        try:
            return self._by_name[name]
        except KeyError:
            raise NereusError(f"{self.model_stage} at {self.position}: no shard of {name!r}") from None

    def block(self, name: str) -> torch.Tensor:
        """All slots of ``name``: a view ``[n_slots, *shard_shape]`` (slots ``numel_per_slot`` apart)."""
        s = self.shard(name)
        off = self.offsets[name]
        rows = self.buffer.view(len(self.slots), self.numel_per_slot)
        return rows[:, off:off + s.numel].view(len(self.slots), *shard_shape(s))

    def view(self, name: str, slot: str) -> torch.Tensor:
        """One slot of ``name``: a contiguous view of its shard shape."""
        return self.block(name)[self.slots.index(slot)]

    def params_only(self) -> "EmuShard":
        """The ``param`` slot as a holding of its own: a view of this buffer's first slot, no copy."""
        return EmuShard(self.model_stage, self.spec, self.value_head, self.layout, self.position, PARAM_SLOTS,
                        buffer=self.buffer[:self.numel_per_slot], logical=self.logical)

    def describe(self) -> str:
        return f"{self.model_stage} tp{self.layout.tp}·pp{self.layout.pp} pos{self.position} ({self.nbytes} B)"

    def like(self, layout: Layout, position: Position, *, device=None) -> "EmuShard":
        """An empty holding of the same model-stage at another ``(layout, position)``."""
        return EmuShard(self.model_stage, self.spec, self.value_head, layout, position, self.slots,
                        device=device or self.buffer.device, logical=self.logical)

    def fill_from(self, source: "EmuShard", shard: Shard, data: Optional[torch.Tensor] = None) -> None:
        """Copy ``shard`` (a slice of one parameter) into this holding.

        Args:
            source: where the slice is read from, unless ``data`` is given.
            data: the slice as ``[n_slots, *shard_shape(shard)]`` (e.g. received from a peer).

        Raises:
            NereusError: if the slice is not inside this holding's shard or the source's.
        """
        mine = self.shard(shard.name)
        if data is None:
            theirs = source.shard(shard.name)
            data = narrow_piece(source.block(shard.name), theirs, shard)
        target = narrow_piece(self.block(shard.name), mine, shard)
        target.copy_(data)


def narrow_piece(block: torch.Tensor, held: Shard, piece: Shard) -> torch.Tensor:
    """The part of ``block`` (``[n_slots, *shard_shape(held)]``) that is ``piece``."""
    if not held.contains(piece):
        raise NereusError(f"{piece.name}[{piece.start}:{piece.stop}] dim {piece.dim} is not inside "
                          f"[{held.start}:{held.stop}] dim {held.dim}")
    if held.is_full and piece.is_full:
        return block
    dim = piece.dim if not piece.is_full else held.dim
    h, p = held.along(dim), piece.along(dim)
    return block.narrow(1 + dim, p.start - h.start, p.stop - p.start)


# --------------------------------------------------------------------------- engines


def _engine_key(engine) -> tuple[Layout, Position]:
    g = engine.groups
    return Layout(engine.candidate.tp, engine.candidate.pp), (g.pp_rank, g.tp_rank)


def bind_engine(engine, shard: Optional[EmuShard] = None, *, logical: LogicalState = LogicalState()) -> EmuShard:
    """Make ``engine``'s parameters (and Adam tensors, when trainable) views into a holding.

    Args:
        engine: a :class:`emu.engine.stage.StageEngine`.
        shard: the holding to adopt (its layout and position must be the engine's); when
            ``None`` a new one is allocated and filled from the engine (one copy).
        logical: the logical state of a new holding (ignored when ``shard`` is given).

    Returns:
        The holding the engine now lives in. Adam's per-parameter ``step`` is set from
        ``logical.step``; Adam state starts as zeros with ``step = 0``, which is exactly what
        ``torch.optim.Adam`` initialises lazily, so the next update is unchanged.

    An engine that shards its optimizer state across DP (ZeRO, :mod:`emu.engine.deepspeed_stage`)
    keeps that state in its own buffers: it *adopts* ``shard`` (copies its partition out of it)
    and returns it, and with no ``shard`` it keeps ``logical`` and returns ``None``.

    Raises:
        NereusError: if ``shard`` is for another model-stage, layout or position.
    """
    if getattr(engine, "zero_stage", 0):
        if shard is None:
            engine.logical = logical
            return None
        engine.adopt_holding(shard)
        return shard
    layout, position = _engine_key(engine)
    slots = TRAIN_SLOTS if engine.optimizer is not None else PARAM_SLOTS
    with torch.no_grad():
        if shard is None:
            shard = EmuShard(engine.model_stage, engine.spec, engine.value_head, layout, position, slots,
                             device=engine.device, logical=logical)
            state = engine.optimizer.state if engine.optimizer is not None else {}
            if state:
                step = int(float(next(iter(state.values()))["step"]))
                shard.logical = replace(shard.logical, step=step)
            for name, p in engine.params.items():
                shard.view(name, "param").copy_(p)
                for slot in slots[1:]:
                    src = state.get(p, {}).get(slot)
                    shard.view(name, slot).copy_(src) if src is not None else shard.view(name, slot).zero_()
        elif (shard.model_stage, shard.layout, shard.position, shard.slots) != (engine.model_stage, layout,
                                                                              position, slots):
            raise NereusError(f"bind_engine: holding {shard.describe()} slots {shard.slots} does not fit "
                              f"engine {engine.ms} tp{layout.tp}·pp{layout.pp} {position}")
        for name, p in engine.params.items():
            p.data = shard.view(name, "param")
            if engine.optimizer is not None:
                engine.optimizer.state[p] = {
                    "step": torch.tensor(float(shard.logical.step), dtype=torch.float32),
                    "exp_avg": shard.view(name, "exp_avg"), "exp_avg_sq": shard.view(name, "exp_avg_sq"),
                }
    engine.emu_shard = shard
    return shard


def holding_of(engine) -> EmuShard:
    """The engine's bound holding with Adam's current ``step`` as ``c``.

    A ZeRO engine exports a new canonical holding (collective over its DP group: every replica
    of the model-stage calls this in the same order).

    Raises:
        NereusError: if the engine was never bound (:func:`bind_engine`).
    """
    if getattr(engine, "zero_stage", 0):
        return engine.export_holding()
    shard = getattr(engine, "emu_shard", None)
    if shard is None:
        raise NereusError(f"{engine.ms}: engine is not bound to an EMU holding")
    if engine.optimizer is not None and engine.optimizer.state:
        step = int(float(next(iter(engine.optimizer.state.values()))["step"]))
        shard.logical = replace(shard.logical, step=step)
    return shard


def trained_steps(engine) -> int:
    """The RL steps whose updates ``engine``'s state holds (``LogicalState.version``; −1: it
    stopped between a step's updates). Local: no collective, also on a ZeRO engine."""
    if getattr(engine, "zero_stage", 0):
        return engine.logical.version
    shard = getattr(engine, "emu_shard", None)
    return shard.logical.version if shard is not None else 0


def mark_trained(engine, steps: int) -> None:
    """Record that ``engine``'s state now holds ``steps`` RL steps' updates (−1: mid-step)."""
    if getattr(engine, "zero_stage", 0):
        engine.logical = replace(engine.logical, version=steps)
    elif getattr(engine, "emu_shard", None) is not None:
        engine.emu_shard.logical = replace(engine.emu_shard.logical, version=steps)


def params_holding_of(engine) -> EmuShard:
    """The engine's parameters as a ``PARAM_SLOTS`` holding (weight synchronisation's source).

    A view of the bound holding (no copy); a ZeRO engine's parameters are full on every replica
    (ZeRO-1/2), so it copies them into a new holding without communication.
    """
    if not getattr(engine, "zero_stage", 0):
        return holding_of(engine).params_only()
    layout, position = _engine_key(engine)
    shard = EmuShard(engine.model_stage, engine.spec, engine.value_head, layout, position, PARAM_SLOTS,
                     device=engine.device, logical=replace(engine.logical, step=engine.adam_step()))
    with torch.no_grad():
        for name, p in engine.params.items():
            shard.view(name, "param").copy_(p)
    return shard


def full_tensors(holdings: list[EmuShard], slot: str = "param") -> dict[str, torch.Tensor]:
    """Canonical full tensors of ``slot`` assembled from holdings that together cover a model.

    Raises:
        NereusError: if some part of a parameter is on none of the holdings.
    """
    out: dict[str, torch.Tensor] = {}
    for h in holdings:
        for s in h.shards:
            if s.name not in out:
                out[s.name] = torch.full(s.full_shape, float("nan"))
            out[s.name].narrow(s.dim, s.start, s.stop - s.start).copy_(h.view(s.name, slot))
    for name, t in out.items():
        if torch.isnan(t).any():
            raise NereusError(f"full_tensors: part of {name} is on no holding")
    return out


def nbytes_of(spec: ModelSpec, value_head: bool, layout: Layout, position: Position, n_slots: int) -> int:
    """Bytes of a holding (fp32), without allocating it."""
    return 4 * n_slots * sum(s.numel for s in shards_of(spec, layout, tuple(position), value_head))


__all__ = ["EmuShard", "LogicalState", "PARAM_SLOTS", "TRAIN_SLOTS", "bind_engine", "derived_seed",
           "full_tensors", "holding_of", "nbytes_of", "shard_shape", "slots_for"]
