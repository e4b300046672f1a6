"""One controller: the simulator decides exactly as a live job does on the same measurements.

The simulator replays a growing-length run of the demo job's own plan problem under the ``nereus``
policy (its ground truth supplies the measurements). Every call it makes to its controller —
observations, boundaries with their pools and surviving units, transitions measured, switches —
is recorded, then made again on the controller a live job builds for that job
(:func:`nereusd.control.jobs.controller_for_job`, what ``nereusd`` runs). Every decision
must come out the same: verdict, triggers, target plan, predicted latencies and ``L̂_tran``.
A simulator with a controller, policy or knob of its own fails this test.
"""

from __future__ import annotations

import math

import pytest

from nereusd.config.site import load_site
from nereusd.control import controller as control
from nereusd.control.jobs import controller_for_job
from nereusd.control.problem import job_problem
from nereusd.sim import replay
from nereusd.sim.policies import parse_policy
from nereusd.sim.truth import TruthConfig
from nereusd.traces import LengthTrace, PoolTrace
from tests.support import demo_job

PROMPT = 5


class Recording(control.Controller):
    """The simulator's controller, recording each call and what it returned."""

    calls: list = []

    def observe(self, obs):
        out = super().observe(obs)
        Recording.calls.append(("observe", (obs,), {}, out))
        return out

    def boundary(self, step, pool, **kw):
        out = super().boundary(step, pool, **kw)
        Recording.calls.append(("boundary", (step, pool), kw, out))
        return out

    def transition_measured(self, predicted_s, measured_s):
        Recording.calls.append(("transition_measured", (predicted_s, measured_s), {}, None))
        super().transition_measured(predicted_s, measured_s)

    def switched(self, plan, pool):
        Recording.calls.append(("switched", (plan, pool), {}, None))
        super().switched(plan, pool)

    def transition_ran(self, dag):
        Recording.calls.append(("transition_ran", (dag,), {}, None))
        super().transition_ran(dag)

    def world_formed(self):
        Recording.calls.append(("world_formed", (), {}, None))
        super().world_formed()

    def groups_built(self, plan):
        out = super().groups_built(plan)
        Recording.calls.append(("groups_built", (plan,), {}, out))
        return out

    def failed(self, step, length=None):
        Recording.calls.append(("failed", (step, length), {}, None))
        super().failed(step, length)


def decision(outcome):
    if outcome is None:
        return None
    d = outcome.decision.to_dict()
    return d | {"planned_length": outcome.planned_length}


def test_simulated_decisions_are_the_live_controllers(monkeypatch):
    job = demo_job(curriculum=False)
    site = load_site(job.config.site)
    pool = tuple(range(job.devices))
    problem = job_problem(job, site, pool, job.config.rollout.max_new_tokens, PROMPT)
    lengths = LengthTrace("hand-made growth", tuple(min(96.0, 10.0 * 1.25 ** i) for i in range(16)))
    sim = replay.Simulation(problem, lengths, PoolTrace("constant", math.inf, (1.0,)), 16,
                            TruthConfig(noise_sigma=0.0, contention_per_h=0.0),
                            max_response_length=job.config.rollout.max_new_tokens)
    Recording.calls = []
    monkeypatch.setattr(replay, "Controller", Recording)
    result = sim.run(parse_policy("nereus"))
    assert result.switches >= 1, "the growth should make the simulated job switch at least once"

    live = controller_for_job(job, site, sim.launch, PROMPT, pool=pool)
    boundaries = 0
    for name, args, kw, sim_out in Recording.calls:
        live_out = getattr(live, name)(*args, **kw)
        if name == "boundary":
            boundaries += 1
            assert decision(live_out) == decision(sim_out), f"boundary after step {args[0]}"
        elif name == "observe":
            assert live_out == pytest.approx(sim_out)
    assert boundaries == 16 and any(c[0] == "switched" for c in Recording.calls)
    assert any(c[0] == "transition_ran" for c in Recording.calls)   # the group pools, as a live job keeps them
    assert live.plan.describe() == result.plans[result.records[-1].plan_id]
