"""Policy names of the simulator and their parameters.

- ``frozen``: the fastest launch layout for the initial conditions and budget (the oracle's
  first plan); DP scaling on a pool change (:func:`nereusd.planner.rescale.dp_rescale`);
  checkpoint/restart into a layout that fits after an OOM;
- ``nereus`` / ``nereus@G``: the controller with payback admission, ``γ = 0.5`` or ``G``;
- ``greedy``: the same triggers, any positive predicted gain admitted (``γ = ∞``);
- ``periodic-k``: replan every ``k`` steps (and on urgent triggers), any positive gain admitted;
- ``oracle``: the best plan for every step under the ground truth (lengths, contention and
  memory of the step known), transitions free — a lower bound.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from nereusd.errors import ConfigError

FROZEN, NEREUS, GREEDY, PERIODIC, ORACLE = "frozen", "nereus", "greedy", "periodic", "oracle"


@dataclass(frozen=True)
class Policy:
    """A policy: ``kind`` (one of the names above), its ``gamma`` and ``period``."""

    name: str
    kind: str
    gamma: float = 0.5
    period: int = 0

    @property
    def adaptive(self) -> bool:
        """Runs the controller (triggers, planner, admission)."""
        return self.kind in (NEREUS, GREEDY, PERIODIC)


def parse_policy(text: str) -> Policy:
    """``frozen``, ``nereus``, ``nereus@0.25``, ``greedy``, ``periodic-3``, ``oracle``.

    Raises:
        ConfigError: for an unknown name or a bad parameter.
    """
    name = text.strip()
    try:
        if name == FROZEN:
            return Policy(name, FROZEN, gamma=0.0)
        if name == ORACLE:
            return Policy(name, ORACLE, gamma=0.0)
        if name == GREEDY:
            return Policy(name, GREEDY, gamma=math.inf)
        if name == NEREUS:
            return Policy(name, NEREUS, gamma=0.5)
        if name.startswith(NEREUS + "@"):
            gamma = float(name.split("@", 1)[1])
            if not 0 <= gamma:
                raise ValueError(gamma)
            return Policy(name, NEREUS, gamma=gamma)
        if name.startswith(PERIODIC + "-"):
            period = int(name.split("-", 1)[1])
            if period < 1:
                raise ValueError(period)
            return Policy(name, PERIODIC, gamma=math.inf, period=period)
    except ValueError:
        raise ConfigError(f"policy {name!r}: bad parameter (e.g. nereus@0.25, periodic-3)") from None
    raise ConfigError(f"policy {name!r}: expected frozen, nereus, nereus@<gamma>, greedy, periodic-<k> or oracle")


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
