"""What the controller learns about transitions beyond the DAG's byte-and-link model (paper §4.2,
``L̂_tran``; DESIGN.md "Cost model"): a vLLM engine's start-up, each model-stage's re-attachment
at ``transition_finish``, the weight-sync communicators it creates, and the fixed cost of a transition — each learned from its own
measurement (:func:`~nereusd.control.monitor.ema`, weight 0.5; the first measurement taken as is)
and added to the ``L̂_tran`` of every target that incurs it
(:meth:`TransitionCostLearning.extra_l_tran_s`).

:class:`TransitionCostLearning` is a part of :class:`nereusd.control.controller.Controller`
(its attributes are the controller's, kept in its ``state()``), in a module of its own so that
the controller's decision logic stays readable.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Mapping

from nereusd.backends import restarts_vllm_engines
from nereusd.control.monitor import ema
from nereusd.plan import ModelStage, Plan
from nereusd.transition import rebuilt_model_stages
from nereusd.transition.ops import TransitionDag


class TransitionCostLearning:
    """The learned terms of ``L̂_tran`` (module docstring); call :meth:`_init_transition_costs`
    from ``__init__``."""

    def _init_transition_costs(self) -> None:
        self.transition_overhead_s = 0.0
        self._transitions_seen = 0
        self.engine_start_s = 0.0
        """Seconds a vLLM engine takes to start (the slowest rank's; EMA of measurements, 0 before one)."""
        self._engine_starts_seen = 0
        self.rebuild_s: dict[ModelStage, float] = {}
        """Seconds ``transition_finish`` takes to re-attach each model-stage (its communicators and
        engine, the slowest rank's; measured by the build, then EMA over transitions)."""
        self.sync_group_s = 0.0
        """Seconds per process group ``transition_finish`` creates for the weight-sync communicators
        (the slowest rank's set-up over the groups created; EMA, 0 before a measurement)."""
        self._sync_groups_seen = 0
        self.restart_s = 0.0
        """Seconds a checkpoint/restart takes (stop, relaunch, checkpoint read; EMA of measured
        ones, weight 0.5; 0 before one): the price of reaching a plan whose transition does not
        fit memory (:func:`nereusd.control.admission.admit`)."""
        self._restarts_seen = 0
        self.warm_engines: dict[ModelStage, dict[int, tuple]] = {}
        """vLLM engines a background join started on devices before they joined
        (``{model_stage: {device: replica key}}``, set by the shell; cleared at the next switch):
        a target that places those replicas there starts no engine for them."""

    # ---- learning ----------------------------------------------------------------------------
    def transition_measured(self, predicted_s: float, measured_s: float, terms_s: float | None = None) -> None:
        """Learn the fixed cost of a transition (EMA, weight 0.5; the first measurement is taken as
        is; before one, the build's, :meth:`engines_built`): what ``L̂_tran`` prices by no term of
        its own — control-plane round trips, task handling, the garbage collection.

        ``terms_s``: seconds of the measured transition spent in what has a term of its own (the
        engines' detach with any ZeRO export or re-partition, the DAG's communicator set-up and
        ops, engine re-attachments, weight-sync communicator set-up and vLLM start-ups,
        :meth:`engines_rebuilt`, :meth:`sync_groups_set_up`, :meth:`engine_started`;
        :meth:`nereusd.transition.runner.TransitionProgress.terms_s`); the fixed cost is then
        ``measured_s − terms_s``. Without it (the simulator), ``measured − predicted`` plus the
        fixed cost predicted, so that the error of every other term lands in the fixed cost (a
        DAG predicted at 0.04 s that took 0.2 s made the next transition, 0.05 s, predicted at
        0.26 s in the demo)."""
        if not math.isfinite(measured_s):
            return
        if terms_s is not None:
            extra = max(0.0, measured_s - terms_s)
        else:
            extra = max(0.0, measured_s - (predicted_s - self.transition_overhead_s))
        self.transition_overhead_s = ema(self.transition_overhead_s, extra, self._transitions_seen)
        self._transitions_seen += 1

    def engines_built(self, rebuild_s: Mapping[ModelStage, float], finish_overhead_s: float,
                      sync_setup_s: float = 0.0, sync_groups: int = 0) -> None:
        """What a build measured that a transition repeats: each model-stage's re-attachment
        (:meth:`engines_rebuilt`), the weight-sync communicators' set-up (``sync_setup_s`` for
        ``sync_groups`` groups, :meth:`sync_groups_set_up`) and, until a transition has been
        measured, the fixed cost (``finish_overhead_s`` less the sync set-up: the garbage
        collection every ``transition_finish`` runs), so that the first ``L̂_tran`` is not the
        DAG's alone."""
        self.engines_rebuilt(rebuild_s)
        self.sync_groups_set_up(sync_setup_s, sync_groups)
        fixed = finish_overhead_s - sync_setup_s
        if not self._transitions_seen and math.isfinite(fixed) and fixed >= 0:
            self.transition_overhead_s = fixed

    def sync_groups_set_up(self, seconds: float, groups: int) -> None:
        """Learn the seconds per weight-sync process group created, from ``seconds`` measured for
        ``groups`` new groups (EMA, weight 0.5; the first taken as is; nothing learned without a
        new group: reused groups cost next to nothing, ``emu.state.groups.GroupPool``)."""
        if groups <= 0 or not (math.isfinite(seconds) and seconds >= 0):
            return
        per = seconds / groups
        self.sync_group_s = ema(self.sync_group_s, per, self._sync_groups_seen)
        self._sync_groups_seen += 1

    def engines_rebuilt(self, rebuild_s: Mapping[ModelStage, float]) -> None:
        """Learn each model-stage's re-attachment seconds (EMA, weight 0.5; the first taken as is)."""
        for ms, seconds in rebuild_s.items():
            if math.isfinite(seconds) and seconds >= 0:
                self.rebuild_s[ms] = ema(self.rebuild_s.get(ms, 0.0), seconds, int(ms in self.rebuild_s))

    def restart_measured(self, seconds: float) -> None:
        """Learn what a checkpoint/restart took (EMA, weight 0.5; the first taken as is)."""
        if not (math.isfinite(seconds) and seconds > 0):
            return
        self.restart_s = ema(self.restart_s, seconds, self._restarts_seen)
        self._restarts_seen += 1

    def engine_started(self, seconds: float) -> None:
        """Learn how long a vLLM engine takes to start, ``seconds`` measured by the workers (the
        build's or a transition's slowest rank; EMA, weight 0.5; the first taken as is)."""
        if not (math.isfinite(seconds) and seconds > 0):
            return
        self.engine_start_s = ema(self.engine_start_s, seconds, self._engine_starts_seen)
        self._engine_starts_seen += 1

    # ---- the workers' group pools ---------------------------------------------------------------
    def transition_ran(self, dag: TransitionDag) -> None:
        """The workers ran ``dag`` (its ``transition_finish`` included): the communicators it
        handed back are idle in their pools now (:class:`nereusd.transition.comms.GroupPoolMirror`),
        and the next ``L̂_tran`` prices no set-up for those it takes back. Call it after
        :meth:`sync_groups_set_up`, which counts the groups this one created."""
        self.transitions.groups.ran(dag)

    def world_formed(self) -> None:
        """A new world (restart, devices joining or leaving): the workers' pools are empty."""
        self.transitions.groups.world_formed()

    def groups_built(self, plan: Plan) -> int:
        """The workers built ``plan`` on a new world: returns the weight-sync groups it created
        (all of its own; :meth:`engines_built` learns their set-up from them)."""
        self.transitions.groups.built(plan)
        return len(self.transitions.groups.held)

    # ---- pricing -----------------------------------------------------------------------------
    def extra_l_tran_s(self, source: Plan, plan: Plan, dag: TransitionDag | None, engines: Iterable[ModelStage],
                       micro_batch: int) -> float:
        """Seconds the learned terms add to the DAG's ``L̂_tran`` of ``source → plan``: the fixed
        cost and the re-attachment of every model-stage the transition rebuilds
        (:func:`nereusd.transition.rebuilt_model_stages`; without a ``dag``, the simulator's scaled
        assessments, those whose layout or devices change), the weight-sync groups it creates
        (:meth:`nereusd.transition.estimate.TransitionEstimator.sync_groups_created`, once a creation has been measured), and a
        vLLM start-up when it starts engines (:func:`nereusd.backends.restarts_vllm_engines`, the
        workers' own rule). The weight-sync groups created are counted against the workers'
        group pools (:meth:`nereusd.transition.comms.GroupPoolMirror.sync_created`)."""
        extra = 0.0
        if self.sync_group_s and dag is not None and plan != source:
            extra += self.sync_group_s * self.transitions.sync_groups_created(dag)
        if plan != source:
            moved = ({op.model_stage for op in dag.ops} if dag is not None else
                     {ms for ms in set(plan) | set(source) if ms not in plan or ms not in source
                      or (plan[ms].layout, plan[ms].devices) != (source[ms].layout, source[ms].devices)})
            extra += self.transition_overhead_s + sum(self.rebuild_s.get(ms, 0.0)
                                                      for ms in rebuilt_model_stages(source, plan, moved))
        return extra + self.engine_start_term_s(source, plan, engines, micro_batch)

    def engine_start_term_s(self, source: Plan, plan: Plan, engines: Iterable[ModelStage], micro_batch: int) -> float:
        """The vLLM start-up ``L̂_tran`` of ``source → plan`` holds: the learned start-up when the
        transition starts engines (:func:`nereusd.backends.restarts_vllm_engines`, the workers'
        own rule, warm engines of a background join counted; they start in parallel), else 0."""
        return self.engine_start_s if self.engine_start_s and restarts_vllm_engines(
            source, plan, engines, micro_batch, self.warm_engines) else 0.0

    # ---- state of a resumed nereusd ----------------------------------------------------------
    def _transition_costs_state(self) -> dict[str, Any]:
        """This part of the controller's ``state()`` (JSON)."""
        return {"transition_overhead_s": self.transition_overhead_s, "transitions_seen": self._transitions_seen,
                "engine_start": [self.engine_start_s, self._engine_starts_seen],
                "rebuild_s": {str(ms): s for ms, s in self.rebuild_s.items()},
                "sync_group": [self.sync_group_s, self._sync_groups_seen],
                "restart": [self.restart_s, self._restarts_seen]}

    @staticmethod
    def _parse_transition_costs(state: Mapping) -> tuple:
        """This part of a controller state, checked (:meth:`_set_transition_costs` applies it).

        Raises:
            KeyError, TypeError, ValueError, PlanError: a missing or malformed field.
        """
        overhead_s, seen = float(state["transition_overhead_s"]), int(state["transitions_seen"])
        if not math.isfinite(overhead_s) or seen < 0:   # the fixed cost may be negative (learned), not nan
            raise ValueError(f"transition_overhead_s {overhead_s!r}, transitions_seen {seen!r}")
        engine_start_s, engine_starts_seen = state.get("engine_start", (0.0, 0))   # absent before it was learned
        engine_start_s, engine_starts_seen = float(engine_start_s), int(engine_starts_seen)
        if not (math.isfinite(engine_start_s) and engine_start_s >= 0 and engine_starts_seen >= 0):
            raise ValueError(f"engine_start {engine_start_s!r}")
        rebuild_s = {ModelStage.parse(ms): float(x) for ms, x in state.get("rebuild_s", {}).items()}
        if not all(math.isfinite(x) and x >= 0 for x in rebuild_s.values()):
            raise ValueError(f"rebuild_s {state['rebuild_s']!r}")
        sync_group_s, sync_groups_seen = state.get("sync_group", (0.0, 0))   # absent before it was learned
        sync_group_s, sync_groups_seen = float(sync_group_s), int(sync_groups_seen)
        if not (math.isfinite(sync_group_s) and sync_group_s >= 0 and sync_groups_seen >= 0):
            raise ValueError(f"sync_group {sync_group_s!r}")
        restart_s, restarts_seen = state.get("restart", (0.0, 0))   # absent before it was learned
        restart_s, restarts_seen = float(restart_s), int(restarts_seen)
        if not (math.isfinite(restart_s) and restart_s >= 0 and restarts_seen >= 0):
            raise ValueError(f"restart {restart_s!r}")
        return (overhead_s, seen, engine_start_s, engine_starts_seen, rebuild_s, sync_group_s, sync_groups_seen,
                restart_s, restarts_seen)

    def _set_transition_costs(self, parsed: tuple) -> None:
        (self.transition_overhead_s, self._transitions_seen, self.engine_start_s, self._engine_starts_seen,
         self.rebuild_s, self.sync_group_s, self._sync_groups_seen, self.restart_s, self._restarts_seen) = parsed
