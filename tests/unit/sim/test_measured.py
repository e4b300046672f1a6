"""The measured ground truth (:mod:`nereusd.sim.measured`): the effects it has that the cost
model lacks, its continuous batching, and the simulator's oracle ranking plans by it."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from nereusd.config.site import load_site
from nereusd.cost.model import CostModel
from nereusd.errors import ConfigError
from nereusd.plan import Candidate, ModelStage, Role, Stage
from nereusd.planner.space import PlanProblem
from nereusd.rl.rollout import split_even
from nereusd.sim.measured import MeasuredTruth, _slot_ends, device_figures, ground_truth
from nereusd.sim.policies import parse_policy
from nereusd.sim.replay import Simulation
from nereusd.sim.scenario import run_policies
from nereusd.sim.truth import GroundTruth, TruthConfig
from nereusd.traces import LengthTrace, PoolTrace
from nereusd.workflow import Workload, build_workflow
from tests.support.specs import SMALL_1B as SMALL

MEASURED = TruthConfig(kind="measured", noise_sigma=0.0, contention_per_h=0.0, straggler_sd=0.0)
GEN = ModelStage(Role.ACTOR, Stage.GENERATION)
TRAIN = ModelStage(Role.ACTOR, Stage.TRAINING)


def problem(site="h200-ib", nodes=2, batch=64, response=256):
    s = load_site(site).with_nodes(nodes)
    wl = Workload(prompt_length=256, response_length=response, global_batch=batch)
    return PlanProblem(build_workflow("ppo"), {r: SMALL for r in Role}, wl, s, tuple(range(nodes * 8)))


def cand(tp, pp, dp, mb=1, first=0):
    return Candidate(tp, pp, dp, tuple(range(first, first + tp * pp * dp)), micro_batch=mb)


def test_kind_selects_the_truth_and_bad_settings_are_refused():
    assert type(ground_truth(problem(), TruthConfig())) is GroundTruth
    assert type(ground_truth(problem(), MEASURED)) is MeasuredTruth
    with pytest.raises(ConfigError, match="kind must be one of efficiency, measured"):
        TruthConfig(kind="exact")
    with pytest.raises(ConfigError, match="straggler_sd"):
        TruthConfig(straggler_sd=-0.1)
    with pytest.raises(ConfigError, match="seed must be an integer >= 0, got -1"):   # was numpy's traceback
        TruthConfig(seed=-1)
    with pytest.raises(ConfigError, match="no figures for device 'virtual CPU"):
        MeasuredTruth(problem(site="local", nodes=1), MEASURED)
    assert device_figures("NVIDIA H200 SXM 141GB").compute_units == 132
    assert device_figures("AMD Instinct MI250X (one GCD)").compute_units == 110


def test_small_gemms_run_below_peak_and_tp_does_not_split_everything():
    truth = MeasuredTruth(problem(), MEASURED)
    h = SMALL.hidden_size
    per_token = [truth.gemm_s(t, h, 4 * h) / t for t in (1, 16, 8192)]
    assert per_token[0] > per_token[1] > per_token[2]          # weight-bound, then wave-quantised
    one = truth._layer_pass_s(SMALL, 2048, 512, 1, backward=False)
    eight = truth._layer_pass_s(SMALL, 2048, 512, 8, backward=False)
    assert eight > one / 8 * 1.2                               # norms, residuals and small tiles stay


def test_the_ratio_to_the_cost_model_is_not_one_constant():
    """Calibration has something to learn: no single efficiency maps the cost model's prior
    onto this truth across layouts and lengths."""
    pb = problem(nodes=4)
    truth = MeasuredTruth(pb, MEASURED)
    cm = CostModel(pb.site)
    ratios = []
    for m, c, length in ((TRAIN, cand(1, 1, 8, 1), 256), (TRAIN, cand(8, 1, 1, 8), 256), (TRAIN, cand(2, 4, 4, 2), 2048),
                         (GEN, cand(1, 1, 16, 64), 256), (GEN, cand(8, 1, 2, 8), 2048)):
        wl = dataclasses.replace(pb.workload, response_length=length)
        model_s = cm.stage_cost(SMALL, m, sequences=pb.workflow.sequences(m, wl), prompt_length=wl.prompt_length,
                                response_length=length, tp=c.tp, pp=c.pp, dp=c.dp, micro_batch=c.micro_batch).latency_s
        ratios.append(truth.replica_s(m, c, length, 0, False) / model_s)
    assert max(ratios) / min(ratios) > 1.5, ratios


def test_continuous_batching_refills_slots_and_the_longest_sets_the_time():
    assert _slot_ends(np.array([10.0, 1, 1, 1]), 2).tolist() == [3.0, 10.0]
    assert _slot_ends(np.array([5.0, 2]), 4).tolist() == [2.0, 5.0]
    truth = MeasuredTruth(problem(), MEASURED)
    lengths = truth.response_lengths(2000, 128, step=3)     # the trace's length is the longest
    assert lengths.max() == 2000 and 1.7 < 2000 / lengths.mean() < 4.0 and lengths.min() / lengths.mean() < 0.5
    assert np.array_equal(lengths, truth.response_lengths(2000, 128, step=3))
    # the replica with the most tokens sets a training stage's pace
    per_replica = [lengths[r * 32:(r + 1) * 32].mean() for r in range(4)]
    assert truth.replica_length(2000, 128, 4, 3) == pytest.approx(max(per_replica))
    assert truth.replica_length(2000, 128, 1, 3) == pytest.approx(lengths.mean())
    # padded as the engine pads: micro-batches of 4 to their own longest, a whole replica (pp > 1)
    # to its longest; the busiest replica holds the step's longest
    fours = [sum(4 * lengths[r * 32 + i:r * 32 + i + 4].max() for i in range(0, 32, 4)) / 32 for r in range(4)]
    assert truth.replica_length(2000, 128, 4, 3, rows=4) == pytest.approx(max(fours))
    assert truth.replica_length(2000, 128, 4, 3, rows=32) == 2000
    assert (truth.replica_length(2000, 128, 4, 3) < truth.replica_length(2000, 128, 4, 3, rows=4)
            < truth.replica_length(2000, 128, 4, 3, rows=32))
    # 30 sequences over 8 replicas, dealt as the driver deals them (shares of 4 and 3, where
    # contiguous slices of 4 would leave the last replica 2): the busiest replica's tokens over
    # the largest share
    odd = truth.response_lengths(2000, 30, step=3)
    assert [b - a for a, b in split_even(30, 8)] == [4] * 6 + [3] * 2
    for rows in (1, 2):
        work = [sum(odd[a:b][i:i + rows].max() * len(odd[a:b][i:i + rows]) for i in range(0, b - a, rows))
                for a, b in split_even(30, 8)]
        assert truth.replica_length(2000, 30, 8, 3, rows=rows) == pytest.approx(max(work) / 4)
    assert truth.replica_length(2000, 30, 8, 3) != pytest.approx(max(odd[a:a + 4].mean() for a in range(0, 30, 4)))
    wl = truth.problem.workload
    short = MeasuredTruth(dataclasses.replace(problem(response=2000), workload=dataclasses.replace(
        wl, response_length=2000)), MEASURED)
    packed = MeasuredTruth(dataclasses.replace(problem(response=2000), workload=dataclasses.replace(
        wl, response_length=2000, max_tokens_per_micro_batch=4096)), MEASURED)
    # a pipeline pads every row to the longest; a token budget packs, whatever the pipeline
    assert short.replica_s(TRAIN, cand(1, 2, 4), 2000, 3, False) > 1.5 * packed.replica_s(TRAIN, cand(1, 2, 4), 2000, 3, False)
    assert short.replica_s(TRAIN, cand(1, 1, 4), 2000, 3, False) == packed.replica_s(TRAIN, cand(1, 1, 4), 2000, 3, False)
    # the same sequences through more slots finish sooner, never later
    c8, c64 = cand(1, 1, 1, 8), cand(1, 1, 1, 64)
    assert truth.replica_s(GEN, c64, 256, 0, False) < truth.replica_s(GEN, c8, 256, 0, False)


def test_a_tp_prefill_pays_its_all_reduces_and_runs_a_wave_per_pass():
    """vLLM's prefill is a forward of the prompts' tokens: under TP every layer all-reduces its
    activations twice, as a training or inference forward does in this truth. The prefill
    was once its FLOPs alone, which made TP-8 generation look faster than it is on a slow link."""
    pb = problem(site="frontier-mi250x")
    truth = MeasuredTruth(pb, MEASURED)
    h, layers, prompt = SMALL.hidden_size, SMALL.num_layers, 256
    one = truth._prefill_s(SMALL, 32, 32, prompt, tp=1, pp=1, contended=False)
    eight = truth._prefill_s(SMALL, 32, 32, prompt, tp=8, pp=1, contended=False)
    all_reduces = 2 * layers * truth.all_reduce_s(32 * prompt * h * truth.e, 8, spans=False)
    assert all_reduces > 0 and eight > one / 8 + all_reduces
    # four passes of 8 prompts: each pays its own all-reduces, of a quarter of the bytes
    waves = truth._prefill_s(SMALL, 32, 8, prompt, tp=8, pp=1, contended=False)
    assert waves > 4 * 2 * layers * truth.all_reduce_s(8 * prompt * h * truth.e, 8, spans=False)
    # and a replica's generation pays it: with a link twice as fast a TP-8 replica's prefill
    # gets cheaper, a TP-1 replica's does not move
    fast = MeasuredTruth(dataclasses.replace(pb, site=dataclasses.replace(pb.site, network=dataclasses.replace(
        pb.site.network, intra_node_gbps=2 * pb.site.network.intra_node_gbps))), MEASURED)
    assert fast._prefill_s(SMALL, 32, 32, prompt, 8, 1, False) < eight
    assert fast._prefill_s(SMALL, 32, 32, prompt, 1, 1, False) == one
    assert truth.replica_s(GEN, cand(8, 1, 1, 32), 64, 0, False) > eight


def test_dp_gradients_hide_behind_the_backward_and_stragglers_slow_a_stage():
    truth = MeasuredTruth(problem(nodes=4), MEASURED)
    grads = 4.0 * 1e9
    full = truth.all_reduce_s(grads, 8, spans=True)
    assert full > truth.all_reduce_s(grads, 8, spans=False) > 0
    assert truth.all_reduce_s(grads, 1, spans=True) == 0.0
    slow = MeasuredTruth(problem(nodes=4), dataclasses.replace(MEASURED, straggler_sd=0.05))
    assert slow.slowest(cand(1, 1, 32)) >= slow.slowest(cand(1, 1, 2)) >= 1.0
    assert truth.slowest(cand(1, 1, 32)) == 1.0


def test_the_oracle_takes_the_truths_fastest_of_the_planners_plans():
    lengths = LengthTrace("hand-made ramp", tuple(float(x) for x in np.linspace(256, 2048, 12)))
    sim = Simulation(problem(), lengths, PoolTrace("constant", math.inf, (1.0,)), 12, MEASURED)
    oracle = sim._oracle
    for step, length in ((0, 256.0), (11, 2048.0)):
        candidates = oracle._candidates(oracle_bucket(length), sim.problem.pool, False,
                                        oracle._fraction(length, step))
        assert oracle._fraction(length, step) < 1.0   # the truth's responses are not all the longest
        chosen = oracle.plan(step, length, sim.problem.pool, 0.0)
        assert chosen in candidates
        assert oracle.truth.rank_key(chosen, length, step) == min(
            oracle.truth.rank_key(p, length, step) for p in candidates if not oracle.truth.oom(p, length, step))
    # run after the others, the oracle also ranks every plan they ran: it bounds what they found
    names = ("frozen-start", "nereus", "oracle")
    results = dict(zip(names, run_policies(sim, [parse_policy(p) for p in names])))
    assert all(r.oom_events == 0 for r in results.values())
    assert set(results["nereus"].layouts) <= set(oracle.known)
    assert results["oracle"].mean_step_s <= min(results[p].mean_step_s for p in names[:2]) * 1.001


def oracle_bucket(length):
    from nereusd.sim.oracle import length_bucket
    return length_bucket(length, 16)


def test_the_oracle_ranks_under_the_steps_contention():
    """In a contention episode (inter-node bandwidth × ``contention_factor``) the oracle takes
    the truth's fastest plan *under contention*, which here is not the fastest without it:
    ranked without it, the oracle ran slower plans than Nereus through the episodes of a spot
    trace."""
    length = 4096.0
    config = dataclasses.replace(MEASURED, contention_per_h=50.0, contention_mean_h=10.0, contention_factor=0.1)
    sim = Simulation(problem(nodes=2), LengthTrace("flat", (length,) * 4), PoolTrace("constant", math.inf, (1.0,)),
                     4, config)
    oracle, truth = sim._oracle, sim._oracle.truth
    t = next(start + 1.0 for start, _ in truth.episodes())
    assert truth.contended(t)
    pool = sim.problem.pool
    fitting = [p for p in oracle._candidates(oracle_bucket(length), pool, True, oracle._fraction(length, 1))
               if not truth.oom(p, length, 1)]
    chosen = oracle.plan(1, length, pool, t)
    assert truth.rank_key(chosen, length, 1, True) == min(truth.rank_key(p, length, 1, True) for p in fitting)
    assert chosen != min(fitting, key=lambda p: truth.rank_key(p, length, 1, False))


def test_the_simulated_site_carries_the_latency_growth_an_operator_would_measure():
    """``build`` under the measured truth sets the site's ``*_latency_growth`` to what
    nccl-tests would read on the simulated cluster, ``(t8 − t2)/(2·t2)`` of its small all-reduces
    (the controller's model carries a calibrated α to group sizes the job has not run with it);
    the ``efficiency`` truth, which is the cost model, keeps the site file's."""
    from nereusd.sim.measured import probed_latency_growth
    from nereusd.sim.scenario import Scenario, build

    p = problem()
    truth = ground_truth(p, MEASURED)
    growth = {}
    for link, spans, gbps in (("intra", False, p.site.intra_node_gbps), ("inter", True, p.site.inter_node_gbps)):
        t2, t8 = (truth.all_reduce_s(8.0, n, spans=spans) for n in (2, 8))
        growth[link] = probed_latency_growth(link, gbps * 1e9)
        assert growth[link] == pytest.approx((t8 - t2) / (2 * t2), rel=1e-9)
        assert 0.4 < growth[link] < 0.55   # NCCL's tree: an 8-rank call takes about twice a 2-rank one
    scenario = Scenario(gpus=16, steps=4, length_trace="generated-ramp")
    measured, _ = build(scenario, dataclasses.replace(MEASURED))
    net = measured.problem.site.network
    assert (net.intra_node_latency_growth, net.inter_node_latency_growth) == pytest.approx(
        (growth["intra"], growth["inter"]))
    modelled, _ = build(scenario, TruthConfig(kind="efficiency"))
    assert modelled.problem.site.network.intra_node_latency_growth == load_site("h200-ib").network.intra_node_latency_growth
