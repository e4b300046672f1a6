"""Pool-change events: the GPU pool grew or shrank, and whether the job can go on without a replan.

Sources (DESIGN.md, "Slurm is the distributed engine"): an agent registering (another
allocation joined, ``nereus-launch grow``), an agent's heartbeat stopping, Slurm taking a node
(DOWN, DRAIN, job shrink; seen by :class:`nereusd.slurm.AllocationWatcher`) and the preemption
warning (``SIGUSR2`` from ``sbatch --signal=B:USR2@N``). nereusd journals each as a
``pool_changed`` event and hands it to the controller's hook.

Until live re-planning exists, :func:`assess` decides with the current plan only: a change that
touches none of the plan's devices is absorbed (the job goes on; the pool is just bigger or
smaller); one that takes a device of the plan stops the job cleanly; a preemption warning
checkpoints at the next safe boundary and stops.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Iterable


class PoolChangeKind(str, enum.Enum):
    """What happened to the pool."""

    JOINED = "joined"
    LOST = "lost"
    PREEMPTION = "preemption"


class PoolVerdict(str, enum.Enum):
    """What the job does about a pool change."""

    CONTINUE = "continue"
    """The plan's devices are intact: go on with the same plan on the changed pool."""
    STOP = "stop"
    """The plan lost a device; without live re-planning the job stops with a checkpoint."""
    CHECKPOINT_AND_STOP = "checkpoint_and_stop"
    """Preemption warning: checkpoint at the next safe boundary, then stop."""
    REPLAN = "replan"
    """Live adaptation: the job re-plans for the changed pool at the next safe boundary."""


@dataclass(frozen=True)
class PoolChange:
    """One change of the pool.

    Attributes:
        kind: joined, lost or preemption.
        cause: ``registration``, ``heartbeat``, ``slurm:node_down``, ``slurm:node_drain``,
            ``slurm:node_released``, ``slurm:job_ending`` or ``signal:SIGUSR2``.
        node_id: the node (Slurm node name) that joined or left; ``None`` for preemption.
        devices: global device indices that joined or left.
        detail: a sentence for the journal and the user.
    """

    kind: PoolChangeKind
    cause: str
    node_id: str | None
    devices: tuple[int, ...]
    detail: str


def assess(change: PoolChange, plan_devices: Iterable[int], live: bool = False) -> tuple[PoolVerdict, str]:
    """Decide what the job does about ``change`` given the devices the current plan uses.

    With ``live`` (live adaptation on), devices that join, and spares that leave, make the job
    re-plan at the next safe boundary; a plan device lost in the middle of a step still stops it.

    Returns:
        The verdict and a reason naming the devices involved.
    """
    plan = set(plan_devices)
    if change.kind == PoolChangeKind.PREEMPTION:
        return PoolVerdict.CHECKPOINT_AND_STOP, f"{change.detail}: checkpoint at the next step boundary and stop"
    if live and change.kind == PoolChangeKind.JOINED:
        return PoolVerdict.REPLAN, (f"{change.detail}: devices {list(change.devices)} join the pool; the job "
                                "re-plans at the next safe boundary and uses them where that repays the transition")
    if change.kind == PoolChangeKind.JOINED:
        return PoolVerdict.CONTINUE, (f"{change.detail}: devices {list(change.devices)} join the pool as spares "
                                  "(the current plan is kept until live re-planning uses them)")
    hit = sorted(plan & set(change.devices))
    if not hit and live:
        return PoolVerdict.REPLAN, (f"{change.detail}: devices {list(change.devices)} left the pool; the plan does "
                                "not use them; the job re-plans at the next safe boundary")
    if not hit:
        return PoolVerdict.CONTINUE, (f"{change.detail}: devices {list(change.devices)} left the pool; the plan does "
                                  "not use them, the job continues on the remaining devices")
    # live: the pool's record says the restart instead (nereusd.daemon.pool.PoolState.changed)
    return PoolVerdict.STOP, (f"{change.detail}: the plan uses devices {hit} of it and live adaptation is off "
                          "(adaptation.enabled: false); the job stops")
