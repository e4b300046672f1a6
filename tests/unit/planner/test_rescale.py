"""DP-only rescale (the frozen baselines' pool-change rule and the controller's fallback target)."""

from __future__ import annotations

import dataclasses

import pytest

from nereusd.control.problem import site_for_pool
from nereusd.cost.model import CostModel
from nereusd.plan import Stage
from nereusd.planner.rescale import _valid_dps, dp_rescale
from nereusd.planner.search import Planner
from tests.support.planning import problem


def _set_sizes(pb, plan):
    return [sum(plan[m].tp * plan[m].pp * plan[m].dp for m in group) for group in pb.workflow.concurrent_sets()]


@pytest.mark.parametrize("algorithm", ["ppo", "grpo"])
@pytest.mark.parametrize("small_nodes,big_nodes", [(3, 8), (5, 8), (8, 3), (2, 7)])
def test_a_rescale_leaves_no_device_idle_that_a_member_could_use(algorithm, small_nodes, big_nodes):
    """Every member keeps its TP and PP and gets at least its proportional DP, and no member
    can step up to its next valid DP without some concurrent set overflowing its share of the
    pool (``⌊its devices in the plan × n / n_plan⌋``): the floors alone left a quarter of 64
    devices idle when a pool grew from 24 (training DP must divide the mini-batch)."""
    small = problem(small_nodes, algorithm, batch=1024)
    base = Planner(small, CostModel(small.site)).solve().plan
    big = problem(big_nodes, algorithm, batch=1024)
    n, n_plan = len(big.pool), max(_set_sizes(small, base))
    budgets = [min(n, size * n // n_plan) for size in _set_sizes(small, base)]
    out = dp_rescale(base, big)
    assert out is not None
    assert max(_set_sizes(big, out)) <= n
    for m, c in out.items():
        assert (c.tp, c.pp) == (base[m].tp, base[m].pp)
        assert set(c.devices) <= set(big.pool) and len(set(c.devices)) == c.tp * c.pp * c.dp
        if m.stage is Stage.TRAINING:
            assert big.workload.mini_batch_size % c.dp == 0
        if n >= n_plan:   # a growing pool: nobody shrinks below its floor
            floor = max(d for d in _valid_dps(big, m, n) if d <= max(1, base[m].dp * n // n_plan))
            assert c.dp >= floor, m
        bigger = [d for d in _valid_dps(big, m, n // (c.tp * c.pp)) if d > c.dp]
        if bigger:
            stepped = {x: y.tp * y.pp * y.dp for x, y in out.items()} | {m: c.tp * c.pp * bigger[0]}
            assert any(sum(stepped[x] for x in group) > budget
                       for group, budget in zip(big.workflow.concurrent_sets(), budgets) if m in group), (
                f"{m} could step up to dp {bigger[0]}")


def test_a_pool_that_grows_back_is_filled():
    """The case that showed it (scripts/bench_sim.py, A100 ramp): a 24-device plan's training
    pair rescaled to 64 devices fills them all."""
    small = problem(3, "ppo", batch=1024)
    base = Planner(small, CostModel(small.site)).solve().plan
    big = problem(8, "ppo", batch=1024)
    out = dp_rescale(base, big)
    training = [m for m in out if m.stage is Stage.TRAINING]
    used = sum(out[m].tp * out[m].pp * out[m].dp for m in training)
    spare = len(big.pool) - used
    assert spare < min(out[m].tp * out[m].pp for m in training), (used, {str(m): out[m].describe() for m in training})


@pytest.mark.parametrize("algorithm", ["ppo", "grpo", "remax"])
@pytest.mark.parametrize("nodes,batch", [(1, 8), (2, 64), (3, 1024), (8, 1024), (5, 256)])
def test_a_rescale_to_the_devices_the_plan_spans_is_the_plan(algorithm, nodes, batch):
    """The planner may leave devices of a concurrent set idle on purpose (a generation that
    gains nothing from more replicas): the fill does not undo that."""
    pb = problem(nodes, algorithm, batch=batch)
    base = Planner(pb, CostModel(pb.site)).solve().plan
    spanned = dataclasses.replace(pb, pool=base.devices(), site=site_for_pool(pb.site, base.devices()))
    assert dp_rescale(base, spanned) == base


def test_a_set_that_cannot_shrink_lets_another_member_step_down():
    """The member with the most devices may have nothing smaller (DP 1): the next one steps
    down instead of the rescale giving up while DP 1 of every member fits (found by a fault
    search: ``None`` for 5 devices where 1 + 4 fit)."""
    pb = problem(1, "ppo", batch=16)
    base = Planner(pb, CostModel(pb.site)).solve().plan
    pool = tuple(range(5))
    small = dataclasses.replace(pb, pool=pool, site=site_for_pool(pb.site, pool))
    need = max(sum(base[m].tp * base[m].pp for m in group) for group in pb.workflow.concurrent_sets())
    assert need <= len(pool)
    out = dp_rescale(base, small)
    assert out is not None and max(_set_sizes(small, out)) <= len(pool)
