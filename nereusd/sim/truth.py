"""Ground truth of a simulated cluster: what a step, a transition and a restart really cost.

The controller never reads this module's state; it only receives the measurements the replay
hands it (:class:`nereusd.control.controller.StepObservation`: model-stage times, per-device
peaks, the step's length) and must calibrate, exactly as the live job does. The truth is built from the same cost and memory formulas as the controller's
model (:mod:`nereusd.cost.model`, :mod:`nereusd.cost.memory`) but with:

- **hidden efficiencies** per operation class: the controller's conservative prior times a
  factor drawn once per seed from ``U(efficiency_lo, efficiency_hi)``, capped at 0.95;
- **per-step noise**: each model-stage's time times ``exp(N(0, noise_sigma))``, drawn per
  (seed, step, model-stage) so every policy sees the same noise at the same step;
- **contention episodes** on the wall-clock axis (Poisson arrivals, exponential durations):
  inter-node communication efficiency times ``contention_factor`` while one lasts;
- **memory variance per batch**: the true peak is the memory model at the *padded* length of
  the step's longest micro-batch, ``mean × spread``, with ``spread ~ N(spread_mean, spread_sd)``
  clipped to ``[1, spread_max]`` — the controller's model sees only the mean length;
- **engine rebuilds**: a transition that gives a device of a vLLM generation model-stage a new
  replica (another ``tp``, TP devices or wave size: the workers' rule,
  :func:`nereusd.backends.restarts_vllm_engines`) starts its engines (vLLM: weights, KV-cache
  profiling, CUDA graphs), which the transition DAG's byte-and-link price leaves out:
  ``engine_rebuild_s`` seconds (0 by default; the "costly transitions" scenarios of
  ``scripts/bench_sim.py`` set it, on ``Scenario.generation = "vllm"``);
- **out-of-memory**: a device whose true peak (own working set plus co-resident state)
  exceeds its *capacity* fails the step: the partial step is lost, the job restarts from the
  last checkpoint (every ``checkpoint_interval`` steps; the steps since are re-run) after
  ``restart_s`` plus reading the checkpoint at ``storage_gbps`` per node.

Every number is an assumption stated here and in the README, not a measurement.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace
from typing import Callable, Mapping

import numpy as np

from nereusd.backends import restarts_vllm_engines
from nereusd.cost.calibration import GENERATION_PREFIX, LINK_TYPES, PRIORS, Calibration, comm_class, grad_sync_class
from nereusd.cost.model import CostModel
from nereusd.cost.memory import stage_memory
from nereusd.errors import ConfigError
from nereusd.plan import ModelStage, Plan
from nereusd.planner.space import PlanProblem
from nereusd.transition.memory import AdamStateSizes


MAX_NOISE_SIGMA = 2.0
"""Largest per-step time noise σ (log-normal): at 2 a step is 400 × its noiseless time at 3σ,
and beyond it simulated time runs away (``simulate --noise 100``: 10¹⁵ s a step)."""
MAX_CONTENTION_PER_H = 3600.0
"""Most contention episodes per hour of simulated wall clock (one a second)."""
MAX_EPISODE_DRAWS = 1_000_000
"""Contention episodes one :meth:`GroundTruth.contended` call may draw before it refuses: the
simulated clock has run away (astronomical step or restart times), and drawing them all would
fill the machine's memory."""

TRUTH_KINDS = ("efficiency", "measured")
"""The ground truths: the cost model with hidden efficiencies, or :mod:`nereusd.sim.measured`."""


@dataclass(frozen=True, kw_only=True)
class TruthConfig:
    """Knobs of the ground truth (see the module docstring for what each does).

    Attributes:
        seed: one seed for every draw.
        efficiency_lo, efficiency_hi: hidden efficiency = prior × U(lo, hi), capped at 0.95.
        noise_sigma: log-normal sigma of per-step, per-model-stage time noise.
        contention_per_h: contention episodes per hour of wall clock.
        contention_mean_h: mean episode length, hours.
        contention_factor: inter-node efficiency multiplier during an episode.
        spread_mean, spread_sd, spread_max: padded-length factor of the longest micro-batch.
        restart_s: relaunch time of a checkpoint/restart (allocation, process start, NCCL
            init), seconds, before reading the checkpoint.
        storage_gbps: checkpoint read bandwidth per node, GB/s.
        checkpoint_interval: steps between checkpoints.
        engine_rebuild_s: seconds a transition adds when it starts vLLM engines
            (:meth:`GroundTruth.engine_rebuild_s`; the problem's generation runs on vLLM,
            ``Scenario.generation``), beyond the DAG's own time.
        kind: ``efficiency`` (this module: the cost model with hidden efficiencies) or
            ``measured`` (:mod:`nereusd.sim.measured`: formulas of its own from published
            figures, with effects the cost model lacks).
        straggler_sd: ``measured`` only: spread of the per-device speed factor.
        length_sigma: ``measured`` only: log-normal sigma of the responses' lengths in a step.
    """

    seed: int = 0
    efficiency_lo: float = 1.0
    efficiency_hi: float = 1.6
    noise_sigma: float = 0.03
    contention_per_h: float = 0.25
    contention_mean_h: float = 1.0
    contention_factor: float = 0.5
    spread_mean: float = 1.15
    spread_sd: float = 0.06
    spread_max: float = 1.5
    restart_s: float = 180.0
    storage_gbps: float = 2.0
    checkpoint_interval: int = 20
    engine_rebuild_s: float = 0.0
    kind: str = "efficiency"
    straggler_sd: float = 0.03
    length_sigma: float = 0.41

    def __post_init__(self) -> None:
        """Raises:
            ConfigError: for a knob outside its range (a negative rate, noise or time, a
                non-finite value, efficiency bounds out of order), naming each."""
        problems = [f"{name} must be a finite number >= 0, got {getattr(self, name)!r}"
                    for name in ("noise_sigma", "contention_per_h", "contention_mean_h", "spread_sd", "restart_s",
                                 "engine_rebuild_s", "straggler_sd", "length_sigma")
                    if not (math.isfinite(getattr(self, name)) and getattr(self, name) >= 0)]
        problems += [f"{name} must be a finite number > 0, got {getattr(self, name)!r}"
                     for name in ("efficiency_lo", "efficiency_hi", "contention_factor", "spread_mean", "spread_max",
                                  "storage_gbps")
                     if not (math.isfinite(getattr(self, name)) and getattr(self, name) > 0)]
        for name, top, why in (("noise_sigma", MAX_NOISE_SIGMA, "a step then varies by e^(3σ) = 400× and more"),
                               ("contention_per_h", MAX_CONTENTION_PER_H, "one episode a second")):
            if math.isfinite(getattr(self, name)) and getattr(self, name) > top:
                problems.append(f"{name} must be at most {top:g} ({why}), got {getattr(self, name)!r}")
        if self.efficiency_lo > self.efficiency_hi:
            problems.append(f"efficiency_lo {self.efficiency_lo} exceeds efficiency_hi {self.efficiency_hi}")
        if self.kind not in TRUTH_KINDS:
            problems.append(f"kind must be one of {', '.join(TRUTH_KINDS)}, got {self.kind!r}")
        if self.seed < 0:
            problems.append(f"seed must be an integer >= 0, got {self.seed}")
        if self.checkpoint_interval < 1:
            problems.append(f"checkpoint_interval must be >= 1, got {self.checkpoint_interval}")
        if problems:
            raise ConfigError("ground truth: " + "; ".join(problems))


class GroundTruth:
    """Hidden costs of one simulated cluster for one problem shape.

    Args:
        problem: workflow, model specs, site (the workload is replaced per step).
        config: the assumptions.
    """

    ranks_by_truth = False
    """Whether the oracle must rank the planner's plans by :meth:`rank_key` (a truth the planner
    cannot search); this truth is the planner's own cost model, so its plans are its optimum."""

    def __init__(self, problem: PlanProblem, config: TruthConfig | None = None,
                 response_cap: Callable[[int], int] | None = None) -> None:
        self.problem = problem
        self.config = config or TruthConfig()
        self.response_cap = response_cap
        """Each step's response cap under a length curriculum: the padded length of
        :meth:`stage_peaks` never exceeds it (no response is longer); ``None``: no cap."""
        rng = random.Random(self.config.seed)
        # the per-call latency classes draw after the others, and a generation engine's classes
        # after those, so each seed keeps the draws it had before they existed
        grad_sync = {grad_sync_class(link): comm_class("all_reduce", link) for link in LINK_TYPES}
        order = sorted((c for c in PRIORS if c not in grad_sync),
                       key=lambda c: (c.startswith(GENERATION_PREFIX), c.startswith("latency_"), c))
        self.efficiency = {c: min(0.95, PRIORS[c] * rng.uniform(self.config.efficiency_lo, self.config.efficiency_hi))
                           for c in order}
        # a gradient synchronisation is an all-reduce to this truth (and draws nothing)
        self.efficiency.update({sync: self.efficiency[all_reduce] for sync, all_reduce in grad_sync.items()})
        self._models: dict[bool, CostModel] = {}
        self._episodes: list[tuple[float, float]] = []
        self._episodes_until = 0.0
        self._ep_rng = random.Random(self.config.seed * 7919 + 1)
        self._groups: dict[tuple, list[tuple[ModelStage, tuple[ModelStage, ...]]]] = {}

    # ---- hidden state ------------------------------------------------------------------------
    def contended(self, time_s: float) -> bool:
        """Whether a contention episode covers ``time_s``."""
        cfg = self.config
        drawn = 0
        while self._episodes_until <= time_s and cfg.contention_per_h > 0:
            drawn += 1
            if drawn > MAX_EPISODE_DRAWS:
                raise ConfigError(f"ground truth: more than {MAX_EPISODE_DRAWS:,} contention episodes to reach "
                                  f"{time_s:.3g} s of simulated time: the clock has run away (step or restart "
                                  f"times far beyond a real job's); check --noise, --restart-s and the model size")
            start = self._episodes_until + self._ep_rng.expovariate(cfg.contention_per_h / 3600.0)
            length = self._ep_rng.expovariate(1.0 / (cfg.contention_mean_h * 3600.0))
            self._episodes.append((start, start + length))
            self._episodes_until = start + length
        return any(a <= time_s < b for a, b in self._episodes[-4:])

    def episodes(self) -> list[tuple[float, float]]:
        """Contention episodes drawn so far, ``(start_s, end_s)``."""
        return list(self._episodes)

    def cost_model(self, contended: bool = False) -> CostModel:
        """A cost model whose 'calibration' is the hidden efficiencies (contended or not)."""
        cm = self._models.get(contended)
        if cm is None:
            eff = dict(self.efficiency)
            if contended:
                eff = {c: v * self.config.contention_factor if c.endswith("_inter") else v for c, v in eff.items()}
            cm = self._models[contended] = CostModel(self.problem.site, Calibration(priors=eff),
                                                     site_measured=False)
        return cm

    def noise(self, step: int) -> dict[ModelStage, float]:
        """Multiplicative noise per model-stage at ``step`` (same for every policy)."""
        rng = np.random.default_rng([self.config.seed, 17, step])
        stages = self.problem.workflow.model_stages
        draws = np.exp(rng.normal(0.0, self.config.noise_sigma, len(stages)))
        return dict(zip(stages, draws.tolist()))

    def spread(self, step: int) -> float:
        """Padded-length factor of the longest micro-batch at ``step``."""
        cfg = self.config
        rng = np.random.default_rng([cfg.seed, 29, step])
        return float(min(cfg.spread_max, max(1.0, rng.normal(cfg.spread_mean, cfg.spread_sd))))

    # ---- a step ------------------------------------------------------------------------------
    def response_length_mean(self, longest: float, step: int) -> float:
        """Mean generated response (tokens) of the step whose longest is ``longest``, what a live
        job's record reports: in this truth every response is as long as the longest."""
        return float(longest)

    def stage_times(self, plan: Plan, response_length: float, step: int, time_s: float) -> dict[ModelStage, float]:
        """True seconds of each model-stage of ``plan`` at ``step`` (noise and contention in)."""
        cm = self.cost_model(self.contended(time_s))
        wl = replace(self.problem.workload, response_length=max(1, int(round(response_length))))
        noise = self.noise(step)
        out = {}
        for m, c in plan.items():
            latency, _ = cm.stage_latency(self.problem.spec(m), m, sequences=self.problem.workflow.sequences(m, wl),
                                          prompt_length=wl.prompt_length, response_length=wl.response_length,
                                          tp=c.tp, pp=c.pp, dp=c.dp, micro_batch=c.micro_batch or wl.micro_batch,
                                          mini_batches=wl.mini_batches, recompute=c.recompute, epochs=wl.epochs)
            out[m] = latency * noise[m]
        return out

    def stage_peaks(self, plan: Plan, response_length: float, step: int) -> dict[ModelStage, tuple[int, int]]:
        """True ``(peak, resident)`` bytes per device of each model-stage at ``step``."""
        wl = self.problem.workload
        padded = max(1, int(round(response_length * self.spread(step))))
        if self.response_cap is not None:   # padding reaches the longest response, which the cap cut
            padded = max(1, min(padded, self.response_cap(step)))
        out = {}
        for m, c in plan.items():
            est = stage_memory(self.problem.spec(m), m, sequences=self.problem.workflow.sequences(m, wl),
                               prompt_length=wl.prompt_length, response_length=padded, tp=c.tp, pp=c.pp,
                               dp=c.dp, micro_batch=c.micro_batch or wl.micro_batch, recompute=c.recompute,
                               dtype=self.problem.site.compute_dtype, device_kind=self.problem.site.device_kind,
                               engine_seq=self.problem.engines.get(m), zero_stage=c.zero_stage, packed=wl.packed,
                               mini_batches=wl.mini_batches)
            out[m] = (est.peak_bytes, est.resident_bytes)
        return out

    def device_peaks(self, plan: Plan, response_length: float, step: int) -> dict[int, int]:
        """True peak bytes per device at ``step``: for each model-stage on the device, its own
        working peak plus the resident state of the others there (what a live worker's memory
        accounting measures)."""
        peaks = self.stage_peaks(plan, response_length, step)
        out: dict[int, int] = {}
        for m, c in plan.items():
            for d in c.devices:
                others = sum(peaks[o][1] for o in plan.model_stages_on(d) if o != m)
                out[d] = max(out.get(d, 0), peaks[m][0] + others)
        return out

    def oom(self, plan: Plan, response_length: float, step: int, headroom: float = 0.0) -> str:
        """Why ``plan`` runs out of memory at ``step`` (``""`` when it fits the capacity);
        ``headroom``: the share of capacity to leave free (``oracle@H``: over ``1 − H`` counts)."""
        peaks = self.stage_peaks(plan, response_length, step)
        capacity = self.problem.site.device_memory_bytes * (1.0 - headroom)
        for m, others in self.colocation(plan):
            need = peaks[m][0] + sum(peaks[o][1] for o in others)
            if need > capacity:
                return f"{m}: {need / 2**30:.1f} GiB > {capacity / 2**30:.1f} GiB"
        return ""

    def colocation(self, plan: Plan) -> list[tuple[ModelStage, tuple[ModelStage, ...]]]:
        """Each model-stage with every set of other model-stages sharing one of its devices."""
        key = tuple((str(m), c.devices) for m, c in plan.items())
        groups = self._groups.get(key)
        if groups is None:
            on: dict[int, list[ModelStage]] = {}
            for m, c in plan.items():
                for d in c.devices:
                    on.setdefault(d, []).append(m)
            sets = {tuple(v) for v in on.values()}
            groups = [(m, tuple(o for o in s if o != m)) for s in sorted(sets, key=str) for m in s]
            if len(self._groups) > 256:
                self._groups.clear()
            self._groups[key] = groups
        return groups

    # ---- transitions -------------------------------------------------------------------------
    def engine_rebuild_s(self, source: Plan, target: Plan, warm: Mapping[ModelStage, Mapping[int, tuple]] | None = None) -> float:
        """Seconds the generation engines' restarts add to a transition from ``source`` to
        ``target``: ``engine_rebuild_s`` once (engines start in parallel) when any device of a
        vLLM model-stage (:attr:`PlanProblem.engines`) starts an engine by the workers' own rule
        (:func:`nereusd.backends.restarts_vllm_engines`: its replica's ``tp``, TP devices or
        ``max_num_seqs`` change, or it had none and no ``warm`` engine of that replica, which a
        background join started before the device joined), else 0. A pool shrink whose surviving
        replicas keep their devices restarts nothing, as on a live job."""
        if not self.config.engine_rebuild_s:
            return 0.0
        starts = restarts_vllm_engines(source, target, self.problem.engines, self.problem.workload.micro_batch, warm)
        return self.config.engine_rebuild_s if starts else 0.0

    # ---- restarts ----------------------------------------------------------------------------
    def restart_s(self, plan: Plan) -> float:
        """Relaunch plus checkpoint read of every model's parameters and optimizer state."""
        sizes = AdamStateSizes.for_dtype(self.problem.site.compute_dtype)
        per_role: dict = {}
        for m in plan:   # a trained role's checkpoint holds its optimizer state too
            per_role[m.role] = max(per_role.get(m.role, 0.0), sizes.moved_bytes_per_element(m))
        total = sum(self.problem.specs[r].num_parameters() * b for r, b in per_role.items())
        nodes = max(1, math.ceil(len(plan.devices()) / self.problem.site.devices_per_node))
        return self.config.restart_s + total / (nodes * self.config.storage_gbps * 1e9)


def step_latency_s(workflow, stage_s: Mapping[ModelStage, float]) -> float:
    """Critical path of measured model-stage times (:meth:`Workflow.critical_path_s`)."""
    return workflow.critical_path_s(stage_s)
