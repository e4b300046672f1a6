"""The longest response the coming step may generate, judged from the run's own steps.

The controller chooses plans, and judges the running one, for this length rather than the last
step's: a plan must hold the *next* step, whose longest response is not known yet (the engine
pads to the longest sequence, so it sets the step's memory). Every boundary judges the running
plan again, so the lookahead has to cover one step's growth, not the growth until the next drift
trigger.

- base: the largest longest-response of the last :data:`LENGTH_WINDOW` steps;
- margin: the largest relative jump seen so far in the run of a step's longest response over
  the base before it, times :data:`JUMP_SAFETY`, at least :data:`MIN_MARGIN`, at most
  ``δ_len`` (the drift threshold, which was the margin itself before issue 16); ``δ_len`` until
  :data:`LENGTH_WINDOW` steps have been seen.

The margin is an assumption about the future from the past: a step that jumps further than any
before it, by more than the safety, can run out of memory (the job then restarts from its
checkpoint and plans that length for the re-run, :meth:`Controller.failed`). On the shipped
length traces the largest jump over the base of the 8 steps before is 6 % for the generated ramp,
3 % for ``verl-amd-7b-grpo``, 11 % for ``verl-0.5b-ppo`` and 17–18 % for the DeepGRPO traces
(1,000 steps each). A fixed 30 % made Nereus run slower layouts than it needed on the
memory-tight ramps of ``scripts/bench_sim.py`` (A100: 40 % of the oracle's headroom captured).
"""

from __future__ import annotations

import math
from collections import deque
from typing import Mapping

LENGTH_WINDOW = 8
"""Steps whose longest responses the base is the maximum of."""
JUMP_SAFETY = 1.5
"""The margin is this multiple of the largest jump seen (an assumption: the next surprise is at
most half again the largest so far)."""
MIN_MARGIN = 0.05
"""The smallest margin, whatever the run has shown."""
MAX_TOKENS = 1 << 31
"""Longest response a restored state may hold (tokens); far above any model's context, and below
what a float holds exactly (a state with 10**400 restored, then crashed the first forecast)."""
GROWTH_WINDOW = 64
"""Steps whose longest responses :meth:`LengthLookahead.growth_per_step` fits a trend to."""
GROWTH_MIN_STEPS = 16
"""Fewer steps than this give no trend (growth 0)."""


class LengthLookahead:
    """Tracks the steps' longest responses (tokens) and forecasts the coming step's.

    Args:
        delta_length: ``δ_len``, the margin's cap and its value before a window is seen.
    """

    def __init__(self, delta_length: float) -> None:
        self.delta_length = float(delta_length)
        self.jump = 0.0
        """Largest ``L_i / max(L_{i−W} … L_{i−1}) − 1`` seen (relative)."""
        self.seen = 0
        self.history: deque[int] = deque(maxlen=GROWTH_WINDOW)
        """The last :data:`GROWTH_WINDOW` steps' longest responses, oldest first."""

    @property
    def window(self) -> list[int]:
        """The last :data:`LENGTH_WINDOW` steps' longest responses (the base's), oldest first."""
        return list(self.history)[-LENGTH_WINDOW:]

    def observe(self, length: int) -> None:
        """A step's longest response (tokens, ≥ 1)."""
        if self.history:
            self.jump = max(self.jump, length / max(self.window) - 1.0)
        self.history.append(int(length))
        self.seen += 1

    def growth_per_step(self) -> float:
        """The run's recent growth of the longest response, relative per step (≥ 0): the
        least-squares slope ``b`` of ``log L_i = a + b·i`` over the last :data:`GROWTH_WINDOW`
        steps, as ``e^b − 1``; 0 when the lengths fall or stay, or fewer than
        :data:`GROWTH_MIN_STEPS` steps are known. One step's longest response is noisy (a
        batch's maximum); a fit over 64 steps is not: on the generated ramp (16× over 1,000
        steps, 0.28 % per step) it reads 0.2–0.4 %."""
        n = len(self.history)
        if n < GROWTH_MIN_STEPS:
            return 0.0
        ys = [math.log(max(1, x)) for x in self.history]   # exact sums: a flat run reads 0, not 1e-17
        mean_i, mean_y = (n - 1) / 2.0, sum(ys) / n
        slope = sum((i - mean_i) * (y - mean_y) for i, y in enumerate(ys)) / sum((i - mean_i) ** 2 for i in range(n))
        return max(0.0, math.expm1(slope))

    def margin(self) -> float:
        """Relative margin over the base (module docstring)."""
        if self.seen < LENGTH_WINDOW:
            return self.delta_length
        return min(self.delta_length, max(MIN_MARGIN, JUMP_SAFETY * self.jump))

    def coming(self, length: int, cap: int) -> int:
        """The coming step's longest response: ``⌈max(length, base)·(1 + margin)⌉``, at most
        ``cap`` (``max_new_tokens``), at least 1."""
        base = max(int(length), *self.window) if self.history else int(length)
        return max(1, int(min(cap, math.ceil(base * (1.0 + self.margin())))))

    def to_json(self) -> dict:
        return {"window": list(self.window), "jump": self.jump, "seen": self.seen, "history": list(self.history)}

    def restore(self, data: Mapping) -> None:
        """Raises: KeyError, TypeError, ValueError for a malformed state (nothing changed then)."""
        if not isinstance(data["window"], list) or not isinstance(data.get("history", []), list):
            raise TypeError(f"lookahead window and history must be lists: {dict(data)!r}")
        window = [_whole(x) for x in data["window"]]   # written for the states before "history"
        history = [_whole(x) for x in data.get("history", window)][-GROWTH_WINDOW:]   # absent before 2026-12-05
        jump, seen = float(data["jump"]), int(data["seen"])
        if not (math.isfinite(jump) and jump >= 0.0) or seen < 0 or any(
                not 1 <= x <= MAX_TOKENS for x in window + history):
            raise ValueError(f"lookahead state out of range: {dict(data)!r}")
        self.history.clear()
        self.history.extend(history)
        self.jump, self.seen = jump, seen


def _whole(x) -> int:
    """A token count from a state: an int (not a bool, a string or a float)."""
    if type(x) is not int:
        raise TypeError(f"expected a whole number of tokens, got {x!r}")
    return x


MEAN_FRACTION_GRID = 20
"""Plans are made for the mean over longest response to a twentieth, so that step-to-step noise
in it does not change the plans."""


def planned_mean_fraction(fraction: float) -> float:
    """``fraction`` (mean over longest response) to a 1/:data:`MEAN_FRACTION_GRID`, at least
    one: what the controller, and the simulator's oracle, plan generation for."""
    return max(1 / MEAN_FRACTION_GRID, round(fraction * MEAN_FRACTION_GRID) / MEAN_FRACTION_GRID)
