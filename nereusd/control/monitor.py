"""Monitor: drift signals, replan triggers and the ``H_x`` estimates (paper §4.1, §4.3).

Pure, clocked logic: the caller passes the step number; nothing reads a clock.

- *Urgent* triggers: the GPU pool changed, or the predicted peak memory of the current plan for
  the coming step exceeds the usable capacity.
- *Drift* triggers: a signal ``x`` differs from its reference (its value at the last replan) by
  more than ``δ_x`` relative (``δ_len = 30 %`` for the per-step sequence length).
- Reference values reset after every replan, admitted or not (:meth:`Monitor.replanned`), so a
  persistent deviation does not retrigger at every step and steady growth crosses repeatedly.
- ``H_x``: exponential moving average of the number of steps between threshold crossings of
  ``x`` (updated at crossings only), 1 before any interval has been seen. The pool signal's
  crossings are its changes.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Mapping

from nereusd.config.job import DEFAULT_DELTA_LENGTH


class Signal(str, enum.Enum):
    """What a trigger reacts to (a ``str``: journal records and comparisons read the value)."""

    SEQUENCE_LENGTH = "sequence_length"
    """The step's longest response (drift)."""
    GPU_POOL = "gpu_pool"
    """Devices joined or left (urgent)."""
    PEAK_MEMORY = "peak_memory"
    """The current plan's predicted peak for the coming step exceeds the usable memory (urgent)."""
    EFFICIENCY = "efficiency"
    """Predicted over measured step time (drift)."""
    PERIOD = "period"
    """Every ``period`` steps (a policy's knob, not a measurement)."""
    FORCED = "forced"
    """The operator forces a layout (``adaptation.forced``)."""
    RESTARTED = "restarted"
    """The job restarted into a plan for the longest response (a failure's remedy, not the
    fastest plan for the coming steps): replan once, opportunistically."""
    RECHECK = "recheck"
    """A faster target was rejected for its payback period; the plan has since stayed valid long
    enough that it would repay within ``γ`` of those steps: replan once, opportunistically
    (:func:`nereusd.control.admission.recheck_due`)."""

    def __str__(self) -> str:
        return self.value


SEQUENCE_LENGTH, GPU_POOL, PEAK_MEMORY, EFFICIENCY = (Signal.SEQUENCE_LENGTH, Signal.GPU_POOL, Signal.PEAK_MEMORY,
                                                       Signal.EFFICIENCY)
PERIOD, FORCED, RESTARTED, RECHECK = Signal.PERIOD, Signal.FORCED, Signal.RESTARTED, Signal.RECHECK
DEFAULT_DELTAS = {SEQUENCE_LENGTH: DEFAULT_DELTA_LENGTH, EFFICIENCY: 0.20}
DEFAULT_EMA_ALPHA = 0.5


def ema(average: float, value: float, seen: int, alpha: float = DEFAULT_EMA_ALPHA) -> float:
    """The exponential moving average once ``value`` is seen: ``value`` itself when ``seen`` (the
    values averaged so far) is 0, else ``alpha·value + (1 − alpha)·average``. The one rule of the
    monitor's ``H_x`` and of the learned transition costs
    (:class:`nereusd.control.transition_costs.TransitionCostLearning`)."""
    return value if seen == 0 else alpha * value + (1 - alpha) * average


@dataclass(frozen=True)
class Trigger:
    """Why a replan starts. ``urgent`` triggers waive profitability."""

    signal: Signal
    urgent: bool
    value: float
    reference: float | None
    detail: str = ""

    def to_dict(self) -> dict:
        return {"signal": Signal(self.signal).value, "urgent": self.urgent, "value": self.value,
                "reference": self.reference, "detail": self.detail}


@dataclass
class _Signal:
    reference: float | None = None
    last_crossing: int | None = None
    horizon: float = 1.0
    intervals: int = 0


@dataclass
class Monitor:
    """Tracks drift signals of one job.

    Args:
        deltas: relative thresholds ``δ_x`` per drift signal.
        ema_alpha: weight of the newest interval in the ``H_x`` average.
    """

    deltas: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_DELTAS))
    ema_alpha: float = DEFAULT_EMA_ALPHA
    _signals: dict[str, _Signal] = field(default_factory=dict)
    _pool: tuple[int, ...] | None = None

    def horizon(self, signal: str) -> float:
        """``H_x`` in steps: EMA of steps between crossings, 1.0 before any interval."""
        return self._signals.get(signal, _Signal()).horizon

    def steps_since_crossing(self, signal: str, step: int) -> int:
        """Steps since ``signal`` last crossed its threshold (since step 0 when it never did)."""
        last = self._signals.get(signal, _Signal()).last_crossing
        return max(0, step - (last if last is not None else 0))

    def reference(self, signal: str) -> float | None:
        return self._signals.get(signal, _Signal()).reference

    def _crossed(self, signal: str, step: int) -> None:
        s = self._signals.setdefault(signal, _Signal())
        if s.last_crossing is not None and step > s.last_crossing:
            interval = step - s.last_crossing
            s.horizon = ema(s.horizon, interval, s.intervals, self.ema_alpha)
            s.intervals += 1
        s.last_crossing = step

    def observe(
        self,
        step: int,
        *,
        signals: Mapping[str, float],
        pool: tuple[int, ...] | None = None,
        predicted_peak_bytes: int | None = None,
        usable_bytes: int | None = None,
    ) -> list[Trigger]:
        """Check triggers at the safe boundary after ``step``.

        Args:
            signals: drift signal values of this step (e.g. ``sequence_length``).
            pool: the current device pool; a change is an urgent trigger.
            predicted_peak_bytes / usable_bytes: the current plan's predicted peak for the
                coming step and the usable capacity; over capacity is an urgent trigger.

        Returns:
            The triggers that fire (empty: keep going). A first value of a signal only sets
            its reference.
        """
        triggers: list[Trigger] = []
        if pool is not None:
            pool = tuple(sorted(pool))
            if self._pool is not None and pool != self._pool:
                self._crossed(GPU_POOL, step)
                triggers.append(Trigger(GPU_POOL, True, len(pool), len(self._pool),
                                        f"pool {len(self._pool)} -> {len(pool)} devices"))
            self._pool = pool
        if predicted_peak_bytes is not None and usable_bytes is not None and predicted_peak_bytes > usable_bytes:
            triggers.append(Trigger(PEAK_MEMORY, True, predicted_peak_bytes, usable_bytes,
                                    "predicted peak exceeds usable capacity"))
        for name, value in signals.items():
            s = self._signals.setdefault(name, _Signal())
            if s.reference is None:
                s.reference = float(value)
                continue
            delta = self.deltas.get(name)
            if delta is None or s.reference == 0:
                continue
            change = abs(value - s.reference) / abs(s.reference)
            if change > delta:
                self._crossed(name, step)
                triggers.append(Trigger(Signal(name), False, float(value), s.reference,
                                        f"changed {change:.0%} > δ={delta:.0%}"))
        return triggers

    def replanned(self, signals: Mapping[str, float]) -> None:
        """Reset references to the current values after a replan, admitted or not."""
        for name, value in signals.items():
            self._signals.setdefault(name, _Signal()).reference = float(value)

    def to_json(self) -> dict:
        """State for the journal (survives a daemon restart with :meth:`from_json`)."""
        return {
            "deltas": dict(self.deltas), "ema_alpha": self.ema_alpha,
            "pool": list(self._pool) if self._pool is not None else None,
            "signals": {k: vars(v).copy() for k, v in self._signals.items()},
        }

    @classmethod
    def from_json(cls, data: Mapping) -> "Monitor":
        """Raises: KeyError, TypeError, ValueError for a malformed state (every value is checked
        here, not at the first boundary that reads it)."""
        def opt(value, kind):
            return None if value is None else kind(value)

        mon = cls(deltas={str(k): float(v) for k, v in data["deltas"].items()}, ema_alpha=float(data["ema_alpha"]))
        mon._pool = tuple(int(d) for d in data["pool"]) if data.get("pool") is not None else None
        mon._signals = {str(k): _Signal(reference=opt(v["reference"], float), last_crossing=opt(v["last_crossing"], int),
                                        horizon=float(v["horizon"]), intervals=int(v["intervals"]))
                        for k, v in data["signals"].items()}
        # a nan threshold or reference never fires its trigger; a negative horizon inverts payback
        if not all(math.isfinite(d) and d > 0 for d in mon.deltas.values()) or not 0 < mon.ema_alpha <= 1:
            raise ValueError(f"monitor deltas {dict(mon.deltas)!r} / ema_alpha {mon.ema_alpha!r} out of range")
        for name, sig in mon._signals.items():
            if (sig.reference is not None and not math.isfinite(sig.reference)) or not (
                    math.isfinite(sig.horizon) and sig.horizon > 0) or sig.intervals < 0 or (
                    sig.last_crossing is not None and sig.last_crossing < 0):
                raise ValueError(f"monitor signal {name}: {sig!r} out of range")
        return mon
