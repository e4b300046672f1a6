"""Placement: map chosen ``(tp, pp, dp)`` per model-stage onto concrete devices.

Rules (paper §4.2 "Plan search"; DESIGN.md "Planner"):

- model-stages that run concurrently (one phase of a synchronous step; generation against
  everything else when asynchronous) get disjoint device sets; different phases may share;
- a replica (``tp·pp`` devices) goes inside one node when it fits, else each TP group does;
  only when the pool is too fragmented for that does a TP group cross nodes;
- devices a model-stage already holds in the current plan are preferred, replica by replica,
  so that transitions stay cheap (its state is already there);
- among nodes that fit, the fullest one is taken (best fit), which packs power-of-two
  replicas without fragmentation.

Device order inside a candidate follows :class:`nereusd.plan.Candidate`: replica-major, then
pipeline stage, then tensor rank.
"""

from __future__ import annotations

import heapq
import logging
from typing import Mapping, Sequence

from nereusd.errors import PlanError
from nereusd.plan import Candidate, ModelStage, Plan

log = logging.getLogger(__name__)


def nodes_of(pool: Sequence[int], devices_per_node: int) -> dict[int, list[int]]:
    """Group global device ids by node (``device // devices_per_node``), each list sorted."""
    nodes: dict[int, list[int]] = {}
    for d in sorted(pool):
        nodes.setdefault(d // devices_per_node, []).append(d)
    return nodes


class _PreferIndex:
    """Nodes holding free preferred devices, ordered by the key ``_take`` minimises,
    ``(−min(preferred free, count), free, node)``, kept in one lazy heap per ``count``; only
    the node a take changes is re-keyed, so a take costs O(log nodes), not a scan."""

    def __init__(self, free: dict[int, list[int]], prefer: set[int]) -> None:
        self.free, self.prefer = free, prefer
        self.pc = {n: sum(d in prefer for d in devs) for n, devs in free.items()}
        self.heaps: dict[int, list] = {}

    def _key(self, node: int, count: int) -> tuple[int, int, int]:
        return (-min(self.pc[node], count), len(self.free[node]), node)

    def best(self, count: int) -> int | None:
        heap = self.heaps.get(count)
        if heap is None:
            heap = self.heaps[count] = [self._key(n, count) for n in self.free
                                        if self.pc[n] > 0 and len(self.free[n]) >= count]
            heapq.heapify(heap)
        while heap:
            key = heap[0]
            node = key[2]
            if self.pc[node] > 0 and len(self.free[node]) >= count and key == self._key(node, count):
                return node
            heapq.heappop(heap)
        return None

    def changed(self, node: int) -> None:
        self.pc[node] = sum(d in self.prefer for d in self.free[node])
        for count, heap in self.heaps.items():
            if self.pc[node] > 0 and len(self.free[node]) >= count:
                heapq.heappush(heap, self._key(node, count))

    def changed_all(self) -> None:
        self.pc = {n: sum(d in self.prefer for d in devs) for n, devs in self.free.items()}
        self.heaps.clear()


def _take(free: dict[int, list[int]], count: int, prefer: set[int],
          index: _PreferIndex | None = None) -> list[int] | None:
    """``count`` free devices inside one node, preferring ``prefer`` then best fit; None if none.

    Among nodes with a free preferred device and room for ``count``: most preferred devices
    (up to ``count``), then fewest free devices, then lowest node id; else best fit over all
    nodes. ``index`` (built on the same ``free`` and ``prefer``) answers the first part fast.
    """
    best = None
    if prefer:
        if index is None:
            index = _PreferIndex(free, prefer)
        best = index.best(count)
    if best is None:
        best_key = None
        for node, devs in free.items():
            if len(devs) >= count and (best_key is None or (len(devs), node) < best_key):
                best, best_key = node, (len(devs), node)
                if len(devs) == count:
                    break
    if best is None:
        return None
    devs = free[best]
    chosen = [d for d in devs if d in prefer][:count]
    chosen += [d for d in devs if d not in chosen][: count - len(chosen)]
    free[best] = [d for d in devs if d not in chosen]
    if index is not None:
        index.changed(best)
    return sorted(chosen)


def _place_packed(free: dict[int, list[int]], size: int, dp: int) -> list[int] | None:
    """Fast path without preferences: whole replicas cut node by node from the free lists
    (fullest nodes first). None if fewer than ``dp`` replicas fit that way."""
    blocks: list[list[int]] = []
    for node in sorted(free, key=lambda n: (len(free[n]), n)):
        devs = free[node]
        while len(devs) >= size and len(blocks) < dp:
            blocks.append(devs[:size])
            devs = devs[size:]
        if len(blocks) == dp:
            break
    if len(blocks) < dp:
        return None
    used = {d for blk in blocks for d in blk}
    for node in free:
        free[node] = [d for d in free[node] if d not in used]
    return [d for blk in blocks for d in blk]


def _place_one(free: dict[int, list[int]], tp: int, pp: int, dp: int, prefer: set[int],
               devices_per_node: int) -> list[int]:
    if not prefer:
        packed = _place_packed(free, tp * pp, dp)
        if packed is not None:
            return packed
    devices: list[int] = []
    index = _PreferIndex(free, prefer) if prefer else None
    for _ in range(dp):
        replica = _take(free, tp * pp, prefer, index)
        if replica is None:
            replica = []
            for _ in range(pp):
                group = _take(free, tp, prefer, index)
                if group is None:
                    rest = sorted(d for devs in free.values() for d in devs)
                    if len(rest) < tp:
                        raise PlanError(f"placement: {tp} devices needed, {len(rest)} free")
                    group = ([d for d in rest if d in prefer] + [d for d in rest if d not in prefer])[:tp]
                    if tp <= devices_per_node:   # a wider TP group crosses nodes by design
                        log.warning("placement: TP group %s crosses nodes (pool too fragmented)", group)
                    for node in free:
                        free[node] = [d for d in free[node] if d not in group]
                    if index is not None:
                        index.changed_all()
                replica += sorted(group)
        devices += replica
    return devices


def place(
    layouts: Mapping[ModelStage, tuple[int, int, int, int, bool, int]],
    concurrent_sets: Sequence[Sequence[ModelStage]],
    pool: Sequence[int],
    devices_per_node: int,
    current: Plan | None = None,
) -> Plan:
    """Assign devices to every model-stage.

    Args:
        layouts: ``(tp, pp, dp, micro_batch, recompute, zero_stage)`` per model-stage.
        concurrent_sets: groups that must get disjoint devices (:meth:`Workflow.concurrent_sets`);
            a model-stage in several groups (asynchronous generation) is placed once, first.
        pool: available global device ids.
        current: the running plan, whose device sets are preferred.

    Raises:
        PlanError: if a concurrent set needs more devices than the pool has.
    """
    placed: dict[ModelStage, list[int]] = {}
    for group in concurrent_sets:
        free = nodes_of(pool, devices_per_node)
        taken = {d for m in group if m in placed for d in placed[m]}
        for node in free:
            free[node] = [d for d in free[node] if d not in taken]
        need = sum(layouts[m][0] * layouts[m][1] * layouts[m][2] for m in group if m not in placed)
        have = sum(len(v) for v in free.values())
        if need > have:
            raise PlanError(f"placement: concurrent set {[str(m) for m in group]} needs {need} devices, {have} free")
        todo = [m for m in group if m not in placed]
        todo.sort(key=lambda m: (-layouts[m][0] * layouts[m][1], m.sort_key()))
        for m in todo:
            tp, pp, dp = layouts[m][:3]
            prefer = set(current[m].devices) if current is not None and m in current else set()
            placed[m] = _place_one(free, tp, pp, dp, prefer, devices_per_node)
    return Plan({
        m: Candidate(tp=layouts[m][0], pp=layouts[m][1], dp=layouts[m][2], devices=tuple(devs),
                     micro_batch=layouts[m][3], recompute=layouts[m][4], zero_stage=layouts[m][5])
        for m, devs in placed.items()
    })
