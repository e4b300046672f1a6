"""Controller side of a transition: dispatch the DAG to workers, collect progress, survive a death.

:class:`TransitionRunner` drives the worker task kinds of :mod:`emu.worker.transition_tasks` through a
:class:`nereusd.daemon.control_plane.ControlPlane`:

1. ``transition_prepare`` on every worker of the world (communicators, set-up time), carrying
   each device's part of the first ready set — the ops with no predecessor — which it runs once
   its communicators exist (one round trip of every worker less than a ``transition_run`` of
   its own: ``scripts/bench_control.py``);
2. each later ready set — ops whose predecessors all completed — goes out as one
   ``transition_run`` task to the devices of those ops; as each task completes its ops are done
   and the next ready set goes out at once, while earlier tasks may still run elsewhere. Every
   worker receives its tasks in submission order, so the ops two workers share are run by both
   in the same order;
3. ``transition_finish`` on every worker.

Progress (completed ops) and per-op timings are kept in :class:`TransitionProgress`. When a
worker dies or fails (``WorkerError``), the runner raises :class:`TransitionInterrupted` with
what survived (:mod:`nereusd.transition.recovery`: the intact holdings and the complete units
they form, and the model-stages whose last copy is gone). It is a ``WorkerError``, so the
driver's recovery takes it like any failed task: today that is a checkpoint/restart of the
survivors (:meth:`nereusd.daemon.live.LiveAdaptation.recover`); replanning from the intact
units in memory (paper §6.2) is not implemented yet.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from nereusd import protocol as P
from nereusd.errors import WorkerError
from nereusd.plan import ModelStage, Plan
from nereusd.transition import repartitioned_by
from nereusd.transition.comms import communicator_plan
from nereusd.transition.dag import Holding, topological_order
from nereusd.transition.ops import TransitionDag
from nereusd.transition.recovery import intact_holdings, intact_units

log = logging.getLogger(__name__)


class TransitionInterrupted(WorkerError):
    """A worker died or failed during a transition; carries what survived.

    A :class:`~nereusd.errors.WorkerError`, so that whoever recovers from a failed task
    (:meth:`nereusd.rl.driver.RLDriver.run`) recovers from this one too: with every holder of
    some part of a model-stage dead, the state is not recoverable from memory, and the job
    restarts from its latest checkpoint instead of failing.

    Attributes:
        progress: the :class:`TransitionProgress` at the failure.
        intact: the holdings that still exist (:func:`intact_holdings`).
        units: the complete units they form (:func:`intact_units`), a plan to replan from;
            model-stages with no complete unit are missing from it.
        lost: the model-stages of which no complete unit survived (their last copy is gone).
    """

    def __init__(self, message: str, progress: "TransitionProgress | None", intact: set[Holding], units: Plan,
                 lost: tuple[ModelStage, ...] = (), error_kind: str | None = None) -> None:
        super().__init__(message, error_kind=error_kind)
        self.progress, self.intact, self.units, self.lost = progress, intact, units, tuple(lost)


@dataclass
class TransitionProgress:
    """What has run: completed op ids, per-op timings (seconds), set-up time, the slowest
    vLLM engine start-up of ``transition_finish`` (0 when no engine started), and where the
    time went (``phases_s``, seconds): the wall time of the three steps seen from nereusd
    (``prepare``, ``ops``, ``finish``) and, slowest rank each, the workers' engine detach
    (a ZeRO export included), communicator set-up, engine rebuild, ZeRO re-partition,
    weight-sync communicator set-up, garbage collection, vLLM engine start-up and weight reload
    (``detach``, ``setup``, ``rebuild``, ``repartition``, ``sync_setup``, ``collect``,
    ``engine_start``, ``engine_load``)."""

    completed: set[str] = field(default_factory=set)
    timings: dict[str, dict[str, Any]] = field(default_factory=dict)
    setup_s: float = 0.0
    elapsed_s: float = 0.0
    engine_start_s: float = 0.0
    phases_s: dict[str, float] = field(default_factory=dict)
    rebuild_s: dict[ModelStage, float] = field(default_factory=dict)
    """Per model-stage re-attached by ``transition_finish``: its slowest rank's seconds."""

    def dag_terms_s(self) -> float:
        """Seconds spent in what the DAG's own price (``L̂_tran`` before the learned terms,
        :func:`nereusd.transition.assess_transition`) covers: the engines' detach (a ZeRO export
        included), ZeRO re-partitions, the DAG's communicator set-up and its ops (first start
        to last end over all workers, at most the ``prepare`` plus ``ops`` phases that nereusd
        timed on its own clock: workers' clocks on other nodes may be skewed)."""
        ops = (max(t["end_s"] for t in self.timings.values()) - min(t["start_s"] for t in self.timings.values())
               if self.timings else 0.0)
        if "prepare" in self.phases_s:
            ops = min(ops, self.phases_s["prepare"] + self.phases_s.get("ops", 0.0))
        return (self.phases_s.get("detach", 0.0) + self.phases_s.get("setup", 0.0) + max(0.0, ops)
                + self.phases_s.get("repartition", 0.0))

    def terms_s(self) -> float:
        """Seconds spent in what ``L̂_tran`` prices by terms of its own
        (:meth:`nereusd.control.controller.Controller.transition_measured`): the DAG's
        (:meth:`dag_terms_s`), the engine re-attachments, the weight-sync communicators' set-up
        and vLLM start-ups."""
        return (self.dag_terms_s() + self.phases_s.get("rebuild", 0.0)
                + self.phases_s.get("sync_setup", 0.0) + self.phases_s.get("engine_start", 0.0))

    def slowest(self, results: Mapping[int, Any], *fields: str) -> None:
        """Keep, per field, the largest value any worker's result reports in ``phases_s``."""
        for name in fields:
            key = name.removesuffix("_s")
            self.phases_s[key] = max((float(r.result.get(name, 0.0)) for r in results.values()), default=0.0)

    def record(self, results: Mapping[int, Any]) -> None:
        """Merge the ``timings`` of one ``transition_run`` task's results (per device)."""
        for res in results.values():
            for t in res.result.get("timings", []):
                cur = self.timings.setdefault(t["op_id"], {"kind": t["kind"], "start_s": t["start_s"],
                                                           "end_s": t["end_s"]})
                cur["start_s"] = min(cur["start_s"], t["start_s"])
                cur["end_s"] = max(cur["end_s"], t["end_s"])
                cur["duration_s"] = cur["end_s"] - cur["start_s"]


def slowest_by_stage(results: Mapping[int, Any]) -> dict[ModelStage, float]:
    """Per model-stage, the largest of the workers' ``rebuild_s_by_stage`` (``{model_stage:
    seconds}``, reported by ``build`` and ``transition_finish``)."""
    out: dict[ModelStage, float] = {}
    for res in results.values():
        for ms, seconds in (res.result.get("rebuild_s_by_stage") or {}).items():
            key = ModelStage.parse(ms)
            out[key] = max(out.get(key, 0.0), float(seconds))
    return out


def ready_ops(dag: TransitionDag, completed: set[str], started: set[str]) -> list[str]:
    """Ops not started whose predecessors all completed, in the DAG's deterministic order."""
    return [x for x in topological_order(dag)
            if x not in started and all(p in completed for p in dag.predecessors(x))]


class TransitionRunner:
    """Runs one DAG on the workers behind ``control`` (module docstring).

    Args:
        control: the :class:`nereusd.daemon.control_plane.ControlPlane`.
        world: every device of the current world generation (all take part in set-up).
        timeout_s: per task.
    """

    def __init__(self, control, world: Iterable[int], timeout_s: float = 600.0) -> None:
        self.control, self.world, self.timeout_s = control, sorted(world), timeout_s

    def run(self, dag: TransitionDag, syncs: list[P.SyncDag] | None = None) -> TransitionProgress:
        """Execute ``dag``; returns the progress with every op completed. ``syncs``: the target
        plan's weight-sync DAGs (:func:`nereusd.transition.sync_dag_args`), handed to the
        workers with ``transition_finish``.

        Raises:
            TransitionInterrupted: if a worker died or failed mid-transition (with the intact
                holdings and units to replan from).
        """
        progress = TransitionProgress()
        start = time.perf_counter()
        try:
            self.run_ops(dag, progress)
            finished = time.perf_counter()
            finish = P.TransitionFinishArgs(syncs=syncs or [])
            res = self.control.run({d: finish for d in self.world}, self.timeout_s)
            progress.phases_s["ops"] = finished - start - progress.phases_s.get("prepare", 0.0)
            progress.phases_s["finish"] = time.perf_counter() - finished
            progress.slowest(res, "rebuild_s", "repartition_s", "sync_setup_s", "collect_s", "engine_start_s",
                             "engine_load_s")
            progress.engine_start_s = progress.phases_s["engine_start"]
            progress.rebuild_s = slowest_by_stage(res)
        except WorkerError as err:
            dead = {d for d in self.world if d in self.control.exited_workers}
            intact = intact_holdings(dag, progress.completed, dead)
            units, lost = intact_units(intact)
            # a ZeRO model-stage being re-partitioned held each optimizer partition once, on its
            # old replica: one of them dead, that state is gone (emu.engine.zero_repartition)
            gone = {ms for ms in repartitioned_by(dag.current, dag.target) if dead & set(dag.current[ms].devices)}
            units = Plan({ms: cand for ms, cand in units.items() if ms not in gone})
            # a model-stage of the current plan with no holding left at all is lost as well
            lost = tuple(sorted((set(dag.current) | set(lost)) - set(units), key=ModelStage.sort_key))
            what = f"; no complete unit of {[str(m) for m in lost]} survived (restart from the last " \
                   "checkpoint)" if lost else ""
            log.error("transition interrupted after %d of %d ops (dead devices %s): %s; intact units %s%s",
                      len(progress.completed), len(dag.ops), sorted(dead), err, units.describe(), what)
            raise TransitionInterrupted(f"transition interrupted{what}: {err}", progress, intact, units,
                                        lost, error_kind=err.error_kind) from err
        progress.elapsed_s = time.perf_counter() - start
        log.info("transition done: %d ops in %.3f s (set-up %.3f s)", len(dag.ops), progress.elapsed_s,
                 progress.setup_s)
        return progress

    def run_ops(self, dag: TransitionDag, progress: TransitionProgress,
                prepared: tuple[dict[int, P.TransitionPrepareArgs], dict[str, Any]] | None = None) -> None:
        """Steps 1 and 2 of the module docstring: every op of ``dag`` run, ``progress`` kept.
        ``prepared``: :func:`prepare_task` for ``dag``, this runner's world and
        :func:`first_ops` of ``dag``, when built already.

        Raises:
            WorkerError: a worker died or failed (:meth:`run` makes it a
                :class:`TransitionInterrupted`).
        """
        ready = ready_ops(dag, set(), set())
        args, shared = prepared or prepare_task(dag, self.world, _by_device(dag, ready))
        start = time.perf_counter()
        res = self.control.run(args, self.timeout_s, shared=shared)
        progress.phases_s["prepare"] = time.perf_counter() - start
        progress.slowest(res, "setup_s", "detach_s")
        progress.setup_s = progress.phases_s["setup"]
        progress.record(res)
        progress.completed.update(ready)
        started, pending = set(ready), {}
        while len(progress.completed) < len(dag.ops):
            ready = ready_ops(dag, progress.completed, started)
            if ready:
                task = self.control.submit({d: P.TransitionRunArgs(ops=o) for d, o in _by_device(dag, ready).items()})
                pending[task] = ready
                started.update(ready)
            for task in [t for t in pending if self.control.done(t)]:
                progress.record(self.control.collect(task, self.timeout_s))
                progress.completed.update(pending.pop(task))
            if pending and not ready:
                self.control.poll(0.005)
                for task in pending:  # raises WorkerError when a worker of a task died
                    self.control.raise_if_lost(task)


def first_ops(dag: TransitionDag) -> dict[int, list[str]]:
    """Each device's part of ``dag``'s first ready set (what ``transition_prepare`` runs)."""
    return _by_device(dag, ready_ops(dag, set(), set()))


def _by_device(dag: TransitionDag, op_ids: list[str]) -> dict[int, list[str]]:
    """``op_ids`` (in their order) split by participant: what each device runs of them."""
    ops: dict[int, list[str]] = defaultdict(list)
    for op_id in op_ids:
        for d in dag.op(op_id).participants:
            ops[d].append(op_id)
    return ops


def prepare_task(dag: TransitionDag, world: Iterable[int], first_ops: Mapping[int, list[str]] | None = None
                 ) -> tuple[dict[int, P.TransitionPrepareArgs], dict[str, Any]]:
    """``transition_prepare`` per device of ``world`` — its slice of ``dag`` without the plans, and
    its ops of ``first_ops`` (the first ready set by device) — and the fields every device shares
    (``TaskDispatch.submit``'s ``shared``, sent once per agent): the whole DAG's communicator
    plan, the plans, the changed model-stages.

    Why: the whole DAG to every worker grew as devices × ops (11 MiB per worker at 8,192
    devices for the tiniest model; 92 MB, over the frame limit, for Llama-3.1-8B at tp 8); then
    the slices with their plans and the communicator plan to every worker were 1.8 GiB and
    84 s to build at 8,192 devices (``scripts/bench_control.py``).
    """
    shared = {"communicators": [[op_id, list(devices)] for op_id, devices in communicator_plan(dag)],
              "plans": dag.plans_json(), "changed": sorted({str(op.model_stage) for op in dag.ops})}
    op_json: dict[str, str] = {}   # an op is in each of its participants' slices: encoded once
    first_ops = first_ops or {}
    return {d: P.TransitionPrepareArgs(dag=part.to_json(plans=False, op_cache=op_json), ops=first_ops.get(d, []))
            for d, part in dag.slices(world).items()}, shared


def prepare_args(dag: TransitionDag, world: Iterable[int]) -> dict[int, P.TransitionPrepareArgs]:
    """What each worker of ``world`` receives for :func:`prepare_task`: its args with the shared
    fields set (as its agent sets them)."""
    args, shared = prepare_task(dag, world)
    return {d: P.with_shared(P.Task(task_id=0, args=a), shared).args for d, a in args.items()}
