"""Memoised transition assessments: the DAG of ``S → S*``, its memory feasibility and ``L̂_tran``.

The controller and the simulator's ground truth both call the transition engine's own
:func:`nereusd.transition.assess_transition`; they differ only in the cost model whose links
price the DAG — the controller's calibrated one, or the ground truth's hidden one. The assessed
DAG travels with the estimate (:attr:`TransitionEstimate.dag`): a live job executes exactly the
DAG that admission assessed.

Scale (the simulator only): planning the DAG of a 1,024-GPU transition takes seconds (every
shard route is enumerated), which would dominate a simulation that assesses hundreds of targets.
With ``max_devices`` set, plans above it are assessed *scaled down in DP* by the smallest power
of two that brings them under the limit (same TP/PP layouts, ``ceil(dp/f)`` replicas, placed by
:func:`nereusd.planner.placement.place` on a proportionally smaller pool). Replicas move
concurrently and each device has one port (the engine's cost rule), so the makespan of the
scaled DAG is the same per-device pattern as the full one; what this misses is link sharing
between more replicas than the scaled plan has. Such an estimate has no DAG to execute
(``dag is None``). Live jobs assess every plan at full size (``max_devices=None``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

from nereusd.cost.model import CostModel
from nereusd.errors import PlanError
from nereusd.models import ModelSpec
from nereusd.plan import ModelStage, Plan, Role
from nereusd.planner.placement import place
from nereusd.transition import assess_transition, sync_communicator_plan
from nereusd.transition.comms import GroupPoolMirror
from nereusd.transition.ops import TransitionDag


@dataclass(frozen=True)
class TransitionEstimate:
    """``l_tran_s`` seconds; ``feasible`` and ``reason`` from the DAG's memory check; ``scale``
    the DP reduction factor used (1: the full plans); ``dag`` the assessed DAG (``None`` when
    nothing changes or the plans were scaled); ``blocked`` the model-stage (its string form)
    whose op does not fit memory, ``""`` when it fits or the current plan itself does not."""

    l_tran_s: float
    feasible: bool
    reason: str = ""
    scale: int = 1
    dag: TransitionDag | None = None
    blocked: str = ""


class TransitionEstimator:
    """Memoised transition assessments for one site and one pricing cost model.

    Args:
        specs: model spec per role.
        site: the cluster (``nereusd.config.site.SiteConfig``, with the job's device memory).
        cost_model: prices links (calibrated controller model, or the ground truth's).
        concurrent_sets: :meth:`Workflow.concurrent_sets`, for re-placing scaled plans.
        max_devices: largest plan assessed at full size (``None``: every plan; see the module
            docstring).
    """

    def __init__(self, specs: Mapping[Role, ModelSpec], site, cost_model: CostModel,
                 concurrent_sets: Sequence[Sequence[ModelStage]], max_devices: int | None = None) -> None:
        self.specs = dict(specs)
        self.site = site
        self.cost_model = cost_model
        self.sets = [tuple(s) for s in concurrent_sets]
        self.max_devices = max_devices
        self._memo: dict[tuple, TransitionEstimate] = {}
        self._memo_version = 0
        self._sync_plans: dict[tuple, list[tuple[str, tuple[int, ...]]]] = {}
        self.groups = GroupPoolMirror(self.sync_plan)
        """The workers' group pools as the transitions they ran left them: a full-size estimate
        prices no set-up for the communicators they hand back (a scaled one, every set-up)."""

    def sync_plan(self, plan: Plan) -> list[tuple[str, tuple[int, ...]]]:
        """:func:`nereusd.transition.sync_communicator_plan` of ``plan`` (memoised); nothing for a
        plan over ``max_devices``. Every transition from or to such a plan is assessed scaled,
        which prices every set-up and takes nothing from the pools, and the transition after it
        leaves the pools as a build of its target does (the simulator's replay): the groups such a
        plan holds are never read. Planning them took most of a simulation at 4,096 GPUs (22 s of
        one step; an adversarial trial, 2026-12-07)."""
        if self.max_devices is not None and self._span(plan) > self.max_devices:
            return []
        key = plan.key()
        if key not in self._sync_plans:
            if len(self._sync_plans) > 256:
                self._sync_plans.clear()
            self._sync_plans[key] = sync_communicator_plan(plan, self.specs, devices_per_node=self.site.devices_per_node)
        return self._sync_plans[key]

    def sync_groups_created(self, dag: TransitionDag) -> int:
        """Weight-sync groups the target plan of ``dag`` creates at its ``transition_finish``
        (:meth:`GroupPoolMirror.sync_created`)."""
        return self.groups.sync_created(dag)

    def forget(self) -> None:
        """Drop every memoised estimate (the cost model's calibration changed wholesale)."""
        self._memo.clear()

    def estimate(self, current: Plan, target: Plan) -> TransitionEstimate:
        """Assess ``current → target``; equal plans cost nothing.

        Raises:
            PlanError: from the transition planner (a layout that cannot shard a model).
        """
        if self._memo_version != self.groups.version:   # the pool changed: set-ups priced anew
            self._memo.clear()
            self._memo_version = self.groups.version
        key = (current.key(), target.key())
        hit = self._memo.get(key)
        if hit is not None:
            return hit
        if key[0] == key[1]:
            est = TransitionEstimate(0.0, True)
        else:
            scale = 1
            while self.max_devices is not None and \
                    max(self._span(current), self._span(target)) / scale > self.max_devices and \
                    any(c.dp >= 2 * scale for p in (current, target) for c in p.candidates.values()):
                scale *= 2
            cur, tgt = (current, target) if scale == 1 else self._scaled(current, target, scale)
            result = assess_transition(cur, tgt, self.specs, self.site, cost_model=self.cost_model,
                                       reused=self.groups.reused if scale == 1 else None)
            v = result.feasibility.violation
            est = TransitionEstimate(result.l_tran_s, result.feasible, result.reason, scale,
                                     result.dag if scale == 1 else None,
                                     v.model_stage if v is not None and v.op_id is not None else "")
        if len(self._memo) > 4096:
            self._memo.clear()
        self._memo[key] = est
        return est

    @staticmethod
    def _span(plan: Plan) -> int:
        return len(plan.devices())

    def _scaled(self, current: Plan, target: Plan, scale: int) -> tuple[Plan, Plan]:
        """Both plans with ``ceil(dp/scale)`` replicas, re-placed on a smaller pool."""
        dpn = self.site.devices_per_node

        def layouts(plan: Plan) -> dict:
            return {m: (c.tp, c.pp, max(1, math.ceil(c.dp / scale)), c.micro_batch, c.recompute, c.zero_stage)
                    for m, c in plan.items()}

        lc, lt = layouts(current), layouts(target)
        need = max(sum(lay[m][0] * lay[m][1] * lay[m][2] for m in group if m in lay)
                   for lay in (lc, lt) for group in self.sets)
        pool = tuple(range(math.ceil(need / dpn) * dpn))
        try:
            cur = place(lc, self.sets, pool, dpn)
            return cur, place(lt, self.sets, pool, dpn, current=cur)
        except PlanError:
            pool = tuple(range(pool[-1] + 1 + 4 * dpn))
            cur = place(lc, self.sets, pool, dpn)
            return cur, place(lt, self.sets, pool, dpn, current=cur)
