"""Policy names of the simulator and the controller policies they stand for.

Every policy but the oracle runs the one controller (:class:`nereusd.control.controller.Controller`)
with its own :class:`~nereusd.control.controller.ControlPolicy`:

- ``frozen-start`` (alias ``frozen``): a static framework's behaviour (the paper's frozen
  baseline) — launch on the fastest layout for the initial lengths, keep it, DP-rescale the
  *launch* plan on every pool change (:func:`nereusd.planner.rescale.dp_rescale`), and after an
  OOM checkpoint/restart into the controller's plan for the longest response, which becomes the
  launch plan (:class:`~nereusd.control.controller.PolicyKind`);
- ``frozen-final``: the same, launched on the fastest layout that holds the run's longest
  responses (what a user who knows the final length would pick);
- ``nereus`` / ``nereus@G``: payback admission with the payback margin ``γ = 0.5`` or ``G``,
  launched (as ``greedy`` and ``periodic-k``) on ``frozen-start``'s plan unless the controller's
  memory model refuses it, then on its own launch plan
  (:meth:`nereusd.sim.replay.Simulation.launch_adaptive`);
- ``greedy``: the same triggers, any positive predicted gain admitted (``γ = ∞``);
- ``periodic-k``: replan every ``k`` steps (and on urgent triggers), any positive gain admitted;
- ``oracle`` (no controller): the best plan for every step under the ground truth (lengths,
  contention and memory of the step known), transitions free — a lower bound for layout
  choices. A pool change that takes every replica of one of its model-stages costs it the
  checkpoint restart it costs every policy: device losses are not what layouts are compared on
  (without it, the oracle's headroom on spot pools was mostly restarts no policy can avoid).
- ``oracle@H``: the oracle keeping ``H`` of every device's memory free under the truth (each
  step's padded lengths known): ``oracle@0.1`` keeps the planner's 10 % headroom
  (:data:`nereusd.cost.memory.HEADROOM`), so its gain over the oracle's is what running at
  memory limits known in advance is worth. A diagnostic: the captured share of a table is
  measured against ``oracle`` when it runs.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from nereusd.control.policy import ControlPolicy, PolicyKind
from nereusd.errors import ConfigError

FROZEN, NEREUS, GREEDY, PERIODIC, ORACLE = "frozen", "nereus", "greedy", "periodic", "oracle"
FROZEN_START, FROZEN_FINAL = "frozen-start", "frozen-final"
"""The two frozen baselines' names (kind :data:`FROZEN`)."""
ADAPTIVE = (NEREUS, GREEDY, PERIODIC)
"""Kinds that adapt: they launch on :meth:`nereusd.sim.replay.Simulation.launch_adaptive`, the
frozen ones on the truth's best plan for their lengths."""


@dataclass(frozen=True)
class Policy:
    """A named policy: ``control`` is the controller's policy (``None`` for the oracle)."""

    name: str
    kind: str
    control: ControlPolicy | None
    launch_at_longest: bool = False
    """Launch on the best plan for the run's longest responses (``frozen-final``) instead of the
    initial lengths."""
    memory_headroom: float = 0.0
    """(Oracle) share of each device's memory its plans leave free under the truth (``oracle@H``)."""

    @property
    def payback_margin(self) -> float:
        """``γ`` of the controller (0 for the oracle, which admits nothing)."""
        return self.control.payback_margin if self.control is not None else 0.0

    @property
    def period(self) -> int:
        return self.control.period if self.control is not None else 0


def parse_policy(text: str) -> Policy:
    """``frozen-start`` (``frozen``), ``frozen-final``, ``nereus``, ``nereus@0.25``, ``greedy``,
    ``periodic-3``, ``oracle``, ``oracle@0.1``.

    Raises:
        ConfigError: for an unknown name or a bad parameter.
    """
    if not isinstance(text, str):
        raise ConfigError(f"policy {text!r}: expected a name such as nereus or periodic-3")
    name = text.strip()
    if name.startswith(NEREUS + "@") and not re.fullmatch(r"nereus@(\d+(\.\d*)?|\.\d+|inf)", name, re.ASCII):
        raise ConfigError(f"policy {name!r}: bad parameter (e.g. nereus@0.25, nereus@inf)")
    if name.startswith(PERIODIC + "-") and not re.fullmatch(r"periodic-[1-9]\d*", name, re.ASCII):
        raise ConfigError(f"policy {name!r}: bad parameter (e.g. periodic-3)")
    if name.startswith(ORACLE + "@"):
        match = re.fullmatch(r"oracle@(0(\.\d*)?|\.\d+)", name, re.ASCII)
        if not match or not float(match.group(1)) < 0.9:
            raise ConfigError(f"policy {name!r}: bad parameter: the share of memory to keep free, "
                              "0 ≤ H < 0.9 (e.g. oracle@0.1)")
        headroom = float(match.group(1))   # named canonically: oracle@0.10 is oracle@0.1, oracle@0 the oracle
        return Policy(f"{ORACLE}@{headroom:g}" if headroom else ORACLE, ORACLE, None, memory_headroom=headroom)
    try:
        if name in (FROZEN, FROZEN_START, FROZEN_FINAL):
            label = FROZEN_START if name == FROZEN else name
            return Policy(label, FROZEN, ControlPolicy(name=label, kind=PolicyKind.FROZEN, payback_margin=0.0),
                          launch_at_longest=name == FROZEN_FINAL)
        if name == ORACLE:
            return Policy(name, ORACLE, None)
        if name == GREEDY:
            return Policy(name, GREEDY, ControlPolicy(name=name, payback_margin=math.inf))
        if name == NEREUS:
            return Policy(name, NEREUS, ControlPolicy(name=name))   # the default γ, a job's
        if name.startswith(NEREUS + "@"):
            margin = float(name.split("@", 1)[1])
            if not 0 <= margin:
                raise ValueError(margin)
            return Policy(name, NEREUS, ControlPolicy(name=name, payback_margin=margin))
        if name.startswith(PERIODIC + "-"):
            period = int(name.split("-", 1)[1])
            if period < 1:
                raise ValueError(period)
            return Policy(name, PERIODIC, ControlPolicy(name=name, payback_margin=math.inf, period=period))
    except ValueError:
        raise ConfigError(f"policy {name!r}: bad parameter (e.g. nereus@0.25, periodic-3)") from None
    raise ConfigError(f"policy {name!r}: expected frozen-start (frozen), frozen-final, nereus, nereus@<gamma>, "
                      "greedy, periodic-<k>, oracle or oracle@<memory headroom>")


def parse_policies(text: str) -> list[Policy]:
    """A comma-separated list of policies (duplicates refused).

    Raises:
        ConfigError: for an unknown or repeated policy.
    """
    out = [parse_policy(p) for p in text.split(",") if p.strip()]
    names = [p.name for p in out]
    if len(set(names)) != len(names):
        raise ConfigError(f"policies: {names} lists one twice")
    if not out:
        raise ConfigError("policies: none given")
    return out
