"""A ZeRO model-stage's optimizer partitions moved straight from the old replica set to the new one.

The alternative path to a ZeRO model-stage's export (``DeepSpeedStageEngine.export_holding``:
every replica joins the full Adam moments, 12 B per parameter, then the transition DAG copies
whole holdings to joiners). When a transition keeps a model-stage on ZeRO (``zero_stage`` ≥ 1
before and after; :func:`nereusd.transition.zero_repartitioned`, the one rule nereusd and the
workers share):

1. ``transition_prepare``: each old replica keeps its flat partitions — Adam ``m``, ``v`` and,
   when parameters are narrower than fp32, the fp32 master — (:func:`keep_partition`, no
   communication) and hands the transition DAG a parameter-only holding (``PARAM_SLOTS``);
   the DAG moves parameters alone.
2. ``transition_finish``: each new replica builds its DeepSpeed engine, takes the parameters from
   its holding (``DeepSpeedStageEngine.adopt_holding``), and :func:`repartition` fills its
   partition: the new replica ``j`` owns elements ``[t_j, t_j + M_j)`` of DeepSpeed's flat buffer
   and the old replica ``i`` held ``[s_i, s_i + L_i)``; each overlap (below the parameter count
   ``P``; the rest is DeepSpeed's alignment padding, zero) is one point-to-point message per slot
   from ``i`` to ``j``, or a local copy when both are the same rank. In fp32 training the master
   partition is a slice of the parameters, which every replica holds.

Every element is copied, never computed, so a move is bit-exact
(``tests/distributed/test_deepspeed_engine.py``). A new replica receives ``(8 or 12)·P/dp_new``
bytes instead of the whole ``12·P`` holding, and no replica ever holds more than its partitions
plus the parameters: a transition stays at ZeRO's size. A leaving replica sends its partition
before it is released; until then (a worker lost mid-transition) the partition is its only copy,
and the job restarts from the last checkpoint (``nereusd.transition.runner``), as for a worker
lost mid-step.

Precondition: the flat buffer is laid out as a holding's slot rows
(``DeepSpeedStageEngine._flat_is_holding_row``: one parameter group in module order, packed —
true of every model here); :func:`keep_partition` refuses an engine that is not.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Optional

import torch
import torch.distributed as dist

from emu.state.unit import PARAM_SLOTS, EmuShard
from nereusd.errors import NereusError
from nereusd.plan import ModelStage

log = logging.getLogger(__name__)

MOMENTS = ("exp_avg", "exp_avg_sq")
MASTER = "fp32"


@dataclass
class FlatPartition:
    """One old replica's partition of a ZeRO model-stage's flat optimizer state, kept from
    ``transition_prepare`` until :func:`repartition`.

    Attributes:
        model_stage: whose state it is.
        start: index of its first element in DeepSpeed's flat buffer (DP rank × partition size).
        numel: ``P``, the parameter count (elements past it are alignment padding).
        slots: 1-D tensors of equal length, ``{"exp_avg", "exp_avg_sq"[, "fp32"]}``; empty before
            the first optimizer step (Adam has no state yet).
        step: Adam's ``step``.
    """

    model_stage: ModelStage
    start: int
    numel: int
    slots: dict[str, torch.Tensor] = field(default_factory=dict)
    step: int = 0

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.slots.values())

    @property
    def length(self) -> int:
        return next(iter(self.slots.values())).numel() if self.slots else 0


def keep_partition(engine, memory=None) -> tuple[EmuShard, FlatPartition]:
    """Detach a ZeRO engine for a re-partitioning transition: its parameters as a new
    ``PARAM_SLOTS`` holding (copied: DeepSpeed's parameters live in its flat buffer; booked as
    ``export`` while the engine exists) and its optimizer partitions; the engine is released,
    its entries freed, and the partitions booked on ``memory`` (default: the engine's) as
    ``partition``. Local: no communication.

    Returns:
        ``(holding, partition)``: the holding is not booked (the caller puts it in its store).

    Raises:
        NereusError: if DeepSpeed's flat buffer is not laid out as the holding's rows.
    """
    memory = memory or engine.memory
    params_bytes = sum(p.numel() * p.element_size() for p in engine.params.values())
    memory.allocate(engine.ms, "export", params_bytes)   # the parameters' copy, beside the engine
    shard = EmuShard(engine.model_stage, engine.spec, engine.value_head, engine.candidate.layout, (0, 0), PARAM_SLOTS,
                     device=engine.device, logical=replace(engine.logical, step=engine.adam_step()))
    if not engine._flat_is_holding_row(shard):
        memory.free(engine.ms, "export")
        raise NereusError(f"{engine.ms}: DeepSpeed's flat buffer is not laid out as a holding; cannot re-partition")
    opt = engine.ds_optimizer
    flat = opt.single_partition_of_fp32_groups[0]
    start, _ = engine._partition_span(flat, shard.numel_per_slot)
    state = engine._adam_state()
    slots = {k: state[k] for k in MOMENTS} if state else {}
    narrow = any(p.dtype != torch.float32 for p in engine.params.values())
    if state and narrow:
        slots[MASTER] = flat
    part = FlatPartition(engine.model_stage, start, shard.numel_per_slot, slots, engine.adam_step())
    with torch.no_grad():
        for name, p in engine.params.items():
            shard.view(name, "param").copy_(p)
    engine.logical = shard.logical
    engine.release()
    for what in ("export", "parameters", "gradients", "optimizer"):
        memory.free(engine.ms, what)
    memory.allocate(engine.ms, "partition", part.nbytes)   # what of the optimizer's entry it keeps
    return shard, part


def _meta(old: Optional[FlatPartition], engine) -> tuple:
    """This rank's ``(old start, old length, slots, step, new start, new length, P)``
    (``-1`` where it holds no old partition or no new replica)."""
    new_start = new_len = -1
    numel = old.numel if old is not None else -1
    if engine is not None:
        flat = engine.ds_optimizer.single_partition_of_fp32_groups[0]
        numel = sum(p.numel() for p in engine.params.values())
        new_start, new_len = engine._partition_span(flat, numel)[0], flat.numel()
    if old is None:
        return (-1, 0, (), 0, new_start, new_len, numel)
    return (old.start, old.length, tuple(sorted(old.slots)), old.step, new_start, new_len, numel)


@torch.no_grad()
def repartition(old: Optional[FlatPartition], engine, memory) -> int:
    """Move the optimizer partitions of the old replica set into the new engines (module docstring).

    Called on *every* rank of the world after the new engines of the model-stage were built:
    ``old`` is this rank's kept partition (``None`` where it held no old replica), ``engine`` its
    new :class:`~emu.engine.deepspeed_stage.DeepSpeedStageEngine` that already took its
    parameters (``None`` where it holds no new replica). Collective over the world: one
    ``all_gather_object`` of the spans, then point-to-point messages. ``old``'s booking
    (``partition``, :func:`keep_partition`) is freed on ``memory`` at the end.

    Returns:
        Bytes this rank received from other ranks.

    Raises:
        NereusError: if the old replicas disagree on the Adam step or the slots, or the spans do
            not cover the new partitions.
    """
    meta = [None] * dist.get_world_size()
    dist.all_gather_object(meta, _meta(old, engine))
    rank = dist.get_rank()
    holders = [(r, m) for r, m in enumerate(meta) if m[0] >= 0]
    if len({(m[2], m[3]) for _, m in holders}) > 1:
        raise NereusError(f"re-partition: old replicas disagree on slots and step: {[(m[2], m[3]) for _, m in holders]}")
    slot_names, step = (holders[0][1][2], holders[0][1][3]) if holders else ((), 0)
    numel = max(m[6] for m in meta)
    received, pending, targets, covered = 0, [], {}, 0
    if engine is not None:
        opt = engine.ds_optimizer
        flat = opt.single_partition_of_fp32_groups[0]
        start, valid = engine._partition_span(flat, numel)
        targets = {k: torch.zeros_like(flat) for k in slot_names if k != MASTER}
        if MASTER in slot_names:
            targets[MASTER] = flat
        else:   # fp32: the master partition is a slice of the parameters (DeepSpeed's flat buffer)
            flat[:valid].copy_(opt.bit16_groups_flat[0][start:start + valid])
            flat[valid:].zero_()
    for src, m in holders:
        s, length = m[0], m[1]
        for dst, n in enumerate(meta):
            if n[4] < 0 or not slot_names:
                continue
            lo, hi = max(s, n[4]), min(s + length, n[4] + n[5], numel)
            if lo >= hi:
                continue
            if dst == rank:
                covered += hi - lo
            for tag, k in enumerate(slot_names):
                if src == rank and dst == rank:
                    targets[k][lo - n[4]:hi - n[4]].copy_(old.slots[k][lo - s:hi - s])
                elif src == rank:
                    pending.append(dist.isend(old.slots[k][lo - s:hi - s], dst, tag=tag))
                elif dst == rank:
                    buf = targets[k][lo - n[4]:hi - n[4]]
                    pending.append(dist.irecv(buf, src, tag=tag))
                    received += buf.numel() * buf.element_size()
    for work in pending:
        work.wait()
    if engine is not None:
        if slot_names and covered != valid:
            raise NereusError(f"{engine.ms}: re-partition covered {covered} of this partition's {valid} elements")
        if slot_names:
            engine._set_adam_state(step, {k: targets[k] for k in MOMENTS})
        else:
            opt.optimizer.state.pop(flat, None)
    if old is not None:
        memory.free(str(old.model_stage), "partition")
        old.slots.clear()
    return received
