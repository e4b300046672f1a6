"""What a simulated run records: one :class:`StepRecord` per executed (or failed) step, and each
policy's :class:`PolicyResult` with the totals the report prints (:mod:`nereusd.sim.replay`
fills them; :mod:`nereusd.sim.report` reads them)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Sequence

from nereusd.plan import Plan
from nereusd.sim.policies import Policy


@dataclass
class StepRecord:
    """One executed (or failed) step: seconds of each kind spent at it."""

    step: int
    start_s: float
    length: float
    pool: int
    plan_id: int
    step_s: float = 0.0
    lost_s: float = 0.0
    transition_s: float = 0.0
    restart_s: float = 0.0
    stall_s: float = 0.0
    oom: bool = False
    switched: bool = False
    rerun: bool = False
    pool_changed: bool = False
    """The pool changed at the boundary after this step."""
    engine_start_s: float = 0.0
    """Of ``transition_s``, the vLLM engines' start-up (the truth's ``engine_rebuild_s``; 0 without it)."""
    margin_missed: bool = False
    """(``oracle@H``) no plan left ``H`` of memory free at this step: it ran the best that fits."""


@dataclass
class PolicyResult:
    """Everything one policy did over the run."""

    policy: Policy
    steps: int
    records: list[StepRecord] = field(default_factory=list)
    plans: list[str] = field(default_factory=list)
    decisions: list[dict] = field(default_factory=list)
    layouts: dict[str, Plan] = field(default_factory=dict)
    """Every plan the policy ran, by :meth:`Plan.describe` (what :attr:`plans` names)."""

    def _sum(self, name: str) -> float:
        return sum(getattr(r, name) for r in self.records)

    @classmethod
    def pooled(cls, runs: Sequence["PolicyResult"]) -> "PolicyResult":
        """One policy's runs of one scenario under several seeds, as one run of all their steps:
        its mean step is the mean over the runs (of equal ``steps``), its shares are of the summed
        seconds (``scripts/bench_sim.py --seeds``; one seed's steps, transitions and restarts can
        flatter or wrong a policy by several percent).

        Raises:
            ValueError: without runs, or runs of different policies.
        """
        if not runs or any(r.policy != runs[0].policy for r in runs):
            raise ValueError(f"pooled: expected runs of one policy, got {[r.policy.name for r in runs]}")
        plans = list(dict.fromkeys(p for r in runs for p in r.plans))
        index = {p: k for k, p in enumerate(plans)}
        records = [replace(x, plan_id=index[r.plans[x.plan_id]]) for r in runs for x in r.records]
        return cls(runs[0].policy, sum(r.steps for r in runs), records, plans,
                   [d for r in runs for d in r.decisions], {k: v for r in runs for k, v in r.layouts.items()})

    @property
    def total_s(self) -> float:
        return sum(r.step_s + r.lost_s + r.transition_s + r.restart_s + r.stall_s for r in self.records)

    @property
    def transition_s(self) -> float:
        return self._sum("transition_s")

    @property
    def engine_start_s(self) -> float:
        """Of :attr:`transition_s`, the vLLM engines' start-ups: the rest is the paper's transition
        cost (communicator set-up and state movement: the paper's evaluation, "Metrics")."""
        return self._sum("engine_start_s")

    @property
    def pool_transition_s(self) -> float:
        """Transition seconds spent at boundaries where the pool changed (the switch a pool
        change forces, or that it enables), as opposed to those adaptation chose on its own."""
        return sum(r.transition_s for r in self.records if r.pool_changed)

    @property
    def stall_s(self) -> float:
        return self._sum("stall_s")

    @property
    def margin_missed_steps(self) -> int:
        """Steps at which an ``oracle@H`` could not leave ``H`` of memory free (0 for the others)."""
        return sum(r.margin_missed for r in self.records)

    @property
    def restart_s(self) -> float:
        return self._sum("restart_s")

    @property
    def mean_step_s(self) -> float:
        return (self.total_s - self.stall_s) / self.steps

    @property
    def switches(self) -> int:
        return sum(r.switched for r in self.records)

    @property
    def oom_events(self) -> int:
        return sum(r.oom for r in self.records)

    @property
    def restarts(self) -> int:
        return sum(r.restart_s > 0 for r in self.records)
