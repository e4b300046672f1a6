"""The transition-DAG validator (paper §6.1–§6.2: acyclic, never the last copy lost).

Validation (:func:`validate`) checks, for every linearisation of the DAG at once:

* acyclicity and well-formed ops;
* holdings: every holding an op reads or frees exists (its creator is an ancestor, every reader
  precedes its consumer), none is created twice, and the final holdings are exactly the
  target plan's — every target unit is produced and nothing else is left;
* the last copy: no *ideal* of the DAG (set of completed ops closed under predecessors) leaves
  some part of a model-stage's state on no device. Parts are the atoms of the grid
  ``(lcm(pp, pp*), lcm(tp, tp*))``; for one atom, an ideal losing it chooses, for every holding
  containing it, "its consumer completed" or "its creator not completed", with the conflict
  "creator ≤ consumer"; that is a 2-SAT instance, solved exactly. Only Destroys with ``discard``
  (model-stages the target plan drops) may drop a last copy.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Sequence

from nereusd.errors import PlanError
from nereusd.plan import Layout, ModelStage, Plan
from nereusd.shards import Position
from nereusd.transition.dag import Holding, closure, topological_order
from nereusd.transition.ops import Op, OpKind, TransitionDag


def plan_holdings(plan: Plan) -> set[Holding]:
    """The holdings of every device in ``plan``."""
    out = set()
    for m, cand in plan.items():
        for x in cand.devices:
            _, p, t = cand.coords_of(x)
            out.add((m, x, cand.layout, (p, t)))
    return out


def op_effects(op: Op) -> tuple[list[Holding], list[Holding], list[Holding]]:
    """``(read, consumed, created)`` holdings of ``op`` (see :mod:`nereusd.transition.ops`)."""
    m, src, dst = op.model_stage, op.source_layout, op.target_layout
    sources = [(m, x, src, p) for x, p in zip(op.source_devices, op.source_positions)]
    targets = [(m, x, dst, p) for x, p in zip(op.target_devices, op.target_positions)]
    if op.kind is OpKind.SPLIT:
        receivers = set(op.target_devices)
        read = [h for h in sources if h[1] not in receivers]
        return read, [h for h in sources if h[1] in receivers], targets
    if op.kind is OpKind.EXTEND:
        return sources, [], targets
    if op.kind is OpKind.DESTROY:
        return [], sources, []
    if op.kind is OpKind.MERGE:
        return [], sources, targets
    return [], [], targets


def _check_shape(op: Op, target: Plan) -> None:
    def bad(why: str) -> PlanError:
        return PlanError(f"op {op.id} ({op.kind}): {why}")

    has_src, has_dst = op.source_layout is not None, op.target_layout is not None
    need = {OpKind.SPLIT: (True, True), OpKind.EXTEND: (True, True), OpKind.MERGE: (True, True),
            OpKind.DESTROY: (True, False), OpKind.CREATE: (False, True)}[op.kind]
    if (has_src, has_dst) != need:
        raise bad(f"expected source/target layouts {need}, got {(has_src, has_dst)}")
    for lay, positions in ((op.source_layout, op.source_positions), (op.target_layout, op.target_positions)):
        for p, t in positions:
            if lay is not None and not (0 <= p < lay.pp and 0 <= t < lay.tp):
                raise bad(f"position {(p, t)} outside tp{lay.tp}·pp{lay.pp}")
    if op.kind is OpKind.EXTEND and (op.source_layout, op.source_positions) != (op.target_layout,
                                                                              op.target_positions):
        raise bad("Extend pairs must have the same layout and positions on both sides")
    if op.kind is OpKind.MERGE and op.source_devices != op.target_devices:
        raise bad("Merge keeps its devices")
    if op.kind is OpKind.SPLIT and not set(op.target_devices) <= set(op.source_devices):
        raise bad("Split receivers must be devices of the split unit")
    if op.discard and (op.kind is not OpKind.DESTROY or op.model_stage in target):
        raise bad(f"discard is only for a Destroy of a model-stage the target plan drops "
                  f"({op.model_stage} stays)")


def validate(dag: TransitionDag) -> None:
    """Check a transition DAG (module docstring): acyclic, well-formed, race-free holdings,
    exactly the target holdings at the end, and never the last copy of a model-stage's state lost.

    Raises:
        PlanError: describing the first problem found (op ids, devices, positions).
    """
    desc = closure(dag)

    def before(a: int, b: int) -> bool:
        return bool(desc[a] >> b & 1)

    for op in dag.ops:
        _check_shape(op, dag.target)
    held = plan_holdings(dag.current)
    creator: dict[Holding, int | None] = {h: None for h in sorted(held, key=_holding_key)}
    consumer: dict[Holding, int] = {}
    readers: dict[Holding, list[int]] = defaultdict(list)
    for op_id in topological_order(dag):
        i = dag.index_of(op_id)
        read, consumed, created = op_effects(dag.ops[i])
        for h in read + consumed:
            if h not in held:
                raise PlanError(f"op {op_id}: device {h[1]} does not hold {h[0]} at {_where(h)}")
        for h in read:
            readers[h].append(i)
        for h in consumed:
            held.discard(h)
            consumer[h] = i
        for h in created:
            if h in creator:
                raise PlanError(f"op {op_id}: {h[0]} at {_where(h)} on device {h[1]} is created twice")
            creator[h] = i
            held.add(h)
    for h, c in creator.items():
        users = readers[h] + ([consumer[h]] if h in consumer else [])
        for u in users:
            if c is not None and not before(c, u):
                raise PlanError(f"op {dag.ops[u].id} may run before {dag.ops[c].id} creates {h[0]} "
                                f"on device {h[1]}")
        if h in consumer:
            for r in readers[h]:
                if r != consumer[h] and not before(r, consumer[h]):
                    raise PlanError(f"op {dag.ops[consumer[h]].id} may free device {h[1]}'s {h[0]} "
                                    f"before {dag.ops[r].id} reads it")
    want = plan_holdings(dag.target)
    if held != want:
        extra = sorted((str(h[0]), h[1]) for h in held - want)
        lacking = sorted((str(h[0]), h[1]) for h in want - held)
        raise PlanError(f"transition ends with extra holdings {extra} and lacks {lacking}")
    for m in dag.current:
        if m in dag.target:
            _check_last_copy(dag, m, creator, consumer, before)


def _holding_key(h: Holding) -> tuple:
    return (h[0].sort_key(), h[1], h[2].tp, h[2].pp, h[3])


def _where(h: Holding) -> str:
    return f"tp{h[2].tp}·pp{h[2].pp} {h[3]}"


def _atoms(layout: Layout, position: Position, grid: tuple[int, int]) -> frozenset[Position]:
    gp, gt = grid
    fp, ft = gp // layout.pp, gt // layout.tp
    p, t = position
    return frozenset((a, b) for a in range(p * fp, (p + 1) * fp) for b in range(t * ft, (t + 1) * ft))


def _check_last_copy(dag: TransitionDag, m: ModelStage, creator, consumer, before) -> None:
    cur, tgt = dag.current[m], dag.target[m]
    grid = (math.lcm(cur.pp, tgt.pp), math.lcm(cur.tp, tgt.tp))
    holdings = [(h, c, consumer.get(h)) for h, c in creator.items() if h[0] == m]
    contents = [_atoms(h[2], h[3], grid) for h, _, _ in holdings]
    seen: set[frozenset[int]] = set()
    for a in range(grid[0]):
        for b in range(grid[1]):
            sig = frozenset(i for i, atoms in enumerate(contents) if (a, b) in atoms)
            if sig in seen:
                continue
            seen.add(sig)
            members = [holdings[i] for i in sorted(sig)]
            if any(c is None and r is None for _, c, r in members):
                continue
            choice = _losing_ideal(members, before)
            if choice is not None:
                done = sorted({dag.ops[r].id for (h, c, r), x in zip(members, choice) if x})
                raise PlanError(
                    f"{m}: part {(a, b)} of grid pp{grid[0]}·tp{grid[1]} is on no device once {done} "
                    f"have completed (a Destroy or Merge drops its last copy)")


def _losing_ideal(members, before) -> list[bool] | None:
    """2-SAT: ``x_h`` true = consumer of ``h`` completed, false = creator not completed."""
    n = len(members)
    clauses: list[tuple[int, int]] = []  # literal 2v = x_v, 2v+1 = ¬x_v
    for v, (_, c, r) in enumerate(members):
        if r is None:
            clauses.append((2 * v + 1, 2 * v + 1))
        if c is None:
            clauses.append((2 * v, 2 * v))
    for h, (_, _, r) in enumerate(members):
        if r is None:
            continue
        for g, (_, c, _) in enumerate(members):
            if c is not None and (c == r or before(c, r)):
                clauses.append((2 * h + 1, 2 * g))
    return two_sat(n, clauses)


def two_sat(n: int, clauses: Sequence[tuple[int, int]]) -> list[bool] | None:
    """Solve 2-SAT over ``n`` variables; literal ``2v`` is ``x_v``, ``2v+1`` is ``¬x_v``.

    Returns:
        A satisfying assignment, or ``None`` when there is none (Aspvall, Plass & Tarjan 1979).
    """
    graph: list[list[int]] = [[] for _ in range(2 * n)]
    for a, b in clauses:
        graph[a ^ 1].append(b)
        graph[b ^ 1].append(a)
    comp = _scc(graph)
    if any(comp[2 * v] == comp[2 * v + 1] for v in range(n)):
        return None
    # Tarjan numbers components in reverse topological order: pick the literal found first.
    return [comp[2 * v] < comp[2 * v + 1] for v in range(n)]


def _scc(graph: list[list[int]]) -> list[int]:
    """Iterative Tarjan; components numbered in reverse topological order."""
    n = len(graph)
    index = [-1] * n
    low = [0] * n
    comp = [-1] * n
    on_stack = [False] * n
    stack: list[int] = []
    counter = ncomp = 0
    for root in range(n):
        if index[root] != -1:
            continue
        work = [(root, 0)]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack[root] = True
        while work:
            v, i = work[-1]
            if i < len(graph[v]):
                work[-1] = (v, i + 1)
                w = graph[v][i]
                if index[w] == -1:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack[w] = True
                    work.append((w, 0))
                elif on_stack[w]:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                while True:
                    w = stack.pop()
                    on_stack[w] = False
                    comp[w] = ncomp
                    if w == v:
                        break
                ncomp += 1
    return comp
