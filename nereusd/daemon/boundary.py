"""What happens at a safe boundary, as pure plans: the pool change and the actions that follow
the controller's decision (DESIGN.md "One RL step", steps 3–5). No sockets, no processes, no
clock: :class:`nereusd.daemon.live.LiveAdaptation` gathers the inputs and executes the result.

1. :func:`plan_pool` — from the world, the registry's view of lost devices, removal requests
   and the pool schedule's due events: which devices leave (lost spares, then removals: devices
   not in the world yet first — they hold nothing of the job —, then the world's
   highest-numbered, never the last device), how many are added, and whether devices of the
   running plan were lost (then nothing is planned: the recovery path restarts the job);
2. the shell adds devices and grows the world, then asks the controller (pure as well);
3. :func:`plan_actions` — from the decision, the devices that leave and those that joined: the
   transition to run (the DAG admission assessed, as it is), then a checkpoint/restart, the
   release of the devices that leave, or a rebuild of the engines after the world re-formed.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from nereusd.config.pool_schedule import PoolEvent, net_change
from nereusd.control.admission import ADMIT, RESTART, Decision
from nereusd.plan import Plan
from nereusd.transition.ops import TransitionDag


@dataclass(frozen=True)
class PoolActions:
    """The pool change due at one boundary.

    Attributes:
        add: devices to add (a new local agent).
        leaving: devices of the world whose workers stop: lost spares and chosen removals, sorted.
        leaving_outside: removals of registered devices not in the world yet (waiting for a
            background join, or in one: its join is cancelled), sorted. They hold nothing of
            the job, so a removal takes them first: ``nereus-launch pool --remove`` during a
            join once counted them on arrival and then refused itself at the boundary, where
            only the world's devices were candidates.
        lost_spares: devices lost since the step's last task that hold nothing of the plan
            (``{device: {"cause", ...}}`` from the registry).
        lost_plan_devices: devices of the running plan that were lost: their state is gone, the
            recovery path (checkpoint/restart) takes over and nothing but ``add`` is planned.
        refused_remove: a removal refused (it would leave fewer devices than the job needs, or a
            pool no plan fits), else 0.
        refused_reason: why, for the journal.
        sources: readable causes of the change for the journal.
    """

    add: int = 0
    leaving: tuple[int, ...] = ()
    leaving_outside: tuple[int, ...] = ()
    lost_spares: Mapping[int, Mapping[str, Any]] = field(default_factory=dict)
    lost_plan_devices: tuple[int, ...] = ()
    refused_remove: int = 0
    refused_reason: str = ""
    sources: tuple[str, ...] = ()


def too_few_left(left: int, min_devices: int) -> str:
    """Why a removal that leaves ``left`` devices is refused, or ``""``: the job runs on no fewer
    than ``min_devices`` (:func:`~nereusd.config.pool_schedule.min_devices_of`, at least one).
    Asked when ``nereus-launch pool --remove`` arrives (:meth:`PoolController.request_remove`)
    and at the boundary (:func:`plan_pool`, the schedule's removals too)."""
    need = max(1, min_devices)
    return f"the job needs at least {need} device(s)" if left < need else ""


def plan_pool(*, world: Sequence[int], registered: Sequence[int], lost: Mapping[int, Mapping[str, Any]],
              plan_devices: Sequence[int], pending_remove: int, due: Sequence[PoolEvent], min_devices: int = 1,
              unfit: Callable[[tuple[int, ...]], str | None] | None = None) -> PoolActions:
    """The pool change at a boundary (module docstring, step 1).

    Args:
        world: devices of the current world, in rank order.
        registered: devices the control plane's registry holds now.
        lost: devices of the world the registry knows to be lost.
        plan_devices: devices the running plan uses.
        pending_remove: devices ``nereus-launch pool --remove`` asked to release.
        due: the pool schedule's events due now.
        min_devices: the fewest devices the job runs on
            (:func:`~nereusd.config.pool_schedule.job_min_devices`); a removal below it is refused.
        unfit: why no plan fits a pool (``None`` when one does); a removal that leaves such a pool
            is refused instead of failing the job at its restart.

    Raises:
        ValueError: a negative removal request (callers validate what users ask for).
    """
    if pending_remove < 0:
        raise ValueError(f"pending_remove must be >= 0, got {pending_remove}")
    registered = sorted(set(registered))
    sources = [e.source for e in due] + ([f"nereus-launch pool --remove {pending_remove}"] if pending_remove else [])
    scheduled_remove, add = net_change(due)
    hit = tuple(sorted(set(lost) & set(plan_devices)))
    if hit:   # the devices due to join still join (the schedule hands each event out once)
        return PoolActions(add=add, lost_plan_devices=hit, sources=tuple(sources))
    remove = pending_remove + scheduled_remove
    leaving = set(lost)
    refused, reason = 0, ""
    outside: list[int] = []
    if remove:
        inside = [d for d in registered if d in world and d not in lost]
        candidates = inside + [d for d in registered if d not in world and d not in lost]   # taken from the end
        removed = candidates[-remove:] if remove < len(candidates) else list(candidates)
        kept = tuple(sorted(d for d in candidates if d not in removed))
        reason = too_few_left(len(kept), min_devices)
        if reason:
            reason += f"; {len(candidates)} in the pool"
        elif unfit is not None:
            reason = unfit(kept) or ""
        if reason:
            refused, removed = remove, []
        leaving |= {d for d in removed if d in world}
        outside = sorted(d for d in removed if d not in world)
    return PoolActions(add=add, leaving=tuple(sorted(leaving)), leaving_outside=tuple(outside), lost_spares=dict(lost),
                       refused_remove=refused, refused_reason=reason, sources=tuple(sources))


class ActionKind(str, enum.Enum):
    """One step of what the shell executes after a decision."""

    TRANSITION = "transition"
    """Run ``dag`` (admission's, as it is): the driver continues on ``target``."""
    RESTART = "checkpoint_restart"
    """Checkpoint now and restart every surviving worker into the controller's restart plan."""
    RELEASE = "release"
    """Stop the workers of ``devices`` (the plan no longer uses them), re-form the world, rebuild."""
    REBUILD = "rebuild"
    """Rebuild every engine on the same plan (the world re-formed with devices that joined)."""


@dataclass(frozen=True)
class Action:
    """One action; ``why`` is journalled with it."""

    kind: ActionKind
    why: str = ""
    target: Plan | None = None
    dag: TransitionDag | None = None
    predicted_s: float | None = None
    devices: tuple[int, ...] = ()


def plan_actions(decision: Decision | None, *, plan: Plan, leaving: Sequence[int],
                 joined: Sequence[int]) -> tuple[Action, ...]:
    """What to execute after the controller's ``decision`` (``None``: nothing triggered), in order.

    - admitted: the transition, then the release of ``leaving`` (the target avoids them);
    - checkpoint/restart, or devices leave that the running plan uses and nothing moved off
      them: a restart, alone;
    - devices leave: their release; devices joined (the world re-formed) and nothing was
      admitted: a rebuild on the same plan.

    Raises:
        ValueError: an admitted target that still uses a device that leaves (the controller
            plans on the pool without them; this is an internal invariant).
    """
    actions: list[Action] = []
    admitted = decision is not None and decision.verdict == ADMIT
    running = plan
    if admitted:
        target = decision.target
        stuck = sorted(set(leaving) & set(target.plan.devices()))
        if stuck:
            raise ValueError(f"the admitted plan uses devices {stuck} that leave the pool")
        actions.append(Action(ActionKind.TRANSITION, decision.reason, target.plan, target.dag, decision.l_tran_s))
        running = target.plan
    stuck = sorted(set(leaving) & set(running.devices()))
    if (decision is not None and decision.verdict == RESTART) or stuck:
        why = decision.reason if decision is not None and decision.verdict == RESTART else (
            f"devices {list(leaving)} leave and no feasible plan moves off them"
            + (f" ({decision.reason})" if decision is not None else ""))
        return (Action(ActionKind.RESTART, why, devices=tuple(leaving)),)
    if leaving:
        actions.append(Action(ActionKind.RELEASE, "removed from the pool", devices=tuple(leaving)))
    elif joined and not admitted:
        actions.append(Action(ActionKind.REBUILD, "rebuild after re-forming the world"))
    return tuple(actions)
