"""The communicators a transition DAG uses, in the one order every world rank creates them.

``torch.distributed.new_group`` is collective over the whole world (non-members call it too),
so every rank needs this list even for the ops it takes no part in: nereusd computes it once
and sends it beside each worker's slice of the DAG (:meth:`TransitionDag.slices`), instead of
the whole DAG to every worker.
"""

from __future__ import annotations

from typing import Callable, Generic, Hashable, Iterable, TypeVar

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


def created_groups(plan: Iterable[tuple[str, Iterable[int]]]) -> list[tuple[str, tuple[int, ...]]]:
    """The process groups a communicator plan creates, in creation order: one per ``(op id,
    device set)`` (sorted, duplicates within an op once), none for a single device — exactly
    what :class:`emu.state.communicators.Communicators` creates from it."""
    out: dict[tuple[str, tuple[int, ...]], None] = {}
    for op_id, devices in plan:
        group = tuple(sorted(set(devices)))
        if len(group) > 1:
            out.setdefault((op_id, group), None)
    return list(out)


GROUP_POOL_CAPACITY = 32
"""Idle process groups a worker keeps for reuse (:class:`IdleGroups`, ``emu.state.groups.GroupPool``)."""

T = TypeVar("T")


class IdleGroups(Generic[T]):
    """Idle process groups by key, oldest first, at most ``capacity`` of them: the bookkeeping of
    a worker's pool (``emu.state.groups.GroupPool``, whose values are the groups) and of nereusd's
    copy of it (:class:`GroupPoolMirror`, values ``None``), so that both decide alike which group
    a transition reuses and which one it creates.

    :meth:`take` removes the oldest idle entry of a key; :meth:`put` appends one and returns the
    values pushed out past ``capacity``, oldest first (the worker destroys those groups)."""

    def __init__(self, capacity: int = GROUP_POOL_CAPACITY) -> None:
        self.capacity = capacity
        self.entries: list[tuple[Hashable, T]] = []

    def __len__(self) -> int:
        return len(self.entries)

    def take(self, key: Hashable) -> tuple[bool, T | None]:
        """``(True, value)`` of the oldest idle entry of ``key``, removed; ``(False, None)`` without one."""
        for i, (k, value) in enumerate(self.entries):
            if k == key:
                del self.entries[i]
                return True, value
        return False, None

    def put(self, key: Hashable, value: T) -> list[T]:
        """Make ``value`` idle under ``key``; returns the values evicted past ``capacity``."""
        self.entries.append((key, value))
        evicted = []
        while len(self.entries) > self.capacity:
            evicted.append(self.entries.pop(0)[1])
        return evicted

    def clear(self) -> None:
        self.entries.clear()


class GroupPoolMirror:
    """nereusd's copy of its workers' group pools, by device set (every rank of a world keeps
    the same pool: ``emu.state.groups.GroupPool``), so that ``L̂_tran`` prices the set-up of the
    communicators a transition creates, not of those its workers take back from the pool.

    What the workers do (``emu.worker.transition_tasks``), and the method that follows it here:

    - a build creates the plan's weight-sync groups and holds them (:meth:`built`);
    - a transition takes the DAG's groups (:func:`communicator_plan` order), hands them back
      after the ops, hands back the old plan's weight-sync groups and takes the new plan's
      (``transition_finish``; :meth:`ran`);
    - a new world (a restart, devices joining or leaving) empties every pool and drops the held
      groups (:meth:`world_formed`).

    Args:
        sync_plan: a plan's weight-sync communicators, as ``(op id, device set)`` in creation
            order (:func:`created_groups` of each weight-sync DAG's :func:`communicator_plan`).
    """

    def __init__(self, sync_plan: Callable[[object], list[tuple[str, tuple[int, ...]]]],
                 capacity: int = GROUP_POOL_CAPACITY) -> None:
        self.sync_plan = sync_plan
        self.idle: IdleGroups[None] = IdleGroups(capacity)
        self.held: list[tuple[int, ...]] = []
        """Device sets of the running plan's weight-sync groups."""
        self.version = 0
        """Changes whenever the pool does (an estimate priced against an older pool is stale)."""

    def _copy(self) -> IdleGroups[None]:
        idle: IdleGroups[None] = IdleGroups(self.idle.capacity)
        idle.entries = list(self.idle.entries)
        return idle

    def reused(self, dag: TransitionDag) -> frozenset[tuple[str, tuple[int, ...]]]:
        """The ``(op id, device set)`` groups of ``dag`` that its workers take from the pool."""
        idle = self._copy()
        return frozenset(g for g in created_groups(communicator_plan(dag)) if idle.take(g[1])[0])

    def sync_created(self, dag: TransitionDag) -> int:
        """Weight-sync groups of ``dag.target`` that its ``transition_finish`` creates."""
        return self._run(dag, self._copy())[1]

    def ran(self, dag: TransitionDag) -> None:
        """The workers ran ``dag`` and its ``transition_finish``."""
        self.held = self._run(dag, self.idle)[0]
        self.version += 1

    def built(self, plan) -> None:
        """The workers built ``plan``: its weight-sync groups are created and held."""
        self.held = [g for _, g in self.sync_plan(plan)]
        self.version += 1

    def world_formed(self) -> None:
        """A new world: no group is idle or held any more."""
        self.idle.clear()
        self.held = []
        self.version += 1

    def _run(self, dag: TransitionDag, idle: IdleGroups[None]) -> tuple[list[tuple[int, ...]], int]:
        own = [g for _, g in created_groups(communicator_plan(dag))]
        for g in own:
            idle.take(g)
        for g in own + self.held:
            idle.put(g, None)
        held = [g for _, g in self.sync_plan(dag.target)]
        return held, sum(not idle.take(g)[0] for g in held)
