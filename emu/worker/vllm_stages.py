"""Generation model-stages on vLLM: each replica's engine, kept in step with its EMU.

Mixed into :class:`emu.worker.runtime.WorkerRuntime`. The EMU of a ``vllm`` generation
model-stage is built, moved by transitions and refreshed by weight synchronisation exactly as a
native one; beside it, each of its ranks owns one engine process (:class:`VllmEngine`), the TP
rank of the replica's vLLM engine.

- After ``build``, ``transition_finish`` and a re-formation, :meth:`_sync_engines` (every rank, in
  canonical model-stage order, because engine start-up and weight loading are collective in the
  replica's TP group) keeps an engine whose replica is unchanged — same ``tp``, the same devices
  in TP order, the same ``micro_batch`` — and rebuilds the others: a generation TP/DP/device
  change or a pool change starts new engines on the target devices (their start-up is part of the
  measured transition time, so the controller learns it as the transition's fixed cost).
- Whenever the EMU's parameters change (a build, a transition, a weight synchronisation) the
  engine gets them: the replica's canonical full tensors (:meth:`StageEngine.full_state`, a TP
  all-gather) through :meth:`VllmEngine.load_weights`. That is the generation side of the
  weight-sync step, timed and counted in ``sync_weights``' result.
- A device that joins the job in the background (``pool.join: background``,
  :mod:`nereusd.daemon.joins`) starts, before it joins the world, the engines of the replicas
  the controller expects to place on it (:meth:`prestart_engines`, collective over the joining
  devices' private world): they are *warm*, held apart from the plan's engines. The first
  :meth:`_sync_engines` after the join adopts a warm engine where the replica's key and engine
  configuration are what it would start (every TP rank of the replica agreeing), instead of
  starting one, and closes the warm engines it did not adopt.
- ``generate`` books the engine's KV cache and weight copy on the virtual device while it runs
  (a GPU engine sleeps between rollouts, :mod:`emu.engine.vllm_engine`), and returns what the
  native engine returns.
"""

from __future__ import annotations

import logging
import socket
from typing import Any, Optional

import torch
import torch.distributed as dist

from emu.engine.parallel import StageGroups
from emu.engine.vllm_engine import EngineConfig, VllmEngine, free_port
from emu.state.unit import derived_seed
from nereusd import protocol as P
from nereusd.backends import vllm_replica_key
from nereusd.errors import NereusError
from nereusd.cost.memory import kv_cache_bytes, vllm_block_tokens, vllm_kv_cache_tokens
from nereusd.models import ModelSpec
from nereusd.plan import Candidate, ModelStage, Stage

log = logging.getLogger(__name__)


def _host() -> str:
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def _engine_address(group, group_src: int, tp_rank: int) -> tuple[str, int]:
    """The engine world's rendezvous: TP rank 0 (``group_src`` in ``group``) picks a host and a
    free port, and every rank of ``group`` gets them (collective over ``group``)."""
    box: list[Any] = [None]
    if tp_rank == 0:
        host = _host()
        box[0] = (host, free_port(host))
    dist.broadcast_object_list(box, group=group, group_src=group_src)
    return box[0]


class VllmStages:
    """Handlers' helpers for ``vllm`` generation model-stages (state lives on WorkerRuntime)."""

    vllm: dict[ModelStage, VllmEngine]
    _vllm_key: dict[ModelStage, tuple]
    _emu_version: dict[ModelStage, int]

    def _init_vllm(self) -> None:
        self.vllm, self._vllm_key, self._emu_version = {}, {}, {}
        self._warm: dict[ModelStage, tuple[tuple, VllmEngine]] = {}
        """Engines started before this device joined the world (:meth:`prestart_engines`):
        ``{model_stage: (replica key, engine)}``, until :meth:`_sync_engines` adopts or closes them."""

    def _on_vllm(self, ms: ModelStage) -> bool:
        args = self._build_args
        return args is not None and ms.stage is Stage.GENERATION and args.backends.get(str(ms)) == "vllm"

    def _params_changed(self, ms: ModelStage) -> None:
        """The EMU of ``ms`` on this rank has new parameters (its engine must be reloaded)."""
        self._emu_version[ms] = self._emu_version.get(ms, 0) + 1

    def _replica_key(self, ms: ModelStage, cand: Candidate) -> tuple:
        return vllm_replica_key(cand, self.device_index, self._build_args.train.micro_batch)

    def _engine_config(self, ms: ModelStage, engine, addr: str, port: int) -> EngineConfig:
        param = next(iter(engine.params.values()))
        return self._vllm_config(engine.spec, engine.groups.tp.size, engine.groups.tp_rank, param.dtype,
                                 engine.micro_batch, addr, port)

    def _vllm_config(self, spec, tp: int, tp_rank: int, dtype: torch.dtype, max_num_seqs: int, addr: str,
                     port: int) -> EngineConfig:
        """The engine configuration of TP rank ``tp_rank`` of a ``tp``-way replica whose EMU holds
        ``dtype`` parameters and decodes ``max_num_seqs`` sequences at once."""
        args = self._build_args
        max_len = args.max_model_len   # fits spec.max_position: checked before launch
        seqs = max(1, max_num_seqs)
        on_cpu = self.torch_device.type == "cpu"
        block = vllm_block_tokens("cpu" if on_cpu else "cuda")
        tokens = vllm_kv_cache_tokens(seqs, max_len, block)
        element = torch.empty((), dtype=dtype).element_size()
        return EngineConfig(
            spec=spec, tp=tp, tp_rank=tp_rank, master_addr=addr, master_port=port,
            max_model_len=max_len, kv_cache_bytes=kv_cache_bytes(spec, tokens, tp, 1, element),
            block_tokens=block, max_num_seqs=seqs, dtype=str(dtype).removeprefix("torch."),
            device="cpu" if on_cpu else f"cuda:{self.torch_device.index or 0}",
            seed=args.seed, threads=max(1, torch.get_num_threads()))

    def prestart_engines(self, args: P.PrestartEnginesArgs) -> dict[str, Any]:
        """Start the engines of ``args.replicas`` that hold this device, before it joins the
        world (module docstring). Every joining device calls it (their private world, rank =
        position in ``args.world``): a replica's TP group is created by all of them, in order.

        Returns:
            ``{"engine_start_s": s, "warm": [model_stage, …]}``: this rank's longest start-up.
        """
        out, warm = 0.0, []
        for rep in args.replicas:
            ranks = [args.world.index(d) for d in rep.devices]
            group = dist.new_group(ranks) if rep.tp > 1 else None   # collective over the private world
            if self.device_index not in rep.devices:
                continue
            ms = ModelStage.parse(rep.model_stage)
            info = self._build_args.roles[ms.role.value]
            tp_rank = rep.devices.index(self.device_index)
            addr, port = (_engine_address(group, sorted(ranks).index(ranks[0]), tp_rank) if group is not None
                          else ("127.0.0.1", 0))
            cfg = self._vllm_config(ModelSpec.from_dict(info.spec), rep.tp, tp_rank, torch.get_default_dtype(),
                                    rep.max_num_seqs, addr, port)
            self._close_warm(ms)
            engine = VllmEngine(cfg, workdir=self.run_dir)
            self._warm[ms] = ((rep.tp, tuple(rep.devices), rep.max_num_seqs), engine)
            out = max(out, engine.startup_s)
            warm.append(str(ms))
        return {"engine_start_s": out, "warm": warm}

    def _adopt_warm(self, ms: ModelStage, key: tuple, engine) -> Optional[VllmEngine]:
        """The warm engine of ``ms`` if this replica can take it (its key is ``key`` and its
        configuration what :meth:`_engine_config` gives, up to the rendezvous) on every TP rank
        of the replica (collective over its TP group), else ``None`` (and the warm one closed)."""
        entry = self._warm.get(ms)
        if entry is None or entry[0] != key:
            self._close_warm(ms)
            return None
        # a warm engine of this key means every rank of the replica (the key's devices) was
        # prestarted for it, in one task: they all reach this collective
        del self._warm[ms]
        vllm = entry[1]
        ok = vllm.alive and vllm.cfg == self._engine_config(ms, engine, vllm.cfg.master_addr, vllm.cfg.master_port)
        groups: StageGroups = engine.groups
        if groups.tp.size > 1:
            flag = torch.tensor([1 if ok else 0], device=self.torch_device)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=groups.tp.group)
            ok = bool(flag.item())
        if not ok:
            vllm.close()
            return None
        log.info("%s: adopted the vLLM engine started before this device joined", ms)
        return entry[1]

    def _close_warm(self, ms: ModelStage | None = None) -> None:
        """Close the warm engine of ``ms`` (``None``: every warm engine)."""
        for m in [ms] if ms is not None else list(self._warm):
            entry = self._warm.pop(m, None)
            if entry is not None:
                entry[1].close()

    def _rendezvous(self, engine) -> tuple[str, int]:
        """TP rank 0 picks the engine world's address; every TP rank of the replica gets it."""
        groups: StageGroups = engine.groups
        if groups.tp.size == 1:
            return "127.0.0.1", 0
        return _engine_address(groups.tp.group, StageGroups.group_rank(groups.tp_ranks, 0), groups.tp_rank)

    def _sync_engines(self) -> dict[str, float]:
        """Start, keep or stop engines for the current plan; reload stale weights (module docstring).

        Returns:
            ``{"engine_start_s", "engine_load_s"}``: the longest start-up and weight load on this rank.
        """
        out = {"engine_start_s": 0.0, "engine_load_s": 0.0}
        wanted: dict[ModelStage, tuple] = {}
        for ms in sorted(self.engines, key=ModelStage.sort_key):
            if self._on_vllm(ms):
                wanted[ms] = self._replica_key(ms, self.plan[ms])
        for ms in [m for m in self.vllm if self._vllm_key.get(m) != wanted.get(m) or not self.vllm[m].alive]:
            self._close_engine(ms)   # changed replica, or an engine process that died (rebuilt below)
        for ms, key in wanted.items():   # canonical order: start-up and loads are collective per replica
            if self._replica_rebuilds(self.engines[ms], ms not in self.vllm):
                out["engine_start_s"] = max(out["engine_start_s"], self._start_engine(ms, key))
            out["engine_load_s"] += self._refresh_engine(ms).get("load_s", 0.0)
        self._close_warm()   # started for a replica the job did not place here
        return out

    def _start_engine(self, ms: ModelStage, key: tuple) -> float:
        """(Re)start this rank's engine of ``ms`` (every TP rank of the replica calls it) → start-up s."""
        self._close_engine(ms)
        engine = self.engines[ms]
        if self._warm:
            warm = self._adopt_warm(ms, key, engine)
            if warm is not None:
                self.vllm[ms], self._vllm_key[ms] = warm, key
                return 0.0
        addr, port = self._rendezvous(engine)
        self.vllm[ms] = VllmEngine(self._engine_config(ms, engine, addr, port), workdir=self.run_dir)
        self._vllm_key[ms] = key
        return self.vllm[ms].startup_s

    def _revive(self, ms: ModelStage) -> None:
        """Rebuild the replica's engine if any of its processes died since the last call (every TP
        rank of the replica calls it: at a rollout or a weight sync of ``ms``)."""
        vllm = self.vllm.get(ms)
        if vllm is not None and self._replica_rebuilds(self.engines[ms], not vllm.alive):
            log.warning("%s: a vLLM engine process of this replica died; starting a new engine", ms)
            self._start_engine(ms, self._vllm_key[ms])

    def _replica_rebuilds(self, engine, here: bool) -> bool:
        """Whether any TP rank of the replica has no live engine (then every rank starts anew:
        the engine world needs all of them); collective over the replica's TP group."""
        groups: StageGroups = engine.groups
        if groups.tp.size == 1:
            return here
        flag = torch.tensor([1 if here else 0], device=self.torch_device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=groups.tp.group)
        return bool(flag.item())

    def _once_more(self, ms: ModelStage, what: str, fn):
        """``fn()``; if the TP-1 engine of ``ms`` died during it, a new engine (with the EMU's
        weights) and ``fn()`` once more. At TP > 1 the error stands: the replica's ranks would
        not agree on a retry (:meth:`_revive` rebuilds at their next common call)."""
        vllm = self.vllm[ms]
        try:
            return fn()
        except NereusError:
            if vllm.alive or vllm.cfg.tp > 1:   # vLLM refused the request, or TP ranks would disagree
                raise
            log.warning("%s: the vLLM engine process died during %s; restarting it once", ms, what)
            self._start_engine(ms, self._vllm_key[ms])
            self._refresh_engine(ms)
            return fn()

    def _refresh_engine(self, ms: ModelStage) -> dict[str, float]:
        """Load the EMU's parameters into the engine of ``ms`` if they changed since its last load."""
        vllm = self.vllm.get(ms)
        version = self._emu_version.get(ms, 0)
        if vllm is None or vllm.weights_version == version:
            return {}
        full = self.engines[ms].full_state()     # TP all-gather: every rank of the replica
        return vllm.load_weights(((n, t.detach().to("cpu")) for n, t in full.items()), version=version)

    def _close_engine(self, ms: ModelStage) -> None:
        engine = self.vllm.pop(ms, None)
        self._vllm_key.pop(ms, None)
        if engine is not None:
            engine.close()

    def _close_engines(self) -> None:
        for ms in list(self.vllm):
            self._close_engine(ms)
        self._close_warm()

    def _vllm_generate(self, ms: ModelStage, args: P.GenerateArgs) -> Optional[list[list[int]]]:
        """Responses of this replica on its vLLM engine; ``None`` when ``ms`` is not on vLLM here."""
        if ms not in self.vllm:
            return None
        self._revive(ms)
        self._refresh_engine(ms)
        vllm, engine = self.vllm[ms], self.engines[ms]
        if not args.prompts:
            return []
        width = max(len(p) for p in args.prompts)
        if width + args.max_new_tokens > vllm.cfg.max_model_len:
            raise NereusError(f"{ms}: prompt {width} + max_new_tokens {args.max_new_tokens} exceeds the engine's "
                              f"max_model_len {vllm.cfg.max_model_len}")
        name = str(ms)
        self.memory.allocate(name, "kv_cache", vllm.cfg.kv_cache_bytes)
        try:
            self.memory.allocate(name, "engine_weights", engine.parameter_bytes())
            seeds = list(args.seeds) if args.seeds is not None else [derived_seed(args.seed, i) for i in range(len(args.prompts))]

            def run() -> list[list[int]]:
                return self.vllm[ms].generate(args.prompts, max_new_tokens=args.max_new_tokens,
                                              temperature=args.temperature, greedy=args.greedy,
                                              stop_ids=tuple(args.stop_ids), seeds=seeds)
            return self._once_more(ms, "a rollout", run)
        finally:
            self.memory.free(name, "engine_weights")
            self.memory.free(name, "kv_cache")
