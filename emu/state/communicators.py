"""The process groups of one transition, one set per op (:class:`Communicators`), and their
creation in the one order every rank follows (:func:`create_communicators`). Used by the
primitives (:mod:`emu.state.primitives`) and the weight synchronisation.
"""

from __future__ import annotations

import time
from typing import Callable, Iterable, Optional

import torch.distributed as dist

from emu.state.groups import GroupPool, destroy_group
from nereusd.errors import NereusError
from nereusd.transition.comms import communicator_plan
from nereusd.transition.ops import TransitionDag

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
