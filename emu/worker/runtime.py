"""Task handlers of one worker: build the EMUs of its model-stages, run stage tasks, sync weights.

The worker process (:mod:`emu.worker.main`) receives tasks in the order nereusd sent them and calls
:meth:`WorkerRuntime.handle`. Every handler that issues collectives is called by every member of
the collective in the same order, because nereusd sends each task to all members before the
next one (FIFO per worker). Communicators for every model-stage are created at ``build`` by
every rank of the world, in canonical model-stage order.

Result convention: a per-replica result (responses, log-probs, values, scores) is returned by
the replica's *reporting rank* — tensor rank 0 of the last pipeline stage — and is ``{}``
elsewhere; nereusd reads it from ``candidate.device_at(r, pp - 1, 0)``.
"""

from __future__ import annotations

import gc
import logging
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from emu.state.devmem import DeviceMemory
from emu.engine.stage import StageEngine, preload_optimizer
from emu.state.checkpoint import load_holdings, save_holdings, verify_checkpoint
from emu.engine.hf_io import load_state
from emu.engine.parallel import build_stage_groups
from emu.state.groups import GroupPool
from emu.state.primitives import HoldingStore
from emu.worker.transition_tasks import TransitionTasks, rank_space
from emu.worker.vllm_stages import VllmStages
from emu.state.unit import LogicalState, bind_engine, holding_of, mark_trained, trained_steps
from emu.rl.losses import policy_loss_fn, value_loss_fn
from nereusd import protocol as P
from nereusd.errors import NereusError
from nereusd.heap import settle_heap
from nereusd.models import ModelSpec
from nereusd.plan import Candidate, ModelStage, Plan, Role, Stage

log = logging.getLogger(__name__)


FINITE_CHECKED = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
"""Checkpoint dtypes whose NaN and infinity the build refuses (CPU torch has no ``isfinite`` for
the float8 types, which load cast as before)."""


def initial_state(role_info: P.RoleArgs, spec: ModelSpec, seed: int) -> dict[str, torch.Tensor]:
    """Full canonical tensors a role starts from: its HF directory, or a seeded initialisation.

    A critic initialised from the actor keeps the actor's trunk, drops ``lm_head`` and gets a
    value head drawn from ``seed`` (identical on every rank).

    Raises:
        ValueError: a checkpoint tensor holds NaN or infinity (named with the directory: it
            failed in the first generation's sampling, naming neither).
    """
    from emu.engine.model import LlamaModel

    value_head = role_info.value_head
    path = role_info.path
    gen = torch.Generator().manual_seed(seed)
    if path:
        state = load_state(path)
        bad = next((name for name, t in state.items()
                    if t.dtype in FINITE_CHECKED and not torch.isfinite(t).all()), None)
        if bad is not None:
            raise ValueError(f"{path}: tensor {bad} holds NaN or infinity; the checkpoint is damaged")
    else:
        torch.manual_seed(seed)
        state = {k: v.detach().clone() for k, v in LlamaModel(spec, value_head=False).state_dict().items()}
    if value_head and "value_head.weight" not in state:
        h = spec.hidden_size
        state = {k: v for k, v in state.items() if not k.startswith("lm_head")}
        state["value_head.weight"] = torch.randn(1, h, generator=gen) * (1.0 / h ** 0.5) * 0.1
        state["value_head.bias"] = torch.zeros(1)
    return state


class WorkerRuntime(TransitionTasks, VllmStages):
    """The state of one worker: its engines (one per model-stage it holds) and communicators.

    ``settle_heap_at_build``: freeze the process's set-up heap at the first :meth:`build`, before
    any engine exists (:func:`nereusd.heap.settle_heap`); the worker process sets it, a runtime
    built inside another program (a test) does not, since it would freeze that program's heap.
    """

    def __init__(self, *, rank: int, device_index: int, torch_device: torch.device, memory: DeviceMemory,
                 run_dir: str, store_client=None, backend: str = "gloo", settle_heap_at_build: bool = False) -> None:
        self.rank = rank
        self.device_index = device_index
        self.torch_device = torch_device
        self.memory = memory
        self.run_dir = Path(run_dir)
        self.plan: Plan | None = None
        self.engines: dict[ModelStage, StageEngine] = {}
        self.stage_groups: dict[ModelStage, Any] = {}
        self.stage_pg: dict[ModelStage, Any] = {}
        self.store = HoldingStore(memory, torch_device)
        self.store_client, self.backend = store_client, backend
        self.rank_of = lambda device: device
        self._transition = None
        self._partitions = {}   # ZeRO partitions a transition re-partitions (TransitionTasks._repartition)
        self.group_pool = GroupPool()   # transition and weight-sync communicators, reused across transitions
        self._rebuild_all = False
        self._changed: set[ModelStage] = set()   # model-stages the running transition changes
        self._build_args: P.BuildArgs | None = None
        self._heap_settled = not settle_heap_at_build   # nereusd.heap.settle_heap, once, at the first build
        self._init_vllm()
        self._handlers = {
            "build": self.build,
            "generate": self.generate,
            "logprobs": self.logprobs,
            "values": self.values,
            "scores": self.scores,
            "train": self.train,
            "sync_weights": self.sync_weights,
            "save_checkpoint": self.save_checkpoint,
            "load_checkpoint": self.load_checkpoint,
            "transition_prepare": self.transition_prepare,
            "transition_run": self.transition_run,
            "transition_finish": self.transition_finish,
            "reform_world": self.reform_world,
            "memory_report": self.memory_report,
            "describe": self.describe,
            "prestart_engines": self.prestart_engines,
        }
        assert set(self._handlers) == set(P.TASK_KINDS), "every task kind of the protocol has a handler"

    def handle(self, args: P.TaskArgs) -> dict[str, Any]:
        """Run the task whose typed payload is ``args`` (its ``kind`` selects the handler).

        Raises:
            NereusError: what the handler raises.
        """
        handler = self._handlers[args.kind]
        self.memory.reset_peak()
        start = time.perf_counter()
        result = handler(args)
        result.setdefault("peak_memory_bytes", self.memory.peak_bytes)
        result.setdefault("elapsed_s", time.perf_counter() - start)
        return result

    # ------------------------------------------------------------------ build
    def build(self, args: P.BuildArgs) -> dict[str, Any]:
        """Create communicators for every model-stage and the engines this rank holds
        (:class:`nereusd.protocol.tasks.BuildArgs`) → ``model_stages``, ``memory_in_use_bytes``,
        and what a transition's ``transition_finish`` repeats, in seconds: per model-stage its
        communicators and engine (``rebuild_s_by_stage``; the initial weights' reading and
        loading excluded; each model-stage timed from a world barrier, so that no rank's wait for
        a slower one in the collective group creation is counted),
        the weight-sync communicators (``sync_setup_s``) and the garbage collection (``collect_s``)."""
        plan = Plan.from_dict(args.plan)
        roles = args.roles
        seed = args.seed
        self.plan = plan
        self._build_args = args
        self._rebuild_all = False   # a re-formation's pending re-attach is this build (a restart's)
        if "deepspeed" in args.backends.values():   # not inside a later transition that adds a replica here
            from emu.engine.deepspeed_stage import preload_deepspeed

            preload_deepspeed(self.torch_device)
        if not self._heap_settled and not self.engines:   # imports done, no engine yet (its docstring)
            preload_optimizer()
            settle_heap()
            self._heap_settled = True
        rebuild_s: dict[str, float] = {}   # per model-stage: what re-attaching it in a transition costs
        for ms, cand in plan.items():  # every rank, same order: group creation is collective
            dist.barrier()   # timed from a common start, as transition_finish times its re-attachments
            start = time.perf_counter()
            self.stage_groups[ms] = self._groups(cand)
            self.stage_pg[ms] = dist.new_group(sorted(self.rank_of(d) for d in cand.devices))
            rebuild_s[str(ms)] = time.perf_counter() - start
        states: dict[Role, dict[str, torch.Tensor]] = {}
        for ms, cand in plan.items():
            if self.device_index not in cand.devices:
                continue
            info = roles[ms.role.value]
            spec = ModelSpec.from_dict(info.spec)
            if ms.role not in states:
                states[ms.role] = initial_state(info, spec, seed + list(Role).index(ms.role))
            start = time.perf_counter()
            engine = self._make_engine(ms, cand, self.stage_groups[ms])
            rebuild_s[str(ms)] += time.perf_counter() - start
            engine.load_full_state(states[ms.role])   # not timed: a transition binds its holding instead
            start = time.perf_counter()
            bind_engine(engine, logical=LogicalState(seed=seed))
            self.engines[ms] = engine
            self._params_changed(ms)
            rebuild_s[str(ms)] += time.perf_counter() - start
        states.clear()
        start = time.perf_counter()
        self._plan_syncs(args.syncs)
        sync_setup_s = time.perf_counter() - start
        gc.collect()
        return {"model_stages": [str(m) for m in self.engines], "memory_in_use_bytes": self.memory.in_use_bytes,
                "rebuild_s_by_stage": rebuild_s, "sync_setup_s": sync_setup_s,
                "collect_s": time.perf_counter() - start - sync_setup_s,
                **self._sync_engines()}

    def _groups(self, cand: Candidate):
        """Stage groups of ``cand`` in world-rank space (collective over the world)."""
        return build_stage_groups(rank_space(cand, self.rank_of), self.rank)

    def _make_engine(self, ms: ModelStage, cand: Candidate, groups) -> StageEngine:
        """An engine of ``ms`` for this rank's place in ``cand`` (build arguments from ``build``)."""
        args, train = self._build_args, self._build_args.train
        info = args.roles[ms.role.value]
        engine_class, extra = StageEngine, {}
        if cand.zero_stage:   # ZeRO-1/2 run on DeepSpeed (nereusd.backends.ZERO_STAGES)
            from emu.engine.deepspeed_stage import DeepSpeedStageEngine

            engine_class, extra = DeepSpeedStageEngine, {"zero_stage": cand.zero_stage}
        return engine_class(
            **extra, model_stage=ms, spec=ModelSpec.from_dict(info.spec), candidate=rank_space(cand, self.rank_of),
            rank=self.rank, groups=groups, device=self.torch_device, memory=self.memory,
            value_head=info.value_head, trainable=ms.stage == Stage.TRAINING,
            lr=float(args.lr.get(str(ms), 0.0) or 1e-4), weight_decay=train.weight_decay,
            grad_clip=train.grad_clip, micro_batch=cand.micro_batch or train.micro_batch,
            recompute=cand.recompute,
            max_tokens_per_micro_batch=None if ms.stage == Stage.GENERATION else train.max_tokens_per_micro_batch,
        )

    # ------------------------------------------------------------------ stage tasks
    def _engine(self, args) -> StageEngine:
        ms = ModelStage.parse(args.model_stage)
        engine = self.engines.get(ms)
        if engine is None:
            raise NereusError(f"device {self.device_index} holds no shard of {ms}")
        return engine

    def _reporting(self, engine: StageEngine) -> bool:
        cand: Candidate = engine.candidate
        _, pp_rank, tp_rank = cand.coords_of(self.rank)
        return pp_rank == cand.pp - 1 and tp_rank == 0

    def generate(self, args: P.GenerateArgs) -> dict[str, Any]:
        engine = self._engine(args)
        responses = self._vllm_generate(ModelStage.parse(args.model_stage), args)
        if responses is None:
            responses = engine.generate(
                args.prompts, max_new_tokens=args.max_new_tokens, temperature=args.temperature, greedy=args.greedy,
                stop_ids=tuple(args.stop_ids), pad_id=args.pad_id, seed=args.seed, seeds=args.seeds,
            )
        return {"responses": responses} if self._reporting(engine) else {}

    def logprobs(self, args: P.LogprobsArgs) -> dict[str, Any]:
        engine = self._engine(args)
        out = engine.logprobs(args.sequences, args.prompt_lens)
        return {"logprobs": out} if self._reporting(engine) else {}

    def values(self, args: P.ValuesArgs) -> dict[str, Any]:
        engine = self._engine(args)
        out = engine.values(args.sequences, args.prompt_lens)
        return {"values": out} if self._reporting(engine) else {}

    def scores(self, args: P.ScoresArgs) -> dict[str, Any]:
        engine = self._engine(args)
        out = engine.scores(args.sequences)
        return {"scores": out} if self._reporting(engine) else {}

    def train(self, args: P.TrainArgs) -> dict[str, Any]:
        engine = self._engine(args)
        loss = args.loss
        if isinstance(loss, P.PolicyLoss):
            loss_fn = policy_loss_fn(clip=loss.clip, kl_coef=loss.kl_coef, kl_estimator=loss.kl_estimator,
                                     entropy_coef=loss.entropy_coef)
        else:
            loss_fn = value_loss_fn(value_clip=loss.value_clip)
        mark_trained(engine, -1)   # between a step's updates until its last one
        metrics = engine.train_step(args.sequences, args.prompt_lens, args.per_token, loss_fn)
        if args.completes_step is not None:
            mark_trained(engine, args.completes_step)
        return {"metrics": metrics} if self._reporting(engine) else {}

    # ------------------------------------------------------------------ weights and checkpoints
    def save_checkpoint(self, args: P.SaveCheckpointArgs) -> dict[str, Any]:
        """Save every training model-stage's holdings (parameters, Adam state, logical state)
        with torch DCP (:mod:`emu.state.checkpoint`), one checkpoint per role under ``<dir>/<role>/``.

        Returns ``{"verified_bytes": {role: bytes}}`` for the roles whose checkpoint this rank
        verified (the model-stage's first device; :func:`~emu.state.checkpoint.verify_checkpoint`)."""
        root = Path(args.dir)
        assert self.plan is not None
        verified: dict[str, int] = {}
        for ms, cand in self.plan.items():
            if ms.stage != Stage.TRAINING or self.device_index not in cand.devices:
                continue
            save_holdings([holding_of(self.engines[ms])], root / ms.role.value, plan=Plan({ms: cand}),
                          process_group=self.stage_pg[ms])
            if self.device_index == cand.devices[0]:
                verified[ms.role.value] = verify_checkpoint(root / ms.role.value)
        return {"verified_bytes": verified}

    def load_checkpoint(self, args: P.LoadCheckpointArgs) -> dict[str, Any]:
        """Load every training model-stage this rank holds from ``<dir>/<role>/`` (any saved layout)."""
        root = Path(args.dir)
        for ms, engine in self.engines.items():
            if ms.stage == Stage.TRAINING:
                holding = holding_of(engine)
                load_holdings([holding], root / ms.role.value)
                bind_engine(engine, holding)
        return {}

    def memory_report(self, args: P.MemoryReportArgs) -> dict[str, Any]:
        return {"in_use_bytes": self.memory.in_use_bytes, "by_model_stage": self.memory.by_model_stage()}

    def describe(self, args: P.DescribeArgs) -> dict[str, Any]:
        """What this worker holds, for a resumed nereusd deciding whether to keep it: ``plan``
        (the plan its EMUs form; ``None`` before a build) and ``trained_steps``
        (``{model_stage: RL steps its state holds}`` for the training model-stages it holds) and
        ``model_stages`` (the engines it holds). Local: no collective."""
        return {"plan": self.plan.to_dict() if self.plan is not None else None,
                "model_stages": sorted(str(ms) for ms in self.engines),
                "trained_steps": {str(ms): trained_steps(e) for ms, e in self.engines.items()
                                  if ms.stage == Stage.TRAINING}}

    def close(self) -> None:
        """Tear down cleanly (engine processes stopped; barrier, drop tensors, barrier, destroy) — see
        docs/platform.md."""
        self._close_engines()
        if not dist.is_initialized():
            return
        try:
            dist.barrier()
            self.engines.clear()
            gc.collect()
            dist.barrier()
        except RuntimeError as err:  # a peer is already gone: nothing left to agree on
            log.warning("teardown barrier failed: %s", err)
        dist.destroy_process_group()
