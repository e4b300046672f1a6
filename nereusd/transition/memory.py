"""Per-device memory of a transition: state sizes, budgets and the feasibility check (paper §4.3, §6.2).

A transition is executable when, at every operation, each device can hold its retained state,
the intermediate units Split creates, the new replicas Extend and Merge create, the collective
staging buffers, and the co-resident state of every other model-stage (paper §4.3
"Feasibility"; §6.2: Split keeps its source buffers live until the collectives reading them
complete, Destroy releases memory only after teardown).

Accounting, per op and device (bytes):

* ``alloc`` — new holdings, allocated when the op starts (Split receivers: the ``T_sub``
  shard; Extend targets: the copy; Merge: the ``T*`` slice; Create: the unit);
* ``transient`` — staging buffers live only during the op, capped at the DAG's
  ``staging_bytes`` (the budget's ``collective_buffer_bytes``): for a Split what the executor
  stages (:func:`split_staging_elements`: the all-gather output, or the peers' whole holdings a
  receiver takes point-to-point); for a Merge the pieces sent plus those received; otherwise the
  larger of bytes sent and received. The cap is the executor's: an exchange larger than it moves
  piece by piece in chunks of at most ``staging_bytes`` (``emu.state.primitives``; one index of a
  parameter's sliced dimension is the smallest chunk), with the new holding allocated first.
  Extend receives straight into the new holding; its count here is conservative;
* ``free`` — holdings released when the op ends (Split receivers: the ``T`` shard; Merge: the
  ``T_sub`` shard; Destroy: what it frees).

A Split receiver or a Merge device that stages the holding it replaces in host memory
(:attr:`Op.host_staged`) frees it before it allocates the new one: its ``alloc`` is the
difference (negative for a Merge, whose new holding is a slice of the old) and its ``free`` 0. A
Split allocating the new holding beside the old is what kept an 8B model's actor training from
``tp2·pp4·dp4`` to ``tp2·pp2·dp8`` on 64 GB MI250X GCDs (+28.2 GB with 37.6 GB in use, limit
61.8 GB); :func:`stage_in_host` stages the receivers of a Split or Merge that does not fit, within
the budget's :attr:`MemoryBudget.host_staging_bytes`, and :mod:`nereusd.transition.cost` prices the
copies over the host link.

The check walks one topological order (:func:`nereusd.transition.dag.topological_order`
unless another is given): in use before an op + ``alloc`` + ``transient`` must stay within
``(1 − headroom) · capacity`` on every device it touches. This proves that an execution order
within the budget exists; an executor that admits ready ops on a device only while their bytes
fit (the worker's memory accounting, ``emu/state/devmem.py``) follows it without deadlock.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping, Protocol, Sequence

from nereusd.errors import PlanError
from nereusd.config.site import GIB
from nereusd.cost.memory import ADAM_STATE_BYTES, HEADROOM, WORKSPACE_BYTES, dtype_bytes, zero_state_bytes
from nereusd.models import ModelSpec
from nereusd.plan import Layout, ModelStage, Plan, Role, Stage
from nereusd.shards import Position, shard_elements, value_head_for
from nereusd.transition.ops import STAGING_BYTES, Op, OpKind, TransitionDag, rebuilt_model_stages

log = logging.getLogger(__name__)


class StateSizes(Protocol):
    """Bytes of a model-stage's state per parameter element (θ and ω, sharded alike)."""

    def resident_bytes_per_element(self, model_stage: ModelStage) -> float:
        """Bytes a device holds per parameter element of its shard (params, grads, optimizer)."""
        ...

    def moved_bytes_per_element(self, model_stage: ModelStage) -> float:
        """Bytes a transition moves per parameter element (gradients hold no state at a
        safe boundary and are not moved)."""
        ...

    def zero_joined_bytes_per_element(self, model_stage: ModelStage) -> float:
        """Bytes per parameter element that a ZeRO replica's export joins over its DP group (the
        partitioned slots; ``DeepSpeedStageEngine.export_holding``)."""
        ...

    def engine_bytes(self, model_stage: ModelStage, elements: int, dp: int, zero_stage: int) -> int:
        """Bytes a live engine of ``model_stage`` holds for a shard of ``elements`` parameter
        elements in a replica of ``dp``: a transition that does not rebuild it leaves it so."""
        ...


@dataclass(frozen=True, kw_only=True)
class AdamStateSizes:
    """ZeRO-0 Adam state per parameter element, as :mod:`nereusd.cost.memory` counts it.

    Training model-stages hold the parameter in the compute dtype, an fp32 master copy when
    that dtype is narrower, and Adam ``m``, ``v`` in fp32; generation and inference hold the
    parameter only. Gradient buffers hold no state at a safe boundary (paper §6.2): a holding
    (an engine a transition detached, :mod:`emu.state`) has none. An engine the transition keeps
    keeps its gradients allocated (:meth:`engine_bytes`). Default (bf16): 14 bytes per element
    held and moved in training, 2 elsewhere.
    """

    param_bytes: int = 2
    """Bytes per parameter element in the compute dtype (2: bf16, 4: fp32)."""
    master_bytes: int = 4
    """fp32 master copy per element (0 when parameters are already fp32)."""
    optimizer_bytes: int = 8
    """Adam ``m`` and ``v`` per element."""

    @classmethod
    def for_dtype(cls, dtype: str) -> "AdamStateSizes":
        """Sizes for compute dtype ``dtype`` (``nereusd.cost.memory.dtype_bytes``): fp32 master only
        when narrower than fp32."""
        e = dtype_bytes(dtype)
        return cls(param_bytes=e, master_bytes=4 if e < 4 else 0, optimizer_bytes=ADAM_STATE_BYTES)

    def resident_bytes_per_element(self, model_stage: ModelStage) -> float:
        if model_stage.stage is Stage.TRAINING:
            return self.param_bytes + self.master_bytes + self.optimizer_bytes
        return self.param_bytes

    def engine_bytes(self, model_stage: ModelStage, elements: int, dp: int, zero_stage: int) -> int:
        """A live engine's bytes, as the planner counts them (:func:`nereusd.cost.memory.stage_memory`'s
        resident bytes, :func:`~nereusd.cost.memory.zero_state_bytes`): a training engine adds its
        gradients to a holding's bytes at ZeRO-0, and holds the ZeRO-partitioned master, Adam
        state and gradients at ZeRO-1/2; other engines hold their parameters."""
        if model_stage.stage is not Stage.TRAINING:
            return elements * self.param_bytes
        if not zero_stage:
            return elements * (2 * self.param_bytes + self.master_bytes + self.optimizer_bytes)
        return elements * self.param_bytes + sum(zero_state_bytes(elements, dp, zero_stage, self.param_bytes).values())

    def moved_bytes_per_element(self, model_stage: ModelStage) -> float:
        if model_stage.stage is Stage.TRAINING:
            return self.param_bytes + self.master_bytes + self.optimizer_bytes
        return self.param_bytes

    def zero_joined_bytes_per_element(self, model_stage: ModelStage) -> float:
        """The fp32 master and Adam ``m``, ``v``: partitioned at ZeRO-1/2. Without a master (fp32
        training) the parameters are the master's values and no replica lacks them."""
        return self.master_bytes + self.optimizer_bytes if model_stage.stage is Stage.TRAINING else 0.0


@dataclass(frozen=True)
class ParamsMoved:
    """``sizes`` except that the holdings of ``model_stages`` carry their parameters alone: ZeRO
    model-stages whose optimizer partitions a transition moves apart from the DAG
    (``nereusd.transition.zero_repartitioned``). Their resident and moved bytes per element are
    ``sizes``' less the partitioned slots (:meth:`AdamStateSizes.zero_joined_bytes_per_element`:
    master unless fp32, Adam ``m``, ``v``), which :meth:`StateModel.partition_bytes` counts."""

    sizes: StateSizes
    model_stages: frozenset

    def resident_bytes_per_element(self, model_stage: ModelStage) -> float:
        less = self.sizes.zero_joined_bytes_per_element(model_stage) if model_stage in self.model_stages else 0.0
        return self.sizes.resident_bytes_per_element(model_stage) - less

    def moved_bytes_per_element(self, model_stage: ModelStage) -> float:
        less = self.sizes.zero_joined_bytes_per_element(model_stage) if model_stage in self.model_stages else 0.0
        return self.sizes.moved_bytes_per_element(model_stage) - less

    def zero_joined_bytes_per_element(self, model_stage: ModelStage) -> float:
        return self.sizes.zero_joined_bytes_per_element(model_stage)

    def engine_bytes(self, model_stage: ModelStage, elements: int, dp: int, zero_stage: int) -> int:
        return self.sizes.engine_bytes(model_stage, elements, dp, zero_stage)


@dataclass(frozen=True, kw_only=True)
class MemoryBudget:
    """What each device may hold during a transition.

    Raises:
        PlanError: on a non-positive capacity, a headroom outside ``[0, 1)`` or negative bytes.
    """

    capacity_bytes: int
    """Device capacity (``SiteConfig.device_memory_bytes``)."""
    headroom: float = HEADROOM
    """Fraction of capacity kept free (DESIGN.md: 10 %)."""
    workspace_bytes: int = 0
    """Bytes held by the framework on every device of either plan (``memory.WORKSPACE_BYTES``)."""
    reserved_bytes: Mapping[int, int] = field(default_factory=dict)
    """Further bytes per device held by other things than model state."""
    collective_buffer_bytes: int = STAGING_BYTES
    """The most one op stages on one device at a time: :func:`nereusd.transition.plan_transition`
    writes it into the DAG (:attr:`~nereusd.transition.ops.TransitionDag.staging_bytes`), and the
    executor moves larger exchanges in chunks of at most this size."""
    host_staging_bytes: int = 0
    """Host memory each device may borrow to stage its holdings during a transition
    (:func:`stage_in_host`; the site's ``host_staging_gib``); 0: no staging."""

    def __post_init__(self) -> None:
        if not isinstance(self.capacity_bytes, int) or self.capacity_bytes <= 0:
            raise PlanError(f"capacity_bytes must be a positive integer, got {self.capacity_bytes!r}")
        if not 0 <= self.headroom < 1:
            raise PlanError(f"headroom must be in [0, 1), got {self.headroom!r}")
        for name in ("collective_buffer_bytes", "host_staging_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise PlanError(f"{name} must be an integer, got {value!r}")
        if self.collective_buffer_bytes < 0 or self.workspace_bytes < 0 or self.host_staging_bytes < 0 or any(
                v < 0 for v in self.reserved_bytes.values()):
            raise PlanError("collective_buffer_bytes, workspace_bytes, host_staging_bytes and reserved_bytes "
                            "must be >= 0")

    @classmethod
    def from_site(cls, site, *, collective_buffer_bytes: int = STAGING_BYTES) -> "MemoryBudget":
        """From a ``nereusd.config.site.SiteConfig``: its device capacity, the memory model's headroom,
        the framework workspace of its device kind, and its host staging (``host_staging_gib``,
        none without a ``host_link_gbps`` to price it)."""
        staging = int(site.device.host_staging_gib * GIB) if site.device.host_link_gbps > 0 else 0
        return cls(capacity_bytes=site.device_memory_bytes, headroom=HEADROOM,
                   workspace_bytes=WORKSPACE_BYTES[site.device_kind],
                   collective_buffer_bytes=collective_buffer_bytes, host_staging_bytes=staging)

    def baseline_bytes(self, devices: Iterable[int]) -> dict[int, int]:
        """Workspace plus reserved bytes of each of ``devices``."""
        return {x: self.workspace_bytes + self.reserved_bytes.get(x, 0) for x in devices}

    @property
    def limit_bytes(self) -> int:
        """``⌊(1 − headroom) · capacity⌋``: the most a device may hold, reserved bytes included."""
        return int((1.0 - self.headroom) * self.capacity_bytes)


@dataclass(frozen=True)
class MemoryViolation:
    """The first point of a schedule where a device would exceed its limit."""

    op_id: str | None
    """The op (``None``: the current plan itself does not fit)."""
    device: int
    model_stage: str
    needed_bytes: int
    """Bytes the op adds on the device (allocations and staging)."""
    in_use_bytes: int
    """Bytes in use on the device before the op."""
    limit_bytes: int

    def describe(self) -> str:
        where = f"op {self.op_id}" if self.op_id else "the current plan"
        return (f"device {self.device}: {where} ({self.model_stage}) needs {self.needed_bytes} bytes "
                f"with {self.in_use_bytes} in use, limit {self.limit_bytes}")


@dataclass(frozen=True)
class FeasibilityReport:
    """Result of :func:`check_feasibility`; per-device bytes include workspace and reserved bytes."""

    violation: MemoryViolation | None
    peak_bytes: Mapping[int, int]
    final_bytes: Mapping[int, int]
    order: tuple[str, ...]

    @property
    def feasible(self) -> bool:
        return self.violation is None


class StateModel:
    """Bytes of holdings and ops for one job: model specs per role plus :class:`StateSizes`.

    Raises:
        PlanError: (from :meth:`spec`) if a model-stage's role has no model spec.
    """

    def __init__(self, models: Mapping[Role, ModelSpec], sizes: StateSizes,
                 repartitioned: Iterable[ModelStage] = ()) -> None:
        self.models = dict(models)
        self.repartitioned = frozenset(repartitioned)
        """ZeRO model-stages a transition re-partitions (``nereusd.transition.zero_repartitioned``,
        of those it rebuilds): their holdings carry parameters only (:class:`ParamsMoved`), each
        replica also holds its optimizer partition (:meth:`partition_bytes`), and
        :func:`check_feasibility` adds the re-partition after the DAG's ops. Other ZeRO
        model-stages are counted at their ZeRO-0 size, what their export makes them."""
        self.sizes = ParamsMoved(sizes, self.repartitioned) if self.repartitioned else sizes

    def spec(self, model_stage: ModelStage) -> ModelSpec:
        try:
            return self.models[model_stage.role]
        except KeyError:
            raise PlanError(f"{model_stage}: no model spec for role {model_stage.role}") from None

    def holding_bytes(self, model_stage: ModelStage, layout: Layout, position: Position) -> int:
        """Resident bytes of ``model_stage``'s shard at ``position`` of ``layout``."""
        return int(self.elements(model_stage, layout, position) * self.sizes.resident_bytes_per_element(model_stage))

    def elements(self, model_stage: ModelStage, layout: Layout, position: Position) -> int:
        """Parameter elements of ``model_stage``'s shard at ``position`` of ``layout``."""
        return shard_elements(self.spec(model_stage), layout, position, value_head_for(model_stage.role))

    def partition_bytes(self, model_stage: ModelStage, cand) -> int:
        """Bytes of one replica's optimizer partition of a re-partitioned ZeRO model-stage on
        candidate ``cand`` (``tp = pp = 1``): ``⌈P/dp⌉`` elements of the partitioned slots
        (DeepSpeed's alignment padding left out); 0 for other model-stages."""
        if model_stage not in self.repartitioned or not cand.zero_stage:
            return 0
        elements = self.elements(model_stage, cand.layout, (0, 0))
        return int(-(-elements // cand.dp) * self.sizes.zero_joined_bytes_per_element(model_stage))

    def start_bytes(self, current: Plan, rebuilt: Iterable[ModelStage]) -> dict[int, int]:
        """State bytes per device when a transition from ``current`` starts its ops, after
        ``transition_prepare`` detached the engines it rebuilds (``rebuilt``,
        :func:`~nereusd.transition.ops.rebuilt_model_stages`): their holdings (:meth:`plan_bytes`'
        terms) and, for the model-stages it keeps, their engines as they run, gradients and ZeRO
        partitions included (:meth:`StateSizes.engine_bytes`).

        Until 2026-12-07 a kept training engine was counted as a holding: without its gradients
        (Qwen2.5-1.5B in fp32 at DP 8: 18.5 GB a device where the planner counts 24.7 GB) and,
        at ZeRO-1/2, at its ZeRO-0 size (a review)."""
        rebuilt = set(rebuilt)
        out: dict[int, int] = defaultdict(int)
        for m, cand in current.items():
            for x in cand.devices:
                _, p, t = cand.coords_of(x)
                if m in rebuilt:
                    out[x] += self.holding_bytes(m, cand.layout, (p, t)) + self.partition_bytes(m, cand)
                else:
                    out[x] += self.sizes.engine_bytes(m, self.elements(m, cand.layout, (p, t)), cand.dp,
                                                      cand.zero_stage)
        return dict(out)

    def plan_bytes(self, plan: Plan) -> dict[int, int]:
        """Resident state bytes per device of ``plan`` as holdings (all model-stages, co-resident
        summed; engines a transition keeps hold more: :meth:`start_bytes`)."""
        out: dict[int, int] = defaultdict(int)
        for m, cand in plan.items():
            for x in cand.devices:
                _, p, t = cand.coords_of(x)
                out[x] += self.holding_bytes(m, cand.layout, (p, t)) + self.partition_bytes(m, cand)
        return dict(out)

    def op_bytes(self, op: Op, collective_buffer_bytes: int) -> dict[int, tuple[int, int, int]]:
        """``{device: (alloc, transient, free)}`` of ``op`` (module docstring)."""
        m = op.model_stage
        out: dict[int, list[int]] = defaultdict(lambda: [0, 0, 0])
        src = {x: (op.source_layout, p) for x, p in zip(op.source_devices, op.source_positions)}
        dst = {x: (op.target_layout, p) for x, p in zip(op.target_devices, op.target_positions)}
        if op.kind in (OpKind.SPLIT, OpKind.EXTEND, OpKind.MERGE, OpKind.CREATE):
            for x, (lay, p) in dst.items():
                out[x][0] += self.holding_bytes(m, lay, p)
        # the holdings the op frees: a Split's on its receivers, a Merge's or Destroy's on every source
        replaced = ({x: src[x] for x in dst} if op.kind is OpKind.SPLIT
                    else src if op.kind in (OpKind.DESTROY, OpKind.MERGE) else {})
        staged = op.staged_elements
        for x, (lay, p) in replaced.items():
            if x in staged:   # freed before the new holding is allocated
                out[x][0] -= self.holding_bytes(m, lay, p)
            else:
                out[x][2] += self.holding_bytes(m, lay, p)
        moved: dict[int, list[int]] = defaultdict(lambda: [0, 0])
        per_element = self.sizes.moved_bytes_per_element(m)
        for r in op.routes:
            if r.src != r.dst:
                nbytes = int(r.shard.numel * per_element)
                moved[r.src][0] += nbytes
                moved[r.dst][1] += nbytes
        if op.kind is OpKind.SPLIT:
            spec, vh = self.spec(m), value_head_for(m.role)
            staged = split_staging_elements(op, lambda pos: shard_elements(spec, op.source_layout, pos, vh))
            for x, elements in staged.items():
                out[x][1] += min(collective_buffer_bytes, int(elements * per_element))
        else:
            # Merge sends copies of its pieces while receiving others: both live at once.
            combine = (lambda a, b: a + b) if op.kind is OpKind.MERGE else max
            for x, (sent, received) in moved.items():
                out[x][1] += min(collective_buffer_bytes, combine(sent, received))
        return {x: (a, t, f) for x, (a, t, f) in out.items()}


def split_gather_groups(op: Op) -> list[list[tuple[int, Position]]]:
    """A Split's gather groups that receive: the ``(device, T position)`` of its unit with one
    ``T_sub`` position (the smallest enclosing TP/PP group), in unit order, when the group has a
    receiver and more than one member."""
    T, S = op.source_layout, op.target_layout
    kp, kt = T.pp // S.pp, T.tp // S.tp
    groups: dict[Position, list[tuple[int, Position]]] = defaultdict(list)
    for x, (p, t) in zip(op.source_devices, op.source_positions):
        groups[(p // kp, t // kt)].append((x, (p, t)))
    receivers = set(op.target_devices)
    return [g for _, g in sorted(groups.items()) if len(g) > 1 and receivers & {x for x, _ in g}]


def split_all_gathers(group: Sequence[tuple[int, Position]], receivers: set[int],
                      elements: Callable[[Position], int]) -> bool:
    """Whether a gather group runs one all-gather (every member receives, one holding size)
    rather than point-to-point sends of whole holdings to the receivers (emu/state/primitives.py)."""
    return {x for x, _ in group} <= receivers and len({elements(p) for _, p in group}) == 1


def split_staging_elements(op: Op, elements: Callable[[Position], int]) -> dict[int, int]:
    """Staging per device of a Split, in parameter elements, as the executor stages it.

    All-gather: every member stages ``k ×`` the holding (the gather output). Point-to-point:
    each receiver stages every peer's whole holding, and a member that sends to another receiver
    its own holding: unchunked it sends in place, but when the exchange is chunked
    (:attr:`TransitionDag.staging_bytes`) each send is a copy, live beside the chunk received,
    so the count bounds both ways of executing it. ``elements(position)`` gives the holding's
    parameter elements at a ``T`` position.
    """
    receivers = set(op.target_devices)
    out: dict[int, int] = defaultdict(int)
    for group in split_gather_groups(op):
        if split_all_gathers(group, receivers, elements):
            for x, p in group:
                out[x] += len(group) * elements(p)
        else:
            for x, p in group:
                if x in receivers:
                    out[x] += sum(elements(q) for y, q in group if y != x)
                if (receivers - {x}) & {y for y, _ in group}:
                    out[x] += elements(p)
    return dict(out)


def tight_devices(ops: Iterable[Op], current: Plan, state: StateModel, budget: MemoryBudget) -> set[int]:
    """Devices whose worst case — current state plus every allocation and staging buffer of
    ``ops``, nothing released — exceeds ``budget.limit_bytes``. Only these need
    release-before-acquire edges for memory (:func:`nereusd.transition.dag.join`). The model-stages
    without ops are kept engines (:meth:`StateModel.start_bytes`; one that only changes its ZeRO
    stage is rebuilt without ops, and counted here as kept)."""
    ops = list(ops)
    worst = defaultdict(int, state.start_bytes(current, {op.model_stage for op in ops}))
    touched = {x for op in ops for x in op.devices} | set(current.devices())
    for x, v in budget.baseline_bytes(touched | set(budget.reserved_bytes)).items():
        worst[x] += v
    for op in ops:
        for x, (alloc, transient, _) in state.op_bytes(op, budget.collective_buffer_bytes).items():
            worst[x] += alloc + transient
    return {x for x, v in worst.items() if v > budget.limit_bytes}


def check_feasibility(
    dag: TransitionDag,
    state: StateModel,
    budget: MemoryBudget,
    order: Sequence[str] | None = None,
) -> FeasibilityReport:
    """Walk ``order`` (default: the DAG's topological order) and account every device's bytes.

    Staging is capped at ``dag.staging_bytes``, what the executor stages (the budget's
    ``collective_buffer_bytes`` when :func:`nereusd.transition.plan_transition` had the budget).

    Returns:
        A report with the first :class:`MemoryViolation` (``None`` if the walk fits), the peak
        and final bytes per device (reserved bytes included; the walk continues past a
        violation so the figures cover every op).

    Raises:
        PlanError: if ``order`` is not a topological order of the DAG's ops.
    """
    from nereusd.transition.dag import topological_order

    order = tuple(order) if order is not None else tuple(topological_order(dag))
    _check_order(dag, order)
    limit = budget.limit_bytes
    rebuilt = rebuilt_model_stages(dag.current, dag.target, {op.model_stage for op in dag.ops})
    in_use: dict[int, int] = defaultdict(int, state.start_bytes(dag.current, rebuilt))
    devices = set(dag.current.devices()) | set(dag.target.devices()) | set(budget.reserved_bytes)
    for x, v in budget.baseline_bytes(devices).items():
        in_use[x] += v
    peak = dict(in_use)
    violation = None
    for x in sorted(in_use):
        if in_use[x] > limit and violation is None:
            owners = dag.current.model_stages_on(x)
            violation = MemoryViolation(None, x, ",".join(map(str, owners)), 0, in_use[x], limit)
    for op_id in order:
        op = dag.op(op_id)
        for x, (alloc, transient, free) in sorted(state.op_bytes(op, dag.staging_bytes).items()):
            during = in_use[x] + alloc + transient
            if during > limit and violation is None:
                violation = MemoryViolation(op_id, x, str(op.model_stage), alloc + transient,
                                            in_use[x], limit)
            peak[x] = max(peak.get(x, 0), during)
            in_use[x] += alloc - free
    for m in sorted(state.repartitioned, key=ModelStage.sort_key):
        # transition_finish: each new replica's partition is allocated while the old ones still
        # hold theirs (emu.engine.zero_repartition), then the old ones are released
        cur, tgt = dag.current.candidates.get(m), dag.target.candidates.get(m)
        if cur is None or tgt is None:
            continue
        new = state.partition_bytes(m, tgt)
        for x in tgt.devices:
            during = in_use[x] + new
            if during > limit and violation is None:
                violation = MemoryViolation(f"repartition {m}", x, str(m), new, in_use[x], limit)
            peak[x] = max(peak.get(x, 0), during)
            in_use[x] = during
        for x in cur.devices:
            in_use[x] -= state.partition_bytes(m, cur)
    if violation is not None:
        log.debug("transition DAG over memory: %s", violation.describe())   # the admission record says it
    return FeasibilityReport(violation, dict(peak), {x: v for x, v in in_use.items()}, order)


def stage_in_host(dag: TransitionDag, state: StateModel, budget: MemoryBudget,
                  report: FeasibilityReport | None = None) -> tuple[TransitionDag, FeasibilityReport]:
    """Stage in host memory the receivers of each Split or Merge that does not fit, until the DAG
    fits or staging cannot help.

    While the first violation of :func:`check_feasibility` (``report``, computed if not given) is
    a Split's or a Merge's, its receivers stage the holdings they replace (:attr:`Op.host_staged`): each
    receiver whose staged bytes (:func:`pinned_bytes`), over all the DAG's ops, stay within
    ``budget.host_staging_bytes`` (counted as if all were live at once). Every receiver stages,
    not only the one over: they copy in parallel, so the op takes as long either way. An op is
    staged once; a violation elsewhere (an Extend, the re-partition, the current plan)
    or on a device that could not stage ends the loop.

    Returns:
        The DAG (unchanged when nothing was staged) and its feasibility report.
    """
    report = report if report is not None else check_feasibility(dag, state, budget)
    if budget.host_staging_bytes <= 0:
        return dag, report
    host: dict[int, int] = defaultdict(int)
    for op in dag.ops:
        for x, elements in op.host_staged:
            host[x] += pinned_bytes(elements * state.sizes.resident_bytes_per_element(op.model_stage))
    tried: set[str] = set()
    ids = {op.id for op in dag.ops}
    while report.violation is not None and report.violation.op_id in ids - tried:
        op = dag.op(report.violation.op_id)
        if op.kind not in (OpKind.SPLIT, OpKind.MERGE):
            break
        tried.add(op.id)
        staged = op.staged_elements
        position = dict(zip(op.source_devices, op.source_positions))
        per_element = state.sizes.resident_bytes_per_element(op.model_stage)
        for x in op.target_devices:
            elements = state.elements(op.model_stage, op.source_layout, position[x])
            if x in staged or host[x] + pinned_bytes(elements * per_element) > budget.host_staging_bytes:
                continue
            staged[x] = elements
            host[x] += pinned_bytes(elements * per_element)
        if report.violation.device not in staged:
            break
        new = dataclasses.replace(op, host_staged=tuple(staged.items()))
        dag = dataclasses.replace(dag, ops=tuple(new if o.id == op.id else o for o in dag.ops))
        report = check_feasibility(dag, state, budget, order=report.order)
    return dag, report


def pinned_bytes(nbytes: float) -> int:
    """Host memory a worker pins for a staged holding of ``nbytes``: the next power of two, as
    PyTorch's caching host allocator rounds a pinned request (``CachingHostAllocator.h``,
    ``roundSize``); what :func:`stage_in_host` counts against ``host_staging_bytes``."""
    n = max(1, math.ceil(nbytes))
    return 1 << (n - 1).bit_length()


def _check_order(dag: TransitionDag, order: Sequence[str]) -> None:
    if sorted(order) != sorted(op.id for op in dag.ops):
        raise PlanError("order must list every op of the DAG exactly once")
    position = {x: i for i, x in enumerate(order)}
    for e in dag.edges:
        if position[e.src] > position[e.dst]:
            raise PlanError(f"order runs {e.dst} before its predecessor {e.src}")
