"""The ``pool:`` section of a job: pool changes of a local job (a schedule of events, a replayed
spot trace) and how arriving devices join (:mod:`nereusd.config.pool_schedule` turns them into
events at safe boundaries)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, StrictInt, field_validator, model_validator

from nereusd.config.schema import Number, Strict
from nereusd.errors import ConfigError


class PoolEventConfig(Strict):
    """Devices leaving or joining a local job at a safe boundary: the one before step ``at_step``
    (0-based), or the first one at or after ``at_s`` seconds since the job's first step started.
    Give exactly one of ``at_step`` and ``at_s``."""

    at_step: StrictInt | None = Field(None, ge=1)
    """Apply at the safe boundary before this step."""
    at_s: Number | None = Field(None, ge=0.0)
    """Apply at the first safe boundary at or after this many seconds since the first step
    started (a device cannot leave mid-step in local mode: it leaves at that boundary)."""
    remove: StrictInt = Field(0, ge=0)
    """Devices whose workers are stopped (the highest-numbered ones of the pool)."""
    add: StrictInt = Field(0, ge=0)
    """Virtual devices added by a new local agent; their workers join the world."""

    @model_validator(mode="after")
    def _one_kind(self) -> "PoolEventConfig":
        if (self.at_step is None) == (self.at_s is None):
            raise ValueError(f"give exactly one of at_step (a step) or at_s (seconds since the first step "
                             f"started) (at_step={self.at_step}, at_s={self.at_s})")
        if (self.add > 0) == (self.remove > 0):
            raise ValueError(f"give exactly one of remove or add with a positive count "
                             f"(remove={self.remove}, add={self.add})")
        return self


class PoolTraceConfig(Strict):
    """A spot-availability trace replayed on a local job's pool (see ``nereusd.config.pool_schedule``).

    The trace's full availability is the job's ``devices``; at trace hour ``h`` the pool holds
    ``clamp(floor(devices · available(h) / full + 1/2), min_devices, devices)`` devices, and each change
    of that count is a remove/add event at the matching safe boundary. Trace hour 0 is the trace's
    first sample with every instance available (as in ``nereus-launch simulate``). Give exactly one
    time base: ``seconds_per_trace_hour`` (wall clock) or ``steps_per_trace_hour`` (RL steps).
    """

    name: str
    """A shipped trace (``us-east-2b``, ``us-west-2a``: 16-node AWS spot availability, one sample
    per 300 s; ``nereusd/data/traces/SOURCES.md``) or the path of a trace file of that format."""
    seconds_per_trace_hour: Number | None = Field(None, gt=0.0)
    """Wall-clock seconds of the job per trace hour (e.g. 60: a 10-hour trace in 10 minutes)."""
    steps_per_trace_hour: Number | None = Field(None, gt=0.0)
    """RL steps per trace hour (e.g. 12: one step per 5-minute trace sample)."""
    start_hour: Number = Field(0.0, ge=0.0)
    """Trace hour at which the job's first step starts."""
    min_devices: StrictInt | None = Field(None, ge=1)
    """The scaled pool never drops below this many devices (nor rises above the job's devices).
    Default: the fewest the job can run on — its largest set of model-stages that run
    concurrently on disjoint devices (GRPO: actor and reference inference, 2)."""

    @field_validator("name")
    @classmethod
    def _known_trace(cls, value: str) -> str:
        from nereusd.traces import load_pool_trace   # light: stdlib and nereusd.errors only

        try:
            load_pool_trace(value)
        except ConfigError as err:
            raise ValueError(str(err)) from None
        return value

    @model_validator(mode="after")
    def _one_time_base(self) -> "PoolTraceConfig":
        if (self.seconds_per_trace_hour is None) == (self.steps_per_trace_hour is None):
            raise ValueError("give exactly one time base: seconds_per_trace_hour (wall clock) or "
                             "steps_per_trace_hour (RL steps)")
        return self


class PoolConfig(Strict):
    """Pool changes of a local job (``nereus-launch local``); on a cluster the scheduler decides.
    Both may be given; their changes add up."""

    schedule: list[PoolEventConfig] = Field(default_factory=list)
    """Single events at given steps or times."""
    trace: PoolTraceConfig | None = None
    """A spot-availability trace scaled to the job's devices."""
    join: Literal["background", "immediate"] = "background"
    """How devices that arrive (``schedule``/``trace`` adds, ``nereus-launch pool --add``, a
    ``grow`` allocation) join: ``background`` starts their workers, and the vLLM engines of the
    replicas the controller expects to place on them, while steps go on, and they join the world
    at the first boundary after that is done; ``immediate`` starts them at the boundary they
    arrive at, and the job waits (DESIGN.md "Engine backends and generation on vLLM")."""
    max_devices: StrictInt | None = Field(None, ge=1)
    """Most devices the pool may hold at once (every agent's, ``grow``/``pool --add`` ones
    included); a registration beyond it is refused. Default: 4 × the larger of ``devices`` and
    the launch allocation's devices (:meth:`ResolvedJob.pool_limit`)."""
