"""Transition planning: from plan ``S`` to ``S*`` as a DAG of EMU primitives (paper §5–§6).

Pure (no torch): the controller plans, checks and costs a transition here; workers receive
the DAG as JSON (:meth:`TransitionDag.to_json`) and run its ops. Pieces:

* :mod:`nereusd.transition.ops` — frozen plan objects (EMU, Op, Route, Edge, TransitionDag)
  and their JSON form;
* :mod:`nereusd.transition.local` — ``Δ_M``, ``T_sub`` and the local DAG
  Split → Destroy → Extend → Merge of one model-stage;
* :mod:`nereusd.transition.dag` — the global DAG (release-before-acquire, stage order), a
  deterministic topological order, and the validator (acyclic, race-free, target reached,
  never the last copy lost);
* :mod:`nereusd.transition.memory` — per-device memory at every op against the budget;
* :mod:`nereusd.transition.cost` — ``L̂_tran``, the DAG's critical path.

Typical use::

    dag, report = fitting_dag(S, S_star, models, 8, state, budget)   # plan; admission: feasibility
    cost = estimate_l_tran(dag, state.sizes, SiteLinkCosts.from_site(site))  # profitability
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Collection, Mapping

from nereusd.errors import PlanError
from nereusd.models import ModelSpec
from nereusd.plan import ModelStage, Plan, Role, Stage
from nereusd.protocol.tasks import SyncDag
from nereusd.shards import value_head_for
from nereusd.transition.cost import (
    CostModelLinks,
    LinkCosts,
    SiteLinkCosts,
    TransitionCost,
    estimate_l_tran,
    op_duration_s,
)
from nereusd.transition.comms import communicator_plan, created_groups
from nereusd.transition.dag import join, topological_order
from nereusd.transition.validate import validate
from nereusd.transition.local import Delta, local_dag, t_sub
from nereusd.transition.memory import (
    AdamStateSizes,
    FeasibilityReport,
    MemoryBudget,
    MemoryViolation,
    ParamsMoved,
    StateModel,
    StateSizes,
    check_feasibility,
    stage_in_host,
    tight_devices,
)
from nereusd.transition.via import chain, crossed, via_plan
from nereusd.transition.ops import (
    Edge,
    EdgeReason,
    Emu,
    Op,
    OpKind,
    Route,
    TransitionDag,
    emu_collection,
    emu_collections,
    rebuilt_model_stages,
)

log = logging.getLogger(__name__)

__all__ = [
    "AdamStateSizes", "CostModelLinks", "Delta", "Edge", "EdgeReason", "Emu", "FeasibilityReport",
    "LinkCosts", "MemoryBudget", "MemoryViolation", "Op", "OpKind", "Route", "SiteLinkCosts",
    "StateModel", "StateSizes", "TransitionCost", "TransitionDag", "check_feasibility", "deltas", "stage_in_host",
    "fitting_dag", "via_plan", "chain", "crossed",
    "emu_collection", "emu_collections", "estimate_l_tran", "op_duration_s", "plan_transition",
    "t_sub", "tight_devices", "topological_order", "validate", "TransitionAssessment",
    "assess_transition", "weight_sync_dags", "sync_dag_args", "rebuilt_model_stages",
    "zero_repartitioned", "repartitioned_by", "zero_state_cost", "repartition_cost", "ParamsMoved",
    "sync_communicator_plan",
]


def deltas(current: Plan, target: Plan) -> list[Delta]:
    """``Δ = {Δ_M}``: one entry per model-stage of either plan, in canonical order (paper §6.1)."""
    stages = sorted(set(current) | set(target), key=ModelStage.sort_key)
    return [Delta(m, current.candidates.get(m), target.candidates.get(m)) for m in stages]


def plan_transition(
    current: Plan,
    target: Plan,
    models: Mapping[Role, ModelSpec],
    *,
    devices_per_node: int,
    state: StateModel | None = None,
    budget: MemoryBudget | None = None,
    check: bool = True,
    lean: bool = False,
) -> TransitionDag:
    """Plan the transition ``S → S*`` (paper §6.1).

    Args:
        current, target: the plans ``S`` and ``S*``.
        models: model shapes per role (critic and reward carry a value head).
        devices_per_node: for the node of a device (``device // devices_per_node``); Extend
            prefers a sender on the receiver's node.
        state, budget: with both, release-before-acquire edges are added on every device whose
            worst case exceeds the budget (:func:`~nereusd.transition.memory.tight_devices`);
            without, only at hand-overs of devices between model-stages. The budget's
            ``collective_buffer_bytes`` becomes the DAG's ``staging_bytes`` (default
            :data:`~nereusd.transition.ops.STAGING_BYTES`).
        check: run :func:`~nereusd.transition.dag.validate` on the result.
        lean: Extend only from retained holders (:func:`~nereusd.transition.local.local_dag`).

    Returns:
        The acyclic global DAG; ``len(dag) == 0`` when nothing changes.

    Raises:
        PlanError: if a role has no model spec, a layout cannot shard its model, or
            ``devices_per_node`` < 1.
    """
    if devices_per_node < 1:
        raise PlanError(f"devices_per_node must be >= 1, got {devices_per_node}")
    local = []
    for delta in deltas(current, target):
        role = delta.model_stage.role
        if role not in models:
            raise PlanError(f"{delta.model_stage}: no model spec for role {role}")
        local.append(local_dag(delta, models[role], value_head=value_head_for(role),
                               node_of=lambda x: x // devices_per_node, lean=lean))
    tight = None
    if state is not None and budget is not None:
        devices = tight_devices((op for ops, _ in local for op in ops), current, state, budget)
        tight = devices.__contains__
    dag = join(current, target, local, tight=tight)
    if budget is not None:
        dag = dataclasses.replace(dag, staging_bytes=budget.collective_buffer_bytes)
    if check:
        validate(dag)
    # DEBUG: admission builds a DAG for every target it assesses; the one executed is logged by
    # its runner ("transition done") and the daemon ("transition at step …")
    log.debug("transition DAG %s → %s: %d ops, %d edges", current.describe() or "∅",
              target.describe() or "∅", len(dag.ops), len(dag.edges))
    return dag


@dataclass(frozen=True)
class TransitionAssessment:
    """What admission needs about one target (DESIGN.md "One RL step", step 4)."""

    dag: TransitionDag
    feasibility: FeasibilityReport
    cost: TransitionCost

    @property
    def feasible(self) -> bool:
        return self.feasibility.feasible

    @property
    def l_tran_s(self) -> float:
        return self.cost.l_tran_s

    @property
    def reason(self) -> str:
        """Why the transition does not fit, or ``""``."""
        v = self.feasibility.violation
        return "" if v is None else f"transition does not fit memory: {v.describe()}"


def assess_transition(
    current: Plan,
    target: Plan,
    models: Mapping[Role, ModelSpec],
    site,
    *,
    cost_model=None,
    sizes: StateSizes | None = None,
    budget: MemoryBudget | None = None,
    reused: Callable[[TransitionDag], Collection[tuple[str, tuple[int, ...]]]] | None = None,
) -> TransitionAssessment:
    """Plan, check and cost ``S → S*`` on ``site`` (a ``nereusd.config.site.SiteConfig``).

    Defaults: :meth:`AdamStateSizes.for_dtype` of the site's compute dtype,
    :meth:`MemoryBudget.from_site`, and :class:`CostModelLinks` when a calibrated
    ``cost_model`` (``nereusd.cost.model.CostModel``) is given, else :class:`SiteLinkCosts`.
    ``reused``: the communicators of a DAG that the workers' group pool supplies
    (:meth:`nereusd.transition.comms.GroupPoolMirror.reused`; none without it).

    Raises:
        PlanError: as :func:`plan_transition`.
    """
    sizes = sizes or AdamStateSizes.for_dtype(site.compute_dtype)
    budget = budget or MemoryBudget.from_site(site)
    state = StateModel(models, sizes, repartitioned_by(current, target))
    links = CostModelLinks(cost_model) if cost_model is not None else SiteLinkCosts.from_site(site)
    dag, report = fitting_dag(current, target, models, site.devices_per_node, state, budget)
    cost = estimate_l_tran(dag, state.sizes, links, reused(dag) if reused is not None else ())   # re-partitioned: parameters only (ParamsMoved)
    zero_s, zero_bytes = zero_state_cost(current, target, dag, state, links)
    if zero_s or zero_bytes:
        cost = dataclasses.replace(cost, l_tran_s=cost.l_tran_s + zero_s, bytes_moved=cost.bytes_moved + zero_bytes)
    return TransitionAssessment(dag, report, cost)


def fitting_dag(current: Plan, target: Plan, models: Mapping[Role, ModelSpec], devices_per_node: int,
                state: StateModel, budget: MemoryBudget) -> tuple[TransitionDag, FeasibilityReport]:
    """The first of these DAGs for ``current → target`` that fits ``budget``
    (:func:`~nereusd.transition.memory.check_feasibility`), each with the Splits and Merges that do
    not fit staged in host memory (:func:`~nereusd.transition.memory.stage_in_host`):

    1. :func:`plan_transition`'s;
    2. its lean variant (Extends only from retained holders), when a transition op did not fit;
    3. for crossed model-stages, the path through :func:`~nereusd.transition.via.via_plan`
       (slice first, then gather: no ``T_sub`` holding larger than the target's), plain, then lean.

    Returns the first DAG and its report when none fits. Later DAGs are planned only when the
    earlier ones do not fit (the common case plans one).

    Raises:
        PlanError: as :func:`plan_transition`.
    """
    def staged(dag: TransitionDag) -> tuple[TransitionDag, FeasibilityReport]:
        return stage_in_host(dag, state, budget)

    first = staged(plan_transition(current, target, models, devices_per_node=devices_per_node,
                                   state=state, budget=budget))
    if first[1].feasible or first[1].violation.op_id is None:   # None: the current plan itself does not fit
        return first
    lean = staged(plan_transition(current, target, models, devices_per_node=devices_per_node,
                                  state=state, budget=budget, lean=True))
    if lean[1].feasible:
        return lean
    mid = via_plan(current, target, models)
    if mid is None:
        return first
    to_mid = plan_transition(current, mid, models, devices_per_node=devices_per_node, state=state, budget=budget)
    for thin in (False, True):
        from_mid = plan_transition(mid, target, models, devices_per_node=devices_per_node, state=state,
                                   budget=budget, lean=thin)
        via = chain(to_mid, from_mid)
        validate(via)
        via = staged(via)
        if via[1].feasible:
            return via
    return first


def zero_repartitioned(current: Plan, target: Plan) -> set[ModelStage]:
    """The ZeRO model-stages whose optimizer partitions a transition ``current → target`` moves
    straight from the old replica set to the new one (:mod:`emu.engine.zero_repartition`) instead
    of exporting canonical holdings: those on ZeRO ≥ 1 in both plans. Their DAG ops move
    parameters only. The one rule of the workers (``TransitionTasks``), the price
    (:func:`zero_state_cost`, :func:`assess_transition`) and what an interrupted transition loses
    (``nereusd.transition.runner``)."""
    return {ms for ms, cand in current.items() if cand.zero_stage and ms in target and target[ms].zero_stage}


def repartitioned_by(current: Plan, target: Plan) -> set[ModelStage]:
    """The ZeRO model-stages a transition ``current → target`` re-partitions: those of
    :func:`zero_repartitioned` that it rebuilds (:func:`rebuilt_model_stages`; ops exist exactly
    for the model-stages whose layout or devices change), known before the DAG is planned
    (:class:`StateModel` ``repartitioned``)."""
    moved = {ms for ms, cand in current.items() if ms in target
             and (cand.layout, cand.devices) != (target[ms].layout, target[ms].devices)}
    return zero_repartitioned(current, target) & rebuilt_model_stages(current, target, moved)


def repartition_cost(current, target, elements: float, bytes_per_element: float, links) -> tuple[float, int]:
    """Seconds and bytes of moving ZeRO partitions from replica set ``current`` to ``target``
    (candidates): old replica ``i`` (DP rank = order of its device among the set's, as
    ``new_group`` ranks) holds flat elements ``[i·⌈P/dp⌉, (i+1)·⌈P/dp⌉)``, new replica ``j``
    likewise at the new ``dp``; each overlap between two devices is one transfer of
    ``bytes_per_element`` per element (alignment padding ignored). Each device sends and receives
    one transfer at a time (the DAG model's one port, ``nereusd.transition.cost``): the time is
    the busiest device's sum."""
    old, new = sorted(current.devices), sorted(target.devices)
    per_old, per_new = math.ceil(elements / len(old)), math.ceil(elements / len(new))
    busy: dict[int, float] = defaultdict(float)
    total = 0
    for i, a in enumerate(old):
        for j, b in enumerate(new):
            lo, hi = max(i * per_old, j * per_new), min((i + 1) * per_old, (j + 1) * per_new, elements)
            if lo >= hi or a == b:
                continue
            nbytes = (hi - lo) * bytes_per_element
            seconds = links.transfer_s(nbytes, a, b)
            busy[a] += seconds
            busy[b] += seconds
            total += int(nbytes)
    return max(busy.values(), default=0.0), total


def zero_state_cost(current: Plan, target: Plan, dag: TransitionDag, state: StateModel,
                    links) -> tuple[float, int]:
    """Seconds and bytes of moving the ZeRO optimizer state of the model-stages a transition
    changes (ops of it in ``dag``, another ZeRO stage, or gone from ``target``), model-stages one
    after another, besides the DAG's makespan (which moves their parameters).

    - Kept on ZeRO (:func:`zero_repartitioned`): the partitioned slots (master weights unless
      training is fp32, Adam ``m`` and ``v``, :meth:`AdamStateSizes.zero_joined_bytes_per_element`)
      move between the replica sets, :func:`repartition_cost`.
    - Otherwise the replicas first export their canonical holding (``DeepSpeedStageEngine._join``:
      per partitioned slot one all-reduce of the zero-padded flat buffer on gloo, one all-gather
      elsewhere), priced as the ring all-reduce: ``2(n−1)/n · bytes`` per rank over the slowest
      link of the ring (Thakur et al. 2005, §4); the all-gather moves half of that, so on NCCL this
      over-estimates (not measured on a GPU).
    """
    rebuilt = rebuilt_model_stages(current, target, {op.model_stage for op in dag.ops})
    kept = zero_repartitioned(current, target)
    total_s, total_bytes = 0.0, 0
    for ms, cand in current.items():
        if not cand.zero_stage or (ms not in rebuilt and ms in target):
            continue
        joined = state.sizes.zero_joined_bytes_per_element(ms)
        elements = state.elements(ms, cand.layout, (0, 0))
        if ms in kept:
            seconds, nbytes = repartition_cost(cand, target[ms], elements, joined, links)
            total_s, total_bytes = total_s + seconds, total_bytes + nbytes
            continue
        if cand.dp < 2:
            continue
        n = cand.dp
        per_rank = 2 * (n - 1) / n * elements * joined
        ring = list(cand.devices)
        total_s += max(links.transfer_s(per_rank, a, b) for a, b in zip(ring, ring[1:] + ring[:1]))
        total_bytes += int(per_rank * n)
    return total_s, total_bytes


def weight_sync_dags(plan: Plan, models: Mapping[Role, ModelSpec], *,
                     devices_per_node: int) -> dict[tuple[ModelStage, ModelStage], TransitionDag]:
    """The DAGs of one weight synchronisation of ``plan`` (DESIGN.md "One RL step", step 1):
    for each training model-stage, the transition from its candidate to that of every other
    model-stage of its role (run on parameter-only views of the training holdings).

    Planned here, once per plan, with the site's node size (Extend prefers a sender on the
    receiver's node) and sent to the workers, which execute these DAGs as they are.

    Raises:
        PlanError: as :func:`plan_transition`.
    """
    out = {}
    for source, cand in plan.items():
        if source.stage is not Stage.TRAINING:
            continue
        for target, tcand in plan.items():
            if target.role != source.role or target == source:
                continue
            # parameters only: the source's training-only fields (ZeRO stage) do not describe the copy
            src = dataclasses.replace(cand, zero_stage=0)
            out[(source, target)] = plan_transition(Plan({target: src}), Plan({target: tcand}), models,
                                                    devices_per_node=devices_per_node)
    return out


def sync_communicator_plan(plan: Plan, models: Mapping[Role, ModelSpec], *,
                           devices_per_node: int) -> list[tuple[str, tuple[int, ...]]]:
    """The process groups of ``plan``'s weight-sync DAGs (:func:`weight_sync_dags`) as ``(op id,
    device set)``, in the order the workers create them (each DAG's :func:`created_groups`)."""
    return [g for dag in weight_sync_dags(plan, models, devices_per_node=devices_per_node).values()
            for g in created_groups(communicator_plan(dag))]


def sync_dag_args(dags: Mapping[tuple[ModelStage, ModelStage], TransitionDag]) -> list[SyncDag]:
    """:func:`weight_sync_dags` as task payloads (:class:`nereusd.protocol.tasks.SyncDag`)."""
    return [SyncDag(source=str(s), target=str(t), dag=dag.to_json()) for (s, t), dag in dags.items()]
