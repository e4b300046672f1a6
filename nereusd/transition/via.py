"""Transitions through an intermediate plan: a Merge-first path for crossed layouts.

A model-stage whose layout gets finer in one dimension and coarser in the other (``tp2·pp2 →
tp1·pp4``, ``tp1·pp8 → tp2·pp2``) is *crossed*: ``T_sub = (gcd(tp, tp*), gcd(pp, pp*))`` is
coarser than both ``T`` and ``T*``, so the local DAG (:mod:`nereusd.transition.local`) gathers
every receiver's ``T_sub`` holding — up to twice the target's — before the Merge slices it down.
On 64 GB devices an 8B model's actor training from ``tp1·pp8·dp4`` to ``tp2·pp2·dp8`` went
through a 56 GB ``tp1·pp2`` holding per device and did not fit, where both ends did.

The other order needs no large intermediate: first slice every holding locally to
``T_sup = (lcm(tp, tp*), lcm(pp, pp*))`` (a Merge whose routes are all local: each device keeps a
part of what it holds), then gather ``T_sup → T*`` (a Split, whose receivers allocate the
target holding itself). :func:`via_plan` builds the intermediate plan, placing ``T_sup`` so that
every device's new position lies inside its current holding; :func:`chain` joins the two DAGs
``current → via`` and ``via → target`` into one transition DAG from ``current`` to ``target``.
:func:`nereusd.transition.assess_transition` takes this path when the direct one does not fit.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from typing import Mapping

from nereusd.errors import PlanError
from nereusd.models import ModelSpec
from nereusd.plan import Layout, Plan, Role
from nereusd.shards import check_layout, value_head_for
from nereusd.transition.local import t_sub
from nereusd.transition.ops import Edge, EdgeReason, TransitionDag

VIA_TAG = "via-"
"""Prefix of the kind in the ids of the first DAG's ops (``actor/training:via-merge0``), which keeps
them apart from the second DAG's."""


def crossed(current: Layout, target: Layout) -> bool:
    """Whether ``current → target`` needs both a Split and a Merge (``T_sub`` differs from both)."""
    sub = t_sub(current, target)
    return sub != current and sub != target


def via_plan(current: Plan, target: Plan, models: Mapping[Role, ModelSpec]) -> Plan | None:
    """``current`` with each crossed model-stage at ``T_sup``, or ``None`` when none can be.

    A crossed model-stage (:func:`crossed`; not ZeRO-partitioned) at ``tp·pp·dp`` goes to
    ``T_sup = (lcm(tp, tp*), lcm(pp, pp*))`` on the same devices, ``dp / (a·b)`` replicas where
    ``a = tp_sup / tp`` and ``b = pp_sup / pp``: replica ``r`` of ``T_sup`` takes its device at
    ``(p, t)`` from current replica ``r·a·b + (p mod b)·a + (t mod a)`` at position
    ``(⌊p / b⌋, ⌊t / a⌋)``, which holds that position's whole ``T`` shard. It stays as it is
    when ``a·b`` does not divide its ``dp`` or its model cannot be sharded at ``T_sup``.
    """
    out: dict = {}
    changed = False
    for m, cur in current.items():
        out[m] = cur
        tgt = target.candidates.get(m)
        if tgt is None or cur.zero_stage or tgt.zero_stage or not crossed(cur.layout, tgt.layout):
            continue
        sup = Layout(math.lcm(cur.tp, tgt.tp), math.lcm(cur.pp, tgt.pp))
        a, b = sup.tp // cur.tp, sup.pp // cur.pp
        if cur.dp % (a * b) or m.role not in models:
            continue
        try:
            check_layout(models[m.role], sup, value_head=value_head_for(m.role))
        except PlanError:
            continue
        devices = [cur.device_at(r * a * b + (p % b) * a + (t % a), p // b, t // a)
                   for r in range(cur.dp // (a * b)) for p in range(sup.pp) for t in range(sup.tp)]
        out[m] = dataclasses.replace(cur, tp=sup.tp, pp=sup.pp, dp=cur.dp // (a * b), devices=tuple(devices))
        changed = True
    return Plan(out) if changed else None


def chain(first: TransitionDag, second: TransitionDag) -> TransitionDag:
    """One DAG from ``first.current`` to ``second.target`` that runs ``first`` and then ``second``.

    ``first``'s op ids get :data:`VIA_TAG` before their kind. Each op of ``second`` waits for the
    ops of ``first`` that share a device with it (:attr:`Op.participants`): they create the
    holdings it reads and free the memory it allocates; ops on other devices start at once.

    Raises:
        PlanError: if ``second`` does not start where ``first`` ends, or their staging bounds differ.
    """
    if first.target != second.current:
        raise PlanError("chain: the second DAG must start from the first one's target plan")
    if first.staging_bytes != second.staging_bytes:
        raise PlanError("chain: both DAGs must have the same staging_bytes")

    def renamed(op_id: str) -> str:
        stage, _, rest = op_id.rpartition(":")
        return f"{stage}:{VIA_TAG}{rest}"

    ops1 = tuple(dataclasses.replace(op, id=renamed(op.id)) for op in first.ops)
    edges = [Edge(renamed(e.src), renamed(e.dst), e.reason) for e in first.edges]
    on_device: dict[int, list[str]] = defaultdict(list)
    for op in ops1:
        for x in op.participants:
            on_device[x].append(op.id)
    for op in second.ops:
        for src in sorted({o for x in op.participants for o in on_device.get(x, ())}):
            edges.append(Edge(src, op.id, EdgeReason.STATE))
    edges += second.edges
    return TransitionDag(current=first.current, target=second.target, ops=ops1 + tuple(second.ops),
                         edges=tuple(edges), staging_bytes=first.staging_bytes)
