"""A ground truth that is not the controller's cost model (issue 16, "What to build" 2).

:class:`~nereusd.sim.truth.GroundTruth` prices a step with the controller's own formulas and
hidden per-class efficiencies: a controller that calibrates those efficiencies can only look
good against it. :class:`MeasuredTruth` keeps that truth's memory, out-of-memory, noise,
contention, transition and restart behaviour, but times every model-stage with formulas of its
own, built from hardware figures and published measurements, with effects the cost model
(:mod:`nereusd.cost.model`) does not have:

Training and inference (a Megatron-style replica, 1F1B pipeline):

- **GEMMs are rooflines with wave quantisation**: ``max(FLOPs / (peak · η_gemm · u), bytes /
  (hbm · η_hbm))`` per layer pass, where ``bytes`` are the shard's weights plus the activations
  in and out, and ``u`` the share of the last wave of 128 × 128 output tiles that the device's
  SMs/CUs fill (NVIDIA, "Matrix Multiplication Background User's Guide", *wave quantisation*).
  Small per-device work — few tokens per micro-batch, or a wide TP split — runs below peak.
  The cost model charges FLOPs only.
- **Causal attention** does half the dense FLOPs (FlashAttention skips masked blocks), at its
  own efficiency (FlashAttention-2 reaches 50–73 % of A100 peak forward and less backward,
  Dao 2023 §4.1); its backward is 2.5 × its forward FLOPs (five matmuls against two).
- **Per-token work TP does not split**: RMSNorms and residual adds run replicated on every TP
  rank without sequence parallelism (Korthikanti et al. 2022, §4.2.2): ``12 · h`` bytes per token
  and layer forward, twice backward, at HBM speed.
- **Vocab-parallel loss**: the actor's and reference's logits are materialised in fp32 and read
  by the softmax and loss (4 passes of ``T · V/tp · 4`` bytes) plus three small all-reduces per
  micro-batch (max, sum of exponentials, target logit: Megatron's vocab-parallel cross entropy).
- **A kernel-launch floor**: a layer pass costs at least ``kernels × kernel_floor_s``.
- **NCCL collectives** whose latency grows with ``log2`` of the group and whose bus bandwidth
  ramps up with the message size: ``α(n) + ring_bytes / (η_link · B · s / (s + s_half))``.
- **DP gradients in fp32** (Megatron accumulates and all-reduces main gradients in fp32 under
  bf16), bucketed (25 MB, PyTorch DDP's default, Li et al. VLDB 2020) and overlapped with the
  last micro-batch's backward; only what the backward does not hide is exposed.
- **Adam** reads and writes fp32 parameter, ``m`` and ``v``, reads the fp32 gradient and writes
  the bf16 copy: 30 bytes per parameter.
- **Stragglers**: every device has a fixed speed factor ``1 + |N(0, straggler_sd)|`` (capped at
  1.25), drawn once per seed; a model-stage runs at the pace of its slowest device (Sinha et
  al., "Not All GPUs Are Created Equal", SC'22, measured up to 22 % spread among GPUs of one
  model in production clusters).

Generation (a vLLM-style engine with continuous batching):

- each step's responses have **different lengths**. The simulator's convention is that a
  trace's length is the step's *longest* response (what a live job feeds the controller, and
  what the memory truth pads); the others are ``longest · x / max(x)`` with ``x`` log-normal of
  ``σ = length_sigma`` (0.41: in the verl traces of ``../shared/traces`` the longest response of
  a batch is 1.7–4 × the mean and the shortest 0.3–0.4 ×; σ = 0.41 gives 2.5 × and 0.33 × in a
  128-sequence batch). Training and inference compute the tokens their replica holds, padded as
  the engine Nereus runs pads them (``emu.engine.stage``): by count at ``pp = 1`` each
  micro-batch to its own longest sequence (at micro-batch 1 none: verl's padding removal), at
  ``pp > 1`` every row of a call (training: one per optimizer step) to the call's longest
  (pipeline stages exchange one shape); with a token budget packed rows, padding-free. The slowest replica is the one with the most;
- a replica runs at most ``R`` sequences at once (its wave size ``micro_batch``); a finished
  sequence's slot takes the next waiting one (first come, first served), so the decode batch
  shrinks only in the tail, and the replica's time is set by its **longest slot**;
- a decode step is a roofline over the shard's weights and the running sequences' KV cache
  (at the replica's mean context), plus per step a fixed engine overhead (scheduling, sampling,
  launches) and 2 all-reduces per layer over TP (vLLM's custom all-reduce inside a node: a
  fixed latency plus the bytes at the link's bus bandwidth); pipeline parallelism runs ``pp`` micro-batches through ``pp`` stages;
- the prompts are prefilled ``R`` at a time, each pass the truth's own forward of their tokens
  (the GEMM rooflines, causal attention and the work TP does not split, as above) with two TP
  all-reduces per layer of the pass's activations at the NCCL figures (a prefill's messages,
  ``R · prompt · h`` elements, are far past the 8 MiB up to which vLLM's custom all-reduce
  runs: ``CustomAllreduce(max_size=8192 * 1024)``; larger ones go to NCCL), pipelined over
  ``pp`` stages; its logits computed at the last position only (vLLM's ``LogitsProcessor`` runs
  on the sampling indices). Until 2026-12-07 the prefill was its FLOPs at GEMM efficiency,
  without the TP all-reduces a forward pays everywhere else in this truth: on the MI250X ramp
  (Infinity Fabric at 50 GB/s) a TP-8 replica's 128 prompts of 512 tokens then cost 1.2 s where
  their 64 all-reduces alone take ~1.5 s;
- the weight synchronisation is a broadcast of the shard at the NCCL figures above.

Every figure is in :data:`DEVICE_FIGURES` and :data:`LINK_FIGURES` with its source; where no
public measurement was at hand the docstring says *assumption*. None was measured here (no
GPU). What stays the old truth's: memory and out-of-memory (the memory model with the padded
length), per-step noise, contention episodes (inter-node bandwidth × ``contention_factor``),
transitions (the transition engine under the hidden efficiencies, plus engine rebuilds) and
restarts.

The planner cannot search this truth (it searches the cost model). The simulator's oracle
therefore takes, every step, the fastest plan *under this truth* (:meth:`MeasuredTruth.rank_key`)
among the planner's plans under the old truth's efficiencies for the step's length at several
headrooms (with equal lengths and with the step's mean over longest response, which the
simulator reports to the controllers as a live step record does), for 2, 4 and 8 × that
length, and its own current plan: an upper bound on what
that candidate set holds, not on every layout.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from nereusd.cost.memory import dtype_bytes, parameters_per_device
from nereusd.cost.model import layer_parameters
from nereusd.errors import ConfigError
from nereusd.plan import Candidate, ModelStage, Plan, Role, Stage
from nereusd.planner.space import PlanProblem
from nereusd.rl.rollout import split_even
from nereusd.shards import value_head_for
from nereusd.sim.truth import GroundTruth, TruthConfig

TILE = 128
"""Output tile edge of the GEMM kernels (cuBLAS/CUTLASS's common 128 × 128 tile on Ampere and
Hopper; NVIDIA, "Matrix Multiplication Background User's Guide")."""

DDP_BUCKET_BYTES = 25 * 2**20
"""Gradient bucket (PyTorch DDP ``bucket_cap_mb = 25``, Li et al., "PyTorch Distributed",
VLDB 2020)."""

ADAM_BYTES_PER_PARAM = 30
"""fp32 parameter, ``m`` and ``v`` read and written (24), fp32 gradient read (4), bf16 copy
written (2)."""

UNSPLIT_BYTES_PER_TOKEN_HIDDEN = 12
"""Forward bytes per token, per unit of ``h``, per layer of the work TP replicates: two RMSNorms
(read and write ``h``: 4 h) and two residual adds (two reads and a write: 6 h) in bf16, rounded
up for the RoPE tables and dropout masks (assumption from counting a Llama layer's element-wise
kernels)."""

KERNELS_PER_LAYER_FORWARD = 11
"""Kernels of a Llama layer's forward: 2 norms, QKV, RoPE, attention, O, 2 residual adds, gate/up,
SwiGLU, down (counted from Megatron-core's layer with fused kernels off); backward twice as many."""

VOCAB_LOSS_ALL_REDUCES = 3
"""Small all-reduces per micro-batch of the vocab-parallel cross entropy (max, sum of
exponentials, target logit; Megatron's ``vocab_parallel_cross_entropy``)."""


@dataclass(frozen=True)
class DeviceFigures:
    """What one kind of device achieves, beyond its datasheet peaks (the site config's).

    Attributes:
        compute_units: SMs (NVIDIA) or CUs (AMD) that GEMM tiles are spread over.
        gemm_fraction: share of dense peak a large bf16 GEMM reaches.
        attention_forward, attention_backward: share of dense peak of causal flash attention.
        hbm_fraction: share of peak HBM bandwidth a streaming kernel reaches.
        kernel_floor_s: shortest a kernel takes (launch and tail), seconds.
        decode_overhead_s: an inference engine's fixed cost per decode step (scheduler,
            sampling, launches under CUDA graphs), seconds.
    """

    compute_units: int
    gemm_fraction: float
    attention_forward: float
    attention_backward: float
    hbm_fraction: float
    kernel_floor_s: float
    decode_overhead_s: float


DEVICE_FIGURES: dict[str, DeviceFigures] = {
    # 132 SMs on H100 and H200 SXM (GH100; NVIDIA H100 Tensor Core GPU Architecture whitepaper,
    # 2022). GEMM 0.75 of dense peak for large bf16 GEMMs (assumption: cuBLAS on Hopper reaches
    # 70–80 % at 8k³; end-to-end Megatron MFU of 40–52 % includes everything else). Attention
    # 0.6 / 0.45 (FlashAttention-2 paper: 50–73 % forward on A100; FA3 reaches 75 % on H100 with
    # FP16; backward lower: assumption). HBM 0.9 (assumption: STREAM-like copies reach ~90 % of
    # HBM3 peak). Kernel floor 4 µs (assumption: launch latency of a few µs). Decode overhead
    # 1.5 ms (assumption: vLLM's per-step CPU and sampling cost at small batches).
    "h100": DeviceFigures(132, 0.75, 0.60, 0.45, 0.90, 4e-6, 1.5e-3),
    # 108 SMs (NVIDIA A100 Tensor Core GPU Architecture whitepaper, 2020); Megatron-LM reached
    # 44–52 % of A100 peak end to end (Narayanan et al. 2021, Table 1), GEMMs ~0.7 (assumption).
    "a100": DeviceFigures(108, 0.70, 0.60, 0.45, 0.90, 4e-6, 2.0e-3),
    # 110 CUs per GCD (AMD CDNA 2 architecture whitepaper, 2021: 220 per MI250X). GEMM 0.5:
    # LLM training on Frontier reached 32–38 % of peak end to end (Dash et al., "Optimizing
    # Distributed Training on Frontier for Large Language Models", 2023); attention without FA3,
    # 0.4 / 0.3; HBM 0.8; kernel floor 6 µs; overhead 2.5 ms (assumptions).
    "mi250x": DeviceFigures(110, 0.50, 0.40, 0.30, 0.80, 6e-6, 2.5e-3),
    # 142 SMs (NVIDIA L40S datasheet, 2023); GDDR6 (assumptions as the A100's otherwise).
    "l40s": DeviceFigures(142, 0.70, 0.55, 0.40, 0.85, 4e-6, 2.0e-3),
}


@dataclass(frozen=True)
class LinkFigures:
    """NCCL/RCCL collectives over one kind of link, beyond the site's peak bandwidth.

    ``all_reduce(n ranks, s bytes) = latency_s · (1 + log2 n) / 2 + 2(n−1)/n · s /
    (bus_fraction · B · s / (s + half_bytes))``: latency that grows with the tree depth, bus
    bandwidth that reaches half its plateau at ``half_bytes``.

    Attributes:
        latency_s: a small all-reduce over 2 ranks, seconds.
        bus_fraction: share of the link's peak the bus bandwidth of large messages reaches.
        half_bytes: message size at which the bus bandwidth is half its plateau.
    """

    latency_s: float
    bus_fraction: float
    half_bytes: float


LINK_FIGURES: dict[str, LinkFigures] = {
    # Inside a node (NVLink/NVSwitch, Infinity Fabric, PCIe): small all-reduces of 10–20 µs and
    # bus bandwidth at ~80 % of the per-direction peak for large messages (assumption in line
    # with nccl-tests' published curves; half the plateau near 512 KiB).
    "intra": LinkFigures(12e-6, 0.80, 512 * 2**10),
    # Across nodes: a 2-node H200 NVL cluster's nccl-tests all-reduce peaks at ~35 GB/s bus
    # bandwidth for ≥ 1 GB messages over 400 Gb/s RoCE, 70 % of 50 GB/s
    # (kubernetes.recipes, "NCCL All-Reduce Benchmarking on Multi-Node GPUs"); latency 30 µs,
    # half the plateau at 4 MiB (assumptions).
    "inter": LinkFigures(30e-6, 0.70, 4 * 2**20),
}

CUSTOM_ALL_REDUCE_S = 8e-6
"""Latency of vLLM's custom all-reduce of a decode step's activations inside a node, whatever
the group (one-shot through NVLink peer memory; assumption: it exists because NCCL's ~10–20 µs
dominates at these sizes); its bytes move at the link's bus bandwidth."""


def device_figures(model: str) -> DeviceFigures:
    """The figures of a site's ``device.model`` (matched by name).

    Raises:
        ConfigError: for a device without figures (the CPU site, say).
    """
    name = model.lower().replace(" ", "")
    for key, figures in (("h200", "h100"), ("h100", "h100"), ("a100", "a100"), ("mi250x", "mi250x"), ("l40s", "l40s")):
        if key in name:
            return DEVICE_FIGURES[figures]
    raise ConfigError(f"measured ground truth: no figures for device {model!r} "
                      f"(known: H100/H200, A100, MI250X, L40S); use --truth efficiency")


class MeasuredTruth(GroundTruth):
    """The ground truth of the module docstring.

    Args:
        problem: workflow, model specs, site.
        config: the assumptions shared with :class:`~nereusd.sim.truth.GroundTruth`, plus
            ``straggler_sd`` and ``length_sigma``.

    Raises:
        ConfigError: for a site whose device has no figures (:func:`device_figures`).
    """

    ranks_by_truth = True

    def __init__(self, problem: PlanProblem, config: TruthConfig | None = None,
                 response_cap: Callable[[int], int] | None = None) -> None:
        super().__init__(problem, config, response_cap)
        site = problem.site
        self.device = device_figures(site.device.model)
        self.peak = site.peak_flops() * self.device.gemm_fraction
        self.hbm = site.hbm_bytes_per_s * self.device.hbm_fraction
        self.e = dtype_bytes(site.compute_dtype)   # activations and weights
        rng = np.random.default_rng([self.config.seed, 41])
        n = max(len(problem.pool), site.total_devices)
        self._replica_lengths: dict[tuple, float] = {}
        self.device_speed = np.minimum(1.25, 1.0 + np.abs(rng.normal(0.0, self.config.straggler_sd, n)))

    # ---- links ---------------------------------------------------------------------------
    def _link(self, spans: bool, contended: bool) -> tuple[LinkFigures, float]:
        site = self.problem.site
        if spans:
            bw = site.inter_node_gbps * 1e9 * (self.config.contention_factor if contended else 1.0)
            return LINK_FIGURES["inter"], bw
        return LINK_FIGURES["intra"], site.intra_node_gbps * 1e9

    def all_reduce_s(self, nbytes: float, ranks: int, spans: bool, contended: bool = False) -> float:
        """Seconds of one all-reduce of ``nbytes`` per rank over ``ranks`` ranks (the
        :class:`LinkFigures` formula); 0 for one rank."""
        if ranks <= 1 or nbytes <= 0:
            return 0.0
        f, bw = self._link(spans, contended)
        return _all_reduce_s(f, bw, nbytes, ranks)

    def p2p_s(self, nbytes: float, spans: bool, contended: bool = False) -> float:
        """Seconds of one point-to-point message of ``nbytes``."""
        f, bw = self._link(spans, contended)
        return f.latency_s / 2 + nbytes / _bus(f, bw, nbytes)

    def spans(self, devices: int) -> bool:
        return devices > self.problem.site.devices_per_node

    # ---- compute -------------------------------------------------------------------------
    def gemm_s(self, tokens: float, k: int, n: int, flops_mult: float = 1.0) -> float:
        """A ``[tokens × k] · [k × n]`` bf16 GEMM: roofline with wave quantisation (``flops_mult``
        scales the FLOPs and weight reads, 2 for a backward's two GEMMs)."""
        if tokens <= 0 or n <= 0:
            return 0.0
        tiles = math.ceil(tokens / TILE) * math.ceil(n / TILE)
        units = self.device.compute_units
        fill = tiles / (math.ceil(tiles / units) * units)
        compute = flops_mult * 2.0 * tokens * k * n / (self.peak * fill)
        memory = flops_mult * (k * n + tokens * (k + n)) * self.e / self.hbm
        return max(compute, memory)

    def _layer_pass_s(self, spec, tokens: float, seq: int, tp: int, backward: bool) -> float:
        """One decoder layer's forward (or backward) on one TP rank, without its collectives."""
        h, f = spec.hidden_size, spec.intermediate_size
        q = spec.num_heads * spec.head_dim
        kv = math.ceil(spec.num_kv_heads / tp) * spec.head_dim * 2
        mult = 2.0 if backward else 1.0
        gemms = (self.gemm_s(tokens, h, q // tp + kv, mult) + self.gemm_s(tokens, q // tp, h, mult)
                 + self.gemm_s(tokens, h, 2 * f // tp, mult) + self.gemm_s(tokens, f // tp, h, mult))
        causal_flops = 2.0 * tokens * seq * q / tp          # QKᵀ and AV, half of the dense 4·T·s·q
        frac = self.device.attention_backward if backward else self.device.attention_forward
        attention = (2.5 if backward else 1.0) * causal_flops / (self.peak / self.device.gemm_fraction * frac)
        elementwise = mult * tokens * (UNSPLIT_BYTES_PER_TOKEN_HIDDEN * h + 3 * f // tp) * self.e / self.hbm
        floor = KERNELS_PER_LAYER_FORWARD * mult * self.device.kernel_floor_s
        return max(gemms + attention + elementwise, floor)

    def _head_s(self, spec, role: Role, tokens: float, tp: int, backward: bool, spans: bool,
                contended: bool) -> float:
        """The output head and loss of one micro-batch on the last pipeline stage."""
        if value_head_for(role):
            return self.gemm_s(tokens, spec.hidden_size, 1, 3.0 if backward else 1.0)
        vocab = math.ceil(spec.vocab_size / tp)
        t = self.gemm_s(tokens, spec.hidden_size, vocab, 3.0 if backward else 1.0)
        t += 4 * tokens * vocab * 4 / self.hbm                       # fp32 logits: write, 3 reads
        t += VOCAB_LOSS_ALL_REDUCES * self.all_reduce_s(tokens * 4, tp, spans, contended)
        return t

    # ---- a model-stage ---------------------------------------------------------------------
    def replica_s(self, m: ModelStage, c: Candidate, response_length: float, step: int,
                  contended: bool) -> float:
        """True seconds of one RL step of model-stage ``m`` laid out as ``c`` (no noise, no
        stragglers): the slowest replica."""
        wl = self.problem.workload
        spec = self.problem.spec(m)
        sequences = self.problem.workflow.sequences(m, wl)
        if m.stage is Stage.GENERATION:
            return self._generation_s(spec, sequences, c, wl.prompt_length, response_length, step, contended)
        training = m.stage is Stage.TRAINING
        minis = wl.mini_batches if training else 1
        per_replica = -(-sequences // c.dp)
        b = max(1, min(c.micro_batch or wl.micro_batch, per_replica))
        micro_per_opt = max(1, -(-per_replica // (b * minis)))
        # as the engine pads (emu.engine.stage): by count at pp = 1 each micro-batch to its own
        # longest sequence, at pp > 1 every row of a call (one per optimizer step) to the call's
        # longest; a token budget packs
        rows = 1 if wl.packed else b if c.pp == 1 else -(-per_replica // minis)
        seq = wl.prompt_length + self.replica_length(response_length, sequences, c.dp, step, rows)
        tokens = b * seq
        layers = math.ceil(spec.num_layers / c.pp)
        h = spec.hidden_size
        tp_spans = self.spans(c.tp)
        ar = self.all_reduce_s(tokens * h * self.e, c.tp, tp_spans, contended)
        forward = layers * (self._layer_pass_s(spec, tokens, seq, c.tp, False) + 2 * ar)
        forward += self._head_s(spec, m.role, tokens, c.tp, False, tp_spans, contended)
        slot = forward
        backward = 0.0
        if training:
            backward = layers * (self._layer_pass_s(spec, tokens, seq, c.tp, True) + 2 * ar)
            backward += self._head_s(spec, m.role, tokens, c.tp, True, tp_spans, contended)
            if c.recompute:
                backward += forward
            slot += backward
        if c.pp > 1:
            slot += (2 if training else 1) * self.p2p_s(tokens * h * self.e, self.spans(c.tp * c.pp), contended)
        total = minis * (micro_per_opt + c.pp - 1) * slot
        if training:
            shard = parameters_per_device(spec, c.tp, c.pp, value_head_for(m.role))
            grads = shard * 4.0
            dp_spans = self.spans(c.tp * c.pp * c.dp)
            reduce_s = self.all_reduce_s(grads, c.dp, dp_spans, contended)
            last_bucket = self.all_reduce_s(min(grads, DDP_BUCKET_BYTES), c.dp, dp_spans, contended)
            exposed = max(last_bucket, reduce_s - backward) if c.dp > 1 else 0.0
            total += minis * (exposed + shard * ADAM_BYTES_PER_PARAM / self.hbm)
            total *= wl.epochs   # each pass over the step's sequences repeats the same work
        return total

    def response_lengths(self, longest: float, count: int, step: int) -> np.ndarray:
        """The step's ``count`` response lengths (tokens, ≥ 1; the longest is ``longest``), the
        same for every policy; replica ``r`` of ``dp`` holds the ``r``-th slice of
        :func:`~nereusd.rl.rollout.split_even`, as the driver deals them."""
        sigma = self.config.length_sigma
        rng = np.random.default_rng([self.config.seed, 31, step, count])
        x = np.exp(rng.normal(0.0, sigma, count))
        return np.maximum(1.0, np.round(longest * x / x.max()))

    def response_length_mean(self, longest: float, step: int) -> float:
        """Mean of the step's generated responses (:meth:`response_lengths` of the generation
        model-stage's sequences)."""
        wf, wl = self.problem.workflow, self.problem.workload
        sequences = max(wf.sequences(m, wl) for m in wf.model_stages if m.stage is Stage.GENERATION)
        return float(np.mean(self.response_lengths(max(1.0, float(longest)), sequences, step)))

    def replica_length(self, longest: float, count: int, dp: int, step: int, rows: int = 1) -> float:
        """Response tokens per sequence of the largest share, computed by the busiest of ``dp``
        replicas, padding included: each replica takes its share of ``count`` as the driver
        deals them (:func:`~nereusd.rl.rollout.split_even`), in micro-batches of ``rows``
        consecutive sequences, each padded to its own longest (``rows = 1``: no padding). The
        busiest replica's padded tokens over ``⌈count/dp⌉``, so that ``⌈count/dp⌉`` times it
        is that replica's work."""
        key = (longest, count, dp, step, rows)
        value = self._replica_lengths.get(key)
        if value is None:
            lengths = self.response_lengths(longest, count, step)
            value = 0.0
            for start, stop in split_even(count, dp):
                part = lengths[start:stop]
                if len(part) == 0:
                    continue
                chunks = np.arange(0, len(part), max(1, rows))
                widths = np.maximum.reduceat(part, chunks) * np.diff(np.append(chunks, len(part)))
                value = max(value, float(widths.sum()))
            value /= -(-count // dp)
            if len(self._replica_lengths) > 4096:
                self._replica_lengths.clear()
            self._replica_lengths[key] = value
        return value

    def _generation_s(self, spec, sequences: int, c: Candidate, prompt: int, longest: float, step: int,
                      contended: bool) -> float:
        """The slowest replica's prefill, continuous-batching decode and weight sync."""
        lengths = self.response_lengths(longest, sequences, step)
        per_replica = -(-sequences // c.dp)
        concurrent = max(1, min(c.micro_batch or per_replica, per_replica))
        e, h, d = self.e, spec.hidden_size, spec.head_dim
        layers = math.ceil(spec.num_layers / c.pp)
        weights = parameters_per_device(spec, c.tp, c.pp) * e
        kv_per_token = 2 * layers * math.ceil(spec.num_kv_heads / c.tp) * d * e
        head_flops = 2.0 * spec.vocab_size * h / c.tp
        flops_per_token = 2.0 * layers * layer_parameters(spec) / c.tp + head_flops
        tp_spans = self.spans(c.tp)
        p2p = self.p2p_s(h * e, self.spans(c.tp * c.pp), contended) if c.pp > 1 else 0.0
        worst = 0.0
        for start, stop in split_even(sequences, c.dp):
            mine = lengths[start:stop]
            if len(mine) == 0:
                continue
            ends = _slot_ends(mine, concurrent)
            context = prompt + float(np.sum(mine * (mine + 1) / 2) / np.sum(mine))
            # decode: between consecutive slot ends, ``running`` sequences advance together
            edges = np.concatenate(([0.0], ends))
            steps = np.diff(edges)
            running = np.arange(len(ends), 0, -1, dtype=np.float64)
            micro = np.ceil(running / c.pp)
            memory = (weights + micro * context * kv_per_token) / self.hbm
            compute = micro * flops_per_token / self.peak
            tp_ar = 2 * layers * self._decode_all_reduce_s(micro * h * e, c.tp, tp_spans, contended)
            per_step = c.pp * (np.maximum(memory, compute) + tp_ar + p2p) + self.device.decode_overhead_s
            decode = float(np.sum(steps * per_step))
            prefill = self._prefill_s(spec, len(mine), concurrent, prompt, c.tp, c.pp, contended)
            worst = max(worst, decode + prefill)
        sync = self.p2p_s(weights, self.spans(c.tp * c.pp * c.dp), contended)
        return worst + sync

    def _prefill_s(self, spec, prompts: int, concurrent: int, prompt: int, tp: int, pp: int,
                   contended: bool) -> float:
        """Seconds to prefill ``prompts`` prompts of ``prompt`` tokens, ``concurrent`` per pass:
        each pass one forward of its tokens through a pipeline stage's layers (two TP
        all-reduces per layer at the NCCL figures) and the head at each prompt's last position;
        the passes run through ``pp`` stages in ``passes + pp − 1`` slots of the longest, plus
        a point-to-point hand-over per stage boundary."""
        if prompts <= 0 or prompt <= 0:
            return 0.0
        h = spec.hidden_size
        layers = math.ceil(spec.num_layers / pp)
        vocab = math.ceil(spec.vocab_size / tp)
        tp_spans = self.spans(tp)
        full, rest = divmod(prompts, concurrent)
        slots = [(concurrent, full)] + ([(rest, 1)] if rest else [])
        total, longest = 0.0, 0.0
        for n, count in slots:
            tokens = n * prompt
            ar = self.all_reduce_s(tokens * h * self.e, tp, tp_spans, contended)
            slot = layers * (self._layer_pass_s(spec, tokens, prompt, tp, False) + 2 * ar)
            slot += self.gemm_s(n, h, vocab)
            if pp > 1:
                slot += self.p2p_s(tokens * h * self.e, self.spans(tp * pp), contended)
            total += count * slot
            longest = max(longest, slot)
        return total + (pp - 1) * longest

    def _decode_all_reduce_s(self, nbytes: np.ndarray, ranks: int, spans: bool, contended: bool) -> np.ndarray:
        """One decode all-reduce of ``nbytes`` per rank (an array): vLLM's custom all-reduce
        inside a node (:data:`CUSTOM_ALL_REDUCE_S` plus the ring's bytes at the link's bus
        bandwidth), NCCL's across nodes; 0 for one rank."""
        if ranks <= 1:
            return np.zeros_like(nbytes)
        if spans:
            return np.array([self.all_reduce_s(float(b), ranks, True, contended) for b in nbytes])
        f, bw = self._link(False, contended)
        return CUSTOM_ALL_REDUCE_S + 2 * (ranks - 1) / ranks * nbytes / (f.bus_fraction * bw)

    def stage_times(self, plan: Plan, response_length: float, step: int, time_s: float) -> dict[ModelStage, float]:
        """True seconds of each model-stage of ``plan`` at ``step`` (noise, stragglers and
        contention in)."""
        contended = self.contended(time_s)
        noise = self.noise(step)
        return {m: self.replica_s(m, c, response_length, step, contended) * self.slowest(c) * noise[m]
                for m, c in plan.items()}

    def slowest(self, c: Candidate) -> float:
        """Speed factor of the slowest of ``c``'s devices (≥ 1)."""
        return float(max(self.device_speed[d % len(self.device_speed)] for d in c.devices))

    def rank_key(self, plan: Plan, response_length: float, step: int, contended: bool = False) -> float:
        """Step seconds of ``plan`` without noise, under the step's contention (``contended``):
        how the oracle ranks plans. Ranked without it, the oracle ran slower plans than Nereus
        through contention episodes on a spot trace (``scripts/bench_sim.py``, 2026-12-04)."""
        stage_s = {m: self.replica_s(m, c, response_length, step, contended) * self.slowest(c)
                   for m, c in plan.items()}
        return self.problem.workflow.critical_path_s(stage_s)


def _bus(f: LinkFigures, bandwidth_bytes_per_s: float, nbytes: float) -> float:
    """Bus bandwidth of a message of ``nbytes`` (bytes/s): ``η·B · s / (s + s_half)``."""
    return f.bus_fraction * bandwidth_bytes_per_s * nbytes / (nbytes + f.half_bytes)


def _slot_ends(lengths: np.ndarray, slots: int) -> np.ndarray:
    """Decode steps at which each of ``slots`` engine slots falls idle when ``lengths`` are
    served first come, first served (a finished sequence's slot takes the next one), sorted."""
    if len(lengths) <= slots:
        return np.sort(lengths)
    ends = [float(x) for x in lengths[:slots]]
    heapq.heapify(ends)
    for x in lengths[slots:]:
        heapq.heapreplace(ends, ends[0] + float(x))
    return np.sort(np.asarray(ends))


def _all_reduce_s(f: LinkFigures, bandwidth_bytes_per_s: float, nbytes: float, ranks: int) -> float:
    """Seconds of one all-reduce of ``nbytes`` over ``ranks`` ≥ 2 ranks (the :class:`LinkFigures`
    formula, :meth:`MeasuredTruth.all_reduce_s`)."""
    return (f.latency_s * (1 + math.log2(ranks)) / 2
            + 2 * (ranks - 1) / ranks * nbytes / _bus(f, bandwidth_bytes_per_s, nbytes))


PROBE_BYTES = 8.0
"""The message of the latency probe (nccl-tests' ``all_reduce_perf -b 8 -e 8``)."""


def probed_latency_growth(link: str, bandwidth_bytes_per_s: float) -> float:
    """What an operator timing this truth's all-reduces of :data:`PROBE_BYTES` at 2 and 8 ranks on
    ``link`` (``"intra"``, ``"inter"``; the site's ``bandwidth_bytes_per_s`` there) would write as
    the site's ``*_latency_growth``, ``(t8 − t2)/(2·t2)`` (:class:`~nereusd.config.site.NetworkSpec`):
    the measurement nccl-tests makes on a cluster, made here on the simulated one
    (:func:`nereusd.sim.scenario.build`); :meth:`MeasuredTruth.all_reduce_s`'s formula."""
    t2, t8 = (_all_reduce_s(LINK_FIGURES[link], bandwidth_bytes_per_s, PROBE_BYTES, n) for n in (2, 8))
    return (t8 - t2) / (2 * t2)


BANDWIDTH_PROBE_BYTES = float(2**30)
"""The message of the bandwidth probe (nccl-tests' ``all_reduce_perf -b 1G -e 1G``)."""


def probed_all_reduce_efficiency(link: str, bandwidth_bytes_per_s: float, ranks: int = 8) -> float:
    """What an operator timing this truth's all-reduce of :data:`BANDWIDTH_PROBE_BYTES` over
    ``ranks`` on ``link`` would write as the site's ``*_all_reduce_efficiency``: nccl-tests' bus
    bandwidth ``2 (n − 1)/n · bytes / t`` over the site's ``bandwidth_bytes_per_s``
    (:attr:`~nereusd.config.site.NetworkSpec.intra_node_all_reduce_efficiency`)."""
    t = _all_reduce_s(LINK_FIGURES[link], bandwidth_bytes_per_s, BANDWIDTH_PROBE_BYTES, ranks)
    return 2 * (ranks - 1) / ranks * BANDWIDTH_PROBE_BYTES / t / bandwidth_bytes_per_s


def ground_truth(problem: PlanProblem, config: TruthConfig | None = None,
                 response_cap: Callable[[int], int] | None = None) -> GroundTruth:
    """The ground truth ``config.kind`` names: ``efficiency`` (:class:`GroundTruth`) or
    ``measured`` (:class:`MeasuredTruth`); ``response_cap``: each step's response cap under a
    length curriculum (no padded length exceeds it)."""
    config = config or TruthConfig()
    kind = MeasuredTruth if config.kind == "measured" else GroundTruth
    return kind(problem, config, response_cap)
