"""Controller side of a transition: dispatch the DAG to workers, collect progress, survive a death.

:class:`TransitionRunner` drives the worker task kinds of :mod:`emu.worker.transition_tasks` through a
:class:`nereusd.daemon.control_plane.ControlPlane`:

1. ``transition_prepare`` on every worker of the world (communicators, set-up time);
2. the ready set — ops whose predecessors all completed — goes out as one ``transition_run``
   task to the devices of those ops; as each task completes its ops are done and the next ready
   set goes out at once, while earlier tasks may still run elsewhere. Every worker receives its
   tasks in submission order, so the ops two workers share are run by both in the same order;
3. ``transition_finish`` on every worker.

Progress (completed ops) and per-op timings are kept in :class:`TransitionProgress`. When a
worker dies (``WorkerError``), :func:`intact_holdings` says which holdings still exist — those of
the current plan changed by the completed ops only, minus everything on dead devices and
anything an unfinished op may have consumed — and :func:`intact_units` which complete units
they form, the ``current`` plan from which the controller replans (paper §6.2: "a transition
that stops partway loses no logical state unless the last copy is lost, and Nereus replans
from the intact units"). The DAG never destroys a last copy (validated by
:func:`nereusd.transition.validate.validate`), so unless every holder of some part died,
:func:`intact_units` finds a unit of every model-stage.

Pure functions here take no sockets; :class:`TransitionRunner` is the thin shell.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from nereusd.errors import NereusError, WorkerError
from nereusd.plan import Candidate, Layout, ModelStage, Plan
from nereusd.transition.dag import Holding, topological_order
from nereusd.transition.ops import TransitionDag
from nereusd.transition.validate import op_effects, plan_holdings

log = logging.getLogger(__name__)


class TransitionInterrupted(NereusError):
    """A worker died during a transition; carries what survived.

    Attributes:
        progress: the :class:`TransitionProgress` at the failure.
        intact: the holdings that still exist (:func:`intact_holdings`).
        units: the complete units they form (:func:`intact_units`), a plan to replan from.
    """

    def __init__(self, message: str, progress: "TransitionProgress", intact: set[Holding], units: Plan) -> None:
        super().__init__(message)
        self.progress, self.intact, self.units = progress, intact, units


@dataclass
class TransitionProgress:
    """What has run: completed op ids, per-op timings (seconds), set-up time."""

    completed: set[str] = field(default_factory=set)
    timings: dict[str, dict[str, Any]] = field(default_factory=dict)
    setup_s: float = 0.0
    elapsed_s: float = 0.0

    def record(self, results: Mapping[int, Any]) -> None:
        """Merge the ``timings`` of one ``transition_run`` task's results (per device)."""
        for res in results.values():
            for t in res.result.get("timings", []):
                cur = self.timings.setdefault(t["op_id"], {"kind": t["kind"], "start_s": t["start_s"],
                                                           "end_s": t["end_s"]})
                cur["start_s"] = min(cur["start_s"], t["start_s"])
                cur["end_s"] = max(cur["end_s"], t["end_s"])
                cur["duration_s"] = cur["end_s"] - cur["start_s"]


def ready_ops(dag: TransitionDag, completed: set[str], started: set[str]) -> list[str]:
    """Ops not started whose predecessors all completed, in the DAG's deterministic order."""
    return [x for x in topological_order(dag)
            if x not in started and all(p in completed for p in dag.predecessors(x))]


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


def holdings_from_reports(reports: Mapping[int, list[list[Any]]]) -> set[Holding]:
    """Holdings reported by workers' ``holdings`` task: ``{device: [[ms, tp, pp, p, t], …]}``."""
    out = set()
    for device, rows in reports.items():
        for ms, tp, pp, p, t in rows:
            out.add((ModelStage.parse(ms), int(device), Layout(int(tp), int(pp)), (int(p), int(t))))
    return out


def intact_units(holdings: Iterable[Holding]) -> Plan:
    """Complete units in ``holdings``: per model-stage, the layout with the most complete units,
    as a candidate whose DP replicas are those units (one device per position and unit).

    Raises:
        NereusError: naming a model-stage none of whose layouts has every position held (its
            state is not recoverable from memory: restart from the last checkpoint).
    """
    by_ms: dict[ModelStage, dict[Layout, dict[tuple[int, int], list[int]]]] = defaultdict(
        lambda: defaultdict(lambda: defaultdict(list)))
    for ms, device, layout, pos in holdings:
        by_ms[ms][layout][pos].append(device)
    out: dict[ModelStage, Candidate] = {}
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
            raise NereusError(f"{ms}: no complete unit survived; restart from the last checkpoint")
        layout, units = best
        out[ms] = Candidate(layout.tp, layout.pp, len(units), tuple(d for u in units for d in u))
    return Plan(out)


class TransitionRunner:
    """Runs one DAG on the workers behind ``control`` (module docstring).

    Args:
        control: the :class:`nereusd.daemon.control_plane.ControlPlane`.
        world: every device of the current world generation (all take part in set-up).
        timeout_s: per task.
    """

    def __init__(self, control, world: Iterable[int], timeout_s: float = 600.0) -> None:
        self.control, self.world, self.timeout_s = control, sorted(world), timeout_s

    def run(self, dag: TransitionDag) -> TransitionProgress:
        """Execute ``dag``; returns the progress with every op completed.

        Raises:
            TransitionInterrupted: if a worker died or failed mid-transition (with the intact
                holdings and units to replan from).
        """
        progress = TransitionProgress()
        start = time.perf_counter()
        started: set[str] = set()
        pending: dict[int, list[str]] = {}
        try:
            res = self.control.run("transition_prepare", {d: {"dag": dag.to_json()} for d in self.world},
                                   self.timeout_s)
            progress.setup_s = max((r.result.get("setup_s", 0.0) for r in res.values()), default=0.0)
            while len(progress.completed) < len(dag.ops):
                ready = ready_ops(dag, progress.completed, started)
                if ready:
                    args: dict[int, dict[str, Any]] = defaultdict(lambda: {"ops": []})
                    for op_id in ready:
                        for d in _op_devices(dag, op_id):
                            args[d]["ops"].append(op_id)
                    task = self.control.submit("transition_run", dict(args))
                    pending[task] = ready
                    started.update(ready)
                for task in [t for t in pending if self.control.done(t)]:
                    progress.record(self.control.collect(task, self.timeout_s))
                    progress.completed.update(pending.pop(task))
                if pending and not ready:
                    self.control.poll(0.005)
                    for task in pending:  # raises WorkerError when a worker of a task died
                        self.control._raise_if_lost(self.control._pending[task].devices)
            self.control.run("transition_finish", {d: {} for d in self.world}, self.timeout_s)
        except WorkerError as err:
            dead = {d for d in self.world if d in self.control.exited_workers}
            intact = intact_holdings(dag, progress.completed, dead)
            units = intact_units(intact)
            log.error("transition interrupted after %d of %d ops (dead devices %s): %s; intact units %s",
                      len(progress.completed), len(dag.ops), sorted(dead), err, units.describe())
            raise TransitionInterrupted(f"transition interrupted: {err}", progress, intact, units) from err
        progress.elapsed_s = time.perf_counter() - start
        log.info("transition done: %d ops in %.3f s (set-up %.3f s)", len(dag.ops), progress.elapsed_s,
                 progress.setup_s)
        return progress


def _op_devices(dag: TransitionDag, op_id: str) -> set[int]:
    op = dag.op(op_id)
    return set(op.devices) | {x for r in op.routes for x in (r.src, r.dst)}
