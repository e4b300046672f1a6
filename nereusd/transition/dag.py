"""The global transition DAG: joining local DAGs and a deterministic order (paper §6.1).

Joining. Local DAGs (one per model-stage, :mod:`nereusd.transition.local`) are concatenated in
canonical model-stage order (generation → inference → training, then role) and joined with
*release-before-acquire* edges: an op that acquires memory on a device (Extend and Create on
their target devices, Split on its receivers, Merge on its devices) waits for the ops that
release memory there (Destroy, Merge, and a Split on its receivers: two Splits or Merges on one
tight device, which each allocate before they free, run one after the other). Stage order
breaks ties: acquisitions are joined from the last stage to the first, so when two hand-overs
would wait on each other the earlier stage proceeds and the later one waits; the topological
order runs ready releases first, then generation → inference → training. An edge ``release → acquire`` is added only when ``acquire`` does not
already reach ``release`` (a Destroy that depends, directly or transitively, on the blocked
acquisition is never chosen), so the DAG stays acyclic by construction; :func:`join` asserts it.

Which pairs are joined: without a memory model (``tight=None``) every device that passes from
one model-stage to another is handed over (cross-model-stage pairs only, as in the paper's
examples: critic Extend onto GPU 10 waits for actor Destroy; a Split, and a Merge's
allocation, hand over nothing). With a memory model
(:func:`nereusd.transition.memory.tight_devices`) only devices whose worst case — everything
acquired while nothing is released — exceeds the budget are joined, for every pair on them.

The validator lives in :mod:`nereusd.transition.validate`.
"""

from __future__ import annotations

import heapq
import logging
from collections import defaultdict
from typing import Callable, Iterable, Sequence

from nereusd.errors import PlanError
from nereusd.plan import Layout, ModelStage, Plan
from nereusd.shards import Position
from nereusd.transition.ops import Edge, EdgeReason, Op, OpKind, TransitionDag

log = logging.getLogger(__name__)

Holding = tuple[ModelStage, int, Layout, Position]
"""``(model_stage, device, layout, position)``: one shard set of one model-stage on one device."""


def acquires(op: Op) -> tuple[int, ...]:
    """Devices on which ``op`` allocates state: Extend/Create targets, Split receivers, Merge
    devices (the ``T*`` holding, allocated before the ``T_sub`` one is freed)."""
    if op.kind in (OpKind.EXTEND, OpKind.CREATE, OpKind.SPLIT, OpKind.MERGE):
        return op.target_devices
    return ()


def releases(op: Op) -> tuple[int, ...]:
    """Devices on which ``op`` frees state: Destroy sources, Merge devices, Split receivers (their
    ``T`` holding, once the ``T_sub`` one is whole)."""
    if op.kind in (OpKind.DESTROY, OpKind.MERGE):
        return op.source_devices
    if op.kind is OpKind.SPLIT:
        return op.target_devices
    return ()


class Reachability:
    """Transitive closure of a growing DAG over ``n`` nodes, as bitsets (node ``i`` = bit ``i``)."""

    def __init__(self, n: int) -> None:
        self.desc = [0] * n
        self.anc = [0] * n

    def reaches(self, u: int, v: int) -> bool:
        """Whether there is a path ``u → … → v`` (``u != v``)."""
        return bool(self.desc[u] >> v & 1)

    def add_edge(self, u: int, v: int) -> None:
        """Add ``u → v``; the caller has checked that ``v`` does not reach ``u``."""
        assert u != v and not self.reaches(v, u), f"edge {u}→{v} would close a cycle"
        down = self.desc[v] | (1 << v)
        up = self.anc[u] | (1 << u)
        for x in _bits(up):
            self.desc[x] |= down
        for y in _bits(down):
            self.anc[y] |= up


def _bits(mask: int) -> Iterable[int]:
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


def join(
    current: Plan,
    target: Plan,
    local_dags: Sequence[tuple[Sequence[Op], Sequence[Edge]]],
    *,
    tight: Callable[[int], bool] | None = None,
) -> TransitionDag:
    """Join local DAGs into the global DAG with release-before-acquire edges.

    Args:
        local_dags: ``(ops, state edges)`` per model-stage, in canonical model-stage order.
        tight: whether a device needs ordering for memory (see the module docstring);
            ``None`` joins only hand-overs between model-stages.

    Returns:
        The acyclic global DAG.
    """
    ops = [op for o, _ in local_dags for op in o]
    edges = [e for _, es in local_dags for e in es]
    index = {op.id: i for i, op in enumerate(ops)}
    reach = Reachability(len(ops))
    for e in edges:
        reach.add_edge(index[e.src], index[e.dst])
    releasing: dict[int, list[int]] = defaultdict(list)
    for i, op in enumerate(ops):
        for d in releases(op):
            releasing[d].append(i)
    skipped = 0
    # Later stages are joined first: when two hand-overs would wait on each other, the later
    # stage's acquisition waits and the earlier stage's proceeds (generation → inference →
    # training), and a later stage never overtakes an earlier one on a shared device.
    for a in reversed(range(len(ops))):
        op = ops[a]
        if tight is None and op.kind is OpKind.MERGE:
            continue   # hand-overs only: a Merge's devices already hold its model-stage
        for d in acquires(op):
            if tight is not None and not tight(d):
                continue
            for r in releasing[d]:
                if r == a or reach.reaches(r, a):
                    continue
                if tight is None and (ops[r].model_stage == op.model_stage or ops[r].kind is OpKind.SPLIT):
                    continue   # hand-overs only: a Split's receivers keep their model-stage
                if reach.reaches(a, r):
                    skipped += 1
                    continue
                reach.add_edge(r, a)
                edges.append(Edge(ops[r].id, op.id, EdgeReason.RESOURCE))
    dag = TransitionDag(current, target, tuple(ops), tuple(edges))
    assert len(topological_order(dag)) == len(ops)
    log.debug("transition DAG: %d ops, %d edges (%d resource), %d release edges skipped to stay acyclic",
              len(ops), len(edges), sum(e.reason is EdgeReason.RESOURCE for e in edges), skipped)
    return dag


def _priority(op: Op, index: int) -> tuple[int, int]:
    """Releases first (release-before-acquire), then construction order (stage order)."""
    return (0 if op.kind is OpKind.DESTROY else 1 if op.kind is OpKind.MERGE else 2, index)


def topological_order(dag: TransitionDag) -> list[str]:
    """A deterministic topological order: among ready ops, Destroy then Merge then the rest,
    ties by construction order (generation → inference → training).

    Raises:
        PlanError: if the DAG has a cycle (naming the ops left on it).
    """
    n = len(dag.ops)
    indeg = [0] * n
    succ: list[list[int]] = [[] for _ in range(n)]
    for e in dag.edges:
        s, d = dag.index_of(e.src), dag.index_of(e.dst)
        succ[s].append(d)
        indeg[d] += 1
    ready = [(_priority(op, i), i) for i, op in enumerate(dag.ops) if indeg[i] == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        _, i = heapq.heappop(ready)
        order.append(i)
        for j in succ[i]:
            indeg[j] -= 1
            if indeg[j] == 0:
                heapq.heappush(ready, (_priority(dag.ops[j], j), j))
    if len(order) != n:
        stuck = sorted(dag.ops[i].id for i in range(n) if indeg[i] > 0)
        raise PlanError(f"transition DAG has a cycle through {stuck}")
    return [dag.ops[i].id for i in order]


def closure(dag: TransitionDag) -> list[int]:
    """Descendant bitsets: bit ``j`` of ``result[i]`` is set iff op ``i`` reaches op ``j``.

    Raises:
        PlanError: if the DAG has a cycle.
    """
    order = [dag.index_of(x) for x in topological_order(dag)]
    succ: list[list[int]] = [[] for _ in dag.ops]
    for e in dag.edges:
        succ[dag.index_of(e.src)].append(dag.index_of(e.dst))
    desc = [0] * len(dag.ops)
    for i in reversed(order):
        for j in succ[i]:
            desc[i] |= desc[j] | (1 << j)
    return desc
