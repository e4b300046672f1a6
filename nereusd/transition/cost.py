"""``L̂_tran``: the critical path of a transition DAG (paper §4.3 "Profitability", §6.2).

Each primitive is costed by the bytes it moves over its links plus the set-up of the
communicators it creates (DESIGN.md "Cost model", transition cost):

* bytes of a route = shard elements × :meth:`StateSizes.moved_bytes_per_element`;
* routes between the same two devices travel as one contiguous message (paper §6.2: each shard
  sent once as a contiguous buffer); a message costs :meth:`LinkCosts.transfer_s`;
* a device sends and receives its messages one after another, pairs of devices run
  concurrently, so the transfer time of an op is the largest per-device send or receive time;
  a Merge's local slices (``src == dst``) are added to the device's receive time;
* communicators: the process groups the workers create for the op
  (:func:`nereusd.transition.comms.op_communicators`: a Split one per gather group, an Extend
  one per source-target pair, a Merge one per pair of devices it exchanges between), except
  those the workers' group pool hands back (``reused``,
  :meth:`nereusd.transition.comms.GroupPoolMirror.reused`: such a group costs nothing); a
  device creates its communicators one after another, devices in parallel, so the set-up time
  is the largest per-device sum;
* a device that stages its holding in host memory (:attr:`Op.host_staged`) copies it out before
  the exchange and, into its new holding, back what it keeps: a Split receiver its whole old
  holding, a Merge device its slice (instead of the local copy); each
  :meth:`LinkCosts.host_transfer_s` of the moved bytes, added to its receive time;
* Destroy and Create cost nothing here (teardown is local; a Create's content comes from outside
  the transition).

``L̂_tran`` is the makespan of the DAG with these durations when every op starts as soon as its
predecessors are done and the devices whose links it uses are free: ready primitives run
concurrently (paper §6.2) but a device's link is shared (one port per device), so concurrent
ops that share a device run one after another. Without shared devices this is the DAG's
longest path. Ops are placed in topological order, each into the earliest gap that its ports
leave free for its whole duration (:func:`list_schedule`, a list schedule with backfilling): a
short op placed late may run before a long op placed earlier on the same device, where the
first schedule that only appended to each device's timeline left the gap idle (up to 1.5× the
CP-SAT optimum in ``scripts/bench_dag.py``). Three starting orders and forward-backward
justification (:func:`best_list_schedule`) bring the worst case of that benchmark to 1.14×, with
99 of its 100 cases within 5 % of the optimum (97 with two orders; 2026-12-06, 724da0c).
"""

from __future__ import annotations

import bisect
import heapq
import logging
from collections import defaultdict
from dataclasses import dataclass
from typing import Collection, Hashable, Iterable, Mapping, Protocol, Sequence, TypeVar

from nereusd.config.site import NetworkSpec
from nereusd.cost.formulas import local_copy_s, p2p_s
from nereusd.errors import PlanError
from nereusd.transition.comms import created_groups, op_communicators
from nereusd.transition.memory import StateSizes
from nereusd.transition.ops import Op, OpKind, TransitionDag

log = logging.getLogger(__name__)
K = TypeVar("K", bound=Hashable)


class LinkCosts(Protocol):
    """Seconds to move bytes between devices and to create communicators."""

    def transfer_s(self, nbytes: float, src: int, dst: int, collective: str = "p2p") -> float:
        """Seconds for one message of ``nbytes`` from ``src`` to ``dst`` (``src == dst``: a
        local copy); ``collective`` is the primitive's collective (``all_gather`` for Split,
        ``broadcast`` for Extend, ``p2p`` for Merge)."""
        ...

    def communicator_setup_s(self, devices: Sequence[int]) -> float:
        """Seconds to create one communicator over ``devices``."""
        ...

    def host_transfer_s(self, nbytes: float) -> float:
        """Seconds to copy ``nbytes`` between one device and host memory, one direction."""
        ...


def host_copy_s(nbytes: float, host_link_gbps: float) -> float:
    """``nbytes / host_link_gbps``: one device's copy to or from host memory (the site's achieved
    ``host_link_gbps``, GB/s).

    Raises:
        PlanError: if the site has no host link (``host_link_gbps`` 0), so nothing may stage.
    """
    if host_link_gbps <= 0:
        raise PlanError("the site gives no host_link_gbps: a transition cannot stage holdings in host memory")
    return nbytes / (host_link_gbps * 1e9)


@dataclass(frozen=True, kw_only=True)
class SiteLinkCosts:
    """α-β link model from a site config (``nereusd.config.site.SiteConfig``).

    ``transfer_s = latency + nbytes / bandwidth`` with the intra-node link when both devices
    are on one node (``device // devices_per_node``) and the inter-node link otherwise; a local
    copy reads and writes device memory, ``2 · nbytes / hbm``.
    """

    devices_per_node: int
    intra_node_gbps: float
    """GB/s (10^9 bytes/s) per device and direction inside a node."""
    inter_node_gbps: float
    """GB/s per device and direction across nodes."""
    hbm_gbps: float
    """Device memory bandwidth, GB/s."""
    intra_node_latency_s: float = NetworkSpec.intra_node_latency_us / 1e6
    """Per-message latency inside a node, seconds (default: a site's, :class:`NetworkSpec`)."""
    inter_node_latency_s: float = NetworkSpec.inter_node_latency_us / 1e6
    """Per-message latency across nodes, seconds (default: a site's)."""
    setup_s: float = NetworkSpec.communicator_setup_s
    """Seconds to create one communicator (default: a site's)."""
    host_link_gbps: float = 0.0
    """GB/s per direction between a device and host memory (0: no host staging)."""

    @classmethod
    def from_site(cls, site) -> "SiteLinkCosts":
        """From a ``nereusd.config.site.SiteConfig`` (bandwidths, latencies, communicator set-up)."""
        net = site.network
        return cls(
            devices_per_node=site.devices_per_node,
            intra_node_gbps=net.intra_node_gbps,
            inter_node_gbps=net.inter_node_gbps,
            hbm_gbps=site.device.hbm_gbps,
            intra_node_latency_s=net.intra_node_latency_us * 1e-6,
            inter_node_latency_s=net.inter_node_latency_us * 1e-6,
            setup_s=net.communicator_setup_s,
            host_link_gbps=site.device.host_link_gbps,
        )

    def node_of(self, device: int) -> int:
        return device // self.devices_per_node

    def transfer_s(self, nbytes: float, src: int, dst: int, collective: str = "p2p") -> float:
        if src == dst:
            return local_copy_s(nbytes, self.hbm_gbps * 1e9)
        if self.node_of(src) == self.node_of(dst):
            return p2p_s(nbytes, self.intra_node_gbps * 1e9, self.intra_node_latency_s)
        return p2p_s(nbytes, self.inter_node_gbps * 1e9, self.inter_node_latency_s)

    def communicator_setup_s(self, devices: Sequence[int]) -> float:
        return self.setup_s if len(set(devices)) > 1 else 0.0

    def host_transfer_s(self, nbytes: float) -> float:
        return host_copy_s(nbytes, self.host_link_gbps)


class CostModelLinks:
    """:class:`LinkCosts` from the calibrated :class:`nereusd.cost.model.CostModel`.

    A message costs ``CostModel.transfer_s(nbytes, link, collective)`` — peak link bandwidth and
    latency of the site, divided by the efficiency learned for that collective on that link
    (paper §4.2) — with ``link`` intra-node when both devices are on one node; a local copy
    costs ``2 · nbytes / hbm``; a communicator ``CostModel.communicator_setup_s()``; a copy to or
    from host memory the site's ``host_link_gbps`` (not calibrated: no step measures it).
    """

    def __init__(self, cost_model) -> None:
        self.cost_model = cost_model
        self.site = cost_model.site

    def transfer_s(self, nbytes: float, src: int, dst: int, collective: str = "p2p") -> float:
        if src == dst:
            return local_copy_s(nbytes, self.site.hbm_bytes_per_s)
        link = "intra" if self.site.node_of(src) == self.site.node_of(dst) else "inter"
        return self.cost_model.transfer_s(nbytes, link, collective=collective)

    def communicator_setup_s(self, devices: Sequence[int]) -> float:
        return self.cost_model.communicator_setup_s(1) if len(set(devices)) > 1 else 0.0

    def host_transfer_s(self, nbytes: float) -> float:
        return host_copy_s(nbytes, self.site.device.host_link_gbps)


@dataclass(frozen=True)
class TransitionCost:
    """``L̂_tran`` and the ASAP schedule behind it (seconds from the start of the transition)."""

    l_tran_s: float
    duration_s: Mapping[str, float]
    start_s: Mapping[str, float]
    critical_path: tuple[str, ...]
    bytes_moved: int
    """Bytes sent between distinct devices by all ops."""


_COLLECTIVE = {OpKind.SPLIT: "all_gather", OpKind.EXTEND: "broadcast", OpKind.MERGE: "p2p"}


def op_duration_s(op: Op, sizes: StateSizes, links: LinkCosts,
                  reused: Collection[tuple[str, tuple[int, ...]]] = ()) -> tuple[float, int]:
    """``(seconds, bytes sent between devices)`` of one op (module docstring); ``reused``: the
    ``(op id, device set)`` communicators the workers' group pool supplies, which cost no set-up
    (:meth:`nereusd.transition.comms.GroupPoolMirror.reused`).

    Returns ``(0.0, 0)`` for Destroy and Create.
    """
    seconds, moved, _ = _profile(op, sizes, links, reused)
    return seconds, moved


def _profile(op: Op, sizes: StateSizes, links: LinkCosts,
             reused: Collection[tuple[str, tuple[int, ...]]] = ()) -> tuple[float, int, set[int]]:
    """Seconds, bytes moved, and the devices whose link (or memory, for local slices) it uses."""
    if op.kind in (OpKind.DESTROY, OpKind.CREATE):
        return 0.0, 0, set()
    per_element = sizes.moved_bytes_per_element(op.model_stage)
    message: dict[tuple[int, int], float] = defaultdict(float)
    for r in op.routes:
        message[(r.src, r.dst)] += r.shard.numel * per_element
    send: dict[int, float] = defaultdict(float)
    recv: dict[int, float] = defaultdict(float)
    moved = 0
    collective = _COLLECTIVE.get(op.kind, "p2p")
    staged = op.staged_elements
    for (s, d), nbytes in message.items():
        if s == d and d in staged:   # a staged Merge slices from its host copy: priced below
            continue
        t = links.transfer_s(nbytes, s, d, collective)
        recv[d] += t
        if s != d:
            send[s] += t
            moved += int(nbytes)
    for x, elements in op.host_staged:
        # out before the exchange; back: a Split's own part (its whole old holding), a Merge's slice
        back = message.get((x, x), 0.0) if op.kind is OpKind.MERGE else elements * per_element
        recv[x] += links.host_transfer_s(elements * per_element) + links.host_transfer_s(back)
    setup: dict[int, float] = defaultdict(float)
    for key in created_groups((op.id, g) for g in op_communicators(op)):
        if key in reused:
            continue
        group = key[1]
        t = links.communicator_setup_s(group)
        for x in group:
            setup[x] += t
    transfer = max([*send.values(), *recv.values(), 0.0])
    return max(setup.values(), default=0.0) + transfer, moved, set(send) | set(recv) | set(setup)


def list_schedule(order: Sequence[K], duration: Mapping[K, float], ports: Mapping[K, Iterable[int]],
                  preds: Mapping[K, Sequence[K]]) -> tuple[dict[K, float], dict[K, K | None]]:
    """Starts of jobs placed in ``order`` (a topological order), each at the earliest time when
    its predecessors have finished and every one of its ports is free for its whole duration
    (one job at a time per port; a job of zero duration or without ports takes none) — a list
    schedule with backfilling into earlier gaps.

    Args:
        order: job keys, predecessors before successors.
        duration: seconds (or ticks) per job, ≥ 0.
        ports: the devices whose link a job uses.
        preds: the jobs each job waits for.

    Returns:
        ``(start, via)``: start per job, and what fixed it — the predecessor or the job on a
        shared port that ended at that instant (``None``: nothing, it starts when ready at 0).
    """
    busy: dict[int, list[tuple[float, float, K]]] = {}   # per port: (start, end, job), sorted by start
    start: dict[K, float] = {}
    finish: dict[K, float] = {}
    via: dict[K, K | None] = {}
    for job in order:
        ready, by = max(((finish[p], p) for p in preds.get(job, ())), default=(0, None))
        d = duration[job]
        mine = [busy.setdefault(x, []) for x in ports[job]] if d > 0 else []
        t = ready
        if mine:
            gaps = sorted({ready} | {e for spans in mine for _, e, _ in spans if e > ready})
            for t in gaps:
                if all(_free(spans, t, t + d) for spans in mine):
                    break
            if t > ready:   # started by a job on a shared port ending at t
                by = next(j for spans in mine for _, e, j in spans if e == t)
        start[job], finish[job], via[job] = t, t + d, by
        for spans in mine:
            bisect.insort(spans, (t, t + d, job))
    return start, via


def best_list_schedule(order: Sequence[K], duration: Mapping[K, float], ports: Mapping[K, Iterable[int]],
                       preds: Mapping[K, Sequence[K]], *, passes: int = 2) -> tuple[list[K], dict[K, float], dict[K, K | None]]:
    """The shortest :func:`list_schedule` found from three orders, critical-path order
    (:func:`critical_path_order`), ``order`` itself and bottleneck order
    (:func:`bottleneck_order`) — none wins on every DAG (``scripts/bench_dag.py``) — each
    improved by up to ``passes`` rounds of forward-backward justification
    (:func:`justified_order`); it stops early at a schedule as short as
    :func:`makespan_lower_bound`, so the later orders cost time only where the earlier ones miss
    the bound. Ties: the first found. Returns ``(order used, start, via)``; :func:`list_schedule`
    in that order gives that schedule."""
    bound = makespan_lower_bound(order, duration, ports, preds)
    best = None
    for o in _starting_orders(order, duration, ports, preds):
        previous = float("inf")
        for k in range(passes + 1):
            start, via = list_schedule(o, duration, ports, preds)
            end = max((start[x] + duration[x] for x in o), default=0)
            if best is None or end < best[0]:
                best = (end, o, start, via)
            if best[0] <= bound:
                return best[1], best[2], best[3]   # optimal: nothing shorter exists
            if end >= previous or k == passes:
                break   # stop at the first round that does not shorten the schedule
            previous = end
            o = justified_order(o, duration, ports, preds, start)
    return best[1], best[2], best[3]


def _starting_orders(order: Sequence[K], duration: Mapping[K, float], ports: Mapping[K, Iterable[int]],
                     preds: Mapping[K, Sequence[K]]):
    """:func:`best_list_schedule`'s starting orders, each built only when the one before missed
    the bound."""
    yield critical_path_order(order, duration, preds)
    yield list(order)
    yield bottleneck_order(order, duration, ports, preds)


def makespan_lower_bound(order: Sequence[K], duration: Mapping[K, float], ports: Mapping[K, Iterable[int]],
                         preds: Mapping[K, Sequence[K]]) -> float:
    """No schedule of these jobs is shorter than the longer of the DAG's longest path and the
    busiest port's total work (jobs of zero duration take no port, as in :func:`list_schedule`)."""
    finish: dict[K, float] = {}
    for x in order:
        finish[x] = duration[x] + max((finish[p] for p in preds.get(x, ())), default=0)
    load: dict[int, float] = defaultdict(float)
    for x in order:
        if duration[x] > 0:
            for p in ports[x]:
                load[p] += duration[x]
    return max([*finish.values(), *load.values(), 0])


def justified_order(order: Sequence[K], duration: Mapping[K, float], ports: Mapping[K, Iterable[int]],
                    preds: Mapping[K, Sequence[K]], start: Mapping[K, float]) -> list[K]:
    """One round of forward-backward improvement of the schedule ``start`` (the list schedule of
    ``order``): the jobs are list-scheduled on the *reversed* DAG in order of decreasing finish
    time (each job as late as its successors and ports allow, read backwards), and the returned
    order sorts them by that backward schedule's start, read forwards. A list schedule in the
    returned order is never longer than the backward one, and often shorter than ``start``: jobs
    slide into gaps that the first pass left (Valls, Ballestín and Quintanilla, "Justification
    and RCPSP: A technique that pays", EJOR 165, 2005; Tormos and Lova, Annals of OR 102, 2001).

    Ties keep ``order``'s precedence, so the result is a topological order again (a job of zero
    duration finishing with its predecessor stays after it)."""
    rank = {x: i for i, x in enumerate(order)}
    succ: dict[K, list[K]] = defaultdict(list)
    for x in order:
        for p in preds.get(x, ()):
            succ[p].append(x)
    back = sorted(order, key=lambda x: (-(start[x] + duration[x]), -rank[x]))
    back_start, _ = list_schedule(back, duration, ports, succ)
    return sorted(order, key=lambda x: (-(back_start[x] + duration[x]), rank[x]))


def bottleneck_order(order: Sequence[K], duration: Mapping[K, float], ports: Mapping[K, Iterable[int]],
                     preds: Mapping[K, Sequence[K]]) -> list[K]:
    """``order`` (topological) re-ordered for :func:`list_schedule`: among the jobs whose
    predecessors are placed, the one with the largest sum of its remaining path (as
    :func:`critical_path_order`) and the total work of its busiest port first, ties in
    ``order``'s order. Where one device's link carries most of the transition (the makespan is
    its load), its jobs must run back to back from the start; the critical path alone ranks a
    short job there below a longer chain elsewhere and leaves the busy link idle (two of the
    three cases of ``scripts/bench_dag.py`` over 5 % with two starting orders, at 1.11× and
    1.13×, reach the optimum with it)."""
    load: dict[int, float] = defaultdict(float)
    for x in order:
        if duration[x] > 0:
            for p in ports[x]:
                load[p] += duration[x]
    busiest = {x: max((load[p] for p in ports[x]), default=0.0) if duration[x] > 0 else 0.0 for x in order}
    return _priority_order(order, preds, lambda x, level: level + busiest[x], duration)


def critical_path_order(order: Sequence[K], duration: Mapping[K, float], preds: Mapping[K, Sequence[K]]) -> list[K]:
    """``order`` (topological) re-ordered for :func:`list_schedule`: among the jobs whose
    predecessors are placed, the one with the longest remaining path (its duration plus its
    longest chain of successors) first, ties in ``order``'s order — the classic critical-path
    priority of list scheduling (Graham; Kwok and Ahmad, "Static scheduling algorithms for
    allocating directed task graphs", ACM Computing Surveys 1999, §3)."""
    return _priority_order(order, preds, lambda x, level: level, duration)


def _priority_order(order: Sequence[K], preds: Mapping[K, Sequence[K]], priority, duration: Mapping[K, float]) -> list[K]:
    """A topological order of ``order`` that places, among the jobs whose predecessors are
    placed, the one of the highest ``priority(job, level)`` first (``level``: the job's duration
    plus its longest chain of successors), ties in ``order``'s order."""
    rank = {x: i for i, x in enumerate(order)}
    succ: dict[K, list[K]] = defaultdict(list)
    indeg = {x: 0 for x in order}
    for x in order:
        for p in preds.get(x, ()):
            succ[p].append(x)
            indeg[x] += 1
    level: dict[K, float] = {}
    for x in reversed(order):
        level[x] = duration[x] + max((level[s] for s in succ[x]), default=0)
    key = {x: -priority(x, level[x]) for x in order}
    ready = [(key[x], rank[x], x) for x in order if indeg[x] == 0]
    heapq.heapify(ready)
    out = []
    while ready:
        _, _, x = heapq.heappop(ready)
        out.append(x)
        for s in succ[x]:
            indeg[s] -= 1
            if indeg[s] == 0:
                heapq.heappush(ready, (key[s], rank[s], s))
    return out


def _free(spans: list[tuple[float, float, object]], a: float, b: float) -> bool:
    """Whether no span of ``spans`` (sorted by start) overlaps ``[a, b)``."""
    i = bisect.bisect_left(spans, (b,))   # spans starting before b: (b,) sorts before (b, …)
    return all(e <= a for _, e, _ in spans[:i])


def estimate_l_tran(dag: TransitionDag, sizes: StateSizes, links: LinkCosts,
                    reused: Collection[tuple[str, tuple[int, ...]]] = ()) -> TransitionCost:
    """``L̂_tran``: makespan of the DAG with :func:`op_duration_s` per op (module docstring).

    Ops are placed in critical-path order, in the DAG's topological order
    (:func:`~nereusd.transition.dag.topological_order`) or in bottleneck order, each improved
    by forward-backward justification, whichever gives the shorter schedule
    (:func:`best_list_schedule`), each at the earliest time when its predecessors have finished and the devices whose links it
    uses are free for its whole duration (one port per device: a device's sends, receives and
    communicator set-ups run one after another, also across ops; :func:`list_schedule`). Without
    shared devices this is the DAG's longest path.

    ``reused``: the ``(op id, device set)`` communicators the workers' group pool supplies (no
    set-up; :meth:`nereusd.transition.comms.GroupPoolMirror.reused`).

    Returns:
        The makespan, per-op durations and start times, and the critical path: the chain of
        ops, each started by the end of the previous one (a DAG predecessor or the previous user
        of a shared device).

    Raises:
        PlanError: if the DAG has a cycle.
    """
    from nereusd.transition.dag import topological_order

    duration, ports = {}, {}
    moved = 0
    preds: dict[str, list[str]] = defaultdict(list)
    for e in dag.edges:
        preds[e.dst].append(e.src)
    for op_id in topological_order(dag):
        duration[op_id], nbytes, ports[op_id] = _profile(dag.op(op_id), sizes, links, reused)
        moved += nbytes
    order, start, via = best_list_schedule(topological_order(dag), duration, ports, preds)
    finish = {x: start[x] + duration[x] for x in order}
    rank = {x: i for i, x in enumerate(order)}
    last = max(finish, key=lambda x: (finish[x], rank[x]), default=None)
    path = []
    while last is not None:
        path.append(last)
        last = via[last]
    total = max(finish.values(), default=0.0)
    log.debug("L_tran %.3f s over %d ops, %d bytes moved", total, len(dag.ops), moved)
    return TransitionCost(total, duration, start, tuple(reversed(path)), moved)
