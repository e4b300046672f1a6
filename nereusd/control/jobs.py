"""The controller of a live job, from its job file: the controller :func:`controller_for_job`
builds, the fingerprint that ties a journalled controller state to its job file
(:func:`job_fingerprint`), and the plan an ``adaptation.forced`` entry asks for
(:func:`forced_plan`)."""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Mapping

from nereusd.backends import Backend, check_zero_stage
from nereusd.config.resolve import ResolvedJob
from nereusd.config.site import SiteConfig
from nereusd.control.controller import Controller
from nereusd.control.policy import ControlPolicy
from nereusd.control.problem import job_problem
from nereusd.cost.calibration import Calibration
from nereusd.errors import ConfigError, PlanError
from nereusd.plan import Layout, ModelStage, Plan, Stage
from nereusd.shards import check_layout, value_head_for


def job_fingerprint(job: ResolvedJob) -> str:
    """SHA-256 of the job's validated configuration: a controller state journalled under another
    job file is not resumed (its plan and calibration may not fit it)."""
    return hashlib.sha256(job.config.model_dump_json().encode()).hexdigest()


def controller_for_job(job: ResolvedJob, site: SiteConfig, plan: Plan, prompt_length: int,
                       pool: tuple[int, ...] | None = None, calibration: Calibration | None = None) -> Controller:
    """The controller of a live job: its plan problem, its ``adaptation`` policy, every
    transition assessed at full size (the DAG admission assesses is the one executed)."""
    pool = tuple(sorted(pool)) if pool is not None else plan.devices()
    problem = job_problem(job, site, pool, job.config.rollout.max_new_tokens, prompt_length)
    rollout = job.config.rollout
    return Controller(problem, plan, ControlPolicy.from_config(job.config.adaptation),
                      max_response_length=rollout.max_new_tokens,
                      response_cap=rollout.max_new_tokens_at if rollout.max_new_tokens_schedule else None,
                      pool=pool, calibration=calibration)


def forced_plan(job: ResolvedJob, current: Plan, overrides: Mapping[str, object]) -> Plan:
    """``current`` with the per-model-stage overrides of an ``adaptation.forced`` entry.

    Unspecified degrees keep the current values; ``dp`` defaults to ``devices / (tp·pp)``.

    Raises:
        PlanError: naming the model-stage when the override does not fit its devices or the model
            (:func:`~nereusd.shards.check_layout`).
    """
    out = dict(current.candidates)
    for name, cfg in overrides.items():
        ms = ModelStage.parse(name)
        cur = current[ms]
        devices = tuple(cfg.devices) if cfg.devices is not None else cur.devices
        tp, pp = cfg.tp or cur.tp, cfg.pp or cur.pp
        try:
            Layout(tp, pp).check_devices(len(devices))
            check_layout(job.roles[ms.role].spec, Layout(tp, pp), value_head=value_head_for(ms.role),
                         generation=ms.stage is Stage.GENERATION)
        except PlanError as err:
            raise PlanError(f"adaptation.forced: {ms}: {err}") from None
        dp = cfg.dp or len(devices) // (tp * pp)
        mb = cfg.micro_batch if cfg.micro_batch is not None else cur.micro_batch
        zero = cfg.zero_stage if cfg.zero_stage is not None else cur.zero_stage
        try:
            check_zero_stage(ms, job.backends.get(ms, Backend.NATIVE), zero, tp=tp, pp=pp,
                             key=f"adaptation.forced: {ms}")
        except ConfigError as err:
            raise PlanError(str(err)) from None
        out[ms] = dataclasses.replace(cur, tp=tp, pp=pp, dp=dp, devices=devices[:tp * pp * dp], micro_batch=mb,
                                      recompute=cfg.recompute if cfg.recompute is not None else cur.recompute,
                                      zero_stage=zero)
    return Plan(out)
