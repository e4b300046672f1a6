"""Worker task handlers of transitions, weight synchronisation and world re-formation.

Mixed into :class:`emu.worker.runtime.WorkerRuntime`. Task kinds (args → result):

``transition_prepare`` (every world rank; ``dag`` JSON, ``ops``)
    Engines of model-stages the DAG changes are detached into holdings (their memory moves from
    the engine's entries to the holding's, no copy: engines live in their holdings, see
    :func:`emu.state.unit.bind_engine`; a ZeRO model-stage that stays on ZeRO keeps its optimizer
    partition apart and its holding carries the parameters alone, :mod:`emu.engine.zero_repartition`), and the transition's communicators are created, collectively
    in DAG order; then this device's part of ``ops`` (the first ready set) runs as in
    ``transition_run`` → ``setup_s``, ``timings``.
``transition_run`` (the devices of ``ops``)
    This device's part of ``ops`` (a ready set) → ``timings`` (:class:`emu.state.executor.OpTiming`).
``transition_finish`` (every world rank; ``syncs``: the target plan's weight-sync DAGs)
    Communicators destroyed; engines of the target plan built, in canonical order (group creation
    is collective), on the holdings the transition produced (a re-partitioned ZeRO model-stage's
    optimizer partitions moved into its new engines right after they are built); the weight-sync
    communicators created → ``model_stages``, ``rebuild_s``, ``repartition_s``, ….
``reform_world`` (every surviving or new worker; ``generation``, ``devices``)
    Engines detached into holdings, the old world destroyed, generation ``generation`` of the
    world joined with world rank = index of this device in ``devices``; tensors stay in memory.
``sync_weights`` (source and target devices; ``source``, ``targets``)
    Each target model-stage receives the source's parameters through the transition machinery:
    the DAG from the source's candidate to the target's (planned by nereusd with the site's node
    size and sent with ``build``/``transition_finish``, which create its communicators) runs on
    parameter-only views of the source's holdings.
"""

from __future__ import annotations

import gc
import logging
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from emu.engine.zero_repartition import keep_partition, repartition
from emu.state.executor import TransitionExecutor
from emu.state.primitives import Communicators, HoldingStore, create_communicators
from emu.state.unit import PARAM_SLOTS, EmuShard, bind_engine, holding_of, params_holding_of, slots_for
from emu.worker.world import join_world
from nereusd import protocol as P
from nereusd.errors import NereusError
from nereusd.models import ModelSpec
from nereusd.plan import Candidate, ModelStage, Plan, Role
from nereusd.shards import value_head_for
from nereusd.transition import rebuilt_model_stages, repartitioned_by
from nereusd.transition.ops import TransitionDag

log = logging.getLogger(__name__)

def rank_space(cand: Candidate, rank_of) -> Candidate:
    """``cand`` with world ranks in place of global devices (they differ after a re-formation)."""
    return Candidate(cand.tp, cand.pp, cand.dp, tuple(rank_of(d) for d in cand.devices),
                     micro_batch=cand.micro_batch, recompute=cand.recompute, zero_stage=cand.zero_stage)


class TransitionTasks:
    """Handlers of the task kinds in the module docstring (state lives on WorkerRuntime)."""

    _repartition: set[ModelStage] = frozenset()
    """ZeRO model-stages the running transition re-partitions (:func:`nereusd.transition.repartitioned_by`,
    the rule nereusd prices and books by): detached with :func:`emu.engine.zero_repartition.keep_partition`, their
    partitions moved by :func:`~emu.engine.zero_repartition.repartition` once rebuilt."""

    # ------------------------------------------------------------------ helpers
    def _models(self) -> dict[Role, ModelSpec]:
        return {Role(r): ModelSpec.from_dict(info.spec) for r, info in self._build_args.roles.items()}

    def _specs(self, plan: Plan, params_only: set[ModelStage] = frozenset()) -> dict[
            ModelStage, tuple[ModelSpec, bool, tuple[str, ...]]]:
        """Per model-stage of ``plan``: its model, value head and the slots its holdings carry
        (parameters alone for ``params_only``: ZeRO model-stages being re-partitioned)."""
        models = self._models()
        return {m: (models[m.role], value_head_for(m.role), PARAM_SLOTS if m in params_only else slots_for(m))
                for m in plan}

    def _detach(self, ms: ModelStage) -> None:
        """Move engine ``ms`` into the holding store (no copy; a ZeRO engine exports its canonical
        holding first, collectively over its DP group, with the holding booked while both exist,
        or — re-partitioned, :data:`_repartition` — keeps its optimizer partition apart and puts
        its parameters alone in the store)."""
        engine = self.engines.pop(ms)
        if ms in self._repartition:
            holding, self._partitions[ms] = keep_partition(engine, self.memory)
        else:
            holding = engine.detach() if getattr(engine, "zero_stage", 0) else holding_of(engine)
        for what in ("parameters", "gradients", "optimizer"):
            self.memory.free(str(ms), what)
        engine.module = None
        engine.params.clear()
        engine.optimizer = None
        self.store.put(holding, book=True)
        self.stage_groups.pop(ms, None)

    def _attach(self, ms: ModelStage, cand: Candidate) -> None:
        """Build engine ``ms`` (collective group creation) and bind it to this device's holding."""
        groups = self.stage_groups[ms] = self._groups(cand)
        self.stage_pg[ms] = dist.new_group(sorted(self.rank_of(d) for d in cand.devices))  # checkpoints
        if self.device_index not in cand.devices:
            return
        _, p, t = cand.coords_of(self.device_index)
        holding = self.store.pop(ms, cand.layout, (p, t))
        engine = self._make_engine(ms, cand, groups)
        bind_engine(engine, holding)
        self.engines[ms] = engine
        self._params_changed(ms)

    def _to_rebuild(self, target: Plan) -> set[ModelStage]:
        """Model-stages ``transition_finish`` re-attaches: after a world re-formation every one of
        ``target`` (:meth:`reform_world` detached all engines), else those the transition changed.
        The same set on every rank — attaching creates process groups, a collective over the world —
        so it is computed from the plans and never from the engines this rank happens to hold (a
        rank that holds no engine of a model-stage must still create its groups)."""
        if self._rebuild_all:
            return set(target)
        return self._rebuilt(target, self._changed)

    def _rebuilt(self, target: Plan, moved: set[ModelStage]) -> set[ModelStage]:
        """:func:`nereusd.transition.rebuilt_model_stages` from this rank's plan (the plan before
        the transition until ``transition_finish`` ends), the same on every rank."""
        return rebuilt_model_stages(self.plan, target, moved) if self.plan is not None else set(moved)

    def _retune(self, engine, cand: Candidate) -> None:
        """Apply what a candidate can change without moving state — micro-batch (generation
        waves, training micro-batches) and recomputation — to a live engine; the transition DAG
        has no op for such a change, so without this the engine would keep the old values."""
        engine.micro_batch = cand.micro_batch or self._build_args.train.micro_batch
        engine.recompute = cand.recompute
        if engine.module is not None:
            engine.module.recompute = cand.recompute
        engine.candidate = rank_space(cand, self.rank_of)

    def _plan_syncs(self, syncs: list[P.SyncDag]) -> None:
        """Create the communicators of the current plan's weight-sync DAGs (collective), as nereusd
        planned them (``[{"source", "target", "dag"}]``, :func:`nereusd.transition.weight_sync_dags`)."""
        for comms in getattr(self, "_sync", {}).values():
            comms[1].destroy()
        self._sync: dict[tuple[ModelStage, ModelStage], tuple[TransitionDag, Communicators]] = {}
        for entry in syncs:
            dag = TransitionDag.from_json(entry.dag)
            comms = Communicators(self.rank_of, pool=self.group_pool)
            create_communicators(dag, comms)
            self._sync[(ModelStage.parse(entry.source), ModelStage.parse(entry.target))] = (dag, comms)

    # ------------------------------------------------------------------ tasks
    def transition_prepare(self, args: P.TransitionPrepareArgs) -> dict[str, Any]:
        dag = TransitionDag.from_json(args.dag, plans=args.plans)
        ops_changed = ({ModelStage.parse(m) for m in args.changed} if args.changed is not None
                       else {op.model_stage for op in dag.ops})
        self._changed = ops_changed
        changed = self._rebuilt(dag.target, ops_changed)
        # after a world re-formation every engine was detached by export (reform_world), on every
        # rank alike (a new worker has no plan): nothing is left to re-partition
        self._repartition = (set() if self._rebuild_all or self.plan is None
                             else repartitioned_by(self.plan, dag.target))
        start = time.perf_counter()
        for ms in sorted(changed, key=ModelStage.sort_key):
            if ms in self.engines:
                self._detach(ms)
        detach_s = time.perf_counter() - start
        self._transition = TransitionExecutor(dag, self.device_index, self.store,
                                              self._specs(dag.target, self._repartition),
                                              rank_of=self.rank_of, communicators=args.communicators,
                                              pool=self.group_pool)
        setup_s = self._transition.prepare()
        timings = self._transition.run(args.ops) if args.ops else []
        return {"setup_s": setup_s, "detach_s": detach_s, "timings": [t.to_dict() for t in timings]}

    def transition_run(self, args: P.TransitionRunArgs) -> dict[str, Any]:
        if self._transition is None:
            raise NereusError("transition_run before transition_prepare")
        timings = self._transition.run(args.ops)
        return {"timings": [t.to_dict() for t in timings]}

    def transition_finish(self, args: P.TransitionFinishArgs) -> dict[str, Any]:
        ex, self._transition = self._transition, None
        if ex is None:
            raise NereusError("transition_finish before transition_prepare")
        ex.close()
        target = ex.dag.target
        rebuild = self._to_rebuild(target)
        self._rebuild_all = False
        start = time.perf_counter()
        by_stage: dict[str, float] = {}
        repartition_s = 0.0
        for ms in [m for m in target if m in rebuild]:  # canonical order on every rank
            # each model-stage timed from a common start: no rank's wait for a slower one in the
            # (collective) group creation is counted as this model-stage's re-attachment
            dist.barrier()
            begin = time.perf_counter()
            self._attach(ms, target[ms])
            by_stage[str(ms)] = time.perf_counter() - begin
            if ms in self._repartition:   # collective over the world, like the attachment
                begin = time.perf_counter()
                repartition(self._partitions.pop(ms, None), self.engines.get(ms), self.memory)
                repartition_s += time.perf_counter() - begin
        self._repartition = set()
        for ms, engine in self.engines.items():
            if ms not in rebuild and ms in target:
                self._retune(engine, target[ms])
        attached = time.perf_counter()
        rebuild_s = attached - start - repartition_s
        self.plan = target
        self._plan_syncs(args.syncs)
        synced = time.perf_counter()
        gc.collect()
        sync_setup_s, collect_s = synced - attached, time.perf_counter() - synced
        return {"model_stages": [str(m) for m in self.engines], "memory_in_use_bytes": self.memory.in_use_bytes,
                "rebuild_s": rebuild_s, "rebuild_s_by_stage": by_stage, "repartition_s": repartition_s,
                "sync_setup_s": sync_setup_s,
                "collect_s": collect_s,
                **self._sync_engines()}

    def reform_world(self, args: P.ReformWorldArgs) -> dict[str, Any]:
        start = time.perf_counter()
        self._repartition = set()
        for ms in self._partitions:   # of an interrupted transition: restored from a checkpoint
            self.memory.free(str(ms), "partition")
        self._partitions.clear()
        for ms in sorted(self.engines, key=ModelStage.sort_key):   # canonical order: a ZeRO export is collective
            self._detach(ms)
        for comms in getattr(self, "_sync", {}).values():
            comms[1].destroy()
        self._sync = {}
        self.stage_groups.clear()
        self.stage_pg.clear()
        devices = list(args.devices)
        dist.destroy_process_group()
        self.group_pool.clear()   # its groups went with the world
        self.rank = devices.index(self.device_index)
        if args.store_host is not None and args.store_port is not None:   # a resumed nereusd's store
            self.store_client = dist.TCPStore(args.store_host, args.store_port, is_master=False,
                                              timeout=timedelta(seconds=args.timeout_s))
        join_world(self.store_client, generation=args.generation, rank=self.rank, world_size=len(devices),
                   backend=self.backend, timeout=timedelta(seconds=args.timeout_s))
        mapping = {d: i for i, d in enumerate(devices)}
        self.rank_of = mapping.__getitem__
        self._rebuild_all = True
        return {"rank": self.rank, "reform_s": time.perf_counter() - start}

    def sync_weights(self, args: P.SyncWeightsArgs) -> dict[str, Any]:
        source = ModelStage.parse(args.source)
        out: dict[str, Any] = {}
        for target in (ModelStage.parse(t) for t in args.targets):
            dag, comms = self._sync[(source, target)]
            store = HoldingStore(self.memory, self.torch_device)
            if source in self.engines:
                h = params_holding_of(self.engines[source])
                store.put(EmuShard(target, h.spec, h.value_head, h.layout, h.position, PARAM_SLOTS,
                                   buffer=h.buffer, logical=h.logical))
            ex = TransitionExecutor(dag, self.device_index, store, self._specs(dag.target), rank_of=self.rank_of)
            ex.comms = comms
            ex.run()
            if target in self.engines:
                engine = self.engines[target]
                got = store.get(target, engine.candidate.layout, (engine.groups.pp_rank, engine.groups.tp_rank))
                with torch.no_grad():
                    for name, p in engine.params.items():
                        p.copy_(got.view(name, "param"))
                self._params_changed(target)
                loaded = {}
                if target in self.vllm:   # its vLLM engine gets the new weights now
                    self._revive(target)
                    loaded = self._once_more(target, "a weight load", lambda: self._refresh_engine(target))
                out["engine_load_s"] = out.get("engine_load_s", 0.0) + loaded.get("load_s", 0.0)
                out["engine_bytes"] = out.get("engine_bytes", 0.0) + loaded.get("bytes", 0.0)
            for key in list(store.items):
                store.pop(*key)
        return out
