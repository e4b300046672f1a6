"""A training model-stage on DeepSpeed ZeRO-1/2: the native model, DeepSpeed's sharded optimizer.

:class:`DeepSpeedStageEngine` is a :class:`emu.engine.stage.StageEngine` whose optimizer step is
DeepSpeed's ``DeepSpeedZeroOptimizer`` (ZeRO stage 1 or 2) over the model-stage's DP group: the
fp32 master weights and Adam ``m``/``v`` are partitioned across the ``dp`` replicas (each holds
``⌈P/dp⌉`` elements of DeepSpeed's flat buffer), and at stage 2 the gradients too. Forward passes,
the loss and the batch conventions are the native engine's, unchanged.

Scope: ``tp = pp = 1`` inside the unit (the planner proposes nothing else for this backend, and
:class:`DeepSpeedStageEngine` refuses it). What TP/PP inside a ZeRO unit would need is in
docs/DESIGN.md, "Training on DeepSpeed ZeRO".

Equivalence with the native engine (``stage.py`` module docstring):

* the loss is SUM-reduced with weights normalised by the global batch and gradients are summed
  over DP; DeepSpeed *averages* them over DP, so the loss handed to its backward is ``dp·loss``;
* DeepSpeed divides a loss by its gradient-accumulation steps; we call ``backward`` with
  ``scale_wrt_gas=False`` and mark the accumulation boundary at the step's last micro-batch
  ourselves (micro-batch counts vary per step with token packing, and per replica: the DP
  replicas first agree on the largest count and the shorter ones add zero-loss backwards, since
  ZeRO-2 reduces during every backward);
* clipping: DeepSpeed's global-norm clip (``max_norm / (norm + 1e-6)``), the native engine's
  rule; ``grad_norm`` is DeepSpeed's norm before clipping;
* Adam: the job's ``torch.optim.Adam`` (lr, betas, eps, L2 weight decay) stepped by DeepSpeed on
  its flat partition — elementwise the same update as the native engine's.

State crossing the EMU boundary (DESIGN.md "Training on DeepSpeed ZeRO"): :meth:`export_holding`
gathers the replica's canonical ZeRO-0 holding — parameters and full Adam moments: per
partitioned slot, one collective joins the DP group's flat partitions, sliced at DeepSpeed's
parameter offsets (the values of ``safe_get_full_fp32_param``/``safe_get_full_optimizer_state``,
which would all-reduce one full tensor per parameter; :meth:`_gathered`); in fp32 training the
parameters are the module's own, which DeepSpeed keeps equal to the master — and
:meth:`adopt_holding` writes a holding back into this rank's partition with ``safe_set_full_*``
(local, no communication). Both only copy values, so a round trip is
bit-exact; checkpoints, weight sync and transitions out of ZeRO therefore run unchanged on
holdings. A transition that keeps the model-stage on ZeRO moves the partitions themselves
instead (:mod:`emu.engine.zero_repartition`; :meth:`adopt_holding` then takes a parameter-only
holding).

Memory: parameters as the native engine; gradients and optimizer partitions booked from
:func:`nereusd.cost.memory.zero_state_bytes` before DeepSpeed allocates, then corrected to the
sizes DeepSpeed reports (its partition padding), with a warning when they differ by more than 1 %.

DeepSpeed on CPU needs ``DS_ACCELERATOR=cpu`` before it is imported (set here when the device is
a CPU and the variable is unset); its shared-memory all-reduce op is not built (it would span the
whole worker world and costs a ~30 s compile; ZeRO's collectives use the DP group).
"""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager
from dataclasses import replace
from typing import Optional

import torch
import torch.distributed as dist

from emu.state.primitives import all_gather_single
from emu.state.unit import PARAM_SLOTS, TRAIN_SLOTS, EmuShard, LogicalState
from emu.engine.stage import StageEngine
from nereusd.cost.memory import zero_bucket_elements, zero_state_bytes
from nereusd.errors import NereusError, PlanError

log = logging.getLogger(__name__)

DEEPSPEED_ZERO_STAGES = (1, 2)


def import_deepspeed(device: torch.device):
    """``deepspeed``, imported for ``device`` (``DS_ACCELERATOR=cpu`` on CPUs; the shm op skipped).

    Raises:
        PlanError: if DeepSpeed is not installed.
    """
    if device.type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    # DeepSpeed selects its device from LOCAL_RANK (torchrun sets it; a Nereus worker owns one device).
    os.environ["LOCAL_RANK"] = str(device.index or 0)
    try:
        import deepspeed
        import deepspeed.ops
    except ImportError as err:
        raise PlanError(f"the deepspeed training backend needs DeepSpeed (pip install deepspeed): {err}") from None
    # The CPU accelerator's shared-memory all-reduce spans the torch world (here: the whole pool,
    # not one model-stage) and JIT-compiles for ~30 s; ZeRO's reductions do not use it.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    for name in ("DeepSpeed", "deepspeed"):
        logging.getLogger(name).setLevel(logging.WARNING)
    return deepspeed


def preload_deepspeed(device: torch.device) -> None:
    """Import DeepSpeed and what its first ``initialize`` imports lazily, ahead of need.

    ZeRO's optimizer check (``is_zero_supported_optimizer``) imports DeepSpeed's Muon optimizer,
    which pulls in torch.compile's inductor: 2.2 s inside the first engine's construction on a
    process that had imported DeepSpeed (cProfile of a ``scripts/bench_zero.py`` move, 40 M,
    on a rank that had built no DeepSpeed engine before), on top of DeepSpeed's own import. A
    worker that gets its first ZeRO replica in a transition (a device added to a ZeRO
    model-stage) paid both inside the transition; workers of a job with a ``deepspeed`` backend
    call this when they build instead. Failures are left to the engine's construction, which
    reports them.
    """
    try:
        import_deepspeed(device)
        from deepspeed.runtime.zero.muon import muon_optimizer  # noqa: F401
    except (ImportError, PlanError):
        pass


@contextmanager
def _no_model_broadcast(deepspeed):
    """DeepSpeed's engine without its construction-time broadcast of DP rank 0's parameters.

    ``DeepSpeedEngine.__init__`` broadcasts every parameter from DP rank 0 (one call each) so that
    replicas start equal. Ours are equal by construction: the module is allocated empty
    (``to_empty``) and every path loads the parameters and the fp32 master afterwards on every rank
    (:meth:`StageEngine.initialize`, :meth:`DeepSpeedStageEngine.adopt_holding`, a checkpoint), so
    the broadcast copied uninitialised memory: 0.6–3 s of a dp 2 → 4 move at 40 M parameters on 4
    gloo ranks (``scripts/bench_zero.py``, cProfile). A DeepSpeed without the private method is
    left as it is.
    """
    cls = deepspeed.runtime.engine.DeepSpeedEngine
    original = cls.__dict__.get("_broadcast_model")
    if original is None:
        yield
        return
    cls._broadcast_model = lambda self: None
    try:
        yield
    finally:
        cls._broadcast_model = original


_SINGLE: dict[str, object] = {}


def _rank_alone(rank: int) -> dist.ProcessGroup:
    """A process group of this rank alone, one per world (process groups die with the world).

    Created once per world and reused: ``new_group([rank], use_local_synchronization=True)`` per
    engine gave a name that collided with an earlier one after a few transitions ("The specified
    group name has already been created").
    """
    world = dist.distributed_c10d._get_default_group()
    if _SINGLE.get("world") is not world or _SINGLE.get("rank") != rank:
        _SINGLE.update(world=world, rank=rank, group=dist.new_group([rank], use_local_synchronization=True))
    return _SINGLE["group"]


class _StageMpu:
    """The model-parallel unit DeepSpeed asks for groups: this model-stage's DP group, and this rank
    alone as its (tp = pp = 1) model-parallel group. ``dp = 1`` uses that one-rank group as DP too."""

    def __init__(self, dp_group: Optional[dist.ProcessGroup], dp_ranks: tuple[int, ...], rank: int) -> None:
        self._single = _rank_alone(rank)
        self._dp = dp_group if dp_group is not None else self._single
        self._dp_ranks, self._rank = tuple(dp_ranks) or (rank,), rank

    def get_data_parallel_group(self):
        return self._dp

    def get_data_parallel_world_size(self) -> int:
        return len(self._dp_ranks)

    def get_data_parallel_rank(self) -> int:
        return sorted(self._dp_ranks).index(self._rank)

    def get_data_parallel_group_ranks(self) -> list[int]:
        return sorted(self._dp_ranks)

    def get_model_parallel_group(self):
        return self._single

    get_tensor_model_parallel_group = get_model_parallel_group

    def get_model_parallel_world_size(self) -> int:
        return 1

    get_tensor_model_parallel_world_size = get_model_parallel_world_size

    def get_model_parallel_rank(self) -> int:
        return 0

    get_tensor_model_parallel_rank = get_model_parallel_rank

    def get_tensor_model_parallel_src_rank(self) -> int:
        return self._rank


class DeepSpeedStageEngine(StageEngine):
    """This rank's replica of a training model-stage on DeepSpeed ZeRO (module docstring).

    Args:
        zero_stage: 1 or 2.
        ds_config: entries merged into the DeepSpeed config (``zero_optimization`` merged key by
            key), e.g. ``{"zero_optimization": {"elastic_checkpoint": True}}``.
        (the rest): as :class:`StageEngine`; ``trainable`` must be true.

    Raises:
        PlanError: for ``tp`` or ``pp`` above 1, a stage outside :data:`DEEPSPEED_ZERO_STAGES`, a
            non-trainable engine, or DeepSpeed missing.
        DeviceOutOfMemory: if parameters, gradients and optimizer partitions do not fit.
    """

    def __init__(self, *, zero_stage: int, trainable: bool = True, ds_config: Optional[dict] = None, **kw) -> None:
        cand, ms = kw["candidate"], kw["model_stage"]
        if zero_stage not in DEEPSPEED_ZERO_STAGES:
            raise PlanError(f"{ms}: the deepspeed backend runs zero_stage {DEEPSPEED_ZERO_STAGES}, got {zero_stage}")
        if cand.tp != 1 or cand.pp != 1:
            raise PlanError(f"{ms}: the deepspeed backend runs tp = pp = 1 inside a unit, got {cand.describe()}")
        if not trainable:
            raise PlanError(f"{ms}: the deepspeed backend is for training model-stages")
        lr, betas, eps = kw.pop("lr"), kw.pop("betas", (0.9, 0.999)), kw.pop("eps", 1e-8)
        weight_decay = kw.pop("weight_decay", 0.0)
        super().__init__(trainable=False, lr=lr, **kw)  # the module and its parameters, booked
        deepspeed = import_deepspeed(self.device)
        self.zero_stage, self.trainable = zero_stage, True
        self.module.requires_grad_(True)
        numel = sum(p.numel() for p in self.params.values())
        dp = self.candidate.dp
        booked = zero_state_bytes(numel, dp, zero_stage, 4)
        for what, nbytes in booked.items():
            self.memory.allocate(self.ms, what, nbytes)
        bucket = zero_bucket_elements(numel)
        config = {
            "train_micro_batch_size_per_gpu": self.micro_batch,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": float(self.grad_clip or 0.0),
            "zero_optimization": {"stage": zero_stage, "reduce_bucket_size": bucket,
                                  "allgather_bucket_size": bucket, "overlap_comm": False},
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 2 ** 62,
            "wall_clock_breakdown": False,
        }
        for key, value in (ds_config or {}).items():
            config[key] = {**config.get(key, {}), **value} if key == "zero_optimization" else value
        adam = torch.optim.Adam(list(self.params.values()), lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        self._mpu = _StageMpu(self.groups.dp_group, self.groups.dp_ranks, self.rank)
        with _no_model_broadcast(deepspeed):
            self.ds, self.ds_optimizer, _, _ = deepspeed.initialize(model=self.module, optimizer=adam, config=config,
                                                                    mpu=self._mpu, dist_init_required=False)
        self.params = dict(self.module.named_parameters())  # DeepSpeed re-pointed them into its flat buffer
        self.logical = LogicalState()
        self._stepped_micro = 0
        self._check_booking(booked)

    def _check_booking(self, booked: dict[str, int]) -> None:
        """Re-book ``optimizer`` at the sizes DeepSpeed allocated (master + ``m`` + ``v`` partitions)."""
        part = sum(t.numel() for t in self.ds_optimizer.single_partition_of_fp32_groups)
        actual = 3 * part * 4
        diff = actual - booked["optimizer"]
        if abs(diff) > 0.01 * max(1, booked["optimizer"]):
            log.warning("%s: DeepSpeed's optimizer partitions are %d B, the memory model's %d B", self.ms, actual,
                        booked["optimizer"])
        if diff:
            self.memory.free(self.ms, "optimizer")
            self.memory.allocate(self.ms, "optimizer", actual)

    # ------------------------------------------------------------------ one optimizer step
    def _zero_grad(self) -> None:
        self._stepped_micro = 0
        self._micro_total = 1

    def _begin_step(self, n_micro: int) -> None:
        """Agree on the step's backward count over DP: the largest replica's micro-batch count.

        ZeRO-2 reduce-scatters gradient buckets during every backward, so every replica must run
        the same number of them; with token-budget micro-batches (or no share) replicas differ,
        and the shorter ones add zero-loss backwards (:meth:`_zero_loss`; gradients 0).
        """
        count = torch.tensor([max(1, n_micro)], dtype=torch.int64)
        if self.candidate.dp > 1:
            dist.all_reduce(count, op=dist.ReduceOp.MAX, group=self._mpu.get_data_parallel_group())
        self._micro_total = int(count)

    def _zero_loss(self) -> torch.Tensor:
        """A loss of value and gradient 0 through the whole model: one token forward, times 0.

        Not ``sum(p.sum() for p in params) * 0``: ZeRO-2 fills its reduce buckets in the order
        gradients arrive, and the replicas' buckets must hold the same parameters in the same
        order, so a padding backward has to run the graph a real micro-batch runs (a sum of the
        parameters reached them in another order and reduced mismatched gradients).
        """
        tokens = torch.zeros((1, 1), dtype=torch.long, device=self.device)
        return self.module(tokens).sum() * 0.0

    def _backward(self, loss: torch.Tensor, last: bool) -> None:
        self._stepped_micro += 1
        self.ds.set_gradient_accumulation_boundary(self._stepped_micro == self._micro_total)
        self.ds.backward(loss * self.candidate.dp, scale_wrt_gas=False)

    def _optimizer_step(self) -> float:
        while self._stepped_micro < self._micro_total:   # see _begin_step
            self._backward(self._zero_loss(), last=True)
        self.ds.step()
        norm = self.ds.get_global_grad_norm()
        return float(norm) if norm is not None else 0.0

    # ------------------------------------------------------------------ state
    def _adam_state(self) -> Optional[dict]:
        """Torch Adam's state of this rank's flat partition (``None`` before the first step)."""
        flat = self.ds_optimizer.single_partition_of_fp32_groups[0]
        state = self.ds_optimizer.optimizer.state.get(flat)
        return state or None

    def _set_adam_state(self, step: float, moments: dict[str, torch.Tensor]) -> None:
        """Make ``moments`` (``exp_avg``, ``exp_avg_sq``: tensors shaped as this rank's flat
        partition) and ``step`` the Adam state of the partition, linked to DeepSpeed's
        per-parameter views (what ``safe_get_*`` and the checkpoint code read)."""
        from deepspeed.utils import lazy_init_hp_params_optimizer_state

        opt = self.ds_optimizer
        flat = opt.single_partition_of_fp32_groups[0]
        opt.optimizer.state[flat] = {"step": torch.tensor(float(step), dtype=torch.float32), **moments}
        lazy_init_hp_params_optimizer_state(opt.bit16_groups[0], flat, opt.optimizer.state)
        opt._hp_optimizer_states_linked = True

    def adam_step(self) -> int:
        """Optimizer updates applied (Adam's ``step``)."""
        state = self._adam_state()
        return int(float(state["step"])) if state else 0

    @torch.no_grad()
    def load_full_state(self, state: dict[str, torch.Tensor]) -> None:
        """Parameters and fp32 master partition from canonical full tensors (extra names ignored)."""
        from deepspeed.utils import safe_set_full_fp32_param

        super().load_full_state(state)
        for name, p in self.params.items():
            safe_set_full_fp32_param(p, state[name].to(torch.float32))

    def _flat_is_holding_row(self, shard: EmuShard) -> bool:
        """Whether DeepSpeed's flat buffer orders and packs the parameters as ``shard``'s slot rows do
        (its only padding is after the last parameter): then elements ``[0, numel)`` of the flat
        buffer *are* one slot's row of the holding, and partitions move between the two as slices.
        True for every model here (one parameter group, module order); otherwise the engine goes
        parameter by parameter."""
        opt = self.ds_optimizer
        offsets = getattr(opt, "round_robin_bit16_offsets", None)
        if offsets is None or len(opt.round_robin_bit16_groups) != 1:
            return False
        held = [self.params.get(s.name) for s in shard.shards]
        return ([id(p) for p in opt.round_robin_bit16_groups[0]] == [id(p) for p in held]
                and list(offsets[0]) == [shard.offsets[s.name] for s in shard.shards])

    def _partition_span(self, partition: torch.Tensor, numel: int) -> tuple[int, int]:
        """``(start, valid)``: where this rank's flat ``partition`` starts in DeepSpeed's flat buffer
        (DP rank × partition size; partitions are equal) and how many of its elements lie below
        ``numel`` (the rest is DeepSpeed's alignment padding)."""
        start = dist.get_rank(group=self.ds_optimizer.real_dp_process_group[0]) * partition.numel()
        return start, max(0, min(partition.numel(), numel - start))

    @torch.no_grad()
    def _join(self, partition: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Elements ``[0, out.numel())`` of DeepSpeed's flat buffer (master weights or an Adam
        moment), joined from the DP group's flat partitions into ``out`` by one collective; returns
        ``out``. On gloo one all-reduce of the zero-padded buffer (``/tmp`` A/B, 2 gloo ranks, 3
        slots: 0.10 s vs 0.20 s per-parameter at 6 M parameters, 0.70 s vs 0.88 s at 40 M; an
        all-gather took 0.06 s and 1.33 s); elsewhere an all-gather, half the all-reduce's bytes.
        Collective over DP."""
        group = self.ds_optimizer.real_dp_process_group[0]
        dp, numel = dist.get_world_size(group=group), out.numel()
        if dp == 1:
            return out.copy_(partition[:numel])
        if dist.get_backend(group) == "gloo":
            start, valid = self._partition_span(partition, numel)
            out.zero_()
            out[start:start + valid].copy_(partition[:valid])
            dist.all_reduce(out, group=group)   # x + 0 = x (a -0.0 becomes 0.0, as in DeepSpeed's calls)
        else:
            full = torch.empty(dp * partition.numel(), dtype=partition.dtype, device=partition.device)
            all_gather_single(full, partition.contiguous(), group=group)
            out.copy_(full[:numel])
        return out

    @torch.no_grad()
    def _gathered(self, partition: torch.Tensor, slot: str) -> dict[str, torch.Tensor]:
        """Full fp32 tensors of every parameter from this rank's flat ``partition`` (the master
        weights, ``slot="fp32"``, or an Adam moment of them): :meth:`_join` of the whole flat
        buffer, sliced at DeepSpeed's parameter offsets. The same values as
        ``safe_get_full_fp32_param``/``safe_get_full_optimizer_state``, which all-reduce one
        zero-padded full tensor per parameter. Collective over DP; falls back to DeepSpeed's calls
        on a DeepSpeed without ``round_robin_bit16_offsets``."""
        opt = self.ds_optimizer
        offsets = getattr(opt, "round_robin_bit16_offsets", None)
        if offsets is None:
            from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

            return {name: safe_get_full_fp32_param(p) if slot == "fp32" else safe_get_full_optimizer_state(p, slot)
                    for name, p in self.params.items()}
        dp = dist.get_world_size(group=opt.real_dp_process_group[0])
        full = self._join(partition, torch.empty(dp * partition.numel(), dtype=partition.dtype,
                                                 device=partition.device)) if dp > 1 else partition
        name_of = {id(p): name for name, p in self.params.items()}
        return {name_of[id(p)]: full.narrow(0, offset, p.numel()).view(p.shape)
                for p, offset in zip(opt.round_robin_bit16_groups[0], offsets[0])}

    @torch.no_grad()
    def optimizer_full_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """As :meth:`StageEngine.optimizer_full_state`; collective over the DP group."""
        state = self._adam_state()
        if state is None:
            return {}
        step = torch.tensor(float(self.adam_step()))
        moments = {k: self._gathered(state[k], k) for k in ("exp_avg", "exp_avg_sq")}
        return {name: {"step": step.clone(), **{k: moments[k][name] for k in moments}} for name in self.params}

    @torch.no_grad()
    def load_optimizer_full_state(self, state: dict[str, dict[str, torch.Tensor]]) -> None:
        """This rank's partition of :meth:`optimizer_full_state` output (empty: no state); local."""
        from deepspeed.utils import safe_set_full_optimizer_state

        opt = self.ds_optimizer
        flat = opt.single_partition_of_fp32_groups[0]
        if not state:
            opt.optimizer.state.pop(flat, None)
            return
        missing = [n for n in self.params if n not in state]
        if missing:
            raise NereusError(f"{self.ms}: load_optimizer_full_state: missing {missing[0]!r}")
        step = float(next(iter(state.values()))["step"])
        self._set_adam_state(step, {"exp_avg": torch.zeros_like(flat), "exp_avg_sq": torch.zeros_like(flat)})
        for name, p in self.params.items():
            for k in ("exp_avg", "exp_avg_sq"):
                safe_set_full_optimizer_state(p, state[name][k].to(flat.device, torch.float32), k)

    @torch.no_grad()
    def export_holding(self) -> EmuShard:
        """The replica's canonical holding (``TRAIN_SLOTS``, fp32 master values): collective over DP.

        Each partitioned slot is joined straight into its row of the holding when DeepSpeed's flat
        buffer is laid out as the row (:meth:`_flat_is_holding_row`), else gathered and copied
        parameter by parameter. In fp32 training the ``param`` row is the module's parameters,
        which DeepSpeed sets from the master after every update (no collective).
        """
        shard = EmuShard(self.model_stage, self.spec, self.value_head, self.candidate.layout, (0, 0), TRAIN_SLOTS,
                         device=self.device, logical=replace(self.logical, step=self.adam_step()))
        state = self._adam_state()
        sources = {"param": self.ds_optimizer.single_partition_of_fp32_groups[0],
                   **{slot: state[slot] if state else None for slot in TRAIN_SLOTS[1:]}}
        rows = shard.buffer.view(len(TRAIN_SLOTS), shard.numel_per_slot)
        as_row = self._flat_is_holding_row(shard)
        for slot, partition in sources.items():   # one slot at a time
            if slot == "param" and all(p.dtype == torch.float32 for p in self.params.values()):
                full = self.params
            elif partition is None:
                full = None
            elif as_row:
                self._join(partition, rows[TRAIN_SLOTS.index(slot)])
                continue
            else:
                full = self._gathered(partition, "fp32" if slot == "param" else slot)
            for name in self.params:
                view = shard.view(name, slot)
                view.copy_(full[name]) if full is not None else view.zero_()
            del full
        self.logical = shard.logical
        return shard

    @torch.no_grad()
    def adopt_holding(self, shard: EmuShard) -> None:
        """Take parameters, this rank's optimizer partition and ``c, v, p`` from ``shard`` (local).

        When DeepSpeed's flat buffer is laid out as the holding's rows (:meth:`_flat_is_holding_row`)
        the master and moment partitions are slices of the rows (padding zero, as DeepSpeed pads);
        otherwise ``safe_set_full_*`` per parameter. Moments are loaded even at step 0 (zeros
        there: Adam's own start).

        A ``PARAM_SLOTS`` holding (a re-partitioning transition, :mod:`emu.engine.zero_repartition`)
        gives the parameters and ``c, v, p`` only; :func:`~emu.engine.zero_repartition.repartition`
        fills the optimizer partition next.

        Raises:
            NereusError: if ``shard`` is another model-stage's or neither a full training holding
                nor a parameter-only one.
        """
        if (shard.model_stage, shard.layout) != (self.model_stage, self.candidate.layout) or \
                shard.slots not in (TRAIN_SLOTS, PARAM_SLOTS):
            raise NereusError(f"{self.ms}: cannot adopt holding {shard.describe()} slots {shard.slots}")
        names, step = list(self.params), shard.logical.step
        if shard.slots == PARAM_SLOTS:
            StageEngine.load_full_state(self, {n: shard.view(n, "param") for n in names})
            self.logical = shard.logical
            return
        if not self._flat_is_holding_row(shard):
            self.load_full_state({n: shard.view(n, "param") for n in names})
            self.load_optimizer_full_state({
                n: {"step": torch.tensor(float(step)), "exp_avg": shard.view(n, "exp_avg"),
                    "exp_avg_sq": shard.view(n, "exp_avg_sq")} for n in names})
            self.logical = shard.logical
            return
        StageEngine.load_full_state(self, {n: shard.view(n, "param") for n in names})
        rows = shard.buffer.view(len(TRAIN_SLOTS), shard.numel_per_slot)
        flat = self.ds_optimizer.single_partition_of_fp32_groups[0]
        start, valid = self._partition_span(flat, shard.numel_per_slot)
        moments = {}
        for slot, row in zip(TRAIN_SLOTS, rows):
            into = flat if slot == "param" else torch.empty_like(flat)
            into[:valid].copy_(row[start:start + valid])
            into[valid:].zero_()
            if slot != "param":
                moments[slot] = into
        self._set_adam_state(step, moments)
        self.logical = shard.logical

    def detach(self, memory=None) -> EmuShard:
        """What a worker does with this engine before a transition: export the canonical holding
        (collective over DP) with its bytes booked as ``export`` while engine and holding both
        exist, then :meth:`release` and free the engine's entries. Returns the (unbooked) holding.

        Args:
            memory: the :class:`DeviceMemory` to book on (default: the engine's own).
        """
        memory = memory or self.memory
        numel = sum(p.numel() for p in self.params.values())
        memory.allocate(self.ms, "export", 4 * len(TRAIN_SLOTS) * numel)   # the fp32 holding it exports
        holding = self.export_holding()
        self.release()
        for what in ("export", "parameters", "gradients", "optimizer"):
            memory.free(self.ms, what)
        return holding

    def release(self) -> None:
        """Drop DeepSpeed's engine, hooks and buffers (the caller frees the booked entries).

        DeepSpeed's engine, optimizer and hooks reference one another (closures over the engine
        in its own attributes and in the module's hooks), so after ``destroy()`` their buffers —
        the flat parameters, master and moment partitions, gradients — would wait for the cycle
        collector, and a transition would allocate its holdings beside them (the worker collects
        only after the transition). Their attributes are cleared instead, which frees the buffers
        at once (``tests/distributed/test_deepspeed_engine.py`` checks it with weakrefs); a
        ``gc.collect()`` per release would cost ~0.3 s in a worker that imported DeepSpeed.
        """
        ds, opt = self.ds, self.ds_optimizer
        opt.destroy()
        ds.destroy()
        for obj in (opt, ds):
            vars(obj).clear()
        self.ds = self.ds_optimizer = None
        self.module = None
        self.params.clear()
