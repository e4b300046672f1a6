"""A local job's pool trace and schedule: ``nereus-launch local --pool-trace …`` written into the
job, and the launch lines that say what the pool will do."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from nereusd.config.resolve import ResolvedJob
from nereusd.errors import ConfigError, NereusError


MODEL_KEYS = ("actor", "critic", "reference", "reward")


def pool_trace_override(args: argparse.Namespace, data: dict) -> dict | None:
    """The job mapping ``data`` with ``pool.trace`` set from ``--pool-trace``, ``--trace-hour-s``,
    ``--trace-hour-steps`` and ``--trace-start-hour`` (missing ones keep the job's values), or
    ``None`` when none is given. Model directories become absolute paths (they are relative to
    the job file, and the effective job is written to the run directory).

    Raises:
        NereusError: a time base or start hour without a trace, or a trace without a time base.
    """
    flags = {"seconds_per_trace_hour": args.trace_hour_s, "steps_per_trace_hour": args.trace_hour_steps,
             "start_hour": args.trace_start_hour}
    if args.pool_trace is None and all(v is None for v in flags.values()):
        return None
    pool = dict(data.get("pool") or {})
    trace = dict(pool.get("trace") or {})
    if args.pool_trace is None and not trace:
        raise NereusError("--trace-hour-s, --trace-hour-steps and --trace-start-hour need --pool-trace NAME "
                          "(or a pool.trace in the job)")
    if args.pool_trace is not None:
        trace["name"] = args.pool_trace
    if args.trace_hour_s is not None or args.trace_hour_steps is not None:
        trace.pop("seconds_per_trace_hour", None)
        trace.pop("steps_per_trace_hour", None)
    trace.update({k: v for k, v in flags.items() if v is not None})
    if "seconds_per_trace_hour" not in trace and "steps_per_trace_hour" not in trace:
        raise NereusError("--pool-trace needs a time base: --trace-hour-s S (seconds per trace hour) or "
                          "--trace-hour-steps N (steps per trace hour)")
    out = dict(data, pool=dict(pool, trace=trace))
    base_dir = Path(args.job).resolve().parent
    models = dict(out.get("models") or {})
    for key in MODEL_KEYS:
        if isinstance(models.get(key), str) and not Path(models[key]).is_absolute():
            models[key] = str((base_dir / models[key]).resolve())
    if models:
        out["models"] = models
    return out


def describe_pool_schedule(job: ResolvedJob, preview: int = 8) -> list[str]:
    """Launch lines for the job's ``pool.schedule`` and ``pool.trace`` (the trace's first changes).

    Raises:
        ConfigError: ``pool.trace.min_devices`` above the job's devices.
    """
    from nereusd.config.pool_schedule import schedule_for

    pool = job.config.pool
    try:
        schedule = schedule_for(job)   # validates against the job's devices
    except ConfigError as err:
        raise ConfigError(f"{job.source}: {err}") from None
    lines = []
    if pool.schedule:
        lines.append(f"nereus: pool schedule: {len(pool.schedule)} event(s)")
    trace = schedule.trace
    if trace is not None:
        c = trace.config
        if c.steps_per_trace_hour is not None:
            hours = (job.config.steps - 1) / c.steps_per_trace_hour
            base = f"{c.steps_per_trace_hour:g} steps per trace hour"
        else:
            hours = 48.0
            base = f"{c.seconds_per_trace_hour:g} s per trace hour"
        changes = trace.changes(hours)
        shown = []
        for hour, n in changes[:preview]:
            kind, at = trace.offset(hour)
            where = f"step {max(1, math.ceil(at - 1e-9))}" if kind == "at_step" else f"{at:.0f} s"
            shown.append(f"{n} at {where}")
        more = f", ... ({len(changes)} changes in {hours:.1f} trace hours)" if len(changes) > preview else ""
        lines.append(f"nereus: pool trace {c.name} from hour {c.start_hour:g} ({base}), scaled to {job.devices} "
                     f"devices (min {trace.min_devices}): devices " + (", ".join(shown) + more if shown else "unchanged"))
    if (pool.schedule or trace is not None) and not job.config.adaptation.enabled:
        lines.append("nereus: warning: adaptation.enabled is false, so the pool schedule and trace are not applied")
    return lines
