"""Process groups kept for reuse between transitions (:class:`GroupPool`), and their destruction.

Used by :class:`emu.state.communicators.Communicators`, whose groups the transition executor and the
weight synchronisation take from a worker's pool.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch.distributed as dist

from nereusd.transition.comms import GROUP_POOL_CAPACITY, IdleGroups

log = logging.getLogger(__name__)


def destroy_group(group: Optional[dist.ProcessGroup]) -> None:
    """Destroy ``group`` if this rank is a member (best effort on a broken world)."""
    if group is not None and group != dist.GroupMember.NON_GROUP_MEMBER:
        try:
            dist.destroy_process_group(group)
        except (RuntimeError, ValueError) as err:
            log.warning("destroying a transition communicator failed: %s", err)


class GroupPool:
    """Process groups kept for reuse between transitions and weight-sync plans.

    Destroying a gloo group that carried traffic took 15–30 ms per group on each member in the
    demo (``make demo``, worker logs; 4 ranks on 2 cores), and creating one ~12 ms (a
    ``/tmp`` script, 4 gloo ranks): every transition destroyed its own communicators and the
    old plan's weight-sync ones and created new ones, though they often span the same ranks. A
    group handed back (:meth:`release`) is idle; :meth:`acquire` returns the oldest idle group
    over the same ranks and backend, or creates one. Idle groups past ``capacity`` are destroyed,
    oldest first. A group has one holder at a time, so the ops of one DAG still never share one
    (:class:`Communicators`).

    Every rank of the world must call :meth:`acquire` and :meth:`release` with the same
    arguments in the same order — members and non-members alike (a non-member's group is
    ``NON_GROUP_MEMBER``) — so that the pools of all ranks decide alike and ``new_group``, a
    collective over the world, is called by all or none. :class:`Communicators` does (its
    ``create`` and ``destroy`` are called on every rank in DAG order).
    """

    def __init__(self, capacity: int = GROUP_POOL_CAPACITY) -> None:
        self.idle: IdleGroups[Optional[dist.ProcessGroup]] = IdleGroups(capacity)
        """Idle groups by ``(ranks, backend)``, oldest first: the bookkeeping nereusd mirrors
        (:class:`nereusd.transition.comms.GroupPoolMirror`) to price the set-ups a transition needs."""
        self.created = self.reused = 0

    @property
    def capacity(self) -> int:
        return self.idle.capacity

    def acquire(self, ranks: tuple[int, ...], backend: Optional[str]) -> Optional[dist.ProcessGroup]:
        """An idle group over ``ranks`` (global, sorted), else a new one (collective)."""
        found, group = self.idle.take((ranks, backend))
        if found:
            self.reused += 1
            return group
        self.created += 1
        return dist.new_group(list(ranks), backend=backend)

    def release(self, ranks: tuple[int, ...], backend: Optional[str], group: Optional[dist.ProcessGroup]) -> None:
        """Make ``group`` idle; destroy the oldest idle groups past ``capacity``."""
        for old in self.idle.put((ranks, backend), group):
            destroy_group(old)

    def clear(self) -> None:
        """Forget every idle group (after the world they belonged to was destroyed)."""
        self.idle.clear()
