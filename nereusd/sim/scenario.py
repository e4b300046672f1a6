"""Build a simulation from plain settings and run several policies on it.

Used by ``nereus-launch simulate`` and ``scripts/bench_sim.py``. Policies are independent
given the traces and the ground truth's seed, so :func:`run_policies` may run them in worker
processes (``jobs > 1``, fork start method) with identical results.
"""

from __future__ import annotations

import dataclasses
import math
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from functools import partial
from typing import Callable, Sequence

from nereusd.config.curriculum import curriculum_error, stage_cap
from nereusd.errors import ConfigError
from nereusd.models import resolve_model
from nereusd.plan import MAX_DEVICES, Role
from nereusd.planner.space import GENERATION_ENGINES, PlanProblem, generation_engines
from nereusd.sim.measured import probed_all_reduce_efficiency, probed_latency_growth
from nereusd.sim.policies import ORACLE, Policy
from nereusd.sim.replay import Simulation
from nereusd.sim.results import PolicyResult
from nereusd.traces import LengthTrace, load_length_trace, load_pool_trace
from nereusd.sim.truth import TruthConfig
from nereusd.config.site import load_site
from nereusd.workflow import Workload, build_workflow


@dataclass(frozen=True, kw_only=True)
class Scenario:
    """Plain settings of one simulated job (CLI flags)."""

    model: str = "llama-3.1-8b"
    algorithm: str = "ppo"
    site: str = "h200-ib"
    gpus: int = 64
    steps: int = 1000
    length_trace: str = "generated-ramp"
    pool_trace: str | None = None
    prompt_length: int = 512
    global_batch: int = 1024
    mini_batches: int = 1
    micro_batch: int = 1
    seed: int = 0
    reward_model: bool = True
    """A reward model-stage (``reward/inference``); ``False``: a rule-based reward, as the counting
    and gsm8k jobs' verifiers (``nereus-launch simulate --reward-model none``)."""
    generation: str = "native"
    """``native`` (the EMU's own decoder) or ``vllm``: every generation model-stage on vLLM
    engines, as a live job with ``backend: vllm`` runs it (:attr:`PlanProblem.engines`): each
    replica's engine holds a weight copy and a KV cache preallocated for its wave at
    ``max_model_len`` = prompt + the trace's longest response, and a transition that gives a
    device a new replica starts engines (the truth's ``engine_rebuild_s``), which the controller
    learns and prices as on a live job."""
    max_new_tokens_schedule: tuple[tuple[int, int], ...] = ()
    """A response-length curriculum, ``(at_step, max_new_tokens)`` stages as a job's
    ``rollout.max_new_tokens_schedule``: each step's length is the trace's cut at its stage's cap
    (the trace says how long the responses want to be; the cap cuts them), and the controller
    is told each step's cap, as a live job's is. Empty: the trace as it is."""
    join: str = "background"
    """How devices that come back join, as a job's ``pool.join``: ``background`` (the vLLM engines
    the controller expects on them start while the job runs on; :meth:`Simulation._join_step`) or
    ``immediate``."""




def build(s: Scenario, truth: TruthConfig | None = None) -> tuple[Simulation, dict]:
    """The :class:`Simulation` of ``s`` and a metadata dict for the outputs.

    Raises:
        ConfigError: for a GPU count that is not a positive multiple of the site's node
            size, or bad traces / model / site names.
    """
    site = load_site(s.site)
    dpn = site.devices_per_node
    if s.gpus < 1 or s.gpus % dpn or s.gpus > MAX_DEVICES:
        raise ConfigError(f"--gpus {s.gpus}: expected a positive multiple of {dpn} (devices per node of {site.name}), "
                          f"at most {MAX_DEVICES:,}")
    if s.steps < 1:
        raise ConfigError(f"--steps {s.steps}: expected a positive integer")
    if s.seed < 0:
        raise ConfigError(f"--seed {s.seed}: expected an integer >= 0 (it seeds numpy's generators)")
    if s.generation not in GENERATION_ENGINES:
        raise ConfigError(f"--generation {s.generation!r}: expected one of {', '.join(GENERATION_ENGINES)}")
    truth = truth or TruthConfig(seed=s.seed)
    if truth.engine_rebuild_s and s.generation != "vllm":
        raise ConfigError(f"--engine-rebuild-s {truth.engine_rebuild_s:g}: prices vLLM engine start-ups, but "
                          "generation is native here (add --generation vllm)")
    site = site.with_nodes(s.gpus // dpn)
    if truth.kind == "measured":   # the operator's nccl-tests run on the simulated cluster
        site = dataclasses.replace(site, network=dataclasses.replace(
            site.network, intra_node_latency_growth=probed_latency_growth("intra", site.intra_node_gbps * 1e9),
            inter_node_latency_growth=probed_latency_growth("inter", site.inter_node_gbps * 1e9),
            intra_node_all_reduce_efficiency=probed_all_reduce_efficiency("intra", site.intra_node_gbps * 1e9),
            inter_node_all_reduce_efficiency=probed_all_reduce_efficiency("inter", site.inter_node_gbps * 1e9)))
    spec = resolve_model(s.model)
    lengths = load_length_trace(s.length_trace, steps=s.steps, seed=s.seed)
    trace_steps = len(lengths.response_lengths)
    response_cap = None
    if s.max_new_tokens_schedule:
        stages = tuple(s.max_new_tokens_schedule)
        problem = curriculum_error(stages, None, "--max-new-tokens-schedule", "", s.steps)
        if problem:
            raise ConfigError(problem)
        response_cap = partial(stage_cap, stages, default=stages[0][1])
        lengths = LengthTrace(f"{lengths.label}, cut by the curriculum "
                              + ", ".join(f"{cap} from step {at}" for at, cap in stages),
                              tuple(min(lengths.at(i), response_cap(i)) for i in range(s.steps)), lengths.generated)
    pool = load_pool_trace(s.pool_trace)
    wl = Workload(prompt_length=s.prompt_length, response_length=max(1, math.ceil(lengths.at(0))),
                  global_batch=s.global_batch, mini_batches=s.mini_batches, micro_batch=s.micro_batch)
    workflow = build_workflow(s.algorithm, reward_model=s.reward_model)
    max_model_len = s.prompt_length + math.ceil(max(lengths.response_lengths))
    engines = generation_engines(workflow, s.generation, max_model_len)
    specs = {r: spec for r in Role if s.reward_model or r is not Role.REWARD}
    problem = PlanProblem(workflow, specs, wl, site, tuple(range(s.gpus)), engines=engines)
    if s.join not in ("background", "immediate"):
        raise ConfigError(f"--join {s.join!r}: expected background or immediate")
    sim = Simulation(problem, lengths, pool, s.steps, truth, response_cap=response_cap, join=s.join)
    meta = {"model": s.model, "algorithm": s.algorithm, "site": site.name, "gpus": s.gpus, "steps": s.steps,
            "length_trace": lengths.label, "length_generated": lengths.generated, "length_trace_steps": trace_steps,
            "max_new_tokens_schedule": [list(x) for x in s.max_new_tokens_schedule], "pool_trace": pool.label,
            "global_batch": s.global_batch, "prompt_length": s.prompt_length, "seed": s.seed,
            "reward_model": s.reward_model,
            "generation": s.generation, "join": s.join, "truth": vars(truth), "launch_plan": sim.launch.describe()}
    return sim, meta


_SIM: Simulation | None = None


def _run_one(policy: Policy) -> PolicyResult:
    assert _SIM is not None
    return _SIM.run(policy)


def run_policies(sim: Simulation, policies: Sequence[Policy], jobs: int = 1,
                 on_done: Callable[[PolicyResult], None] | None = None) -> list[PolicyResult]:
    """Run every policy on ``sim`` (results in the order of ``policies``); ``jobs > 1`` uses that
    many forked worker processes. The oracle runs after the others and also ranks the plans they
    ran (:meth:`Simulation.learn_plans`). ``on_done`` is called with each result as it completes
    (progress for a caller; in completion order)."""
    others = [p for p in policies if p.kind != ORACLE]
    oracles = [p for p in policies if p.kind == ORACLE]
    done = dict(zip((id(p) for p in others), _run(sim, others, jobs, on_done)))
    sim.learn_plans(list(done.values()))
    done.update(zip((id(p) for p in oracles), _run(sim, oracles, jobs, on_done)))
    return [done[id(p)] for p in policies]


def _run(sim: Simulation, policies: Sequence[Policy], jobs: int,
         on_done: Callable[[PolicyResult], None] | None = None) -> list[PolicyResult]:
    global _SIM
    report = on_done or (lambda result: None)
    jobs = max(1, min(jobs, len(policies), os.cpu_count() or 1))
    if jobs == 1 or "fork" not in multiprocessing.get_all_start_methods():
        results = []
        for p in policies:
            results.append(sim.run(p))
            report(results[-1])
        return results
    _SIM = sim
    try:
        with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("fork")) as pool:
            futures = [pool.submit(_run_one, p) for p in policies]
            for future in as_completed(futures):
                report(future.result())
            return [f.result() for f in futures]
    finally:
        _SIM = None
