"""What a resumed nereusd continues with: the controller's state as JSON for the journal
(``checkpoint`` events carry it) and its checked restore (``nereusd --resume``).

:class:`ControllerState` is a part of :class:`nereusd.control.controller.Controller` (its
attributes are the controller's), in a module of its own: every field of a restored state is
checked here, whole or not at all, apart from the decisions that use it.
"""

from __future__ import annotations

import math
from typing import Mapping

from nereusd.control.lookahead import MAX_TOKENS, LengthLookahead
from nereusd.control.monitor import Monitor
from nereusd.cost.calibration import Calibration
from nereusd.errors import ConfigError, PlanError
from nereusd.plan import Plan


class ControllerState:
    """:meth:`state` and :meth:`restore` of the controller (module docstring)."""

    STATE_VERSION = 2

    def state(self) -> dict:
        """What the controller learned, for the journal (JSON; ``checkpoint`` events carry it, so
        that ``nereusd --resume`` continues with it, :meth:`restore`): the plan, the response
        length seen, the calibration, the memory ratios, the transition overhead and each
        model-stage's rebuild time, the monitor's
        signals and ``H_x``, the re-run and relaunch marks, a rejection waiting to be asked again,
        and the ``frozen`` policy's base plan."""
        return {"version": self.STATE_VERSION, "plan": self.plan.to_dict(), "length": self.length,
                "calibration": self.calibration.to_json(), "memory_ratios": list(self._memory),
                "efficiency": self.efficiency, "efficiencies": list(self._efficiencies),
                "monitor": self.monitor.to_json(),
                "replay": [self._replay_until, self._replay_length], "relaunch": self._relaunch,
                "restarted": self._restarted, "predicted_step_s": self.predicted_step_s,
                "base_plan": self.base_plan.to_dict(), "lengths": self.lengths.to_json(),
                "mean_fractions": list(self._mean_fractions), "rejected": self._rejected,
                **self._transition_costs_state()}

    def restore(self, state: Mapping) -> None:
        """Continue from :meth:`state` (the plan is the caller's: a resumed job may run another).

        Raises:
            ConfigError: another version or a malformed state, naming the field; the controller
                is unchanged (the caller resumes with what it has).
        """
        try:
            if type(state.get("version")) is not int or state.get("version") != self.STATE_VERSION:
                raise ValueError(f"version {state.get('version')!r}, expected {self.STATE_VERSION}")
            Calibration.from_json(state["calibration"], "controller state: calibration")   # checked first
            monitor = Monitor.from_json(state["monitor"])
            memory = [float(x) for x in state["memory_ratios"]]
            if not all(math.isfinite(x) and x > 0 for x in memory):   # a nan hid the largest ratio from max()
                raise ValueError(f"memory_ratios {memory!r}: expected finite ratios > 0")
            base_plan = Plan.from_dict(state["base_plan"])
            replay_until, replay_length = (int(x) for x in state["replay"])
            if not (0 <= replay_until and 0 <= replay_length <= max(self.max_response_length, 1)):
                raise ValueError(f"replay {state['replay']!r}: a step ≥ 0 and a length of at most max_new_tokens")
            flags = (state["relaunch"], state["restarted"])
            if not all(isinstance(f, bool) for f in flags):   # bool("false") is True
                raise TypeError(f"relaunch / restarted must be true or false, got {flags!r}")
            fields = (int(state["length"]), float(state["efficiency"]), *flags)
            if not (1 <= fields[0] <= MAX_TOKENS and math.isfinite(fields[1]) and fields[1] > 0):
                raise ValueError(f"length {state['length']!r} / efficiency {state['efficiency']!r} out of range")
            predicted = state["predicted_step_s"]
            predicted = None if predicted is None else float(predicted)
            if predicted is not None and not (math.isfinite(predicted) and predicted >= 0):
                raise ValueError(f"predicted_step_s {predicted!r}")
            costs = self._parse_transition_costs(state)
            lengths = LengthLookahead(self.policy.delta_length)
            lengths.restore(state["lengths"])
            ratios = state.get("efficiencies", [fields[1]])   # absent before 2026-12-06
            if not (isinstance(ratios, list) and len(ratios) <= self._efficiencies.maxlen
                    and all(type(x) in (int, float) and 1e-6 <= x <= 1e6 for x in ratios)):   # NaN fails too
                raise ValueError(f"efficiencies {ratios!r}: expected a list of at most {self._efficiencies.maxlen} "
                                 "predicted/measured ratios in [1e-6, 1e6]")
            ratios = [float(x) for x in ratios]
            fractions = [float(x) for x in state.get("mean_fractions", [])]   # absent before 2026-12-04
            if not all(0.0 < x <= 1.0 for x in fractions):
                raise ValueError(f"mean_fractions outside (0, 1]: {fractions}")
            rejected = state.get("rejected")   # absent before 2026-12-05
            if rejected is not None:
                if not (isinstance(rejected, list) and len(rejected) == 2 and type(rejected[0]) is int
                        and type(rejected[1]) in (int, float)):
                    raise ValueError(f"rejected: expected [step, payback steps], got {rejected!r}")
                rejected = (rejected[0], float(rejected[1]))
                if not (rejected[0] >= 0 and math.isfinite(rejected[1]) and rejected[1] >= 0):
                    raise ValueError(f"rejected: a step ≥ 0 and a finite payback ≥ 0, got {list(rejected)!r}")
        except ConfigError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError, PlanError) as err:
            raise ConfigError(f"controller state: malformed ({type(err).__name__}: {err})") from None
        self.calibration.restore(state["calibration"], "controller state: calibration")
        self.cost_model.refresh()
        self.transitions.forget()
        self.monitor = monitor
        self._memory.clear()
        self._memory.extend(memory)
        self.base_plan = base_plan
        self._replay_until, self._replay_length = replay_until, replay_length
        self.length, self.efficiency, self._relaunch, self._restarted = fields
        self._efficiencies.clear()
        self._efficiencies.extend(ratios)
        self.predicted_step_s = predicted
        self.lengths = lengths
        self._mean_fractions.clear()
        self._mean_fractions.extend(fractions)
        self._rejected = rejected
        self._set_transition_costs(costs)
