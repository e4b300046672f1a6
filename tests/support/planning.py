"""Plan problems the planner tests share."""

from __future__ import annotations

from nereusd.config.site import load_site
from nereusd.planner.space import PlanProblem
from nereusd.plan import Role
from nereusd.workflow import Workload, build_workflow
from tests.support.specs import SMALL_1B as SMALL

H200 = load_site("h200-ib")


def problem(nodes, algorithm="ppo", asynchronous=False, spec=SMALL, response=1024, batch=256, site=H200,
            reward=None):
    site = site.with_nodes(nodes)
    specs = {r: spec for r in Role}
    if reward is not None:
        specs[Role.REWARD] = reward
    wl = Workload(prompt_length=256, response_length=response, global_batch=batch)
    return PlanProblem(build_workflow(algorithm, asynchronous=asynchronous), specs, wl, site,
                       tuple(range(site.total_devices)))
