"""Pool changes of a local job over time: the job's ``pool.schedule`` and a spot-availability trace
scaled to the local pool. Pure (no torch, no processes): :class:`PoolSchedule` only answers
"which events are due at this safe boundary?"; :class:`nereusd.daemon.live.LiveAdaptation`
applies them.

**When.** An event is due at the safe boundary before step ``s`` (0-based) once ``at_step ≤ s``,
or once ``at_s ≤ elapsed_s``, the wall-clock seconds since the job's first step started. A device
cannot leave in the middle of a step in local mode: a time event (a preemption in the trace) is
applied at the first safe boundary at or after its time, and events due at the same boundary add
up. Each event is returned once, so a run that rewinds after a checkpoint/restart does not replay
them.

**Trace.** The shipped traces are AWS spot availability for a 16-instance request of
``p3.2xlarge`` (one V100 each), one sample every 300 s, from ``skypilot-org/spot-traces`` (the data
of "Can't Be Late", NSDI 2024; provenance in ``nereusd/data/traces/SOURCES.md``). They are
loaded by :func:`nereusd.traces.load_pool_trace`, which normalises each sample to the trace's
full availability and starts the trace at its first sample with every instance available (trace
hour 0, as in ``nereus-launch simulate``); past its end the trace repeats. With ``D`` = the job's
devices (= full availability), the local pool at trace hour ``h`` holds::

    n(h) = min(D, max(min_devices, floor(D · a(h) / a_max + 1/2)))

devices (``a(h)``: instances available in the sample that holds hour ``h``; ``a_max``: the
trace's full availability; the nearest count, a half upward, as in the simulator:
:meth:`nereusd.traces.PoolTrace.devices_at`). Trace hour ``h`` corresponds
to the boundary before step ``s`` at ``h = start_hour + s / steps_per_trace_hour``, or to
``elapsed_s`` seconds at ``h = start_hour + elapsed_s / seconds_per_trace_hour``. Every change of
``n`` between two boundaries becomes one event at the later boundary: ``remove`` (the
highest-numbered devices leave) or ``add`` (a new local agent), relative to the trace's previous
count (so ``nereus-launch pool`` requests in between are not undone).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Sequence

from nereusd.config.pool import PoolConfig, PoolEventConfig, PoolTraceConfig
from nereusd.errors import ConfigError
from nereusd.traces import PoolTrace, load_pool_trace


def _seconds(hour: float) -> float:
    """Trace seconds of ``hour``, rounded to the microsecond so that a sample's own start hour
    (``i · gap / 3600``) does not fall into the sample before it by floating-point error."""
    return round(hour * 3600.0, 6)


@dataclass(frozen=True)
class PoolEvent:
    """One pool change and what caused it (``source``: a readable label for the journal)."""

    remove: int
    add: int
    source: str
    at_step: int | None = None
    at_s: float | None = None
    trace_hour: float | None = None
    """For a trace event: the trace hour at which the sample it applies begins."""
    available_fraction: float | None = None
    """For a trace event: ``a(h) / a_max`` of that sample."""

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}


class ScaledTrace:
    """A spot-availability trace scaled to a local pool of ``devices`` (formula in the module
    docstring).

    Raises:
        ConfigError: unknown trace, or ``min_devices`` above ``devices``.
    """

    def __init__(self, config: PoolTraceConfig, devices: int, job_min_devices: int = 1) -> None:
        if config.min_devices is not None and config.min_devices > devices:
            raise ConfigError(f"pool.trace.min_devices: {config.min_devices} is more than the job's "
                              f"{devices} devices")
        self.config, self.devices = config, devices
        self.min_devices = config.min_devices if config.min_devices is not None else min(devices, job_min_devices)
        """The floor in use: ``pool.trace.min_devices``, else the job's own minimum."""
        self.trace: PoolTrace = load_pool_trace(config.name)

    @property
    def sample_hours(self) -> float:
        """Length of one trace sample in hours (1/12 for the 300 s spot traces)."""
        return self.trace.gap_s / 3600.0

    def hour(self, step: int, elapsed_s: float) -> float:
        """Trace hour of the boundary before ``step``, ``elapsed_s`` after the first step started."""
        c = self.config
        if c.steps_per_trace_hour is not None:
            return c.start_hour + step / c.steps_per_trace_hour
        return c.start_hour + elapsed_s / c.seconds_per_trace_hour

    def devices_at(self, hour: float) -> int:
        """``n(hour)``: devices of the local pool at trace hour ``hour``."""
        scaled = self.trace.devices_at(_seconds(hour), self.devices, 1)
        return min(self.devices, max(self.min_devices, scaled))

    def sample_start(self, hour: float) -> float:
        """Trace hour at which the sample holding ``hour`` begins (not before ``start_hour``)."""
        if math.isinf(self.trace.gap_s):
            return self.config.start_hour
        return max(self.config.start_hour, math.floor(hour / self.sample_hours + 1e-9) * self.sample_hours)

    def offset(self, hour: float) -> tuple[str, float]:
        """``('at_step', s)`` or ``('at_s', t)``: where trace hour ``hour`` falls in the job."""
        c = self.config
        if c.steps_per_trace_hour is not None:
            return "at_step", (hour - c.start_hour) * c.steps_per_trace_hour
        return "at_s", (hour - c.start_hour) * c.seconds_per_trace_hour

    def changes(self, hours: float) -> list[tuple[float, int]]:
        """``(trace hour, devices)`` at every change of ``n`` within ``hours`` after ``start_hour``
        (the pool starts with all ``devices``); for previews and tests."""
        out, level = [], self.devices
        if math.isinf(self.trace.gap_s):
            return out
        first = math.floor(self.config.start_hour / self.sample_hours + 1e-9)
        last = math.floor((self.config.start_hour + hours) / self.sample_hours + 1e-9)
        for i in range(first, last + 1):
            hour = self.sample_start(i * self.sample_hours)
            n = self.devices_at(hour)
            if n != level:
                out.append((hour, n))
                level = n
        return out

    def event(self, hour: float, since_hour: float | None, level: int, step: int,
              elapsed_s: float) -> PoolEvent | None:
        """The event that moves the pool from ``level`` (its count at trace hour ``since_hour``,
        the previous boundary; ``None``: the job's start) to ``n(hour)``, or ``None``. Its ``trace_hour`` is the start of
        the first sample after ``since_hour`` from which the trace stays at ``n(hour)``: when the
        change happened in the trace, not when the boundary came."""
        n = self.devices_at(hour)
        if n == level:
            return None
        start = self.sample_start(hour)
        if not math.isinf(self.trace.gap_s):
            floor_hour = (self.sample_start(since_hour) if since_hour is not None
                          else self.config.start_hour - self.sample_hours)
            while start - self.sample_hours > floor_hour + 1e-9 and self.devices_at(start - self.sample_hours) == n:
                start = self.sample_start(start - self.sample_hours)
        fraction = self.trace.fraction_at(_seconds(start))
        where = (f"step {step}" if self.config.steps_per_trace_hour is not None else f"{elapsed_s:.1f} s")
        source = (f"trace {self.config.name} hour {start:.2f}: {fraction:.0%} of the spot request available "
                  f"-> {n} of {self.devices} devices (applied at {where})")
        kind, value = self.offset(start)
        timing = {"at_step": step} if kind == "at_step" else {"at_s": round(value, 3)}
        return PoolEvent(remove=max(0, level - n), add=max(0, n - level), source=source,
                         trace_hour=round(start, 4), available_fraction=round(fraction, 4), **timing)


def _describe(index: int, e: PoolEventConfig) -> str:
    when = f"at_step {e.at_step}" if e.at_step is not None else f"at_s {e.at_s:g}"
    what = f"remove {e.remove}" if e.remove else f"add {e.add}"
    return f"pool.schedule[{index}] ({when}: {what})"


class PoolSchedule:
    """The pool changes of a local job: ``pool.schedule`` entries and an optional scaled trace.

    Args:
        config: the job's ``pool`` section; ``devices``: the job's devices (full availability);
        ``job_min_devices``: the fewest the job runs on (:func:`job_min_devices`), the trace's
        floor unless ``pool.trace.min_devices`` sets one.

    Raises:
        ConfigError: see :class:`ScaledTrace`.
    """

    def __init__(self, config: PoolConfig, devices: int, job_min_devices: int = 1) -> None:
        self._pending = [(i, e) for i, e in enumerate(config.schedule)]
        self.trace = ScaledTrace(config.trace, devices, job_min_devices) if config.trace is not None else None
        self._level = devices
        self._max_step = 0
        self._hour: float | None = None   # trace hour of the previous boundary

    def __bool__(self) -> bool:
        return bool(self._pending) or self.trace is not None

    def due(self, step: int, elapsed_s: float) -> list[PoolEvent]:
        """Events due at the safe boundary before ``step``, ``elapsed_s`` seconds after the first
        step started; each is returned once (schedule entries in their order, then the trace)."""
        out, keep = [], []
        for i, e in self._pending:
            if (e.at_step is not None and e.at_step <= step) or (e.at_s is not None and e.at_s <= elapsed_s):
                out.append(PoolEvent(remove=e.remove, add=e.add, source=_describe(i, e), at_step=e.at_step,
                                     at_s=e.at_s))
            else:
                keep.append((i, e))
        self._pending = keep
        if self.trace is not None:
            self._max_step = max(self._max_step, step)   # trace time never runs backwards
            hour = self.trace.hour(self._max_step, elapsed_s)
            hour = hour if self._hour is None else max(self._hour, hour)
            ev = self.trace.event(hour, self._hour, self._level, self._max_step, elapsed_s)
            self._hour = hour
            if ev is not None:
                self._level += ev.add - ev.remove
                out.append(ev)
        return out


def net_change(events: Sequence[PoolEvent]) -> tuple[int, int]:
    """``(remove, add)`` of events applied at one boundary: their net (one of them is 0)."""
    net = sum(e.add - e.remove for e in events)
    return max(0, -net), max(0, net)


def job_min_devices(algorithm: str, *, reward_model: bool, asynchronous: bool) -> int:
    """The fewest devices a job can run on: its largest set of model-stages that run concurrently
    on disjoint devices (DESIGN.md "One RL step"; :meth:`nereusd.workflow.Workflow.concurrent_sets`)."""
    from nereusd.workflow import build_workflow

    wf = build_workflow(algorithm, reward_model=reward_model, asynchronous=asynchronous)
    return max((len(s) for s in wf.concurrent_sets()), default=1)


def schedule_for(job) -> PoolSchedule:
    """The :class:`PoolSchedule` of a resolved job (:class:`nereusd.config.resolve.ResolvedJob`).

    Raises:
        ConfigError: see :class:`ScaledTrace`; and an ``add`` of more devices than one node of
            the job's site holds (an added device is a new local agent's: one node's worth at most).
    """
    from nereusd.config.site import load_site

    cfg = job.config
    per_node = load_site(cfg.site).devices_per_node
    for i, e in enumerate(cfg.pool.schedule):
        if e.add > per_node:
            raise ConfigError(f"pool.schedule[{i}].add: {e.add} devices, but a node of site {cfg.site!r} has "
                              f"{per_node}: one added agent holds one node's devices at most")
    return PoolSchedule(cfg.pool, job.devices, min_devices_of(job))


def min_devices_of(job) -> int:
    """:func:`job_min_devices` of a resolved job (:class:`nereusd.config.resolve.ResolvedJob`)."""
    cfg = job.config
    return job_min_devices(cfg.algorithm.value, reward_model=cfg.reward.kind == "model",
                           asynchronous=cfg.rollout.max_staleness > 0)
