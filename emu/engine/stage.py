"""``StageEngine``: this worker's shard of one model-stage, and what a stage task runs on it.

Conventions (shared with the driver and the RL losses):

* **Sequences** are ``prompt + response`` token lists; ``prompt_lens[i]`` tokens are prompt.
  They are right-padded into one ``[n, S]`` batch: causal attention never sees right padding,
  so no attention mask is needed and positions are ``0 … S-1``.
* **Per response token** ``t`` (``0 ≤ t < len(seq) - prompt_len``), the model is read at
  position ``prompt_len - 1 + t`` — the state from which token ``t`` was generated. There the
  policy gives ``logprobs[t] = log p(seq[prompt_len + t] | prefix)`` and ``entropy[t]``, and a
  critic gives ``values[t]``. A reward model's ``scores`` read the value head at the last token.
* **Results** (``logprobs``, ``values``, ``scores``) are returned on every TP rank of the last
  pipeline stage (identical there) and ``None`` on other pipeline stages.
* **Loss** (``train_step``): ``loss_fn(outputs, batch)`` returns a SUM-reduced scalar whose
  per-token weights the caller normalised by the *global* batch; gradients are summed over
  micro-batches and all-reduced (SUM) over DP replicas, so they equal the one-process gradient.
  Then the global gradient norm is clipped (all TP/PP shards) and ``torch.optim.Adam`` steps.
* **Memory**: parameters, gradients and Adam state (``exp_avg``, ``exp_avg_sq``) are booked at
  construction, the KV cache when allocated, and activations per call from the micro-batch
  shape *before* running (:mod:`emu.state.devmem`).
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

import torch
import torch.distributed as dist

from emu.engine.batch import PackedBatch
from emu.state.devmem import DeviceMemory
from emu.engine.generate import SamplingParams, generate, kv_cache_shape
from emu.engine.canonical import init_full_state, replicated_grad_names, shard_dim, shard_full_tensor
from emu.engine.model import KVCache, LlamaModel
from emu.engine.parallel import (StageGroups, gather_pp, gather_tp, run_pipeline,
                                vocab_parallel_logprobs_entropy)
from nereusd.cost.memory import micro_batch_activation_bytes, pipeline_in_flight, prefill_activation_bytes
from nereusd.errors import NereusError, PlanError
from nereusd.models import ModelSpec
from nereusd.plan import Candidate, ModelStage, Stage
from nereusd.shards import check_layout, layer_range

log = logging.getLogger(__name__)

LossFn = Callable[[dict[str, torch.Tensor], dict[str, torch.Tensor]], tuple[torch.Tensor, dict[str, torch.Tensor]]]


def preload_optimizer() -> None:
    """Construct a throwaway ``torch.optim.Adam`` so that what its first construction imports
    lazily is imported ahead of need. The first ``torch.optim.Adam(...)`` in a process imports
    ``torch._dynamo`` (0.87 s and 281 modules on this CPU build, torch 2.13), which landed inside
    a worker's first training engine (its build measured 1.5 s for a 0.7 M-parameter model whose
    re-attachment takes 0.05 s) and after the set-up heap was frozen, so every later garbage
    collection scanned it. Workers call this when they build, before :func:`nereusd.heap.settle_heap`.
    """
    torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))])


class StageEngine:
    """This rank's shard of one model-stage replica set (see module docstring for conventions).

    Raises:
        PlanError: if the candidate cannot shard the model (:func:`nereusd.shards.check_layout`),
            ``micro_batch < 1``, or ``rank`` is not in the candidate.
        DeviceOutOfMemory: if parameters (and, when trainable, gradients and Adam state) do not
            fit ``memory``.
    """

    def __init__(self, *, model_stage: ModelStage, spec: ModelSpec, candidate: Candidate, rank: int,
                 groups: StageGroups, device: torch.device, memory: DeviceMemory, value_head: bool,
                 trainable: bool, lr: float, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, grad_clip: Optional[float], micro_batch: int,
                 recompute: bool = False, max_tokens_per_micro_batch: Optional[int] = None) -> None:
        check_layout(spec, candidate.layout, generation=model_stage.stage is Stage.GENERATION, value_head=value_head)
        if micro_batch < 1:
            raise PlanError(f"{model_stage}: micro_batch must be >= 1, got {micro_batch}")
        if max_tokens_per_micro_batch is not None and max_tokens_per_micro_batch < 1:
            raise PlanError(f"{model_stage}: max_tokens_per_micro_batch must be >= 1, got {max_tokens_per_micro_batch}")
        if rank not in candidate.devices or groups is None or groups.rank != rank:
            raise PlanError(f"{model_stage}: rank {rank} is not a member of {candidate.describe()}")
        self.model_stage, self.ms = model_stage, str(model_stage)
        self.spec, self.candidate, self.rank, self.groups = spec, candidate, rank, groups
        self.device, self.memory = torch.device(device), memory
        self.value_head, self.trainable = value_head, trainable
        self.grad_clip, self.micro_batch, self.recompute = grad_clip, micro_batch, recompute
        self.max_tokens_per_micro_batch = max_tokens_per_micro_batch
        """Token budget of a forward/training micro-batch (packed, padding-free); ``None``: by count."""
        self.layers = layer_range(spec, candidate.pp, groups.pp_rank)
        with torch.device("meta"):
            module = LlamaModel(spec, value_head=value_head, tp=groups.tp, layer_range=self.layers)
        self._param_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
        self._act_bytes = next(module.parameters()).element_size()   # activations in the parameters' dtype
        memory.allocate(self.ms, "parameters", self._param_bytes)
        if trainable:
            memory.allocate(self.ms, "gradients", self._param_bytes)
            memory.allocate(self.ms, "optimizer", 2 * self._param_bytes)
        self.module = module.to_empty(device=self.device)
        self.module.recompute = recompute
        self.params = dict(self.module.named_parameters())
        self.optimizer: Optional[torch.optim.Adam] = None
        if trainable:
            for p in self.params.values():
                p.grad = torch.zeros_like(p)
            self.optimizer = torch.optim.Adam(list(self.params.values()), lr=lr, betas=betas, eps=eps,
                                              weight_decay=weight_decay)
        else:
            self.module.requires_grad_(False)
        log.info("rank %d %s: %s shard dp%d pp%d tp%d, layers %s, %d parameter bytes, micro-batches of %s", rank,
                 self.ms, candidate.describe(), groups.dp_rank, groups.pp_rank, groups.tp_rank,
                 f"{self.layers.start}-{self.layers.stop - 1}", self._param_bytes,
                 f"{micro_batch} sequences" if max_tokens_per_micro_batch is None
                 else f"<= {max_tokens_per_micro_batch} tokens (packed)")

    # ------------------------------------------------------------------ state

    def initialize(self, seed: int) -> None:
        """Load the deterministic initial parameters of :func:`emu.engine.model.init_full_state`."""
        self.load_full_state(init_full_state(self.spec, value_head=self.value_head, seed=seed,
                                             names=list(self.params)))

    @torch.no_grad()
    def load_full_state(self, state: dict[str, torch.Tensor]) -> None:
        """Keep this rank's shard of canonical full tensors (HF names; extra names are ignored).

        Raises:
            NereusError: if a parameter of this shard is missing or has the wrong full shape.
        """
        for name, param in self.params.items():
            if name not in state:
                raise NereusError(f"{self.ms}: load_full_state: missing {name!r}")
            shard = shard_full_tensor(name, state[name], self.spec, self.groups.tp.size, self.groups.tp_rank)
            if shard.shape != param.shape:
                raise NereusError(f"{self.ms}: load_full_state: {name} shard {tuple(shard.shape)} "
                                  f"!= expected {tuple(param.shape)} (full {tuple(state[name].shape)})")
            param.copy_(shard)

    @torch.no_grad()
    def full_state(self) -> dict[str, torch.Tensor]:
        """Canonical full tensors of the replica, gathered on every rank of it (this engine's device)."""
        local = {n: gather_tp(n, p, self.spec, self.groups) for n, p in self.params.items()}
        return gather_pp(local, self.spec, self.value_head, self.groups)

    @torch.no_grad()
    def optimizer_full_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """Adam state per canonical parameter: ``{name: {"exp_avg", "exp_avg_sq" (full shape), "step" (0-d)}}``.

        Empty before the first step. Gathered on every rank of the replica.
        """
        if self.optimizer is None or not self.optimizer.state:
            return {}
        local: dict[str, torch.Tensor] = {}
        step = 0.0
        for name, p in self.params.items():
            st = self.optimizer.state[p]
            step = float(st["step"])
            for key in ("exp_avg", "exp_avg_sq"):
                local[f"{name}#{key}"] = gather_tp(name, st[key], self.spec, self.groups)
        full = gather_pp(local, self.spec, self.value_head, self.groups, suffixes=("#exp_avg", "#exp_avg_sq"))
        out: dict[str, dict[str, torch.Tensor]] = {}
        for key, tensor in full.items():
            name, what = key.split("#")
            out.setdefault(name, {"step": torch.tensor(step)})[what] = tensor
        return out

    @torch.no_grad()
    def load_optimizer_full_state(self, state: dict[str, dict[str, torch.Tensor]]) -> None:
        """Keep this rank's shard of :meth:`optimizer_full_state` output (empty: no state).

        Raises:
            NereusError: if the engine is not trainable or a parameter's entry is missing.
        """
        if self.optimizer is None:
            raise NereusError(f"{self.ms}: load_optimizer_full_state on a non-trainable engine")
        if not state:
            self.optimizer.state.clear()
            return
        tp, tp_rank = self.groups.tp.size, self.groups.tp_rank
        for name, p in self.params.items():
            if name not in state:
                raise NereusError(f"{self.ms}: load_optimizer_full_state: missing {name!r}")
            entry = state[name]
            self.optimizer.state[p] = {
                "step": torch.tensor(float(entry["step"]), dtype=torch.float32),
                **{k: shard_full_tensor(name, entry[k], self.spec, tp, tp_rank).to(p.device).clone()
                   for k in ("exp_avg", "exp_avg_sq")},
            }

    def parameter_bytes(self) -> int:
        """Bytes of this rank's parameter shard."""
        return self._param_bytes

    def peak_memory_bytes(self) -> int:
        """Peak booked bytes of this device (all model-stages on it), see :class:`DeviceMemory`."""
        return self.memory.peak_bytes

    # ------------------------------------------------------------------ generation

    def generate(self, prompts: list[list[int]], *, max_new_tokens: int, temperature: float = 1.0,
                 greedy: bool = False, stop_ids: tuple[int, ...] = (), pad_id: int = 0,
                 seed: int = 0, seeds: Optional[list[int]] = None) -> list[list[int]]:
        """Responses for this replica's prompts (:func:`emu.engine.generate.generate`), on every TP rank.

        At most ``micro_batch`` sequences decode concurrently (the planner's generation wave, paper
        §4.2): a larger share runs in waves, wave ``w > 0`` sampling from a seed derived from
        ``seed`` and ``w`` (one wave uses ``seed`` itself); with per-sequence ``seeds`` the draws
        do not depend on waves or replicas at all.

        Raises:
            PlanError: for a value-head model; DeviceOutOfMemory: if the KV cache or prefill
            activations do not fit (checked before any work).
        """
        if self.value_head:
            raise PlanError(f"{self.ms}: a value-head model cannot generate")
        if self.candidate.pp > 1:
            raise PlanError(f"{self.ms}: generation needs pp=1 (PP is folded into DP for generation)")
        if not prompts:
            return []
        if len(prompts) > self.micro_batch:  # waves of ``micro_batch`` concurrent sequences
            out: list[list[int]] = []
            for w, lo in enumerate(range(0, len(prompts), self.micro_batch)):
                out += self.generate(prompts[lo:lo + self.micro_batch], max_new_tokens=max_new_tokens,
                                     temperature=temperature, greedy=greedy, stop_ids=stop_ids, pad_id=pad_id,
                                     seed=seed if w == 0 else (seed ^ (w * 0x9E3779B1)) & 0x7FFFFFFF,
                                     seeds=None if seeds is None else seeds[lo:lo + self.micro_batch])
            return out
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, greedy=greedy,
                                stop_ids=tuple(stop_ids), pad_id=pad_id, seed=seed,
                                seeds=None if seeds is None else tuple(seeds))
        width = max(len(p) for p in prompts)
        shape = kv_cache_shape(self.module, len(prompts), width + max_new_tokens)
        act = sum(prefill_activation_bytes(self.spec, tp=self.groups.tp.size, layers=len(self.layers),
                                           batch=len(prompts), prompt=width, act_bytes=self._act_bytes))
        self.memory.allocate(self.ms, "kv_cache", KVCache.nbytes_for(*shape))
        try:
            self.memory.allocate(self.ms, "activations", act)
            layers, b, kvh, max_len, d = shape
            cache = KVCache(list(self.layers), b, kvh, max_len, d, self.device)
            return generate(self.module, prompts, params, groups=self.groups, device=self.device, kv_cache=cache)
        finally:
            self.memory.free(self.ms, "activations")
            self.memory.free(self.ms, "kv_cache")

    # ------------------------------------------------------------------ forward passes

    def logprobs(self, sequences: list[list[int]], prompt_lens: list[int]) -> Optional[list[list[float]]]:
        """Per response token ``log p(token | prefix)``; ``None`` off the last pipeline stage."""
        if self.value_head:
            raise PlanError(f"{self.ms}: logprobs needs an LM head, this model has a value head")
        return self._read(sequences, self._response_index(sequences, prompt_lens), "logprobs")

    def values(self, sequences: list[list[int]], prompt_lens: list[int]) -> Optional[list[list[float]]]:
        """Per response token, the value head at the position before it; ``None`` off the last stage."""
        if not self.value_head:
            raise PlanError(f"{self.ms}: values needs a value head")
        return self._read(sequences, self._response_index(sequences, prompt_lens), "values")

    def scores(self, sequences: list[list[int]]) -> Optional[list[float]]:
        """Value head at each sequence's last token (reward model); ``None`` off the last stage."""
        if not self.value_head:
            raise PlanError(f"{self.ms}: scores needs a value head")
        if any(not s for s in sequences):
            raise ValueError(f"{self.ms}: scores of an empty sequence (sequence {[len(s) for s in sequences].index(0)})")
        out = self._read(sequences, [[len(s) - 1] for s in sequences], "values")
        return None if out is None else [row[0] for row in out]

    def _response_index(self, sequences: list[list[int]], prompt_lens: list[int]) -> list[list[int]]:
        if len(sequences) != len(prompt_lens):
            raise ValueError(f"{len(sequences)} sequences but {len(prompt_lens)} prompt_lens")
        out = []
        for seq, pl in zip(sequences, prompt_lens):
            if not 1 <= pl <= len(seq):
                raise ValueError(f"prompt_len {pl} outside [1, {len(seq)}] for a sequence of {len(seq)} tokens")
            out.append(list(range(pl - 1, len(seq) - 1)))
        return out

    @torch.no_grad()
    def _read(self, sequences: list[list[int]], index: list[list[int]], key: str) -> Optional[list[list[float]]]:
        if not sequences:
            return [] if self.groups.is_last_stage else None
        batch = PackedBatch.build(sequences, index, self.micro_batch, self.device,
                                  max_tokens=self.max_tokens_per_micro_batch)
        results = self._run(batch, lambda out, i: self._head(out, batch, i, entropy=False)[key], train=False)
        if not self.groups.is_last_stage:
            return None
        width = batch.index.shape[1]
        rows = torch.cat([torch.nn.functional.pad(r, (0, width - r.shape[1])) for r in results])
        return batch.rows_of(rows.cpu(), [len(ix) for ix in index])

    def _head(self, out: torch.Tensor, batch: "PackedBatch", i: int, entropy: bool) -> dict[str, torch.Tensor]:
        """Per-token outputs ``[mb, t]`` of micro-batch ``i`` from the last stage's output.

        ``t = batch.head_width(i)``: the head gathers and reduces only the read positions this
        micro-batch has, not the call's width ``T`` (the later columns are padding in all its rows).
        """
        t = batch.head_width(i)
        idx = batch.micro(batch.index, i)[:, :t]
        if self.value_head:
            return {"values": out.gather(1, idx)}
        picked = out.gather(1, idx[..., None].expand(-1, -1, out.shape[-1]))
        lp, ent = vocab_parallel_logprobs_entropy(picked, batch.micro(batch.targets, i)[:, :t], self.groups.tp, entropy)
        return {"logprobs": lp, "entropy": ent} if entropy else {"logprobs": lp}

    def _run(self, batch: "PackedBatch", head_fn, train: bool) -> list:
        """Run every micro-batch (pipelined when ``pp > 1``) with activations booked first.

        Training books the micro-batches a stage holds at once (:func:`pipeline_in_flight`);
        inference runs under ``no_grad``, so a stage holds one micro-batch's layer at a time
        whatever the schedule, as the memory model predicts (``stage_memory``). (It booked the
        in-flight count for inference too: a pp-2 inference stage asked for twice what the plan
        was priced at and failed out of memory in the demo.)

        Padded micro-batches at ``pp == 1`` are cut to their own longest sequence; pipeline stages
        exchange one shape, so there every micro-batch keeps the call's width.
        """
        n, mb, seq = batch.n_micro, batch.mb, batch.tokens.shape[1]
        tp, pp = self.groups.tp.size, self.candidate.pp
        per_mb = micro_batch_activation_bytes(
            self.spec, tp=tp, layers=len(self.layers), batch=mb, seq=seq, act_bytes=self._act_bytes, train=train,
            recompute=self.recompute, first_stage=self.groups.pp_rank == 0, last_stage=self.groups.is_last_stage,
            head_positions=batch.index.shape[1], vocab_head=not self.value_head, packed=batch.segments is not None)
        module = self.module if batch.segments is None else _PackedRows(self.module, batch)
        in_flight = pipeline_in_flight(n, pp, self.groups.pp_rank) if train else 1
        self.memory.allocate(self.ms, "activations", per_mb * in_flight)
        try:
            if pp == 1:
                results = []
                for i in range(n):
                    tokens = batch.micro(batch.tokens, i)
                    if batch.segments is None:
                        tokens = tokens[:, :max(1, int((batch.micro(batch.positions, i) >= 0).sum(1).max()))]
                    res = head_fn(module(tokens), i)
                    if train:
                        self._backward(res, last=i == n - 1)
                    results.append(res)
                return results
            out_shape = (mb, seq) if self.value_head else (mb, seq, self.spec.vocab_size // tp)
            return run_pipeline(module, self.groups, self.device,
                                tokens=batch.tokens if self.groups.is_first_stage else None, n_micro=n,
                                hidden_size=self.spec.hidden_size, out_shape=out_shape,
                                loss_fn=lambda out, index: head_fn(out, int(index[0])), train=train)
        finally:
            self.memory.free(self.ms, "activations")

    # ------------------------------------------------------------------ training

    def train_step(self, sequences: list[list[int]], prompt_lens: list[int],
                   per_token: dict[str, list[list[float]]], loss_fn: LossFn) -> dict[str, float]:
        """One optimizer step over this replica's share (see module docstring for the loss).

        Args:
            per_token: per response token inputs of the loss (e.g. ``weight``, ``advantages``,
                ``old_logprobs``), each ``len(sequences)`` lists of ``len(seq) - prompt_len``.
            loss_fn: ``(outputs, batch) -> (loss, metrics)``; ``outputs`` holds ``logprobs`` and
                ``entropy`` (policy) or ``values`` (critic), ``batch`` the ``per_token`` tensors
                and ``mask``, all ``[mb, t]`` float (``t``: the micro-batch's most response
                tokens); rows and tokens beyond the data are 0 in every ``batch`` tensor, so a
                weighted SUM ignores them.

        Returns:
            ``loss``, ``loss_fn``'s metrics (each summed over micro-batches and DP replicas) and
            ``grad_norm`` (before clipping), identical on every rank of the model-stage.

        Raises:
            NereusError: if the engine is not trainable.
        """
        if not self.trainable:
            raise NereusError(f"{self.ms}: train_step on a non-trainable engine")
        index = self._response_index(sequences, prompt_lens)
        sums: dict[str, float] = {}

        def head_fn(out: torch.Tensor, i: int) -> torch.Tensor:
            outputs = self._head(out, batch, i, entropy=True)
            width = next(iter(outputs.values())).shape[1]  # batch.head_width(i)
            inputs = {k: batch.micro(v, i)[:, :width] for k, v in batch.per_token.items()}
            loss, metrics = loss_fn(outputs, inputs)
            for k, v in {"loss": loss, **metrics}.items():
                sums[k] = sums.get(k, 0.0) + float(v.detach())
            return loss

        self._zero_grad()
        batch = PackedBatch.build(sequences, index, self.micro_batch, self.device, per_token,
                                  max_tokens=self.max_tokens_per_micro_batch) if sequences else None
        self._begin_step(batch.n_micro if batch is not None else 0)
        if batch is not None:
            self._run(batch, head_fn, train=True)
        grad_norm = self._optimizer_step()
        metrics = self._reduce_metrics(sums)
        metrics["grad_norm"] = grad_norm
        cuda_peak = self.memory.cuda_peak_bytes()
        if cuda_peak is not None:
            metrics["cuda_peak_bytes"] = float(cuda_peak)
        return metrics

    # Hooks of one optimizer step; the DeepSpeed engine (emu.engine.deepspeed_stage) replaces them.
    def _zero_grad(self) -> None:
        for p in self.params.values():
            p.grad.zero_()

    def _begin_step(self, n_micro: int) -> None:
        """The step will run ``n_micro`` micro-batches on this replica (0: no share)."""

    def _backward(self, loss: torch.Tensor, last: bool) -> None:
        """Backward of one micro-batch's loss (``last``: the step's final micro-batch)."""
        loss.backward()

    def _optimizer_step(self) -> float:
        """Reduce gradients (TP-replicated, then DP SUM), clip, step Adam → the norm before clipping."""
        self._reduce_gradients()
        grad_norm = self._clip_gradients()
        self.optimizer.step()
        return grad_norm

    def _reduce_gradients(self) -> None:
        g = self.groups
        for name in replicated_grad_names(list(self.params), self.spec, g.tp.size):
            dist.all_reduce(self.params[name].grad, group=g.tp.group)
        if g.dp_group is not None:
            grads = [p.grad for p in self.params.values()]
            flat = torch._utils._flatten_dense_tensors(grads)
            dist.all_reduce(flat, group=g.dp_group)
            for grad, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
                grad.copy_(synced)

    @torch.no_grad()
    def _clip_gradients(self) -> float:
        """Global L2 norm over every shard of the replica; scale grads to ``grad_clip`` if above."""
        g, tp = self.groups, self.groups.tp.size
        sq = torch.zeros((), dtype=torch.float64, device=self.device)
        for name, p in self.params.items():
            if shard_dim(name, self.spec, tp) is not None or g.tp_rank == 0:
                sq += p.grad.double().pow(2).sum()
        if g.tp.group is not None:
            dist.all_reduce(sq, group=g.tp.group)
        if g.pp_group is not None:
            dist.all_reduce(sq, group=g.pp_group)
        norm = float(sq.sqrt())
        if self.grad_clip is not None:
            coef = self.grad_clip / (norm + 1e-6)
            if coef < 1.0:
                for p in self.params.values():
                    p.grad.mul_(coef)
        return norm

    def _reduce_metrics(self, sums: dict[str, float]) -> dict[str, float]:
        g = self.groups
        if g.is_last_stage and g.dp_group is not None:
            parts: list = [None] * len(g.dp_ranks)
            dist.all_gather_object(parts, sums, group=g.dp_group)
            sums = {}
            for part in parts:
                for k, v in part.items():
                    sums[k] = sums.get(k, 0.0) + v
        if g.pp_group is not None:
            box = [sums]
            dist.broadcast_object_list(box, group=g.pp_group,
                                       group_src=StageGroups.group_rank(g.pp_ranks, self.candidate.pp - 1))
            sums = box[0]
        return dict(sums)


class _PackedRows(torch.nn.Module):
    """``module`` called on packed rows: each forward gets the next micro-batch's positions and
    segments. Pipeline schedules (1F1B, GPipe) run a stage's forwards in micro-batch order, and
    recomputation re-runs layers, not this call, so a counter names the micro-batch."""

    def __init__(self, module: LlamaModel, batch: PackedBatch) -> None:
        super().__init__()
        self.inner, self._batch, self._next = module, batch, 0

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        i, self._next = self._next, self._next + 1
        positions = self._batch.micro(self._batch.positions, i).clamp(min=0)
        return self.inner(inputs, position_ids=positions, segments=self._batch.segments[i])
