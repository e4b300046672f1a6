"""Generation on vLLM engines in the simulator: the truth starts engines by the workers' rule, and
the controller learns and prices the start-up as a live job does."""

from __future__ import annotations

import dataclasses

import pytest

from nereusd.errors import ConfigError
from nereusd.plan import Candidate, Plan, Stage
from nereusd.sim.measured import ground_truth
from nereusd.sim.policies import parse_policy
from nereusd.sim.replay import Simulation, surviving_units
from nereusd.sim.scenario import Scenario, build
from nereusd.sim.truth import TruthConfig
from nereusd.traces import LengthTrace, PoolTrace
from tests.unit.sim.test_sim import QUIET, check_books, small_problem

START_S = 30.0


def vllm_problem(nodes=4):
    problem = small_problem(nodes=nodes)
    engines = {m: 2048 for m in problem.workflow.model_stages if m.stage is Stage.GENERATION}
    return dataclasses.replace(problem, engines=engines)


def with_generation(plan: Plan, cand: Candidate) -> Plan:
    return Plan({m: (cand if m.stage is Stage.GENERATION else c) for m, c in plan.items()})


def test_engines_start_by_the_workers_rule():
    """A shrink whose surviving replicas keep their devices starts nothing; a new replica, a
    new TP layout or another wave size starts engines: once, they start in parallel."""
    problem = vllm_problem()
    truth = ground_truth(problem, dataclasses.replace(QUIET, engine_rebuild_s=START_S))
    sim = Simulation(problem, LengthTrace("flat", (512.0,)), PoolTrace("constant", float("inf"), (1.0,)), 4, QUIET)
    plan = with_generation(sim.launch, Candidate(2, 1, 8, tuple(range(16)), micro_batch=32))
    g = next(m for m in plan if m.stage is Stage.GENERATION)
    assert truth.engine_rebuild_s(Plan({}), plan) == START_S   # a build starts every engine
    assert truth.engine_rebuild_s(plan, plan) == 0.0
    shrunk = with_generation(plan, surviving_units(Plan({g: plan[g]}), 12)[g])   # the replicas on 0-11 survive
    assert truth.engine_rebuild_s(plan, shrunk) == 0.0
    assert truth.engine_rebuild_s(shrunk, plan) == START_S   # the replicas on devices 12-15 start
    assert truth.engine_rebuild_s(plan, with_generation(plan, Candidate(4, 1, 4, tuple(range(16)),
                                                                        micro_batch=32))) == START_S
    assert truth.engine_rebuild_s(plan, with_generation(plan, Candidate(2, 1, 8, tuple(range(16)),
                                                                        micro_batch=16))) == START_S
    native = ground_truth(small_problem(nodes=4), dataclasses.replace(QUIET, engine_rebuild_s=START_S))
    assert native.engine_rebuild_s(plan, with_generation(plan, Candidate(4, 1, 4, tuple(range(16))))) == 0.0


def test_the_controller_learns_and_prices_engine_start_ups():
    """A length ramp on a pool that halves and comes back. The launch's start-up is learned after
    the first step, as a live job learns its build's; from then on every target's ``L̂_tran``
    holds one start-up (30 s) when it starts engines and none when it does not (the plan that
    keeps the running engines, at a growth too), and an admitted
    switch is predicted within 5 % of what it took: the start-up is reported on its own, so the
    fixed cost does not absorb it. Before, the simulated controller knew no engines and priced
    these transitions at under a second."""
    n = 600
    lengths = LengthTrace("hand-made ramp", tuple(256.0 * 2 ** (4 * i / n) for i in range(n)))
    pool = PoolTrace("hand-made halving", 200.0, (1.0, 0.5))
    sim = Simulation(vllm_problem(), lengths, pool, n, dataclasses.replace(QUIET, engine_rebuild_s=START_S))
    res = sim.run(parse_policy("nereus"))
    check_books(res)
    predicted = [a["l_tran_s"] for d in res.decisions for a in [d, *d["alternatives"]] if a.get("l_tran_s")]
    # one start-up, or none for a target that keeps the running engines (through a growth too)
    assert predicted and all(s < 10 or START_S <= s < START_S + 10 for s in predicted), predicted
    assert any(s >= START_S for s in predicted) and any(s < 10 for s in predicted), predicted
    switched = {r.step: r.transition_s for r in res.records if r.switched}
    admitted = [d for d in res.decisions if d["verdict"] == "admit"]
    assert admitted and len(admitted) == len(switched)
    for d in admitted:
        assert d["l_tran_s"] == pytest.approx(switched[d["step"]], rel=0.05, abs=0.5)   # 5.35 s for 5.08 s: the DAG
    # the start-ups are kept apart, so that reports can give the paper's transition cost without them
    started = [r.engine_start_s for r in res.records if r.switched]
    assert all(s in (0.0, START_S) for s in started) and START_S in started
    assert res.engine_start_s == pytest.approx(sum(started)) and 0 < res.engine_start_s < res.transition_s


def test_engine_start_ups_need_vllm_generation():
    with pytest.raises(ConfigError, match="add --generation vllm"):
        build(Scenario(model="counting-tiny", gpus=16, steps=2, global_batch=64), TruthConfig(engine_rebuild_s=30.0))
    with pytest.raises(ConfigError, match="--generation 'sglang'"):
        build(Scenario(model="counting-tiny", gpus=16, steps=2, global_batch=64, generation="sglang"))
    sim, meta = build(Scenario(model="counting-tiny", gpus=16, steps=2, global_batch=64, generation="vllm",
                               length_trace="generated-ramp:100:300", prompt_length=64),
                      TruthConfig(engine_rebuild_s=30.0))
    assert meta["generation"] == "vllm"
    assert set(sim.problem.engines.values()) == {64 + 300}
    assert {m.stage for m in sim.problem.engines} == {Stage.GENERATION}


def test_simulate_says_generation_runs_on_vllm(capsys):
    from launcher.cli import main

    assert main(["simulate", "--model", "counting-tiny", "--gpus", "16", "--steps", "2", "--global-batch", "64",
                 "--generation", "vllm", "--engine-rebuild-s", "30", "--policies", "nereus"]) == 0
    assert "; generation on vLLM (engine start-up 30 s)" in capsys.readouterr().out.splitlines()[0]



def test_devices_that_come_back_join_once_their_engines_are_warm():
    """Generation on vLLM (start-up 30 s), a frozen job on half of 32 GPUs whose other half
    comes back at t = 100 s. Joining in the background (the default, as ``pool.join`` live), the
    returning devices start the engines of the replicas the controller expects on them (its
    launch plan DP-rescaled to 32) while the job runs on the half pool, and join at the first
    boundary from t = 130 s; with those engines warm the growth starts none. Joining at once,
    they join at t = 100 s and the growth starts engines. Devices lost meanwhile end the join."""
    from nereusd.control.controller import Controller
    from nereusd.planner.rescale import dp_rescale

    sim, _ = build(Scenario(model="llama-3.1-8b", gpus=32, steps=10, length_trace="generated-ramp:500:2000",
                            generation="vllm", global_batch=512), TruthConfig(engine_rebuild_s=START_S))
    policy = parse_policy("frozen")
    truth = ground_truth(sim.problem, sim.truth_config)
    half, full = tuple(range(16)), tuple(range(32))
    running = dp_rescale(sim.launch, sim.problem)   # the launch plan on 32
    ctl = Controller(sim.problem, sim.launch, policy.control, max_response_length=sim.max_response_length,
                     pool=full)
    small = dp_rescale(sim.launch, dataclasses.replace(sim.problem, pool=half))
    assert small is not None and running is not None
    ctl.switched(small, half)
    g = next(iter(sim.problem.engines))
    assert small[g].micro_batch == running[g].micro_batch   # the DP rescale keeps every replica's wave

    seen, join = sim._join_step(full, half, None, 100.0, ctl)
    assert seen == half and join is not None and join.ready_s == 100.0 + START_S
    assert set(join.warm[g]) == set(range(16, 32)) and not ctl.warm_engines
    seen, join = sim._join_step(full, half, join, 129.0, ctl)
    assert seen == half and join is not None
    seen, after = sim._join_step(full, half, join, 131.0, ctl)
    assert seen == full and after is None and ctl.warm_engines == join.warm
    target = ctl.anticipated_plan(full)
    assert truth.engine_rebuild_s(small, target, ctl.warm_engines) == 0.0
    assert truth.engine_rebuild_s(small, target) == START_S
    # a loss during the join ends it; at once: no wait
    ctl.warm_engines = {}
    _, join = sim._join_step(full, half, None, 200.0, ctl)
    assert sim._join_step(half[:4], half, join, 210.0, ctl) == (half[:4], None)
    sim.join = "immediate"
    assert sim._join_step(full, half, None, 300.0, ctl) == (full, None)
    with pytest.raises(ValueError, match="join must be"):
        Simulation(sim.problem, sim.lengths, sim.pool_trace, 10, sim.truth_config, join="later")
