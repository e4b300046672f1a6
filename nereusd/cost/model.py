"""Cost model: predicted seconds of a model-stage candidate, of an RL step, and of data movement.

Every prediction is a sum over operation classes of ``ideal_s / efficiency`` where ``ideal_s``
is the time at hardware peak (site config) and ``efficiency`` comes from
:class:`~nereusd.cost.calibration.Calibration` (paper §4.2). Formulas (DESIGN.md "Cost model"):

- training FLOPs per token ``6·P + 12·L·q·s`` (Narayanan et al. 2021, "Efficient Large-Scale
  Language Model Training on GPU Clusters", Eq. 3, with ``q = heads·head_dim``), ``8·P + 16·L·q·s``
  with full recomputation; inference ``2·P + 4·L·q·s``;
- a decode step's GEMMs and its attention are kernels of their own, each at its roofline time
  (Williams et al. 2009): the slower of reading the weights from HBM and the GEMM FLOPs at peak,
  plus the slower of reading the KV cache and the attention FLOPs; in one class (``decode``)
  apart from the prefill's large GEMMs;
- TP: two all-reduces per layer forward, four with backward (Shoeybi et al. 2019, §3), of
  ``b·s·h`` activations; all-reduce ``2(n−1)/n · bytes / bw + 2⌈log2 n⌉·α`` (ring bandwidth,
  Rabenseifner latency: Thakur et al. 2005, :func:`~nereusd.cost.formulas.ring_collective_parts`),
  its two terms calibrated as separate classes (the collective's, and ``latency_<link>`` for
  the per-call α, which dominates small messages: gloo's ~5 ms per call here); plus the
  vocab-parallel embedding's forward all-reduce, and with a language-model head the head
  input's gradient all-reduce and the log-probabilities' per-position reductions
  (:data:`VOCAB_LOSS_ALL_REDUCES_TRAIN`, Shoeybi et al. 2019, §3);
- a fixed dispatch time per layer and pass (site ``layer_launch_us``, class ``launch``) that does
  not shrink with the batch: one pass per micro-batch forward, three with backward, four with
  recomputation; one per decode step, and one for each wave's prefill;
- PP: ``(m + pp − 1)`` micro-batch slots for ``m`` micro-batches (GPipe/1F1B bubble
  ``(pp−1)/(m+pp−1)``, Narayanan et al. 2021 §2.2), plus the p2p calls of the busiest stage per
  slot: a middle stage (``pp > 2``) receives and sends each micro-batch's activations, and with
  backward its gradients. ``torch.distributed.pipelining``'s 1F1B batches each step's forward
  send with a backward receive and vice versa (``batch_isend_irecv``): NCCL and RCCL run a batch
  as one group call, so every stage pays 2 calls' α with backward; gloo runs each op on its own,
  so a middle stage pays 4 (:attr:`~nereusd.config.site.SiteConfig.batches_p2p`). A forward-only
  pass has nothing to pair: a middle stage pays 2, an end stage 1, on any backend (GPipe, which
  the engine runs when there are fewer micro-batches than stages, pairs nothing either: not
  modelled); on virtual CPU
  devices that share a node's cores, a stage holding the whole node reclaims its bubble
  (:func:`~nereusd.cost.formulas.pipeline_slots`);
- DP: ring all-reduce of the gradient shard ``P/(tp·pp)`` per optimizer step on the slowest
  link of the group;
- the step latency is the critical path of the execution-overlap graph
  (:meth:`nereusd.workflow.Workflow.critical_path_s`).

Placement assumption: replicas are packed node by node (what :mod:`nereusd.planner.placement` does), so
a TP group crosses nodes only when ``tp > devices_per_node``, a pipeline when ``tp·pp >
devices_per_node`` and a DP group when ``tp·pp·dp > devices_per_node``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

from nereusd.cost.calibration import (ATTENTION, DECODE, GEMM, LAUNCH, OPTIMIZER, Calibration, comm_class,
                                      generation_class, grad_sync_class, latency_class)
from nereusd.cost.formulas import (adam_update_s, continuous_batching, decode_step_s, p2p_parts, p2p_s, pipeline_slots,
                                   ring_collective_parts)
from nereusd.cost.memory import dtype_bytes, kv_bytes_per_token, micro_batches_per_call, parameters_per_device
from nereusd.models import ModelSpec
from nereusd.plan import ModelStage, Role, Stage
from nereusd.config.site import SiteConfig
from nereusd.shards import value_head_for



@dataclass(frozen=True)
class StageCost:
    """Predicted seconds of one model-stage per RL step.

    ``ideal_s_by_class`` are seconds at peak (efficiency 1) on the critical path, per
    operation class; ``latency_s = Σ ideal / efficiency``. Calibration learns from the pair.
    """

    latency_s: float
    ideal_s_by_class: Mapping[str, float]


class _Acc:
    """Accumulates ideal seconds per class."""

    def __init__(self) -> None:
        self.ideal: dict[str, float] = {}

    def add(self, op_class: str, seconds: float) -> None:
        if seconds > 0:
            self.ideal[op_class] = self.ideal.get(op_class, 0.0) + seconds

    def scaled(self, factor: float) -> "_Acc":
        out = _Acc()
        out.ideal = {k: v * factor for k, v in self.ideal.items()}
        return out

    def merge(self, other: "_Acc") -> None:
        for k, v in other.ideal.items():
            self.add(k, v)

    def renamed(self, classes) -> "_Acc":
        """The same seconds with each class mapped by ``classes`` (e.g. to a generation engine's)."""
        out = _Acc()
        for k, v in self.ideal.items():
            out.add(classes(k), v)
        return out


VOCAB_LOSS_ALL_REDUCES_TRAIN = 4
"""Per-position all-reduces of a training micro-batch's vocab-parallel log-probabilities
(:func:`emu.engine.parallel.vocab_parallel_logprobs_entropy`): the maximum, the sum of
exponentials, the target logit and the entropy's sum (Megatron's vocab-parallel cross entropy,
Shoeybi et al. 2019, §3, plus the entropy the policy loss reads)."""
VOCAB_LOSS_ALL_REDUCES_INFER = 3
"""The same for an inference pass, which reads log-probabilities without the entropy."""


def measured_classes(site: SiteConfig) -> dict[str, float]:
    """The operation classes ``site`` measured on their own, with their efficiency: the training
    engines' all-reduce inside and across nodes where the site gives
    ``network.intra_node_all_reduce_efficiency`` / ``inter_node_all_reduce_efficiency``
    (nccl-tests; 0 is not measured). :class:`CostModel` pins them on its calibration."""
    net = site.network
    return {comm_class("all_reduce", link): e for link, e in (("intra", net.intra_node_all_reduce_efficiency),
                                                              ("inter", net.inter_node_all_reduce_efficiency))
            if e > 0}


def layer_parameters(spec: ModelSpec) -> int:
    """Weights of one decoder layer (q, k, v, o projections and SwiGLU MLP; norms excluded)."""
    h, d = spec.hidden_size, spec.head_dim
    return 2 * spec.num_heads * d * h + 2 * spec.num_kv_heads * d * h + 3 * spec.intermediate_size * h


class CostModel:
    """Pure cost arithmetic for one site and one calibration state.

    Args:
        site: hardware peaks and links.
        calibration: efficiencies per operation class (a fresh, prior-only one if omitted).
        dtype: compute dtype (default: the site's ``compute_dtype``).
        site_measured: pin the classes the site measured (:func:`measured_classes`) on
            ``calibration``; ``False`` only for a simulator's ground truth, whose efficiencies
            are its own.
    """

    def __init__(self, site: SiteConfig, calibration: Calibration | None = None, dtype: str | None = None, *,
                 site_measured: bool = True):
        self.site = site
        self.calibration = calibration or Calibration()
        for op_class, efficiency in measured_classes(site).items() if site_measured else ():
            self.calibration.pin(op_class, efficiency)
        self.dtype = dtype or site.compute_dtype
        self.bytes_per_element = dtype_bytes(self.dtype)
        self.peak_flops = site.peak_flops(self.dtype)
        self._eff: dict[str, float] = {}
        self._cache: dict[tuple, _Acc] = {}
        self._specs: dict[int, tuple[ModelSpec, int]] = {}

    def efficiency(self, op_class: str) -> float:
        """Efficiency of ``op_class``, read once from the calibration (see :meth:`refresh`)."""
        value = self._eff.get(op_class)
        if value is None:
            value = self._eff[op_class] = self.calibration.efficiency(op_class)
        return value

    def refresh(self) -> None:
        """Forget cached efficiencies (and costs that depend on them) after calibrating."""
        self._eff.clear()
        self._cache.clear()

    # ---- links -------------------------------------------------------------------------------
    def link(self, spans_nodes: bool) -> tuple[str, float, float]:
        """``(link type, bandwidth bytes/s, latency s)`` for a group inside a node or across nodes."""
        net = self.site.network
        if spans_nodes:
            return "inter", net.inter_node_gbps * 1e9, net.inter_node_latency_us * 1e-6
        return "intra", net.intra_node_gbps * 1e9, net.intra_node_latency_us * 1e-6

    def latency_growth(self, link: str) -> float:
        """The site's measured growth of a small collective's latency with the group on ``link``
        (``"intra"`` or ``"inter"``; :func:`~nereusd.cost.formulas.ring_collective_parts`)."""
        net = self.site.network
        return net.inter_node_latency_growth if link == "inter" else net.intra_node_latency_growth

    def spans_nodes(self, devices: int) -> bool:
        """Whether a packed group of ``devices`` consecutive devices crosses a node boundary."""
        return devices > self.site.devices_per_node

    def _ring(self, acc: _Acc, collective: str, nbytes: float, n: int, spans: bool, count: float = 1.0,
              grad_sync: bool = False) -> None:
        """``count`` ring collectives of ``nbytes`` over ``n`` ranks: bytes over bandwidth in the
        collective's class (:func:`grad_sync_class` for the DP gradient all-reduce,
        ``grad_sync``), per-call latency in :func:`latency_class`
        (:func:`~nereusd.cost.formulas.ring_collective_parts`)."""
        if n <= 1 or count <= 0:
            return
        link, bw, alpha = self.link(spans)
        bandwidth_s, per_call_s = ring_collective_parts(collective, nbytes, n, bw, alpha, self.latency_growth(link))
        acc.add(grad_sync_class(link) if grad_sync else comm_class(collective, link), bandwidth_s * count)
        acc.add(latency_class(link), per_call_s * count)

    def _p2p(self, acc: _Acc, nbytes: float, spans: bool, count: float = 1.0, collective: str = "p2p") -> None:
        """``count`` messages of ``nbytes`` (``collective``: the class, ``p2p`` or ``broadcast``)."""
        link, bw, alpha = self.link(spans)
        bandwidth_s, per_call_s = p2p_parts(nbytes, bw, alpha)
        acc.add(comm_class(collective, link), bandwidth_s * count)
        acc.add(latency_class(link), per_call_s * count)

    def transfer_s(self, nbytes: float, link: str, collective: str = "broadcast", concurrent: int = 1) -> float:
        """Transition-cost hook: seconds to move ``nbytes`` per sender over ``link``.

        For the transition DAG (DESIGN.md "Transition cost"): one primitive sends ``nbytes``
        from each source rank over ``link`` (``"intra"`` or ``"inter"``) with ``concurrent``
        transfers sharing the same per-device link; ``collective`` picks the calibrated class
        (``broadcast``, ``all_gather``, ``p2p``). Add :meth:`communicator_setup_s` per new group.
        """
        if nbytes <= 0:
            return 0.0
        _, bw, alpha = self.link(link == "inter")
        return p2p_s(nbytes * max(1, concurrent), bw, alpha) / self.efficiency(comm_class(collective, link))

    def communicator_setup_s(self, count: int = 1) -> float:
        """Seconds to create ``count`` communicators one after another (site figure)."""
        return self.site.network.communicator_setup_s * max(0, count)

    # ---- model-stages ------------------------------------------------------------------------
    def stage_cost(
        self,
        spec: ModelSpec,
        model_stage: ModelStage,
        *,
        sequences: int,
        prompt_length: int,
        response_length: int,
        tp: int,
        pp: int,
        dp: int,
        micro_batch: int,
        mini_batches: int = 1,
        recompute: bool = False,
        response_mean_fraction: float = 1.0,
        epochs: int = 1,
    ) -> StageCost:
        """Predicted seconds of ``model_stage`` as ``⟨tp, pp, dp⟩`` for one RL step.

        Args:
            sequences: sequences of the step (all replicas); a replica gets ``ceil(sequences/dp)``
                — the slowest replica sets the latency.
            response_length: generation: the step's longest response (tokens); training and
                inference price every sequence at ``prompt_length + response_length``, so
                callers pass the width the engine pads rows to
                (:meth:`nereusd.workflow.Workload.priced_pass`).
            micro_batch: per-replica micro-batch ``b`` (sequences); for generation the
                concurrent sequences (KV-cache slots) of a replica.
            mini_batches: optimizer steps per pass over the step's sequences (training).
            response_mean_fraction: mean response length over ``response_length``, in (0, 1]
                (generation's continuous batching, :func:`~nereusd.cost.formulas.continuous_batching`).
            epochs: passes over the step's sequences (training; ``train.epochs``, PPO epochs):
                each repeats the pass's micro-batches and optimizer steps, so training costs
                ``epochs`` times one pass.
        """
        acc = _Acc()
        per_replica = math.ceil(sequences / dp)
        if model_stage.stage is Stage.GENERATION:
            self._generation(acc, spec, per_replica, min(micro_batch, per_replica), prompt_length,
                             response_length, tp, pp, dp, response_mean_fraction)
        else:
            training = model_stage.stage is Stage.TRAINING
            self._forward_backward(acc, spec, model_stage.role, per_replica, prompt_length + response_length,
                                   tp, pp, dp, micro_batch, mini_batches if training else 1, training, recompute)
            if training and epochs != 1:
                acc = acc.scaled(epochs)
        eff = self.efficiency
        latency = sum(s / eff(c) for c, s in acc.ideal.items())
        return StageCost(latency, MappingProxyType(dict(acc.ideal)))

    def stage_latency(
        self,
        spec: ModelSpec,
        model_stage: ModelStage,
        *,
        sequences: int,
        prompt_length: int,
        response_length: int,
        tp: int,
        pp: int,
        dp: int,
        micro_batch: int,
        mini_batches: int = 1,
        recompute: bool = False,
        response_mean_fraction: float = 1.0,
        epochs: int = 1,
    ) -> tuple[float, dict[str, float]]:
        """Fast path of :meth:`stage_cost` for the planner's enumeration: ``(latency_s,
        ideal_s_by_class)`` with the same floating-point operations in the same order (so the
        same bits), but per-micro-batch and per-decode costs, parameter counts and
        efficiencies looked up once per shape instead of rebuilt per candidate.

        Same arguments and units as :meth:`stage_cost`.
        """
        per_replica = -(-sequences // dp)
        cache = self._cache
        if model_stage.stage is Stage.GENERATION:
            concurrent = max(1, min(micro_batch, per_replica))
            waves = -(-per_replica // concurrent)
            prefill = self._per_mb_items(spec, True, prompt_length, tp, pp, concurrent, False, False, launch=False,
                                         prefill=True)
            slots = pipeline_slots(waves, pp, self.site.lone_speedup(tp * pp * dp))
            ideal = {generation_class(k): v * slots for k, v in prefill}
            key = ("decode", self._spec_key(spec), per_replica, concurrent, prompt_length, response_length,
                   response_mean_fraction, tp, pp)
            decode = cache.get(key)
            if decode is None:
                decode = cache[key] = self._decode(spec, per_replica, concurrent, prompt_length, response_length,
                                                   response_mean_fraction, tp, pp)
            for k, v in decode.ideal.items():
                ideal[k] = ideal.get(k, 0.0) + v
            for k, v in self._weight_sync(spec, tp, pp, dp).ideal.items():
                ideal[k] = ideal.get(k, 0.0) + v
        else:
            training = model_stage.stage is Stage.TRAINING
            minis = mini_batches if training else 1
            b = max(1, min(micro_batch, per_replica))
            micro_per_opt = micro_batches_per_call(per_replica, b, minis)
            lm_head = not value_head_for(model_stage.role)
            per_mb = self._per_mb_items(spec, lm_head, prompt_length + response_length, tp, pp, b,
                                        training, recompute)
            slots = minis * pipeline_slots(micro_per_opt, pp, self.site.lone_speedup(tp * pp * dp))
            ideal = {k: v * slots for k, v in per_mb}
            if training:
                for k, v in self._optimizer_step(spec, tp, pp, dp, minis, not lm_head).ideal.items():
                    ideal[k] = ideal.get(k, 0.0) + v
                if epochs != 1:
                    ideal = {k: v * epochs for k, v in ideal.items()}
        eff = self._eff
        latency = 0
        for c, s in ideal.items():
            e = eff.get(c)
            if e is None:
                e = self.efficiency(c)
            latency += s / e
        return latency, ideal

    def _per_mb_items(self, spec: ModelSpec, lm_head: bool, seq: int, tp: int, pp: int, b: int,
                      training: bool, recompute: bool, launch: bool = True,
                      prefill: bool = False) -> tuple[tuple[str, float], ...]:
        """Cached ``(class, ideal s)`` items of :meth:`_micro_batch` (shared with :meth:`stage_cost`)."""
        key = ("mb_items", self._spec_key(spec), lm_head, seq, tp, pp, b, training, recompute, launch, prefill)
        items = self._cache.get(key)
        if items is None:
            items = self._cache[key] = tuple(self._per_mb(spec, lm_head, seq, tp, pp, b, training, recompute,
                                                           launch, prefill).ideal.items())
        return items

    def _per_mb(self, spec: ModelSpec, lm_head: bool, seq: int, tp: int, pp: int, b: int, training: bool,
                recompute: bool, launch: bool, prefill: bool = False) -> _Acc:
        """:meth:`_micro_batch`, cached (the one cache key of a micro-batch's cost)."""
        key = ("mb", self._spec_key(spec), lm_head, seq, tp, pp, b, training, recompute, launch, prefill)
        per_mb = self._cache.get(key)
        if per_mb is None:
            per_mb = self._cache[key] = self._micro_batch(spec, lm_head, seq, tp, pp, b, training, recompute,
                                                          launch, prefill)
        return per_mb

    def _params(self, spec: ModelSpec, tp: int, pp: int, value_head: bool = False) -> int:
        """Cached :func:`~nereusd.cost.memory.parameters_per_device`."""
        key = ("params", self._spec_key(spec), tp, pp, value_head)
        value = self._cache.get(key)
        if value is None:
            value = self._cache[key] = parameters_per_device(spec, tp, pp, value_head)
        return value

    def _spec_key(self, spec: ModelSpec) -> int:
        """A small cache key for ``spec`` (hashing the dataclass's fields on every lookup is
        slow); the spec is kept referenced so its ``id`` cannot be reused while cached."""
        entry = self._specs.get(id(spec))
        if entry is None:
            entry = self._specs[id(spec)] = (spec, len(self._specs))
        return entry[1]

    def _flops_s(self, flops: float) -> float:
        return flops / self.peak_flops

    def _forward_backward(self, acc: _Acc, spec: ModelSpec, role: Role, per_replica: int, seq: int,
                          tp: int, pp: int, dp: int, micro_batch: int, mini_batches: int,
                          training: bool, recompute: bool, launch: bool = True, prefill: bool = False) -> None:
        """Inference (forward) or training (forward + backward) of one replica, pipelined.
        ``launch``: charge each micro-batch its per-layer dispatch (not for a generation's
        prefill, charged per wave with its decode: :meth:`_decode`); ``prefill``: the head at
        each sequence's last position only (:meth:`_micro_batch`)."""
        b = max(1, min(micro_batch, per_replica))
        micro_per_opt = micro_batches_per_call(per_replica, b, mini_batches)
        lm_head = not value_head_for(role)
        per_mb = self._per_mb(spec, lm_head, seq, tp, pp, b, training, recompute, launch, prefill)
        slots = mini_batches * pipeline_slots(micro_per_opt, pp, self.site.lone_speedup(tp * pp * dp))
        acc.merge(per_mb.scaled(slots))
        if training:
            acc.merge(self._optimizer_step(spec, tp, pp, dp, mini_batches, not lm_head))

    def _optimizer_step(self, spec: ModelSpec, tp: int, pp: int, dp: int, mini_batches: int,
                        value_head: bool = False) -> _Acc:
        """What ``mini_batches`` optimizer steps of one replica cost beyond their micro-batches
        (cached): the DP ring all-reduce of the gradient shard and the memory-bound Adam update
        (``value_head``: a critic's, :func:`~nereusd.shards.value_head_for`)."""
        key = ("opt", self._spec_key(spec), tp, pp, dp, mini_batches, value_head)
        acc = self._cache.get(key)
        if acc is None:
            acc = self._cache[key] = _Acc()
            shard = self._params(spec, tp, pp, value_head)
            self._ring(acc, "all_reduce", shard * self.bytes_per_element, dp, self.spans_nodes(tp * pp * dp),
                       count=mini_batches, grad_sync=True)
            acc.add(OPTIMIZER, adam_update_s(shard, mini_batches, self.site.hbm_bytes_per_s))
        return acc

    def _micro_batch(self, spec: ModelSpec, lm_head: bool, seq: int, tp: int, pp: int, b: int,
                     training: bool, recompute: bool, launch: bool = True, prefill: bool = False) -> _Acc:
        """One micro-batch of ``b`` sequences through one pipeline stage (the last: it has the head).

        With ``prefill`` (a generation's prompts) the head runs at each sequence's last position
        only, ``b`` rows instead of ``b·seq``: vLLM computes logits at the sampled positions
        (``LogitsProcessor`` on the sampling indices), and the native decoder
        (:func:`emu.engine.generate.generate`) slices the last position before its head. For a
        vocabulary of 151,936 and ``h`` = 896 (Qwen2.5-0.5B) the head is 28 % of the parameters,
        so pricing it at every prompt token over-counts a prefill by ~38 %.

        With ``launch``, each layer's dispatch per pass (site ``layer_launch_us``, class
        ``launch``): ``mult/2`` passes — 1 forward, 3 with backward, 4 with recomputation — what
        makes many small micro-batches slower than few large ones where the batch does not fill
        the device. On the local site (4 virtual devices, 2 cores) a training micro-batch of the
        4-layer demo model took 9–10 ms more than its FLOPs at any batch (16 sequences of 24
        tokens: 210 ms at micro-batch 1, 61 ms at 16, one thread; ``train_step``), ~0.8 ms per
        layer and pass, doubled for devices sharing cores: the site's 1,500 µs."""
        e = self.bytes_per_element
        h, q = spec.hidden_size, spec.num_heads * spec.head_dim
        tokens = b * seq
        layers = math.ceil(spec.num_layers / pp)
        head = spec.vocab_size * h if lm_head else h
        mult = (8 if recompute else 6) if training else 2
        per_mb = _Acc()
        head_rows = b if prefill else tokens
        per_mb.add(GEMM, self._flops_s(mult * (layers * layer_parameters(spec) * tokens + head * head_rows) / tp))
        per_mb.add(ATTENTION, self._flops_s(2 * mult * layers * q * seq * tokens / tp))
        if launch and self.site.layer_launch_s:
            per_mb.add(LAUNCH, self.site.layer_launch_s * layers * mult / 2)
        tp_collectives = (6 if recompute else 4) if training else 2
        spans = self.spans_nodes(tp)
        self._ring(per_mb, "all_reduce", tokens * h * e, tp, spans, count=tp_collectives * layers)
        if tp > 1 and not prefill:   # the engine's vocab-parallel layers (emu/engine/model.py, parallel.py)
            if pp == 1:   # the embedding's forward all-reduce (first stage; priced here when it is the last too)
                self._ring(per_mb, "all_reduce", tokens * h * e, tp, spans)
            if lm_head:
                if training:   # the head's input gradient (Megatron's f before a column-parallel head)
                    self._ring(per_mb, "all_reduce", tokens * h * e, tp, spans)
                losses = VOCAB_LOSS_ALL_REDUCES_TRAIN if training else VOCAB_LOSS_ALL_REDUCES_INFER
                self._ring(per_mb, "all_reduce", tokens * e, tp, spans, count=losses)
        if pp > 1:   # per micro-batch and direction a middle stage receives and sends, an end stage does one
            middle = 2 if pp > 2 else 1
            # with backward, NCCL/RCCL run each 1F1B step's send and receive as one group call
            calls = (2 * (1 if self.site.batches_p2p else middle)) if training else middle
            self._p2p(per_mb, tokens * h * e, self.spans_nodes(tp * pp), count=calls)
        return per_mb

    def _generation(self, acc: _Acc, spec: ModelSpec, per_replica: int, concurrent: int, prompt: int,
                    response: int, tp: int, pp: int, dp: int, mean_fraction: float = 1.0) -> None:
        """Prefill (compute-bound) of ``per_replica`` prompts, a continuous-batching decode of at
        most ``concurrent`` running sequences (:meth:`_decode`), and the weight synchronisation
        that precedes them (:meth:`_weight_sync`).

        The prompts are prefilled ``concurrent`` at a time in one forward pass each (vLLM
        schedules a slot's new prompts into an engine step; the native decoder runs a wave's
        prompts as one batch), ``ceil(per_replica/concurrent)`` passes, one per pipeline slot.
        Prefill and decode are priced in the generation engine's classes
        (:func:`~nereusd.cost.calibration.generation_class`)."""
        concurrent = max(1, concurrent)
        prefill = _Acc()
        self._forward_backward(prefill, spec, Role.ACTOR, per_replica, prompt, tp, pp, dp, concurrent, 1, False,
                               False, launch=False, prefill=True)
        acc.merge(prefill.renamed(generation_class))
        key = ("decode", self._spec_key(spec), per_replica, concurrent, prompt, response, mean_fraction, tp, pp)
        decode = self._cache.get(key)
        if decode is None:
            decode = self._cache[key] = self._decode(spec, per_replica, concurrent, prompt, response, mean_fraction,
                                                     tp, pp)
        acc.merge(decode)
        acc.merge(self._weight_sync(spec, tp, pp, dp))

    def weight_sync_cost(self, spec: ModelSpec, tp: int, pp: int, dp: int) -> StageCost:
        """The weight synchronisation a generation model-stage's :meth:`stage_cost` includes
        (:meth:`_weight_sync`), on its own: what to subtract to price the generation alone."""
        acc = self._weight_sync(spec, tp, pp, dp)
        eff = self.efficiency
        return StageCost(sum(s / eff(c) for c, s in acc.ideal.items()), MappingProxyType(dict(acc.ideal)))

    def _weight_sync(self, spec: ModelSpec, tp: int, pp: int, dp: int) -> _Acc:
        """Weight synchronisation from actor training into a generation replica (cached): each
        device receives its shard once, a broadcast over the link the replica set spans."""
        spans = self.spans_nodes(tp * pp * dp)
        key = ("sync", self._spec_key(spec), tp, pp, spans)
        acc = self._cache.get(key)
        if acc is None:
            acc = self._cache[key] = _Acc()
            self._p2p(acc, self._params(spec, tp, pp) * self.bytes_per_element, spans, collective="broadcast")
        return acc

    def _decode(self, spec: ModelSpec, per_replica: int, concurrent: int, prompt: int, response: int,
                mean_fraction: float, tp: int, pp: int) -> _Acc:
        """The decode of ``per_replica`` sequences, at most ``concurrent`` at once, whose longest
        response is ``response`` tokens and mean ``mean_fraction · response``.

        Continuous batching (:func:`~nereusd.cost.formulas.continuous_batching`) gives the decode
        steps and the mean running batch ``b``. Per step each stage reads its weights once per
        micro-batch in flight (pp of them) and ``b`` sequences' share of the KV cache at the mean
        context ``prompt + mean/2``. The step's GEMMs and its attention (PagedAttention, a
        kernel of its own: Kwon et al. 2023) each take their roofline time (Williams et al.
        2009), the slower of their HBM traffic (weights; KV cache) and their FLOPs at peak, and
        the two add: one roofline over both hid the KV reads behind compute-bound GEMMs, where
        vLLM on this CPU pays ~0.4 µs per sequence, step and context token. Both in class
        ``decode``, whichever bounds them: a decode step's small-batch GEMMs reach a lower
        fraction of peak than a prefill's (vLLM here: ~65 against ~100 GFLOP/s a core), so one
        class for both mispriced one or the other. Held-out generation MAPE of
        ``scripts/bench_costmodel.py``, mean over six stored runs (``--load``): 9.7 % with one
        roofline priced as ``gemm`` when compute-bound, 8.9 % as ``decode``, 8.4 % as two
        rooflines. When
        both are HBM-bound (GPU decode of small batches) the time is all the bytes over
        bandwidth, as before. Plus a fixed dispatch time per layer (site
        ``layer_launch_us``, class ``launch``) that does not shrink with the batch, for each
        decode step and each of the ``ceil(per_replica/concurrent)`` prefill passes, and two TP
        all-reduces per layer of ``b`` tokens' activations.
        """
        acc = _Acc()
        e = self.bytes_per_element
        h, d = spec.hidden_size, spec.head_dim
        layers = math.ceil(spec.num_layers / pp)
        q = spec.num_heads * d
        weights_per_device = parameters_per_device(spec, tp, pp)
        steps, batch = (float(x) for x in continuous_batching(per_replica, concurrent, response, mean_fraction))
        mean_context = prompt + mean_fraction * response / 2.0
        step_s = decode_step_s(pp * weights_per_device * e, batch * mean_context * kv_bytes_per_token(spec, tp, pp, e),
                               2 * (layers * layer_parameters(spec) + spec.vocab_size * h) * batch / tp,
                               4 * layers * q * mean_context * batch / tp, self.site.hbm_bytes_per_s, self.peak_flops)
        acc.add(DECODE, float(step_s) * steps)
        if self.site.layer_launch_s:
            passes = -(-per_replica // concurrent)
            acc.add(LAUNCH, self.site.layer_launch_s * spec.num_layers * (steps + passes))
        step = _Acc()
        self._ring(step, "all_reduce", batch * h * e / pp, tp, self.spans_nodes(tp), count=2 * spec.num_layers)
        if pp > 1:
            self._p2p(step, batch * h * e / pp, self.spans_nodes(tp * pp), count=pp)
        acc.merge(step.scaled(steps))
        return acc.renamed(generation_class)   # in the generation engine's classes
