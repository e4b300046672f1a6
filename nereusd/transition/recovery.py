"""What survives a transition that stopped part-way: intact holdings and complete units (paper §6.2).

Pure. :func:`intact_holdings` applies the completed ops of a DAG to the current plan's holdings
and drops those on dead devices; :func:`intact_units` says which complete units they form and
which model-stages have none left. The DAG never destroys a last copy (validated by
:func:`nereusd.transition.validate.validate`), so unless every holder of some part died, every
model-stage keeps a unit ("a transition that stops partway loses no logical state unless the
last copy is lost").
"""

from __future__ import annotations

from collections import defaultdict
from typing import Iterable

from nereusd.plan import Candidate, Layout, ModelStage, Plan
from nereusd.transition.dag import Holding, topological_order
from nereusd.transition.ops import TransitionDag
from nereusd.transition.validate import op_effects, plan_holdings


def intact_holdings(dag: TransitionDag, completed: Iterable[str], dead: Iterable[int]) -> set[Holding]:
    """Holdings that certainly exist after ``completed`` ops, with ``dead`` devices gone.

    Completed ops are applied to the current plan's holdings in topological order. Ops that
    started but did not complete are not applied: their new holdings are not counted, and
    their sources still count — the executor frees a source only after its replacement is
    whole, so a source is gone only if its op completed (then it is applied). Holdings on dead
    devices are dropped.
    """
    done = set(completed)
    dead = set(dead)
    held = set(plan_holdings(dag.current))
    for op_id in topological_order(dag):
        if op_id not in done:
            continue
        _, consumed, created = op_effects(dag.op(op_id))
        held.difference_update(consumed)
        held.update(created)
    return {h for h in held if h[1] not in dead}


def intact_units(holdings: Iterable[Holding]) -> tuple[Plan, tuple[ModelStage, ...]]:
    """Complete units in ``holdings``: per model-stage, the layout with the most complete units,
    as a candidate whose DP replicas are those units (one device per position and unit).

    Returns:
        ``(units, lost)``: the plan of complete units, and the model-stages (canonical order)
        none of whose layouts has every position held — their state is not recoverable from
        memory, only from the last checkpoint.
    """
    by_ms: dict[ModelStage, dict[Layout, dict[tuple[int, int], list[int]]]] = defaultdict(
        lambda: defaultdict(lambda: defaultdict(list)))
    for ms, device, layout, pos in holdings:
        by_ms[ms][layout][pos].append(device)
    out: dict[ModelStage, Candidate] = {}
    lost: list[ModelStage] = []
    for ms, layouts in by_ms.items():
        best = None
        for layout, positions in layouts.items():
            grid = [(p, t) for p in range(layout.pp) for t in range(layout.tp)]
            used: set[int] = set()
            units = []
            while True:
                unit = []
                for pos in grid:
                    free = [d for d in sorted(positions.get(pos, [])) if d not in used and d not in unit]
                    if not free:
                        break
                    unit.append(free[0])
                if len(unit) < len(grid):
                    break
                used.update(unit)
                units.append(unit)
            if units and (best is None or len(units) > len(best[1])):
                best = (layout, units)
        if best is None:
            lost.append(ms)
            continue
        layout, units = best
        out[ms] = Candidate(layout.tp, layout.pp, len(units), tuple(d for u in units for d in u))
    return Plan(out), tuple(sorted(lost, key=ModelStage.sort_key))
