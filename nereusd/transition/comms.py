"""The communicators a transition DAG uses, in the one order every world rank creates them.

``torch.distributed.new_group`` is collective over the whole world (non-members call it too),
so every rank needs this list even for the ops it takes no part in: nereusd computes it once
and sends it beside each worker's slice of the DAG (:meth:`TransitionDag.slices`), instead of
the whole DAG to every worker.
"""

from __future__ import annotations

from nereusd.transition.memory import split_gather_groups
from nereusd.transition.ops import Op, OpKind, TransitionDag


def gather_groups(op: Op) -> list[list[int]]:
    """A Split's gather groups with a receiver (:func:`nereusd.transition.memory.split_gather_groups`)."""
    return [[x for x, _ in g] for g in split_gather_groups(op)]


def op_communicators(op: Op) -> list[tuple[int, ...]]:
    """Device sets of the communicators ``op`` uses, in a deterministic order."""
    if op.kind is OpKind.SPLIT:
        return [tuple(g) for g in gather_groups(op)]
    if op.kind is OpKind.EXTEND:
        return [tuple(sorted((s, d))) for s, d in zip(op.source_devices, op.target_devices)]
    if op.kind is OpKind.MERGE:
        return sorted({tuple(sorted((r.src, r.dst))) for r in op.routes if r.src != r.dst})
    return []


def communicator_plan(dag: TransitionDag) -> list[tuple[str, tuple[int, ...]]]:
    """``(op id, devices)`` of every communicator of ``dag``, in creation order (``dag.ops``'s)."""
    return [(op.id, devices) for op in dag.ops for devices in op_communicators(op)]
