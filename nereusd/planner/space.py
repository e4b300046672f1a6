"""The plan space: problems, search knobs, and the costed options of each model-stage.

An :class:`Option` is a candidate without devices, ``(tp, pp, dp, micro_batch, recompute)``,
with its predicted latency and memory. Rules (DESIGN.md "Planner"; paper §5.2 "plan space"):

- TP is a power of two (any divisor with ``any_divisor``) that divides the attention heads and
  is compatible with the kv heads (``kv % tp == 0`` or ``tp % kv == 0``); it stays inside a node
  (``tp ≤ devices_per_node``) unless no such option fits memory;
- PP is a power of two (any divisor) dividing the layers;
- training DP keeps ``dp × b × a`` equal to the mini-batch exactly: ``dp`` divides the
  mini-batch and ``b`` divides ``mini-batch/dp`` (``a`` follows); generation and inference
  DP takes every degree that changes the per-replica share ``ceil(sequences/dp)``.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass, field
from typing import Mapping

import numpy as np

from nereusd.cost import vector as costvec
from nereusd.cost.model import CostModel
from nereusd.errors import ConfigError, PlanError
from nereusd.cost.memory import HEADROOM, micro_batches_per_call, stage_memory
from nereusd.models import ModelSpec
from nereusd.plan import Layout, ModelStage, Plan, Role, Stage, training_micro_batch
from nereusd.shards import check_layout, value_head_for
from nereusd.config.site import SiteConfig
from nereusd.workflow import Workflow, Workload


GENERATION_WAVE_CHOICES = 3
"""Wave sizes kept per generation replica layout: the largest ones whose memory fits, from the
whole share down through every power of two to 1 (memory falls with the wave, so the search is
complete: a layout is dropped only if even a wave of 1 does not fit)."""


@dataclass(frozen=True)
class PlanProblem:
    """What to plan: a workflow, the model of each role, the step's workload, site and pool.

    Raises:
        ConfigError: if a role of the workflow has no model spec, or the pool is empty.
    """

    workflow: Workflow
    specs: Mapping[Role, ModelSpec]
    workload: Workload
    site: SiteConfig
    pool: tuple[int, ...]
    engines: Mapping[ModelStage, int] = field(default_factory=dict)
    """Generation model-stages on an engine of their own (vLLM, :mod:`nereusd.backends`) → the
    engine's ``max_model_len``: its weight copy and KV cache enter their memory
    (``engine_seq`` of :func:`nereusd.cost.memory.stage_memory`)."""
    zero_stages: Mapping[ModelStage, tuple[int, ...]] = field(default_factory=dict)
    """Training model-stages whose backend shards optimizer state (DeepSpeed) → the ZeRO stages
    the planner may choose; every other model-stage runs ZeRO-0 unless
    :attr:`PlannerOptions.zero_stages` asks for more."""

    def __post_init__(self) -> None:
        missing = [r.value for r in self.workflow.roles if r not in self.specs]
        if missing:
            raise ConfigError(f"plan problem: no model spec for roles {missing}")
        if not self.pool:
            raise ConfigError("plan problem: the device pool is empty")
        object.__setattr__(self, "pool", tuple(sorted(self.pool)))

    def spec(self, model_stage: ModelStage) -> ModelSpec:
        return self.specs[model_stage.role]


GENERATION_ENGINES = ("native", "vllm")
"""Generation engines a what-if plan may assume (``plan --generation``, ``simulate --generation``)."""


def generation_engines(workflow: Workflow, engine: str, max_model_len: int) -> dict[ModelStage, int]:
    """:attr:`PlanProblem.engines` for every generation model-stage of ``workflow`` on ``engine``:
    ``max_model_len`` each on ``vllm``, none on ``native``."""
    if engine not in GENERATION_ENGINES:
        raise ConfigError(f"--generation {engine!r}: expected one of {', '.join(GENERATION_ENGINES)}")
    if engine != "vllm":
        return {}
    return {m: max_model_len for m in workflow.model_stages if m.stage is Stage.GENERATION}


@dataclass(frozen=True)
class PlannerOptions:
    """Search-space knobs.

    Attributes:
        any_divisor: TP/PP may be any divisor, not only powers of two.
        micro_batches: per-replica micro-batch sizes to try (training and inference), of which
            each layout keeps the largest that fits memory; empty means the workload's and every
            power of two below it. Each is capped at the replica's share and, for training,
            shrunk to the largest divisor of it.
        allow_recompute: also try full activation recomputation (training).
        headroom: memory fraction kept free (10 %).
        generation_pp: also try pipeline parallelism for generation (vLLM can; Nereus's engine
            and job schema fold PP into DP for generation, so plans the runtime executes keep
            ``pp = 1`` there — the default).
        zero_stages: ZeRO stages to try for a training model-stage the problem does not pin
            (``nereus-launch plan --zero``); empty: the problem's (:attr:`PlanProblem.zero_stages`),
            else ZeRO-0. ZeRO-1/2 are offered at ``tp = pp = 1`` only, the DeepSpeed backend's scope.
        generation_micro_batch: when set, the only wave size (concurrent sequences) generation
            may take: the running vLLM engines' ``max_num_seqs``, so that a plan can keep them
            (the controller's engine-keeping alternative), also where a replica's share is
            smaller (an engine serves fewer sequences than its ``max_num_seqs``: the decode is
            the share's, the KV cache booked is the engine's). 0: every wave size.
        shapes: ``(model_stage, tp, pp)`` triples: those model-stages may take only that TP and PP
            (DP, micro-batch and placement stay free). The controller pins the shape a running
            model-stage cannot leave by a transition that fits memory
            (:meth:`nereusd.control.controller.Controller._unblocked`), so that the planner finds
            the best plan the job can reach instead of one it cannot.
    """

    any_divisor: bool = False
    micro_batches: tuple[int, ...] = ()
    allow_recompute: bool = False
    headroom: float = HEADROOM
    generation_pp: bool = False
    zero_stages: tuple[int, ...] = ()
    generation_micro_batch: int = 0
    shapes: tuple[tuple[ModelStage, int, int], ...] = ()

    def shape_of(self, model_stage: ModelStage) -> tuple[int, int] | None:
        """The ``(tp, pp)`` pinned for ``model_stage`` by :attr:`shapes`, else None."""
        for m, tp, pp in self.shapes:
            if m == model_stage:
                return tp, pp
        return None


def zero_stage_choices(problem: "PlanProblem", model_stage: ModelStage, options: PlannerOptions) -> tuple[int, ...]:
    """The ZeRO stages to try for ``model_stage`` (see :attr:`PlannerOptions.zero_stages`)."""
    if model_stage.stage is not Stage.TRAINING:
        return (0,)
    return tuple(problem.zero_stages.get(model_stage) or options.zero_stages or (0,))


@dataclass(frozen=True)
class Option:
    """A costed candidate without devices."""

    model_stage: ModelStage
    tp: int
    pp: int
    dp: int
    micro_batch: int
    recompute: bool
    latency_s: float
    peak_bytes: int
    resident_bytes: int
    cost_by_class: Mapping[str, float] = field(default_factory=dict, compare=False, repr=False)
    zero_stage: int = 0

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def layout(self) -> tuple[int, int, int, int, bool, int]:
        return (self.tp, self.pp, self.dp, self.micro_batch, self.recompute, self.zero_stage)


def degrees(limit: int, divides: int, any_divisor: bool) -> list[int]:
    """Degrees ``d ≤ limit`` dividing ``divides``: powers of two, or every divisor."""
    if any_divisor:
        return [d for d in range(1, min(limit, divides) + 1) if divides % d == 0]
    out, d = [], 1
    while d <= min(limit, divides):
        if divides % d == 0:
            out.append(d)
        d *= 2
    return out


def tp_degrees(spec: ModelSpec, limit: int, any_divisor: bool) -> list[int]:
    kv = spec.num_kv_heads
    return [t for t in degrees(limit, spec.num_heads, any_divisor) if kv % t == 0 or t % kv == 0]


@functools.lru_cache(maxsize=4096)
def shardable(spec: ModelSpec, value_head: bool, tp: int, pp: int, generation: bool) -> bool:
    """Whether ``tp × pp`` passes :func:`nereusd.shards.check_layout` (vocabulary and MLP width
    divisible by ``tp``, tied embeddings at ``pp = 1``, generation at ``pp = 1``, …): the planner
    offers no layout the engine would refuse."""
    try:
        check_layout(spec, Layout(tp, pp), value_head=value_head, generation=generation)
    except PlanError:
        return False
    return True


@functools.lru_cache(maxsize=4096)
def dp_degrees(model_stage: ModelStage, sequences: int, mini_batch: int, limit: int) -> list[int]:
    """DP degrees: divisors of the mini-batch for training; for the other stages the smallest
    ``dp`` giving each distinct share ``ceil(sequences/dp)``."""
    if model_stage.stage is Stage.TRAINING:
        return tuple(d for d in range(1, min(limit, mini_batch) + 1) if mini_batch % d == 0)
    out, seen = [], set()
    for d in range(1, min(limit, sequences) + 1):
        share = math.ceil(sequences / d)
        if share not in seen:
            seen.add(share)
            out.append(d)
    return tuple(out)


@functools.lru_cache(maxsize=65536)
def micro_batch_choices(per_replica: int, configured: int, options: PlannerOptions, training: bool,
                        generation: bool = False) -> list[int]:
    """Per-replica micro-batches to try, largest first. Generation: the concurrent sequences —
    all of the share, then every power of two below it (the enumeration keeps the
    :data:`GENERATION_WAVE_CHOICES` largest that fit memory). Training and inference: the job's
    ``configured`` micro-batch and every power of two below it (:attr:`PlannerOptions.micro_batches`
    replaces that list), each capped at ``per_replica`` and, for training, lowered to a divisor
    of it; the enumeration keeps, per layout, the largest that fits memory.

    Why only the largest that fits: a smaller micro-batch leaves the step's arithmetic as it is
    (gradient accumulation keeps ``dp × b × a`` the global batch) and needs less activation
    memory, so where the job's does not fit a layout a smaller one lets the layout compete (at
    response length 68 the demo's training fitted 4 devices at micro-batch 16 only at tp 4, which
    ran 1.43 s a step against 0.58 s for dp 4 at 4). But the cost model prices a GEMM by its
    FLOPs whatever the batch, so where the job's micro-batch fits, a smaller one would win on a
    smaller PP bubble alone, and the simulator's measured truth, whose kernels lose efficiency on
    small batches, ran such plans 3–8 % slower in three of four cases (a review, 2026-12-05).
    Except at ``pp = 1`` by count where the step's lengths differ: there the engine cuts each
    micro-batch to its own longest sequence, a smaller one computes less padding
    (:meth:`~nereusd.workflow.Workload.priced_pass`), and the enumeration keeps every one that
    fits (a review, 2026-12-07: on one node at a mean of 0.35 of the longest, actor training
    ``tp1·pp1·dp8`` was priced 0.43 s at micro-batch 1 against 0.93 s at 16, the measured truth
    0.26 against 0.55 s)."""
    if generation:
        if options.generation_micro_batch > 0:   # a running engine serves a share below its max_num_seqs
            return (options.generation_micro_batch,)
        out, b = [per_replica], 1 << max(0, (per_replica - 1).bit_length() - 1)
        while b >= 1:
            if b < per_replica:
                out.append(b)
            b //= 2
        return tuple(out)
    if options.micro_batches:
        wanted = sorted(set(options.micro_batches))
    else:
        wanted = [configured] + [1 << k for k in range(configured.bit_length()) if (1 << k) < configured]
    out = []
    for b in wanted:
        out.append(training_micro_batch(b, per_replica) if training else max(1, min(b, per_replica)))
    return tuple(sorted(set(out), reverse=True))


class _LazyCostByClass(Mapping):
    """``Option.cost_by_class`` computed on first use (most options are never asked)."""

    def __init__(self, cost_model: CostModel, spec: ModelSpec, model_stage: ModelStage, kwargs: dict) -> None:
        self._args = (cost_model, spec, model_stage, kwargs)
        self._value: dict[str, float] | None = None

    def _get(self) -> dict[str, float]:
        if self._value is None:
            cost_model, spec, m, kwargs = self._args
            self._value = cost_model.stage_latency(spec, m, **kwargs)[1]
        return self._value

    def __getitem__(self, key: str) -> float:
        return self._get()[key]

    def __iter__(self):
        return iter(self._get())

    def __len__(self) -> int:
        return len(self._get())


class OptionTable:
    """All options of one model-stage as numpy columns, in enumeration order.

    Columns: ``tp``, ``pp``, ``dp``, ``micro_batch``, ``recompute``, ``latency_s`` (s),
    ``peak_bytes``, ``resident_bytes`` (bytes per device), ``zero_stage``. :meth:`option` materialises one
    :class:`Option` (with its cost per operation class); the planner does so only for the
    options it keeps on a frontier.
    """

    def __init__(self, problem: PlanProblem, model_stage: ModelStage, cost_model: CostModel,
                 rows: list[tuple], latency_s: np.ndarray) -> None:
        self.problem, self.model_stage, self.cost_model = problem, model_stage, cost_model
        cols = list(zip(*rows)) if rows else [()] * 8
        self.tp, self.pp, self.dp, self.micro_batch = (np.array(c, dtype=np.int64) for c in cols[:4])
        self.recompute = np.array(cols[4], dtype=bool)
        self.peak_bytes = np.array(cols[5], dtype=np.float64)
        self.resident_bytes = np.array(cols[6], dtype=np.float64)
        self.zero_stage = np.array(cols[7], dtype=np.int64)
        self.latency_s = np.asarray(latency_s, dtype=np.float64)
        self.gpus = self.tp * self.pp * self.dp
        self._options: dict[int, Option] = {}

    def __len__(self) -> int:
        return len(self.tp)

    def option(self, i: int) -> Option:
        """Row ``i`` as an :class:`Option` (memoised)."""
        opt = self._options.get(i)
        if opt is None:
            m, wl = self.model_stage, self.problem.workload
            tp, pp, dp, b = int(self.tp[i]), int(self.pp[i]), int(self.dp[i]), int(self.micro_batch[i])
            rc = bool(self.recompute[i])
            sequences = self.problem.workflow.sequences(m, wl)
            priced_b, priced_response = wl.priced_pass(m.stage, b, _share(self.problem, m, dp), pp, sequences)
            ideal = _LazyCostByClass(self.cost_model, self.problem.spec(m), m, dict(
                sequences=sequences, prompt_length=wl.prompt_length,
                response_length=priced_response, tp=tp, pp=pp, dp=dp, micro_batch=priced_b,
                mini_batches=wl.mini_batches, recompute=rc, response_mean_fraction=wl.response_mean_fraction,
                epochs=wl.epochs))
            opt = self._options[i] = Option(m, tp, pp, dp, b, rc, float(self.latency_s[i]),
                                            int(self.peak_bytes[i]), int(self.resident_bytes[i]), ideal,
                                            zero_stage=int(self.zero_stage[i]))
        return opt

    def options(self) -> list[Option]:
        return [self.option(i) for i in range(len(self))]


def enumerate_options(problem: PlanProblem, model_stage: ModelStage, cost_model: CostModel,
                      options: PlannerOptions, usable_bytes: float) -> list[Option]:
    """Every option of ``model_stage`` whose own peak fits ``usable_bytes``, costed.

    TP crosses nodes only if nothing fits with ``tp ≤ devices_per_node``.
    """
    return option_table(problem, model_stage, cost_model, options, usable_bytes).options()


def option_table(problem: PlanProblem, model_stage: ModelStage, cost_model: CostModel,
                 options: PlannerOptions, usable_bytes: float, *, across_nodes: bool = False) -> OptionTable:
    """:func:`enumerate_options` as an :class:`OptionTable` (costed with :mod:`nereusd.cost.vector`);
    ``across_nodes``: TP up to the whole pool at once (the whole space the search may reach)."""
    site = problem.site
    if across_nodes:
        return _enumerate(problem, model_stage, cost_model, options, usable_bytes, len(problem.pool))
    out = _enumerate(problem, model_stage, cost_model, options, usable_bytes, site.devices_per_node)
    if not len(out) and len(problem.pool) > site.devices_per_node:
        out = _enumerate(problem, model_stage, cost_model, options, usable_bytes, len(problem.pool))
    return out


def _enumerate(problem: PlanProblem, m: ModelStage, cost_model: CostModel, options: PlannerOptions,
               usable_bytes: float, tp_limit: int) -> OptionTable:
    spec, wl, wf, site = problem.spec(m), problem.workload, problem.workflow, problem.site
    n = len(problem.pool)
    sequences = wf.sequences(m, wl)
    training = m.stage is Stage.TRAINING
    generation = m.stage is Stage.GENERATION
    recompute_flags = (False, True) if (training and options.allow_recompute) else (False,)
    zero_choices = zero_stage_choices(problem, m, options)
    rows: list[tuple] = []
    lat_parts: list[np.ndarray] = []
    memo: dict = {}
    pinned = options.shape_of(m)
    for tp in tp_degrees(spec, min(tp_limit, n), options.any_divisor):
        if pinned is not None and tp != pinned[0]:
            continue
        pps = degrees(n // tp, spec.num_layers, options.any_divisor)
        for pp in ((1,) if generation and not options.generation_pp else pps):
            if pinned is not None and pp != pinned[1]:
                continue
            if not shardable(spec, value_head_for(m.role), tp, pp, generation and not options.generation_pp):
                continue
            block: list[tuple] = []
            for dp in dp_degrees(m, sequences, wl.mini_batch_size, n // (tp * pp)):
                per_replica = -(-sequences // dp)
                per_opt = _share(problem, m, dp)
                choices = micro_batch_choices(per_opt, wl.micro_batch, options, training, generation)
                if wl.packed and not generation:
                    choices = choices[:1]   # a token budget prices every plan micro-batch alike
                # by count at pp = 1 each micro-batch is cut to its own longest sequence: where
                # lengths differ, a smaller one computes less padding and may win where a larger fits
                every_fit = pp == 1 and not wl.packed and wl.response_mean_fraction < 1.0
                kept, fitted = 0, set()
                for b in choices:
                    if generation and kept >= GENERATION_WAVE_CHOICES:
                        break   # smaller waves than the largest that fit: slower, never needed
                    priced = wl.priced_micro_batch(m.stage, b, per_opt)
                    for recompute, zero in itertools.product(recompute_flags, zero_choices):
                        if zero and (tp, pp) != (1, 1):
                            continue   # the ZeRO backend (DeepSpeed) runs tp = pp = 1 units
                        if not generation and not every_fit and (recompute, zero) in fitted:
                            continue   # a larger micro-batch fits this layout (micro_batch_choices)
                        # memory depends on the share only through b and the in-flight
                        # micro-batches (see nereusd.cost.memory.stage_memory), and under ZeRO on dp
                        key = (tp, pp, min(priced, per_replica), recompute,
                               min(pp, micro_batches_per_call(per_replica, priced, wl.mini_batches)) if training
                               else 0, zero, dp if zero else 0)
                        mem = memo.get(key)
                        if mem is None:
                            est = stage_memory(
                                spec, m, sequences=sequences, prompt_length=wl.prompt_length,
                                response_length=wl.response_length, tp=tp, pp=pp, dp=dp, micro_batch=priced,
                                recompute=recompute, dtype=cost_model.dtype, device_kind=site.device_kind,
                                engine_seq=problem.engines.get(m), zero_stage=zero, packed=wl.packed,
                                mini_batches=wl.mini_batches)
                            mem = memo[key] = (est.peak_bytes, est.resident_bytes)
                        if mem[0] > usable_bytes:
                            continue
                        block.append((tp, pp, dp, b, recompute, mem[0], mem[1], zero))
                        kept += 1
                        fitted.add((recompute, zero))
            if block:
                cols = list(zip(*block))
                priced = [wl.priced_pass(m.stage, b, _share(problem, m, dp), pp, sequences)
                          for b, dp in zip(cols[3], cols[2])]
                latency = np.zeros(len(block))
                for response in sorted({r for _, r in priced}):   # one call per priced response length
                    at = np.array([i for i, (_, r) in enumerate(priced) if r == response])
                    latency[at] = costvec.latencies(
                        cost_model, spec, m, sequences=sequences, prompt_length=wl.prompt_length,
                        response_length=response, tp=tp, pp=pp, dp=np.array(cols[2])[at],
                        micro_batch=np.array([priced[i][0] for i in at]),
                        recompute=np.array(cols[4])[at], mini_batches=wl.mini_batches,
                        response_mean_fraction=wl.response_mean_fraction, epochs=wl.epochs)
                lat_parts.append(latency)
                rows += block
    latency = np.concatenate(lat_parts) if lat_parts else np.zeros(0)
    return OptionTable(problem, m, cost_model, rows, latency)


def _share(problem: PlanProblem, model_stage: ModelStage, dp: int) -> int:
    """Sequences one of ``dp`` replicas processes per pass: training, per optimizer step."""
    if model_stage.stage is Stage.TRAINING:
        return problem.workload.mini_batch_size // dp
    return -(-problem.workflow.sequences(model_stage, problem.workload) // dp)


def cost_candidate(problem: PlanProblem, model_stage: ModelStage, tp: int, pp: int, dp: int,
                   micro_batch: int, recompute: bool, cost_model: CostModel, zero_stage: int = 0) -> Option:
    """Cost one given candidate layout (for evaluating the running plan under a new workload)."""
    spec, wl = problem.spec(model_stage), problem.workload
    sequences = problem.workflow.sequences(model_stage, wl)
    b = micro_batch or wl.micro_batch
    share = _share(problem, model_stage, dp)
    kw = dict(sequences=sequences, prompt_length=wl.prompt_length, response_length=wl.response_length,
              tp=tp, pp=pp, dp=dp, micro_batch=wl.priced_micro_batch(model_stage.stage, b, share),
              recompute=recompute)
    mem = stage_memory(spec, model_stage, dtype=cost_model.dtype, device_kind=problem.site.device_kind,
                       engine_seq=problem.engines.get(model_stage), zero_stage=zero_stage, packed=wl.packed,
                       mini_batches=wl.mini_batches, **kw)
    priced_b, priced_response = wl.priced_pass(model_stage.stage, b, share, pp, sequences)
    cost = cost_model.stage_cost(spec, model_stage, mini_batches=wl.mini_batches,
                                 response_mean_fraction=wl.response_mean_fraction, epochs=wl.epochs,
                                 **{**kw, "micro_batch": priced_b, "response_length": priced_response})
    return Option(model_stage, tp, pp, dp, b, recompute, cost.latency_s, mem.peak_bytes, mem.resident_bytes,
                  cost.ideal_s_by_class, zero_stage=zero_stage)


@dataclass(frozen=True)
class Evaluation:
    """Predictions for a given plan: step latency, per model-stage options, per device peaks."""

    step_latency_s: float
    options: Mapping[ModelStage, Option]
    peak_bytes: Mapping[int, int]

    def over_capacity(self, usable: int) -> dict[int, int]:
        """Devices whose predicted peak exceeds ``usable`` bytes, with their peak."""
        return {d: b for d, b in self.peak_bytes.items() if b > usable}


def evaluate(problem: PlanProblem, plan: Plan, cost_model: CostModel) -> Evaluation:
    """Predict step latency and per-device peaks of ``plan`` under ``problem``'s workload.

    Raises:
        ConfigError: if the plan lacks a model-stage of the workflow.
    """
    missing = [str(m) for m in problem.workflow.model_stages if m not in plan]
    if missing:
        raise ConfigError(f"plan lacks model-stages {missing}")
    chosen = {m: cost_candidate(problem, m, c.tp, c.pp, c.dp, c.micro_batch, c.recompute, cost_model, c.zero_stage)
              for m, c in plan.items() if m in problem.workflow.model_stages}
    latency = problem.workflow.critical_path_s({m: o.latency_s for m, o in chosen.items()})
    return Evaluation(latency, chosen, device_peaks(problem.workflow, plan, chosen))


def device_peaks(workflow, plan: Plan, chosen: Mapping[ModelStage, Option]) -> dict[int, int]:
    """Predicted peak per device from the actual co-location in ``plan``: for each phase ``p``
    running on the device, its working peak plus the resident state of the model-stages of
    other phases placed there (asynchronous generation devices hold generation only)."""
    peaks: dict[int, int] = {}
    masks: dict[int, int] = {}
    stages = list(plan.candidates)   # canonical order, as Plan.model_stages_on
    for bit, m in enumerate(stages):
        flag = 1 << bit
        for d in plan[m].devices:
            masks[d] = masks.get(d, 0) | flag
    worst_of: dict[int, int] = {}
    for mask in set(masks.values()):
        here = [m for bit, m in enumerate(stages) if mask >> bit & 1]
        worst = 0
        for m in here:
            others = sum(chosen[o].resident_bytes for o in here if o != m)
            worst = max(worst, chosen[m].peak_bytes + others)
        worst_of[mask] = worst
    for device in sorted(masks):
        peaks[device] = worst_of[masks[device]]
    return peaks
