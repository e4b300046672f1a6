"""``Δ_M``, ``T_sub`` and the local DAG of one model-stage (paper §6.1).

``T_sub``. A unit with layout ``T = (tp, pp)`` can be split into units with layout
``(tp_s, pp_s)`` iff ``tp_s | tp`` and ``pp_s | pp`` (equal-chunk shards nest, see
:mod:`nereusd.shards`). The largest layout into which both the current ``T`` and the target
``T*`` units can be split is therefore ``T_sub = (gcd(tp, tp*), gcd(pp, pp*))``; ``T`` splits
into ``k = (tp/tp_s)·(pp/pp_s)`` units and ``k* = (tp*/tp_s)·(pp*/pp_s)`` of them merge into one
``T*`` unit. Paper example (Fig. 6): ``(4, 8) → (8, 2)`` has ``T_sub = (4, 2)``.

Positions. Split is position-wise: the device at ``(p, t)`` of a ``T`` unit ends up with the
``T_sub`` shard ``σ = (p // kp, t // kt)`` (``kp = pp/pp_s``, ``kt = tp/tp_s``), gathered from
its *gather group*, the devices of its unit with the same ``σ`` (the smallest enclosing TP/PP
group). Symmetrically the device at ``(p*, t*)`` of a ``T*`` unit needs the ``T_sub`` shard
``σ* = (p* // kp*, t* // kt*)`` before Merge, which then only slices locally. The transition of
one model-stage is thus a matching of ``T_sub`` positions to devices:

* a device of both plans with ``σ == σ*`` is *retained* (its state stays put);
* every other target device is *missing* and receives its ``σ*`` shard by Extend from a
  holder of that position (same node first, then the least-used sender, then a retained one);
* holdings that are neither retained nor read are redundant and destroyed.

Local DAG, in the paper's default order Split → Destroy → Extend → Merge:

1. ``split`` each current unit that has a retained device or must serve as a source (when
   ``T_sub != T``; with no retained device, unit 0 is the source). Only devices whose
   ``T_sub`` shard is needed (retained or sending) receive; the others just send.
2. ``destroy`` redundant holdings that nothing reads at once (after their unit's Split when
   they are senders in it).
3. ``extend`` one op per target ``T_sub`` sub-unit with missing devices (rank-aligned pairs).
4. ``destroy`` sending-only holdings after every Extend that reads them — a unit with no
   other replica is destroyed only after Extend copies it.
5. ``merge`` each target unit (when ``T_sub != T*``) after every other op of the model-stage,
   so no Merge ever races with the copies the model-stage's state depends on.

Degenerate cases fall out with no special code: no change → no op; pure DP scale-up →
Extends; pure DP scale-down → Destroys; pure device move → one Extend and one Destroy per
unit; a model-stage that joins → ``create`` per unit; one that leaves → ``destroy`` per unit
with ``discard`` set.
"""

from __future__ import annotations

import heapq
import logging
import math
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Callable

from nereusd.models import ModelSpec
from nereusd.plan import Candidate, Layout, ModelStage
from nereusd.shards import Position, check_layout, missing_pieces, shards_of
from nereusd.transition.ops import Edge, EdgeReason, Op, OpKind, Route

log = logging.getLogger(__name__)


def t_sub(current: Layout, target: Layout) -> Layout:
    """``T_sub = (gcd(tp, tp*), gcd(pp, pp*))``: the largest layout both can be split into."""
    return Layout(math.gcd(current.tp, target.tp), math.gcd(current.pp, target.pp))


@dataclass(frozen=True)
class Delta:
    """``Δ_M = (E_M → E*_M)`` for one model-stage (paper §6.1); ``None`` = absent from a plan."""

    model_stage: ModelStage
    current: Candidate | None
    target: Candidate | None

    @property
    def sub_layout(self) -> Layout | None:
        """``T_sub``, or ``None`` when the model-stage is absent from either plan."""
        if self.current is None or self.target is None:
            return None
        return t_sub(self.current.layout, self.target.layout)

    @property
    def unchanged(self) -> bool:
        """Same layout on the same devices in the same order (DP included)."""
        c, t = self.current, self.target
        return c is not None and t is not None and (c.tp, c.pp, c.devices) == (t.tp, t.pp, t.devices)


def _coords(cand: Candidate, device: int) -> tuple[int, Position]:
    dp_rank, pp_rank, tp_rank = cand.coords_of(device)
    return dp_rank, (pp_rank, tp_rank)


def _sub(position: Position, kp: int, kt: int) -> Position:
    """Index of the ``T_sub`` sub-unit a position falls into when its unit is split."""
    return (position[0] % kp, position[1] % kt)


class _Builder:
    """Accumulates the ops and edges of one local DAG with readable ids."""

    def __init__(self, model_stage: ModelStage) -> None:
        self.model_stage = model_stage
        self.ops: list[Op] = []
        self.edges: list[Edge] = []
        self._count: Counter[OpKind] = Counter()

    def add(self, kind: OpKind, *, after: list[str] = (), **fields) -> str:
        op_id = f"{self.model_stage}:{kind.value}{self._count[kind]}"
        self._count[kind] += 1
        defaults = dict(source_layout=None, source_devices=(), source_positions=(), target_layout=None,
                        target_devices=(), target_positions=(), routes=(), discard=False)
        defaults.update(fields)
        self.ops.append(Op(id=op_id, kind=kind, model_stage=self.model_stage, **defaults))
        for pred in dict.fromkeys(after):
            self.edges.append(Edge(pred, op_id, EdgeReason.STATE))
        return op_id


class _SenderPicker:
    """The Extend source of each missing device among the holders of one ``T_sub`` position:
    the holder minimising ``(on another node than the receiver, sends so far, not retained,
    index)`` — that key's minimum over all holders, in O(log n) per pick instead of O(n) (a
    dp 4,096 → 8,192 scale-up has 4,096 holders and 4,096 receivers).

    One heap over all holders and one per node, keyed by ``(sends, not retained, index)``.
    ``sends`` only grows, so an entry whose count is stale is re-pushed when it surfaces.
    """

    def __init__(self, holders: list[int], retained: set[int], node_of: Callable[[int], int],
                 sends: Counter[int]) -> None:
        self._sends = sends
        self._key = {c: (c not in retained, c) for c in holders}
        self._all = [(sends[c], *self._key[c]) for c in holders]
        heapq.heapify(self._all)
        self._by_node: dict[int, list[tuple[int, bool, int]]] = defaultdict(list)
        for entry in self._all:
            self._by_node[node_of(entry[2])].append(entry)
        for heap in self._by_node.values():
            heapq.heapify(heap)

    def _top(self, heap: list[tuple[int, bool, int]]) -> int | None:
        while heap:
            count, _, c = heap[0]
            if count == self._sends[c]:
                return c
            heapq.heapreplace(heap, (self._sends[c], *self._key[c]))
        return None

    def pick(self, node: int) -> int:
        """The source for a receiver on ``node``; the caller then counts its send in ``sends``."""
        src = self._top(self._by_node.get(node, []))
        return src if src is not None else self._top(self._all)


def local_dag(
    delta: Delta, spec: ModelSpec, *, value_head: bool, node_of: Callable[[int], int], lean: bool = False
) -> tuple[list[Op], list[Edge]]:
    """The local DAG of ``delta`` (see the module docstring for the construction).

    Args:
        delta: the model-stage's current and target candidates.
        spec: the model-stage's model shapes.
        value_head: whether it carries a value head (critic, reward).
        node_of: node index of a global device index (intra-node senders are preferred).
        lean: Extend only from retained devices where a ``T_sub`` position has one. By default
            the sends are spread over every holder, retained or not, so that they run in
            parallel; a holder that is not retained then receives its ``T_sub`` holding in the
            Split only to send it, and where it is also an Extend's target it holds both at once.
            The lean DAG is slower and needs less memory
            (:func:`nereusd.transition.assess_transition` tries it when the first does not fit).

    Returns:
        ``(ops, edges)``: ops in Split, Destroy, Extend, Destroy, Merge order; state edges.

    Raises:
        PlanError: if a layout cannot shard ``spec`` (:func:`nereusd.shards.check_layout`).
    """
    m, cur, tgt = delta.model_stage, delta.current, delta.target
    b = _Builder(m)
    if cur is None and tgt is None or delta.unchanged:
        return b.ops, b.edges
    if cur is None:
        check_layout(spec, tgt.layout, value_head=value_head)
        for d in range(tgt.dp):
            devs = tgt.replica_devices(d)
            b.add(OpKind.CREATE, target_layout=tgt.layout, target_devices=devs,
                  target_positions=[_coords(tgt, x)[1] for x in devs])
        return b.ops, b.edges
    if tgt is None:
        for d in range(cur.dp):
            devs = cur.replica_devices(d)
            b.add(OpKind.DESTROY, source_layout=cur.layout, source_devices=devs,
                  source_positions=[_coords(cur, x)[1] for x in devs], discard=True)
        return b.ops, b.edges

    T, T_star = cur.layout, tgt.layout
    S = t_sub(T, T_star)
    for lay in (T, T_star):
        check_layout(spec, lay, value_head=value_head)
    kp, kt = T.pp // S.pp, T.tp // S.tp
    kp_s, kt_s = T_star.pp // S.pp, T_star.tp // S.tp
    split_needed = S != T

    cur_unit, cur_pos, sigma = {}, {}, {}
    for x in cur.devices:
        u, (p, t) = _coords(cur, x)
        cur_unit[x], cur_pos[x], sigma[x] = u, (p, t), (p // kp, t // kt)
    tgt_unit, tgt_pos, sigma_t, tgt_sub = {}, {}, {}, {}
    for x in tgt.devices:
        u, (p, t) = _coords(tgt, x)
        tgt_unit[x], tgt_pos[x] = u, (p, t)
        sigma_t[x], tgt_sub[x] = (p // kp_s, t // kt_s), _sub((p, t), kp_s, kt_s)

    retained = {x for x in tgt.devices if x in sigma and sigma[x] == sigma_t[x]}
    missing = [x for x in tgt.devices if x not in retained]
    if split_needed:
        source_units = sorted({cur_unit[x] for x in retained}) or ([0] if missing else [])
    else:
        source_units = list(range(cur.dp))
    holders: dict[Position, list[int]] = defaultdict(list)
    for x in sorted(cur.devices):
        if cur_unit[x] in source_units:
            holders[sigma[x]].append(x)
    sends: Counter[int] = Counter()
    src_of: dict[int, int] = {}
    if lean:
        holders = defaultdict(list, {pos: [x for x in devs if x in retained] or devs for pos, devs in holders.items()})
    pickers = {pos: _SenderPicker(devs, retained, node_of, sends) for pos, devs in holders.items()}
    for dst in missing:
        src = pickers[sigma_t[dst]].pick(node_of(dst))
        src_of[dst] = src
        sends[src] += 1

    # 1. Split the units that keep or send state.
    split_of: dict[int, str] = {}
    receivers_of: dict[int, list[int]] = {}
    if split_needed:
        for u in source_units:
            devs = cur.replica_devices(u)
            receivers = [x for x in devs if x in retained or sends[x]]
            routes = []
            for r in receivers:
                group = [x for x in devs if sigma[x] == sigma[r] and x != r]
                for peer, piece in missing_pieces(spec, value_head, (T, cur_pos[r]), (S, sigma[r]),
                                                  [(x, T, cur_pos[x]) for x in group]):
                    routes.append(Route(peer, r, piece))
            receivers_of[u] = receivers
            split_of[u] = b.add(
                OpKind.SPLIT, source_layout=T, source_devices=devs,
                source_positions=[cur_pos[x] for x in devs], target_layout=S,
                target_devices=receivers, target_positions=[sigma[x] for x in receivers],
                routes=routes)

    # 2. Destroy what nothing reads: unused units at once, senders after their Split (one op per
    #    T_sub sub-unit of a split unit, as the paper destroys the redundant units Split made).
    for u in range(cur.dp):
        devs = cur.replica_devices(u)
        if u in split_of:
            idle = [x for x in devs if x not in receivers_of[u]]
            subs = sorted({_sub(cur_pos[x], kp, kt) for x in idle})
            for sub in subs:
                part = [x for x in idle if _sub(cur_pos[x], kp, kt) == sub]
                b.add(OpKind.DESTROY, after=[split_of[u]], source_layout=T, source_devices=part,
                      source_positions=[cur_pos[x] for x in part])
        else:
            idle = [x for x in devs if x not in retained and not sends[x]]
            if idle:
                b.add(OpKind.DESTROY, source_layout=T, source_devices=idle,
                      source_positions=[cur_pos[x] for x in idle])

    # 3. Extend: one op per target T_sub sub-unit with missing devices.
    groups: dict[tuple[int, Position], list[int]] = defaultdict(list)
    for dst in missing:
        groups[(tgt_unit[dst], tgt_sub[dst])].append(dst)
    readers: dict[int, list[str]] = defaultdict(list)
    extends: list[str] = []
    for key in sorted(groups):
        dsts = groups[key]
        srcs = [src_of[x] for x in dsts]
        routes = [Route(s, x, sh) for s, x in zip(srcs, dsts)
                  for sh in shards_of(spec, S, sigma_t[x], value_head)]
        after = [split_of[cur_unit[s]] for s in srcs if cur_unit[s] in split_of]
        op_id = b.add(OpKind.EXTEND, after=after, source_layout=S, source_devices=srcs,
                      source_positions=[sigma[s] for s in srcs], target_layout=S, target_devices=dsts,
                      target_positions=[sigma_t[x] for x in dsts], routes=routes)
        extends.append(op_id)
        for s in srcs:
            readers[s].append(op_id)

    # 4. Destroy sending-only holdings after every Extend that reads them, per current sub-unit.
    senders: dict[tuple[int, Position], list[int]] = defaultdict(list)
    for x in cur.devices:
        if sends[x] and x not in retained:
            senders[(cur_unit[x], _sub(cur_pos[x], kp, kt))].append(x)
    for key in sorted(senders):
        devs = senders[key]
        b.add(OpKind.DESTROY, after=[r for x in devs for r in readers[x]], source_layout=S,
              source_devices=devs, source_positions=[sigma[x] for x in devs])

    # 5. Merge each target unit after everything else of this model-stage.
    if S != T_star:
        everything = [op.id for op in b.ops]
        for u in range(tgt.dp):
            devs = tgt.replica_devices(u)
            routes = []
            for x in devs:
                held = {sh.name: sh for sh in shards_of(spec, S, sigma_t[x], value_head)}
                for need in shards_of(spec, T_star, tgt_pos[x], value_head):
                    mine = held[need.name]
                    routes.append(Route(x, x, need if mine.contains(need) else mine))
                # Peers of the same T_sub sub-unit first: replicated k/v pieces then travel
                # between pairs instead of converging on the unit's first devices.
                others = sorted((y for y in devs if y != x), key=lambda y: tgt_sub[y] != tgt_sub[x])
                peers = [(y, S, sigma_t[y]) for y in others]
                routes += [Route(src, x, piece) for src, piece in
                           missing_pieces(spec, value_head, (S, sigma_t[x]), (T_star, tgt_pos[x]), peers)]
            b.add(OpKind.MERGE, after=everything, source_layout=S, source_devices=devs,
                  source_positions=[sigma_t[x] for x in devs], target_layout=T_star, target_devices=devs,
                  target_positions=[tgt_pos[x] for x in devs], routes=routes)
    log.debug("%s: T=%s T_sub=%s T*=%s retained=%s missing=%s → %d ops", m, T, S, T_star,
              sorted(retained), missing, len(b.ops))
    return b.ops, b.edges
