"""Checkpoint/restart fallback and periodic checkpoints of EMU state with torch DCP.

Save (:func:`save_holdings`): every rank hands ``torch.distributed.checkpoint`` the views of its
holdings (:class:`emu.state.unit.EmuShard`) — no copy — under one key per parameter slice and slot,
``"<model_stage>/<name>/<slot>@<dim>:<start>:<stop>"``, plus ``"<model_stage>/logical"`` (the
five integers of :class:`emu.state.unit.LogicalState`). DP replicas and TP ranks holding the same
slice produce the same key, which DCP's default planner writes once.

Load (:func:`load_holdings`), in any layout and on any world size: each rank reads the
checkpoint's metadata, and for every shard of its target holdings reads the saved slices that
intersect it (each slice is a plain tensor in the checkpoint) and copies the intersections into
place — resharding on load, bit-exact since values are only copied. Loading needs no process
group (``no_dist``): every rank reads what it needs independently.

docs/platform.md: DCP measured at ~10 ms × ranks fixed cost, then 1–5 GB/s on page cache.
"""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path
from typing import Iterable, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from emu.state.unit import EmuShard, LogicalState, shard_shape
from nereusd.checkpoints import free_space_note
from nereusd.errors import NereusError, StorageError
from nereusd.plan import ModelStage, Plan
from nereusd.shards import Shard

log = logging.getLogger(__name__)

PLAN_KEY = "plan.json"


def slice_key(model_stage: ModelStage, shard: Shard, slot: str) -> str:
    """The checkpoint key of one slot of one parameter slice."""
    return f"{model_stage}/{shard.name}/{slot}@{shard.dim}:{shard.start}:{shard.stop}"


def parse_key(key: str) -> Optional[tuple[str, str, str, int, int, int]]:
    """``(model_stage, name, slot, dim, start, stop)`` of a slice key, ``None`` for other keys."""
    if "@" not in key:
        return None
    head, span = key.rsplit("@", 1)
    role, stage, rest = head.split("/", 2)
    name, slot = rest.rsplit("/", 1)
    dim, start, stop = (int(v) for v in span.split(":"))
    return f"{role}/{stage}", name, slot, dim, start, stop


@contextlib.contextmanager
def _storage_faults(what: str, directory: str | Path):
    """Re-raise DCP's failures as :class:`StorageError`. torch's ``CheckpointException`` derives
    from ``BaseException``, so without this a full disk at checkpoint time escaped the worker's
    task handler and killed the worker, which nereusd then read as a lost device.

    A load reads what a save wrote and verified: whatever it raises (a truncated file's
    ``EOFError``, a damaged ``.metadata``'s ``ValueError`` or unpickling error) says the
    checkpoint is damaged, not that the disk is full."""
    loading = what == "load"
    try:
        yield
    except NereusError:
        raise
    except (CheckpointException, Exception) as err:   # CheckpointException is a BaseException
        if not (loading or isinstance(err, (CheckpointException, OSError))):
            raise
        cause = err
        if isinstance(err, CheckpointException):   # one failure per rank: say the first
            failures = list(getattr(err, "failures", {}).values())
            cause = failures[0] if failures else err
            cause = cause[0] if isinstance(cause, tuple) else cause   # (exception, its traceback)
        note = " (its files are damaged or incomplete)" if loading else free_space_note(directory)
        raise StorageError(f"checkpoint {what} in {directory} failed: {type(cause).__name__}: {cause}{note}") from None


def save_holdings(holdings: Iterable[EmuShard], directory: str | Path, *, plan: Optional[Plan] = None,
                  process_group: Optional[dist.ProcessGroup] = None) -> None:
    """Save this rank's holdings into the DCP checkpoint ``directory`` (collective over
    ``process_group``, default the world when initialised; every member calls it, with or
    without holdings).

    Args:
        plan: recorded beside the state (as JSON bytes) so a restart knows the saved layout.
    """
    state: dict[str, object] = {}
    for h in holdings:
        for s in h.shards:
            for slot in h.slots:
                state[slice_key(h.model_stage, s, slot)] = h.view(s.name, slot)
        state[f"{h.model_stage}/logical"] = h.logical.to_tensor()
    if plan is not None:
        state[PLAN_KEY] = torch.frombuffer(bytearray(json.dumps(plan.to_dict()).encode()), dtype=torch.uint8)
    no_dist = not dist.is_initialized()
    with _storage_faults("save", directory):
        dcp.save(state, checkpoint_id=str(directory), process_group=process_group, no_dist=no_dist)


def verify_checkpoint(directory: str | Path) -> int:
    """Check that the DCP checkpoint ``directory`` is complete: its metadata reads, and every
    byte range it records lies inside a file that exists. Returns the bytes it records.

    Run once per checkpoint, by one rank, after :func:`save_holdings` returned (DCP writes the
    metadata last, after every rank's files).

    Raises:
        StorageError: naming the directory and the first missing or short file.
    """
    directory = Path(directory)
    with _storage_faults("verification", directory):
        meta = dcp.FileSystemReader(str(directory)).read_metadata()
    sizes: dict[str, int] = {}
    total = 0
    for info in (meta.storage_data or {}).values():
        path = directory / info.relative_path
        if info.relative_path not in sizes:
            try:
                sizes[info.relative_path] = path.stat().st_size
            except OSError as err:
                raise StorageError(f"checkpoint {directory} is incomplete: {path}: {err.strerror or err}") from None
        if info.offset + info.length > sizes[info.relative_path]:
            raise StorageError(f"checkpoint {directory} is incomplete: {path} has {sizes[info.relative_path]} bytes, "
                               f"the metadata records data up to byte {info.offset + info.length}")
        total += info.length
    return total


def saved_plan(directory: str | Path) -> Optional[Plan]:
    """The plan recorded by :func:`save_holdings`, or ``None``."""
    meta = dcp.FileSystemReader(str(directory)).read_metadata().state_dict_metadata
    if PLAN_KEY not in meta:
        return None
    buf = torch.empty(meta[PLAN_KEY].size, dtype=torch.uint8)
    dcp.load({PLAN_KEY: buf}, checkpoint_id=str(directory), no_dist=True)
    return Plan.from_dict(json.loads(bytes(buf.tolist()).decode()))


def load_holdings(targets: Iterable[EmuShard], directory: str | Path) -> None:
    """Fill ``targets`` (allocated holdings in the new layout) from the checkpoint ``directory``.
    Every value loaded must be finite: DCP keeps no checksum, and 4 KiB of ``0xFF`` written into
    a saved file (its size unchanged) loaded as NaN and failed the next step with a worker's
    traceback instead of falling back to the checkpoint before (an adversarial trial,
    2026-12-07). Damage that leaves the values finite still loads.

    Raises:
        StorageError: a value loaded is NaN or infinite.
        NereusError: if a target's model-stage, a parameter slot or part of a slice is not in
            the checkpoint.
    """
    targets = list(targets)
    with _storage_faults("load", directory):
        meta = dcp.FileSystemReader(str(directory)).read_metadata().state_dict_metadata
    saved: dict[tuple[str, str, str], list[Shard]] = {}
    for key in meta:
        parsed = parse_key(key)
        if parsed is None:
            continue
        ms, name, slot, dim, start, stop = parsed
        full_shape = tuple(meta[key].size)
        full_shape = tuple(full_shape[i] if i != dim else -1 for i in range(len(full_shape)))
        saved.setdefault((ms, name, slot), []).append(Shard(name, dim, start, stop, full_shape))
    plans: list[tuple[EmuShard, Shard, str, Shard]] = []  # (target, need, slot, saved piece)
    for h in targets:
        if f"{h.model_stage}/logical" not in meta:
            raise NereusError(f"checkpoint {directory}: no state of {h.model_stage}")
        for need in h.shards:
            for slot in h.slots:
                pieces = saved.get((str(h.model_stage), need.name, slot))
                if not pieces:
                    raise NereusError(f"checkpoint {directory}: no {need.name} {slot} of {h.model_stage}")
                covered = 0
                for piece in pieces:
                    piece = _complete(piece, need.full_shape)
                    inter = _intersection(need, piece)
                    if inter is not None:
                        plans.append((h, inter, slot, piece))
                        covered += inter.numel
                if covered < need.numel:
                    raise NereusError(f"checkpoint {directory}: {need.name} {slot} of {h.model_stage} covers "
                                      f"{covered} of {need.numel} elements")
    # Read each saved piece once, then copy every intersection out of it.
    wanted = {slice_key(_ms(h), p, slot): (p, slot) for h, _, slot, p in plans}
    buffers = {k: torch.empty(shard_shape(p)) for k, (p, _) in wanted.items()}
    logical = {f"{h.model_stage}/logical": torch.zeros(len(LogicalState.FIELDS), dtype=torch.int64) for h in targets}
    with _storage_faults("load", directory):
        dcp.load({**buffers, **logical}, checkpoint_id=str(directory), no_dist=True)
    for h, inter, slot, piece in plans:
        src = buffers[slice_key(_ms(h), piece, slot)]
        mine = h.shard(inter.name)
        partial = [x.dim for x in (inter, piece, mine) if not x.is_full]
        d = partial[0] if partial else 0
        p, i, m = piece.along(d), inter.along(d), mine.along(d)
        data = src.narrow(d, i.start - p.start, i.stop - i.start)
        h.view(inter.name, slot).narrow(d, i.start - m.start, i.stop - i.start).copy_(data)
    for h in targets:
        h.logical = LogicalState.from_tensor(logical[f"{h.model_stage}/logical"])
        for need in h.shards:
            for slot in h.slots:
                if not torch.isfinite(h.view(need.name, slot)).all():
                    raise StorageError(
                        f"checkpoint load in {directory} failed: {need.name} {slot} of {h.model_stage} holds "
                        "non-finite values (its files are damaged, or the run had diverged when it was saved)")
    log.info("loaded %d holdings from %s (%d saved slices read)", len(targets), directory, len(buffers))


def _ms(h: EmuShard) -> ModelStage:
    return h.model_stage


def _complete(piece: Shard, full_shape: tuple[int, ...]) -> Shard:
    return Shard(piece.name, piece.dim, piece.start, piece.stop, tuple(full_shape))


def _intersection(need: Shard, piece: Shard) -> Optional[Shard]:
    """The part of ``need`` inside ``piece`` (same parameter), expressed along one dim."""
    if piece.is_full:
        return need
    if need.is_full:
        return piece
    if need.dim != piece.dim:
        raise NereusError(f"{need.name}: slices along dims {need.dim} and {piece.dim} do not nest")
    lo, hi = max(need.start, piece.start), min(need.stop, piece.stop)
    return Shard(need.name, need.dim, lo, hi, need.full_shape) if lo < hi else None
