"""Task handlers of one worker: build the EMUs of its model-stages, run stage tasks, sync weights.

The worker process (:mod:`emu.worker`) receives tasks in the order nereusd sent them and calls
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

from emu.devmem import DeviceMemory
from emu.engine import StageEngine
from emu.hf_io import load_state
from emu.parallel import build_stage_groups
from emu.rl.losses import policy_loss_fn, value_loss_fn
from nereusd.errors import NereusError
from nereusd.models import ModelSpec
from nereusd.plan import Candidate, ModelStage, Plan, Role, Stage

log = logging.getLogger(__name__)


def initial_state(role_info: dict[str, Any], spec: ModelSpec, seed: int) -> dict[str, torch.Tensor]:
    """Full canonical tensors a role starts from: its HF directory, or a seeded initialisation.

    A critic initialised from the actor keeps the actor's trunk, drops ``lm_head`` and gets a
    value head drawn from ``seed`` (identical on every rank).
    """
    from emu.model import LlamaModel

    value_head = bool(role_info["value_head"])
    path = role_info.get("path")
    gen = torch.Generator().manual_seed(seed)
    if path:
        state = load_state(path)
    else:
        torch.manual_seed(seed)
        state = {k: v.detach().clone() for k, v in LlamaModel(spec, value_head=False).state_dict().items()}
    if value_head and "value_head.weight" not in state:
        h = spec.hidden_size
        state = {k: v for k, v in state.items() if not k.startswith("lm_head")}
        state["value_head.weight"] = torch.randn(1, h, generator=gen) * (1.0 / h ** 0.5) * 0.1
        state["value_head.bias"] = torch.zeros(1)
    return state


class WorkerRuntime:
    """The state of one worker: its engines (one per model-stage it holds) and communicators."""

    def __init__(self, *, rank: int, device_index: int, torch_device: torch.device, memory: DeviceMemory,
                 run_dir: str) -> None:
        self.rank = rank
        self.device_index = device_index
        self.torch_device = torch_device
        self.memory = memory
        self.run_dir = Path(run_dir)
        self.plan: Plan | None = None
        self.engines: dict[ModelStage, StageEngine] = {}
        self.stage_groups: dict[ModelStage, Any] = {}
        self.stage_pg: dict[ModelStage, Any] = {}
        self.role_pg: dict[Role, tuple[list[int], Any]] = {}
        self._handlers = {
            "build": self.build,
            "generate": self.generate,
            "logprobs": self.logprobs,
            "values": self.values,
            "scores": self.scores,
            "train": self.train,
            "sync_weights": self.sync_weights,
            "save_checkpoint": self.save_checkpoint,
            "memory_report": self.memory_report,
        }

    def handle(self, kind: str, args: dict[str, Any]) -> dict[str, Any]:
        """Run task ``kind``.

        Raises:
            NereusError: unknown task kind, or what the handler raises.
        """
        handler = self._handlers.get(kind)
        if handler is None:
            raise NereusError(f"unknown task kind {kind!r} (known: {sorted(self._handlers)})")
        self.memory.reset_peak()
        start = time.perf_counter()
        result = handler(args)
        result.setdefault("peak_memory_bytes", self.memory.peak_bytes)
        result.setdefault("elapsed_s", time.perf_counter() - start)
        return result

    # ------------------------------------------------------------------ build
    def build(self, args: dict[str, Any]) -> dict[str, Any]:
        """Create communicators for every model-stage and the engines this rank holds.

        Args (from nereusd): ``plan`` (Plan.to_dict), ``roles`` ({role: {spec, path,
        value_head}}), ``train`` (optimiser settings), ``lr`` ({model_stage: lr}),
        ``seed``.
        """
        plan = Plan.from_dict(args["plan"])
        roles = args["roles"]
        train = args["train"]
        seed = int(args["seed"])
        self.plan = plan
        for ms, cand in plan.items():  # every rank, same order: group creation is collective
            self.stage_groups[ms] = build_stage_groups(cand, self.rank)
            self.stage_pg[ms] = dist.new_group(list(cand.devices))
        for role in Role:
            members = sorted({d for ms, c in plan.items() if ms.role == role for d in c.devices})
            if members:
                self.role_pg[role] = (members, dist.new_group(members))
        states: dict[Role, dict[str, torch.Tensor]] = {}
        for ms, cand in plan.items():
            if self.rank not in cand.devices:
                continue
            info = roles[ms.role.value]
            spec = ModelSpec.from_dict(info["spec"])
            if ms.role not in states:
                states[ms.role] = initial_state(info, spec, seed + list(Role).index(ms.role))
            trainable = ms.stage == Stage.TRAINING
            engine = StageEngine(
                model_stage=ms, spec=spec, candidate=cand, rank=self.rank, groups=self.stage_groups[ms],
                device=self.torch_device, memory=self.memory, value_head=bool(info["value_head"]),
                trainable=trainable, lr=float(args["lr"].get(str(ms), 0.0) or 1e-4),
                weight_decay=float(train["weight_decay"]), grad_clip=train["grad_clip"],
                micro_batch=cand.micro_batch or int(train["micro_batch"]), recompute=cand.recompute,
            )
            engine.load_full_state(states[ms.role])
            self.engines[ms] = engine
        states.clear()
        gc.collect()
        return {"model_stages": [str(m) for m in self.engines], "memory_in_use_bytes": self.memory.in_use_bytes}

    # ------------------------------------------------------------------ stage tasks
    def _engine(self, args: dict[str, Any]) -> StageEngine:
        ms = ModelStage.parse(args["model_stage"])
        engine = self.engines.get(ms)
        if engine is None:
            raise NereusError(f"device {self.device_index} holds no shard of {ms}")
        return engine

    def _reporting(self, engine: StageEngine) -> bool:
        cand: Candidate = engine.candidate
        _, pp_rank, tp_rank = cand.coords_of(self.rank)
        return pp_rank == cand.pp - 1 and tp_rank == 0

    def generate(self, args: dict[str, Any]) -> dict[str, Any]:
        engine = self._engine(args)
        responses = engine.generate(
            args["prompts"], max_new_tokens=int(args["max_new_tokens"]), temperature=float(args["temperature"]),
            greedy=bool(args["greedy"]), eos_id=int(args["eos_id"]), pad_id=int(args["pad_id"]),
            seed=int(args["seed"]),
        )
        return {"responses": responses} if self._reporting(engine) else {}

    def logprobs(self, args: dict[str, Any]) -> dict[str, Any]:
        engine = self._engine(args)
        out = engine.logprobs(args["sequences"], args["prompt_lens"])
        return {"logprobs": out} if self._reporting(engine) else {}

    def values(self, args: dict[str, Any]) -> dict[str, Any]:
        engine = self._engine(args)
        out = engine.values(args["sequences"], args["prompt_lens"])
        return {"values": out} if self._reporting(engine) else {}

    def scores(self, args: dict[str, Any]) -> dict[str, Any]:
        engine = self._engine(args)
        out = engine.scores(args["sequences"])
        return {"scores": out} if self._reporting(engine) else {}

    def train(self, args: dict[str, Any]) -> dict[str, Any]:
        engine = self._engine(args)
        loss = args["loss"]
        if loss["kind"] == "policy":
            loss_fn = policy_loss_fn(clip=float(loss["clip"]), kl_coef=float(loss["kl_coef"]),
                                     kl_estimator=loss["kl_estimator"], entropy_coef=float(loss["entropy_coef"]))
        elif loss["kind"] == "value":
            loss_fn = value_loss_fn(value_clip=float(loss["value_clip"]))
        else:
            raise NereusError(f"unknown loss kind {loss['kind']!r}")
        metrics = engine.train_step(args["sequences"], args["prompt_lens"], args["per_token"], loss_fn)
        return {"metrics": metrics} if self._reporting(engine) else {}

    # ------------------------------------------------------------------ weights and checkpoints
    def sync_weights(self, args: dict[str, Any]) -> dict[str, Any]:
        """Copy the parameters of ``source`` (a training model-stage) to the ``targets`` of its role.

        Every member of the role's communicator takes part: the source replica gathers full
        tensors, its first device broadcasts them as one flat buffer, and each target engine
        keeps its shard. (Issue 4 replaces this with the EMU resharding primitives.)
        """
        source = ModelStage.parse(args["source"])
        targets = [ModelStage.parse(t) for t in args["targets"]]
        members, group = self.role_pg[source.role]
        assert self.plan is not None
        src_cand = self.plan[source]
        root = src_cand.devices[0]
        full: dict[str, torch.Tensor] | None = None
        if self.rank in src_cand.replica_devices(0):
            full = self.engines[source].full_state()
        meta = [None]
        if self.rank == root:
            assert full is not None
            meta = [[(k, tuple(v.shape), str(v.dtype)) for k, v in full.items()]]
        dist.broadcast_object_list(meta, src=root, group=group)
        names = meta[0]
        if self.rank == root:
            flat = torch.cat([full[k].reshape(-1).to(torch.float32) for k, _, _ in names]).to(self.torch_device)
        else:
            flat = torch.empty(sum(int(torch.Size(s).numel()) for _, s, _ in names), dtype=torch.float32,
                               device=self.torch_device)
        dist.broadcast(flat, src=root, group=group)
        offset, state = 0, {}
        for name, shape, _ in names:
            n = int(torch.Size(shape).numel())
            state[name] = flat[offset:offset + n].view(shape)
            offset += n
        for target in targets:
            if target in self.engines:
                self.engines[target].load_full_state(state)
        del flat, state, full
        return {}

    def save_checkpoint(self, args: dict[str, Any]) -> dict[str, Any]:
        """Save every training model-stage's parameters and Adam state with torch DCP.

        Layout: ``<dir>/<role>/`` one DCP checkpoint per trainable role, keys ``model.<param>``
        and ``optim.<param>.<exp_avg|exp_avg_sq|step>`` holding canonical full tensors.
        """
        import torch.distributed.checkpoint as dcp

        root = Path(args["dir"])
        assert self.plan is not None
        for ms, cand in self.plan.items():
            if ms.stage != Stage.TRAINING or self.rank not in cand.devices:
                continue
            engine = self.engines[ms]
            state: dict[str, Any] = {f"model.{k}": v for k, v in engine.full_state().items()}
            for name, slots in engine.optimizer_full_state().items():
                for slot, value in slots.items():
                    state[f"optim.{name}.{slot}"] = value if torch.is_tensor(value) else torch.tensor(value)
            dcp.save(state, checkpoint_id=str(root / ms.role.value), process_group=self.stage_pg[ms])
        return {}

    def memory_report(self, args: dict[str, Any]) -> dict[str, Any]:
        return {"in_use_bytes": self.memory.in_use_bytes, "by_model_stage": self.memory.by_model_stage()}

    def close(self) -> None:
        """Tear down cleanly (barrier, drop tensors, barrier, destroy) — see PLATFORM.md."""
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
