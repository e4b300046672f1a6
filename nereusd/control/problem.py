"""The plan problem of a job, and its launch plan (paper §4.2): what the controller plans for.

:func:`job_problem` turns a resolved job into a :class:`nereusd.planner.space.PlanProblem` (its
workflow, role models, one step's workload, the site with the job's device memory, a pool);
:func:`launch_plan` is the planner's plan for the job's initial conditions; :func:`solve` the
planner call the controller makes (the urgent path widening micro-batches and recomputation).
"""

from __future__ import annotations

import dataclasses
import math

from nereusd.config.resolve import ResolvedJob
from nereusd.config.site import SiteConfig
from nereusd.control.admission import urgent_replan
from nereusd.control.policy import PolicyKind
from nereusd.cost.calibration import Calibration
from nereusd.backends import ENGINE_COMPUTE_DTYPE, Backend
from nereusd.cost.memory import HEADROOM, usable_bytes
from nereusd.errors import ConfigError, format_bytes
from nereusd.cost.model import CostModel
from nereusd.plan import ModelStage, Plan
from nereusd.planner.search import Infeasible, Planner, PlanResult
from nereusd.planner.space import PlannerOptions, PlanProblem, evaluate
from nereusd.workflow import Workload, build_workflow


def site_for_pool(site: SiteConfig, pool: tuple[int, ...]) -> SiteConfig:
    """``site`` with enough nodes to number every device of ``pool`` (devices that joined a
    running job get numbers past the allocation's)."""
    nodes = max(site.nodes, math.ceil((max(pool, default=0) + 1) / site.devices_per_node))
    return site if nodes == site.nodes else dataclasses.replace(site, nodes=nodes)


def job_site(job: ResolvedJob, site: SiteConfig, pool: tuple[int, ...] = ()) -> SiteConfig:
    """``site`` with the job's device memory, the dtype its engines compute in
    (:data:`~nereusd.backends.ENGINE_COMPUTE_DTYPE`, whatever the site's ``compute_dtype``) and
    enough nodes to number every device of ``pool``: the site a live job is planned on."""
    device = dataclasses.replace(site.device, memory_gib=job.device_memory_bytes / float(1 << 30),
                                 compute_dtype=ENGINE_COMPUTE_DTYPE)
    return site_for_pool(dataclasses.replace(site, device=device), pool)


def job_problem(job: ResolvedJob, site: SiteConfig, pool: tuple[int, ...], response_length: int,
                prompt_length: int) -> PlanProblem:
    """The plan problem of ``job``: its workflow, role models, one step's workload, ``pool``.

    ``global_batch`` of the workload is the step's sequences; ``mini_batches`` the optimizer
    steps per pass over them (``sequences / train.global_batch``), ``epochs`` the passes
    (``train.epochs``).
    """
    cfg = job.config
    workflow = build_workflow(cfg.algorithm.value, reward_model=cfg.reward.kind == "model",
                              asynchronous=cfg.rollout.max_staleness > 0)
    seqs = job.sequences_per_step
    workload = Workload(prompt_length=max(1, prompt_length), response_length=max(1, int(response_length)),
                        global_batch=seqs, mini_batches=seqs // cfg.train.global_batch,
                        micro_batch=cfg.train.micro_batch, epochs=cfg.train.epochs,
                        max_tokens_per_micro_batch=cfg.train.max_tokens_per_micro_batch)
    specs = {role: rm.spec for role, rm in job.roles.items()}
    engines = {ms: job.max_sequence_tokens for ms, b in job.backends.items() if b is Backend.VLLM}
    return PlanProblem(workflow, specs, workload, job_site(job, site, pool), tuple(pool), engines=engines,
                       zero_stages=dict(job.zero_stages))


def solve(problem: PlanProblem, cost_model: CostModel, current: Plan | None, headroom: float,
          urgent: bool, generation_micro_batch: int = 0,
          shapes: tuple[tuple[ModelStage, int, int], ...] = ()) -> tuple[PlanResult | None, list[str]]:
    """The planner's best plan (urgent: widening micro-batch and recomputation); log lines.
    ``generation_micro_batch`` and ``shapes``: :class:`PlannerOptions`' fields."""
    options = PlannerOptions(headroom=headroom, generation_micro_batch=generation_micro_batch, shapes=shapes)
    if urgent:
        return urgent_replan(problem, cost_model, current, options)
    try:
        return Planner(problem, cost_model, options).solve(current), []
    except Infeasible as err:
        return None, [str(err)]


def launch_plan(job: ResolvedJob, site: SiteConfig, prompt_length: int,
                calibration: Calibration | None = None, step: int = 0) -> PlanResult:
    """The plan for the job's initial conditions when its YAML gives none (paper §4.2).

    Chosen for :meth:`~nereusd.config.job.JobConfig.launch_response_length` of ``step`` (the
    step the job starts at: 0, or a resume's checkpoint) on
    devices ``0 … devices−1`` (:func:`launch_for`).

    Raises:
        Infeasible: when nothing fits, even with recomputation.
    """
    length = job.config.launch_response_length(step)
    return launch_for(job_problem(job, site, tuple(range(job.devices)), length, prompt_length), calibration)


@dataclasses.dataclass(frozen=True)
class LaunchChoice:
    """The plan a job launches on (:func:`choose_launch`)."""

    plan: Plan
    source: str
    """Why this plan: ``"planner"``, :data:`~nereusd.journal.JOB_PLAN_SOURCE`, or a sentence."""
    result: PlanResult | None = None
    """The planner's result, when the planner chose it."""
    warning: str | None = None
    """Said before the job starts: the job's own plan is predicted over the planner's headroom."""


def choose_launch(job: ResolvedJob, site: SiteConfig, prompt_length: int, step: int = 0,
                  plan: Plan | None = None) -> LaunchChoice:
    """The plan a job starts on, checked against the memory model before any worker starts: the
    one rule of nereusd's launch and of ``render``/``submit`` on the login node.

    - An adaptive job (``adaptation.enabled``) whose file gives no ``plan``: the planner's
      :func:`launch_plan`; when nothing fits the planner's headroom but the smallest need is
      within the device, the job's default plan (its workers then say what does not fit).
    - A job's own plan (or a frozen job's default plan), predicted at the step's launch response
      length with the planner's memory model (:func:`~nereusd.planner.space.evaluate`): over a
      device's whole memory, an adaptive job launches on the planner's plan instead (as its urgent
      path would have after an out-of-memory build) and a frozen one (adaptation off, or
      ``policy: frozen``, which keeps its launch plan) is refused; over the usable
      share only (the planner's 10 % headroom), it runs with a warning.

    Raises:
        ConfigError: no plan can run: the planner's account of what fails and would fit, or the
            job's plan's device, model-stages and predicted bytes. Until 2026-12-07 ``render``
            and ``submit`` checked neither, and a job's own plan over memory failed in its build
            with a raw out-of-memory error (an adversarial trial).
    """
    from nereusd.journal import JOB_PLAN_SOURCE

    own = plan or job.plan   # the job's plan (the driver's, which starts as it)
    adaptation = job.config.adaptation
    if adaptation.enabled and "plan" not in job.config.model_fields_set:
        try:
            chosen = launch_plan(job, site, prompt_length, step=step)
            return LaunchChoice(chosen.plan, "planner", chosen)
        except Infeasible as err:
            if err.need_bytes > job.device_memory_bytes:   # over the whole device, headroom aside: no plan runs
                raise ConfigError(f"no plan fits this job: {err}") from None
            # only the planner's headroom is short: the default plan, the workers say what does not fit
            return LaunchChoice(own, f"the job's default plan (the planner found none: {err})")
    length = job.config.launch_response_length(step)
    problem = job_problem(job, site, tuple(range(job.devices)), length, prompt_length)
    peaks = evaluate(problem, own, CostModel(problem.site)).peak_bytes
    device = max(peaks, key=lambda d: (peaks[d], -d))
    capacity = problem.site.device_memory_bytes
    over = (f"its device {device} ({', '.join(map(str, own.model_stages_on(device)))}) is predicted to need "
            f"{format_bytes(peaks[device])} at response length {length}")
    if peaks[device] > capacity:
        where = f"the job's plan does not fit: {over}, over the device's {format_bytes(capacity)}"
        if not adaptation.enabled or PolicyKind(adaptation.policy) is PolicyKind.FROZEN:   # it keeps its plan
            raise ConfigError(f"{where}; give a plan that fits, or leave plan out and let the planner choose")
        try:
            chosen = launch_plan(job, site, prompt_length, step=step)
        except Infeasible as err:
            raise ConfigError(f"{where}, and no plan fits this job: {err}") from None
        return LaunchChoice(chosen.plan, f"planner ({where})", chosen, warning=f"{where}: launching on the planner's")
    if peaks[device] > usable_bytes(capacity):
        return LaunchChoice(own, JOB_PLAN_SOURCE, warning=(
            f"the job's plan is tight: {over}, over the {format_bytes(usable_bytes(capacity))} the planner uses "
            f"(its {HEADROOM:.0%} headroom kept free)"))
    return LaunchChoice(own, JOB_PLAN_SOURCE)


def launch_for(problem: PlanProblem, calibration: Calibration | None = None) -> PlanResult:
    """The launch plan of ``problem``: the planner's urgent path (recomputation
    when nothing else fits) under ``calibration`` (default: the site's priors) at the memory
    model's headroom.

    Raises:
        Infeasible: when nothing fits, with the planner's account of what fails and would fit.
    """
    cost_model = CostModel(problem.site, calibration or Calibration())
    result, lines = solve(problem, cost_model, None, HEADROOM, True)
    if result is None:
        why = None
        try:   # the planner's own account of what fails, and what would fit
            Planner(problem, cost_model, PlannerOptions(headroom=HEADROOM, allow_recompute=True), suggest=True).solve()
        except Infeasible as err:
            # the urgent path's lines ("job settings: …", "with recomputation: …") that it says
            # again are dropped; it planned with recomputation, which its line says (without a
            # label, a job-settings line and it read as two verdicts on one model-stage)
            lines = [line for line in lines if line.split(": ", 1)[-1] not in str(err)]
            lines.append(f"{'with' if lines else 'even with'} recomputation: {err}")
            why = err
        raise Infeasible(f"no launch plan fits {len(problem.pool)} devices: " + "; ".join(lines),
                         *((why.model_stage, why.need_bytes, why.usable_bytes) if why is not None else ()))
    return result
