"""Adaptation policies: what distinguishes ``nereus``, ``greedy``, ``periodic-k`` and ``frozen``
(the knobs the one :class:`~nereusd.control.controller.Controller` reads)."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from nereusd.config.job import DEFAULT_PAYBACK_MARGIN, AdaptationConfig
from nereusd.control.monitor import DEFAULT_DELTAS, EFFICIENCY, SEQUENCE_LENGTH
from nereusd.errors import ConfigError

MEMORY_WINDOW = 8
"""Steps whose measured/predicted peak ratio is remembered (the largest one is used)."""


class PolicyKind(str, enum.Enum):
    """How the controller reacts to triggers."""

    NEREUS = "nereus"
    """Monitor → planner → payback admission (the paper's controller)."""
    FROZEN = "frozen"
    """A static framework: keep the launch layouts; on a pool change rescale DP *from the launch
    plan* (not from a plan a restart shrank); after an out-of-memory failure relaunch into the
    planner's layout for the longest response, which becomes the new launch plan; a forced layout,
    which becomes the launch plan once the job runs it."""


@dataclass(frozen=True, kw_only=True)
class ControlPolicy:
    """Everything that distinguishes one adaptation policy from another.

    Attributes:
        name: label for tables and journals (``nereus``, ``greedy``, ``periodic-3``, ...).
        kind: :class:`PolicyKind`.
        payback_margin: ``γ`` of payback admission; ``inf``: any positive gain (``greedy``); 0:
            urgent switches only.
        period: also replan every ``period`` steps (0: on triggers only).
        delta_length: drift threshold ``δ_len`` of the response length (relative).
        delta_efficiency: drift threshold of the achieved efficiency (relative).
        memory_window: steps whose measured/predicted peak ratio is remembered.

    Raises:
        ConfigError: naming every knob out of range.
    """

    name: str = "nereus"
    kind: PolicyKind = PolicyKind.NEREUS
    payback_margin: float = DEFAULT_PAYBACK_MARGIN
    period: int = 0
    delta_length: float = DEFAULT_DELTAS[SEQUENCE_LENGTH]
    delta_efficiency: float = DEFAULT_DELTAS[EFFICIENCY]
    memory_window: int = MEMORY_WINDOW

    def __post_init__(self) -> None:
        problems = []
        if not self.payback_margin >= 0:   # NaN fails too
            problems.append(f"payback_margin must be >= 0 (inf: any gain), got {self.payback_margin!r}")
        if not isinstance(self.period, int) or self.period < 0:
            problems.append(f"period must be a whole number >= 0, got {self.period!r}")
        for name in ("delta_length", "delta_efficiency"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                problems.append(f"{name} must be a positive number, got {value!r}")
        if not isinstance(self.memory_window, int) or self.memory_window < 1:
            problems.append(f"memory_window must be a whole number >= 1, got {self.memory_window!r}")
        if problems:
            raise ConfigError(f"control policy {self.name!r}: " + "; ".join(problems))

    @classmethod
    def from_config(cls, cfg: AdaptationConfig) -> "ControlPolicy":
        """The policy a job's ``adaptation`` section describes."""
        return cls(name=cfg.policy, kind=PolicyKind(cfg.policy), payback_margin=cfg.payback_margin,
                   period=cfg.period, delta_length=cfg.delta_length)
