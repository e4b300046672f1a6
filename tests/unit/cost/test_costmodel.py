"""Cost model, memory model, calibration and workflows: formulas and invariants."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings, strategies as st

from nereusd.cost.calibration import GEMM, PRIORS, Calibration, fit_efficiencies
from nereusd.cost.model import CostModel
from nereusd.errors import ConfigError
from nereusd.cost.memory import parameters_per_device, stage_memory, usable_bytes
from nereusd.models import PRESETS, preset, resolve_model
from nereusd.plan import ModelStage
from nereusd.config.site import load_site
from nereusd.workflow import Workload, build_workflow

SPEC = preset("llama-3.1-8b")
H200 = load_site("h200-ib")
TRAIN = ModelStage.parse("actor/training")
GEN = ModelStage.parse("actor/generation")


def cost(m=TRAIN, **kw):
    args = dict(sequences=256, prompt_length=512, response_length=1024, tp=1, pp=1, dp=8, micro_batch=1)
    args.update(kw)
    return CostModel(H200).stage_cost(SPEC, m, **args)


def test_presets_match_published_sizes():
    assert PRESETS["llama-3.1-8b"].num_parameters() == pytest.approx(8.03e9, rel=0.01)
    assert PRESETS["qwen3-32b"].num_parameters() == pytest.approx(32.8e9, rel=0.01)
    assert PRESETS["llama-3.3-70b"].num_parameters() == pytest.approx(70.6e9, rel=0.01)
    assert resolve_model("Counting-Tiny").num_layers == 4
    with pytest.raises(ConfigError, match="unknown preset|not a preset"):
        resolve_model("gpt-5")


def test_training_compute_matches_6P_rule():
    c = cost(tp=1, pp=1, dp=1, sequences=8)
    tokens = 8 * 1536
    p_layers = SPEC.num_parameters() - SPEC.vocab_size * SPEC.hidden_size  # head counted, embedding not
    assert c.ideal_s_by_class[GEMM] == pytest.approx(6 * p_layers * tokens / H200.peak_flops(), rel=0.01)


def test_more_replicas_faster_and_pp_bubble():
    assert cost(dp=16).latency_s < cost(dp=8).latency_s
    m_few, m_many = cost(pp=4, dp=1, sequences=4), cost(pp=4, dp=1, sequences=64)
    assert m_few.latency_s / 4 > m_many.latency_s / 64    # bubble (pp-1)/(m+pp-1) shrinks


def test_tp_across_nodes_uses_inter_link():
    c = cost(tp=16)
    assert "all_reduce_inter" in c.ideal_s_by_class


def test_generation_is_memory_bound_and_grows_with_length():
    short, long = cost(GEN, response_length=512, micro_batch=64), cost(GEN, response_length=4096, micro_batch=64)
    assert "decode" in long.ideal_s_by_class and long.latency_s > 4 * short.latency_s


def test_transfer_hook():
    cm = CostModel(H200)
    assert cm.transfer_s(0, "intra") == 0
    assert cm.transfer_s(1e9, "inter") > cm.transfer_s(1e9, "intra") > 0
    assert cm.communicator_setup_s(3) == pytest.approx(1.5)


@settings(max_examples=50, deadline=None)
@given(tp=st.sampled_from([1, 2, 4, 8]), pp=st.sampled_from([1, 2, 4]), b=st.sampled_from([1, 2, 4]))
def test_memory_monotone(tp, pp, b):
    kw = dict(sequences=64, prompt_length=512, response_length=2048, dp=1, micro_batch=b)
    full = stage_memory(SPEC, TRAIN, tp=tp, pp=pp, **kw)
    rec = stage_memory(SPEC, TRAIN, tp=tp, pp=pp, recompute=True, **kw)
    assert rec.components["activations"] <= full.components["activations"]
    assert full.resident_bytes == parameters_per_device(SPEC, tp, pp) * 16   # the gradients stay, too
    more = stage_memory(SPEC, TRAIN, tp=tp * 2, pp=pp, **kw)
    assert more.peak_bytes < full.peak_bytes
    assert usable_bytes(100) == 90


def test_zero0_sixteen_bytes_per_parameter():
    m = stage_memory(SPEC, TRAIN, sequences=8, prompt_length=16, response_length=16, tp=1, pp=1, dp=1,
                     micro_batch=1)
    p = parameters_per_device(SPEC, 1, 1)
    c = m.components
    assert c["parameters"] + c["gradients"] + c["optimizer"] == 16 * p


def test_kv_cache_grows_with_concurrency():
    kw = dict(sequences=64, prompt_length=512, response_length=4096, tp=2, pp=1, dp=1)
    assert stage_memory(SPEC, GEN, micro_batch=64, **kw).components["kv_cache"] == \
        8 * stage_memory(SPEC, GEN, micro_batch=8, **kw).components["kv_cache"]


def test_calibration_robust_and_persistent(tmp_path):
    cal = Calibration()
    assert cal.efficiency("never_seen") <= 0.3 and cal.efficiency(GEMM) == PRIORS[GEMM]
    for _ in range(9):
        cal.observe(GEMM, 0.7, 1.0)
    cal.observe(GEMM, 0.7, 100.0)        # one outlier
    assert cal.efficiency(GEMM) == pytest.approx(0.7)
    path = tmp_path / "cal.json"
    cal.save(path)
    back = Calibration.load(path)
    assert back.snapshot() == cal.snapshot()
    path.write_text(json.dumps({"version": 99}))
    with pytest.raises(ConfigError, match="version: expected 1 or 2, got 99"):
        Calibration.load(path)
    path.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="expected a calibration state .* got a list"):
        Calibration.load(path)
    assert Calibration.load(tmp_path / "missing.json").efficiency(GEMM) == PRIORS[GEMM]


def test_calibration_improves_prediction():
    cm = CostModel(H200)
    pred = cost().ideal_s_by_class
    measured = sum(v / 0.8 for v in pred.values())
    cal = Calibration()
    for _ in range(5):
        cal.observe_stage(pred, measured)
    after = CostModel(H200, cal).stage_cost(SPEC, TRAIN, sequences=256, prompt_length=512, response_length=1024,
                                            tp=1, pp=1, dp=8, micro_batch=1)
    assert abs(after.latency_s - measured) < abs(cm.stage_cost(SPEC, TRAIN, sequences=256, prompt_length=512,
                                                 response_length=1024, tp=1, pp=1, dp=8,
                                                 micro_batch=1).latency_s - measured)


def test_fit_recovers_efficiencies_of_exact_data():
    true = {"gemm": 0.4, "all_reduce_intra": 0.2}
    ideals = [{"gemm": 1.0, "all_reduce_intra": 0.5}, {"gemm": 2.0, "all_reduce_intra": 0.1},
              {"gemm": 0.5, "all_reduce_intra": 1.0}]
    samples = [(i, sum(s / true[c] for c, s in i.items())) for i in ideals]
    assert fit_efficiencies(samples, PRIORS, ridge=1e-9) == pytest.approx(true, rel=1e-4)
    assert fit_efficiencies([], PRIORS) == {}
    # efficiencies outside (MIN_EFFICIENCY, MAX_EFFICIENCY] are held at the bound, the rest refit
    fast = [(i, sum(s / {"gemm": 3.0, "all_reduce_intra": 0.2}[c] for c, s in i.items())) for i in ideals]
    assert fit_efficiencies(fast, PRIORS, ridge=1e-9)["gemm"] == pytest.approx(1.5)


def test_the_calibration_fits_with_its_own_ridge():
    """``Calibration(ridge=…)`` is the pull its least-squares fit uses (``bench_costmodel.py``
    reports a weak one beside the controller's): on exact data of two separable classes a weak
    pull recovers both efficiencies, the default one stays nearer the anchors."""
    true = {"gemm": 0.9, "all_reduce_intra": 0.2}
    ideals = [{"gemm": 1.0, "all_reduce_intra": 0.5}, {"gemm": 2.0, "all_reduce_intra": 0.1},
              {"gemm": 0.5, "all_reduce_intra": 1.0}]

    def learned(cal: Calibration) -> dict[str, float]:
        for ideal in ideals * 3:
            cal.observe_stage(ideal, sum(s / true[c] for c, s in ideal.items()))
        return {c: cal.efficiency(c) for c in true}

    weak, default = learned(Calibration(ridge=1e-9)), learned(Calibration())
    assert weak == pytest.approx(true, rel=1e-3)
    assert abs(default["gemm"] - true["gemm"]) > 10 * abs(weak["gemm"] - true["gemm"]), (default, weak)


def test_a_pinned_class_is_not_learned_and_the_rest_explain_the_stage():
    """:meth:`Calibration.pin`: on one layout a stage's classes grow together, so a share of what
    the model lacks landed on the collectives; a class measured on its own stays at its figure,
    and the other classes take the whole measured excess, in the anchors and in the fit."""
    ideal = {"gemm": 1.0, "all_reduce_intra": 0.4}
    measured = 1.0 / 0.3 + 0.4 / 0.8           # gemm really at 0.3, the all-reduce at 0.8
    free, pinned = Calibration(), Calibration()
    pinned.pin("all_reduce_intra", 0.8)
    for step in range(6):
        scale = 1 + step / 5                   # a growing length: both classes grow alike
        for cal in (free, pinned):
            cal.observe_stage({c: v * scale for c, v in ideal.items()}, measured * scale)
    assert pinned.efficiency("all_reduce_intra") == 0.8 and pinned.samples("all_reduce_intra") == 0
    assert pinned.efficiency("gemm") == pytest.approx(0.3, rel=1e-6)
    assert pinned.anchor("gemm") == pytest.approx(0.3, rel=1e-6)
    assert free.efficiency("all_reduce_intra") < 0.6   # learned alongside gemm: over-priced
    # the fit fixes it too; a stage the pinned class alone over-explains gives no anchor sample
    assert fit_efficiencies([(ideal, measured)] * 2, PRIORS, 1e-9, {"all_reduce_intra": 0.8})["gemm"] == \
        pytest.approx(0.3, rel=1e-6)
    before = pinned.samples("gemm")
    pinned.observe_stage({"gemm": 1.0, "all_reduce_intra": 4.0}, 1.0)
    assert pinned.samples("gemm") == before
    pinned.restore(free.to_json())              # the pin is the site's, not saved state
    assert pinned.efficiency("all_reduce_intra") == 0.8
    with pytest.raises(ConfigError, match="pinned efficiency of all_reduce_intra"):
        pinned.pin("all_reduce_intra", 0.0)


def test_a_site_measured_all_reduce_is_pinned_by_its_cost_models():
    """``network.*_all_reduce_efficiency`` (nccl-tests) pins the all-reduce classes on every
    cost model of the site but a simulator truth's (``site_measured=False``)."""
    import dataclasses

    from nereusd.cost.model import measured_classes

    assert measured_classes(H200) == {}
    site = dataclasses.replace(H200, network=dataclasses.replace(
        H200.network, intra_node_all_reduce_efficiency=0.8, inter_node_all_reduce_efficiency=0.7))
    assert measured_classes(site) == {"all_reduce_intra": 0.8, "all_reduce_inter": 0.7}
    cal = Calibration()
    assert CostModel(site, cal).efficiency("all_reduce_intra") == 0.8
    assert cal.pinned == {"all_reduce_intra": 0.8, "all_reduce_inter": 0.7}
    truth = Calibration(priors={"all_reduce_intra": 0.5})
    assert CostModel(site, truth, site_measured=False).efficiency("all_reduce_intra") == 0.5


def test_collective_latency_is_calibrated_apart_from_bandwidth():
    """A machine whose collectives pay much more per call than the site's α (gloo) but move
    bytes at about the site's bandwidth: per-call latency and bytes are separate classes, so a
    fit over small (latency-bound) and large (bandwidth-bound) TP micro-batches learns both and
    predicts every layout; one class per collective could fit only one of them."""
    local = load_site("local")
    spec = preset("counting-tiny")
    true = {**PRIORS, "latency_intra": 0.05, "all_reduce_intra": 0.8}
    truth, prior = CostModel(local, Calibration(priors=true)), CostModel(local)
    shapes = [dict(tp=tp, micro_batch=mb, prompt_length=n, response_length=n)
              for tp in (2, 4) for mb in (1, 8) for n in (8, 256)]

    def run(cm, shape):
        return cm.stage_cost(spec, TRAIN, sequences=16, pp=1, dp=4 // shape["tp"], **shape)

    samples = [(dict(run(prior, sh).ideal_s_by_class), run(truth, sh).latency_s) for sh in shapes]
    assert all(ideal.get("latency_intra", 0) > 0 and ideal.get("all_reduce_intra", 0) > 0 for ideal, _ in samples)
    fitted = fit_efficiencies(samples, PRIORS, ridge=1e-9)
    assert fitted["latency_intra"] == pytest.approx(0.05, rel=1e-3)
    assert fitted["all_reduce_intra"] == pytest.approx(0.8, rel=1e-3)
    # the shapes mix the two terms very differently (that is what lets the fit tell them apart)
    ratios = [ideal["latency_intra"] / ideal["all_reduce_intra"] for ideal, _ in samples]
    assert max(ratios) > 10 * min(ratios)


def test_online_calibration_tells_classes_apart(tmp_path, monkeypatch):
    """Whole-stage times of stages with different class mixes (layouts, lengths): the least-squares
    window learns each class's efficiency, where one shared ratio per sample (the anchors alone,
    the calibration before the window) cannot; the window survives a save and load, and a
    version-1 state still loads."""
    import nereusd.cost.calibration as calibration

    true = {GEMM: 0.8, "all_reduce_intra": 0.1, "optimizer": 0.3}
    mixes = [{GEMM: 1.0, "all_reduce_intra": 0.05, "optimizer": 0.1},
             {GEMM: 0.3, "all_reduce_intra": 0.2, "optimizer": 0.1},
             {GEMM: 2.0, "all_reduce_intra": 0.01, "optimizer": 0.4}]

    def learn() -> Calibration:
        cal = Calibration()
        for _ in range(4):
            for ideal in mixes:
                cal.observe_stage(ideal, sum(s / true[c] for c, s in ideal.items()))
        return cal

    cal = learn()
    assert {c: cal.efficiency(c) for c in true} == pytest.approx(true, rel=0.1)
    with monkeypatch.context() as m:
        m.setattr(calibration, "MIN_FIT_SAMPLES", 10**9)
        shared = learn()
        assert max(abs(shared.efficiency(c) / true[c] - 1) for c in true) > 0.2
    anchors = {c: cal.anchor(c) for c in true}
    cal.save(tmp_path / "cal.json")
    back = Calibration.load(tmp_path / "cal.json")
    assert back.snapshot() == cal.snapshot()
    old = json.loads((tmp_path / "cal.json").read_text()) | {"version": 1}
    del old["stages"]
    assert Calibration.from_json(old).efficiency(GEMM) == pytest.approx(anchors[GEMM])


@pytest.mark.parametrize("bad, message", [
    ({"stages": [[{"gemm": float("nan")}, 1.0]]}, "stage ideal_s of gemm nan"),
    ({"stages": [[{"gemm": 1.0}, float("inf")]]}, "stage measured_s inf"),
    ({"priors": {"gemm": 0.0}}, "prior of gemm 0.0"),
    ({"samples": {"gemm": [-1.0]}}, "sample of gemm -1.0"),
    # OverflowError tracebacks (a bad-input search, 2026-12-06): deque(maxlen=10**30), float(10**400)
    ({"window": 10**30}, "window 1000000000000000000000000000000 is not an integer from 1 to 100,000"),
    ({"window": 32.0}, "window 32.0 is not an integer"),
    ({"prior_weight": 10**400}, "OverflowError"),
])
def test_a_corrupt_calibration_state_is_refused(bad, message):
    """NaN, infinite, zero or negative values (JSON allows NaN and Infinity) would pin classes to
    the efficiency bounds or divide by zero: refused at load, naming the value."""
    cal = Calibration()
    cal.observe_stage({GEMM: 1.0}, 2.0)
    cal.observe_stage({GEMM: 2.0}, 4.0)
    with pytest.raises(ConfigError, match=message):
        Calibration.from_json(cal.to_json() | bad)


def test_a_class_in_one_stage_sample_keeps_its_anchor():
    """The fit answers only for classes at least two whole-stage samples cover."""
    cal = Calibration()
    cal.observe_stage({GEMM: 1.0, "optimizer": 0.01}, 2.5)
    cal.observe_stage({GEMM: 2.0}, 4.0)
    assert cal.efficiency("optimizer") == cal.anchor("optimizer")
    assert cal.efficiency(GEMM) != cal.anchor(GEMM)


def test_workflows():
    ppo, grpo, remax = build_workflow("ppo"), build_workflow("grpo"), build_workflow("remax")
    assert len(ppo.model_stages) == 7 and len(grpo.model_stages) == 5
    wl = Workload(prompt_length=8, response_length=8, global_batch=16)
    assert remax.sequences(GEN, wl) == 32 and remax.sequences(TRAIN, wl) == 16
    lat = {m: 1.0 for m in ppo.model_stages}
    assert ppo.critical_path_s(lat) == 3.0
    assert build_workflow("ppo", asynchronous=True).critical_path_s(lat) == 2.0
    assert all(b > 0 for b in ppo.data_bytes_per_step(wl).values())
    with pytest.raises(ConfigError, match="algorithm 'dpo'"):
        build_workflow("dpo")
    with pytest.raises(ConfigError, match="mini_batches: 3 does not divide"):
        Workload(prompt_length=1, response_length=1, global_batch=16, mini_batches=3)


def test_layer_launch_time_makes_generation_waves_cost():
    # local CPU devices: decode is dispatch-bound, so two waves of 8 cost about twice one of 16
    # (each wave: one dispatch per layer for its prefill and for each of its 96 decode steps)
    import dataclasses

    import numpy as np

    from nereusd.cost import vector as costvec

    local = load_site("local")
    spec = preset("counting-tiny")
    gen = ModelStage.parse("actor/generation")
    kw = dict(sequences=16, prompt_length=8, response_length=96, tp=1, pp=1, dp=1)
    cm = CostModel(local)
    one, two = (cm.stage_cost(spec, gen, micro_batch=b, **kw).latency_s for b in (16, 8))
    launch = local.layer_launch_s * spec.num_layers * (96 + 1) / PRIORS["launch"]
    assert two - one == pytest.approx(launch, rel=0.05)
    off = CostModel(dataclasses.replace(local, device=dataclasses.replace(local.device, layer_launch_us=0.0)))
    assert off.stage_cost(spec, gen, micro_batch=8, **kw).latency_s == pytest.approx(
        two - 2 * launch, rel=1e-9)
    fast = costvec.latencies(cm, spec, gen, sequences=16, prompt_length=8, response_length=96, tp=1, pp=1,
                             dp=np.array([1, 1]), micro_batch=np.array([16, 8]), recompute=np.array([False, False]),
                             mini_batches=1)
    assert list(fast) == pytest.approx([one, two], rel=1e-12)


def test_layer_launch_time_makes_small_training_micro_batches_cost():
    """Each training micro-batch pays one dispatch per layer and pass (3: forward and backward;
    4 with recomputation), so 16 micro-batches of 1 cost 15 × 3 × layers dispatches more than
    one of 16 (the same FLOPs); scalar, fast and vectorised paths agree; without
    ``layer_launch_us`` the micro-batch size costs nothing."""
    import dataclasses

    import numpy as np

    from nereusd.cost import vector as costvec

    local = load_site("local")
    spec = preset("counting-tiny")
    train = ModelStage.parse("actor/training")
    kw = dict(sequences=16, prompt_length=8, response_length=16, tp=1, pp=1, dp=1)
    cm = CostModel(local)
    small, large, small_rc, large_rc = (cm.stage_cost(spec, train, micro_batch=b, recompute=rc, **kw).latency_s
                                        for rc in (False, True) for b in (1, 16))
    per_pass = local.layer_launch_s * spec.num_layers / PRIORS["launch"]
    assert small - large == pytest.approx(15 * 3 * per_pass, rel=1e-9)
    assert small_rc - large_rc == pytest.approx(15 * 4 * per_pass, rel=1e-9)
    assert cm.stage_latency(spec, train, micro_batch=1, **kw)[0] == pytest.approx(small, rel=1e-12)
    fast = costvec.latencies(cm, spec, train, sequences=16, prompt_length=8, response_length=16, tp=1, pp=1,
                             dp=np.array([1, 1]), micro_batch=np.array([1, 16]), recompute=np.array([False, False]),
                             mini_batches=1)
    assert list(fast) == pytest.approx([small, large], rel=1e-12)
    off = CostModel(dataclasses.replace(local, device=dataclasses.replace(local.device, layer_launch_us=0.0)))
    assert off.stage_cost(spec, train, micro_batch=1, **kw).latency_s == pytest.approx(
        off.stage_cost(spec, train, micro_batch=16, **kw).latency_s, rel=1e-9)


def test_ppo_epochs_repeat_training_and_nothing_else():
    """``train.epochs`` passes over the step's sequences: training costs that many times one pass
    (micro-batches, DP all-reduces and optimizer updates alike); inference and generation are
    run once. Before 2026-12-07 the cost model ignored epochs and priced such a job's training at
    one pass (a review)."""
    import dataclasses

    from nereusd.control.problem import job_problem
    from nereusd.plan import Stage
    from tests.support import demo_job

    spec = preset("llama-3.1-8b")
    cm = CostModel(load_site("h200-ib"))
    kw = dict(sequences=256, prompt_length=512, response_length=1024, tp=2, pp=2, dp=4, micro_batch=2,
              mini_batches=4)
    for name in ("actor/training", "actor/inference", "actor/generation"):
        m = ModelStage.parse(name)
        once, thrice = (cm.stage_cost(spec, m, epochs=e, **kw) for e in (1, 3))
        factor = 3 if m.stage is Stage.TRAINING else 1
        assert thrice.latency_s == pytest.approx(factor * once.latency_s, rel=1e-12)
        assert cm.stage_latency(spec, m, epochs=3, **kw)[0] == pytest.approx(thrice.latency_s, rel=1e-12)
    job = demo_job(curriculum=False)
    train = job.config.train.model_copy(update={"epochs": 2})
    job = dataclasses.replace(job, config=job.config.model_copy(update={"train": train}))
    site = load_site(job.config.site)
    problem = job_problem(job, site, tuple(range(job.devices)), 32, 5)
    assert problem.workload.epochs == 2


def test_a_pipeline_holds_one_optimizer_steps_micro_batches_in_flight():
    """The engine runs a training call per optimizer step, ``⌈per_replica / (b · mini_batches)⌉``
    micro-batches, and its first pipeline stage holds ``min(n, pp)`` of them under 1F1B (all ``n``
    when ``n < pp``): with 8 steps of 2 micro-batches at pp 4, two, not four (counted from the whole
    replica's 16 until 2026-12-07, a review)."""
    from nereusd.cost.memory import micro_batches_per_call, pipeline_in_flight

    assert micro_batches_per_call(16, 1, 8) == 2 and micro_batches_per_call(17, 2, 1) == 9
    assert micro_batches_per_call(3, 4, 2) == 1
    train = ModelStage.parse("actor/training")
    kw = dict(sequences=16, prompt_length=64, response_length=192, tp=1, pp=4, dp=1, micro_batch=1,
              dtype="fp32", device_kind="cpu")
    one, eight = (stage_memory(SPEC, train, mini_batches=m, **kw).components["activations"] for m in (1, 8))
    assert pipeline_in_flight(16, 4, 0) == 4 and pipeline_in_flight(2, 4, 0) == 2
    assert eight * 2 == pytest.approx(one, rel=1e-4)   # the first stage holds 2 micro-batches, not 4


def test_a_vllm_generation_books_its_weight_copy_and_a_whole_block_kv_cache():
    """The engine's copy of the weights and the KV cache vLLM preallocates for ``micro_batch``
    sequences of ``max_model_len`` tokens in whole blocks plus the null block — whatever the
    current response length (tests/distributed/test_vllm_engine.py checks vLLM's block count)."""
    from nereusd.cost.memory import kv_cache_bytes, vllm_kv_cache_tokens

    gen = ModelStage.parse("actor/generation")
    kw = dict(sequences=64, prompt_length=100, response_length=200, tp=2, pp=1, dp=2, micro_batch=8,
              device_kind="cpu", dtype="fp32")
    native = stage_memory(SPEC, gen, **kw)
    engine = stage_memory(SPEC, gen, engine_seq=1100, **kw)
    assert vllm_kv_cache_tokens(8, 1100, 32) == (8 * 35 + 1) * 32
    assert engine.components["kv_cache"] == kv_cache_bytes(SPEC, (8 * 35 + 1) * 32, 2, 1, 4)
    assert native.components["kv_cache"] == kv_cache_bytes(SPEC, 8 * 300, 2, 1, 4)
    assert engine.components["engine_weights"] == native.components["parameters"]
    assert "engine_weights" not in native.components and engine.resident_bytes == native.resident_bytes
    # a response longer than the engine's max_model_len cannot happen; the longer of the two counts
    assert stage_memory(SPEC, gen, engine_seq=10, **kw).components["kv_cache"] == \
        kv_cache_bytes(SPEC, vllm_kv_cache_tokens(8, 300, 32), 2, 1, 4)


def test_a_generation_engine_prices_its_dispatch_and_collectives_in_classes_of_its_own():
    """Prefill and decode put the engine's dispatch and TP collectives in ``generation_*``
    classes (vLLM's scheduler and communicator are not the training engines'), compute in the
    shared ones, and the weight sync in the job's. A calibration that learns the generation
    engine's dispatch and collectives leaves training's alone."""
    from nereusd.cost.calibration import LAUNCH, generation_class

    local = load_site("local")
    spec = preset("counting-tiny")
    kw = dict(sequences=16, prompt_length=8, response_length=32, pp=1, dp=1, micro_batch=16)
    gen = CostModel(local).stage_cost(spec, GEN, tp=2, **kw).ideal_s_by_class
    assert {"generation_launch", "generation_latency_intra", "generation_all_reduce_intra", GEMM} <= set(gen)
    assert LAUNCH not in gen and "all_reduce_intra" not in gen
    assert gen["broadcast_intra"] > 0 and gen["latency_intra"] > 0     # the weight sync
    assert generation_class(GEMM) == GEMM and generation_class("decode") == "decode"
    assert PRIORS["generation_latency_intra"] == PRIORS["latency_intra"]

    cal = Calibration()
    for _ in range(4):
        cal.observe_stage(gen, 0.5 * CostModel(local, cal).stage_cost(spec, GEN, tp=2, **kw).latency_s)
    assert cal.efficiency("generation_launch") > PRIORS[LAUNCH]
    assert cal.efficiency("generation_latency_intra") > PRIORS["latency_intra"]
    # training's dispatch and TP all-reduce bytes were not in these samples: unchanged
    assert cal.efficiency(LAUNCH) == PRIORS[LAUNCH]
    assert cal.efficiency("all_reduce_intra") == PRIORS["all_reduce_intra"]


def test_a_generation_wave_prefills_its_prompts_in_one_pass():
    """A wave's prompts go through one forward pass: at TP 2 the prefill makes 2 all-reduces
    per layer per wave (not per sequence), and its FLOPs do not depend on the wave size."""
    from nereusd.cost.formulas import ring_collective_parts

    local = load_site("local")
    spec = preset("counting-tiny")
    cm = CostModel(local)
    kw = dict(sequences=16, prompt_length=8, response_length=4, tp=2, pp=1, dp=1)
    _, _, alpha = cm.link(False)
    per_call = ring_collective_parts("all_reduce", 1.0, 2, 1e9, alpha)[1]
    for waves, micro_batch in ((1, 16), (2, 8), (4, 4)):
        ideal = cm.stage_cost(spec, GEN, micro_batch=micro_batch, **kw).ideal_s_by_class
        decode_calls = 2 * spec.num_layers * kw["response_length"] * waves
        prefill_calls = 2 * spec.num_layers * waves
        assert ideal["generation_latency_intra"] == pytest.approx(per_call * (decode_calls + prefill_calls), rel=1e-9)
    one, four = (cm.stage_cost(spec, GEN, micro_batch=b, **kw).ideal_s_by_class["attention"] for b in (16, 4))
    assert one == pytest.approx(four, rel=1e-9)


def test_a_prefill_prices_the_head_at_each_prompts_last_position():
    """The engines compute a prefill's logits at the sampled position only, so the GEMM FLOPs
    of a wave's prefill are ``2·(L·P_layer·b·prompt + V·h·b)/tp``: the head's do not grow with
    the prompt (Qwen2.5-1.5B: a head of 233 M parameters beside 1.3 B in the layers);
    training keeps the head at every token."""
    from nereusd.cost.model import layer_parameters

    spec, tp, b = preset("qwen2.5-1.5b"), 2, 8
    cm = CostModel(H200)
    body, head = spec.num_layers * layer_parameters(spec), spec.vocab_size * spec.hidden_size
    for prompt in (64, 512):
        gemm = cm._micro_batch(spec, True, prompt, tp, 1, b, False, False, launch=False, prefill=True).ideal[GEMM]
        assert gemm * cm.peak_flops == pytest.approx(2 * (body * b * prompt + head * b) / tp, rel=1e-12)
    train = cm._micro_batch(spec, True, 512, tp, 1, b, True, False).ideal[GEMM]
    assert train * cm.peak_flops == pytest.approx(6 * (body + head) * b * 512 / tp, rel=1e-12)
    kw = dict(sequences=64, prompt_length=512, response_length=1, tp=tp, pp=1, dp=1, micro_batch=b)
    assert cm.stage_latency(spec, GEN, **kw)[1][GEMM] == pytest.approx(cm.stage_cost(spec, GEN, **kw).ideal_s_by_class[GEMM],
                                                                      rel=1e-12)


def test_a_middle_pipeline_stage_pays_twice_the_p2p_calls_of_an_end_stage_on_gloo():
    """Per micro-batch a middle stage receives and sends (forward, and with backward the
    gradients), an end stage does one of each pair: on gloo, which runs each op of a batch on
    its own, the slot's p2p calls double with pp > 2. Counting an end stage's made pp 4 at
    micro-batch 1 the worst held-out layout of ``bench_costmodel.py`` (−15.5 % on 2026-12-05;
    −1.6 % with the middle stage's). NCCL runs a schedule step's batch as one group call: a GPU
    site keeps 2."""
    from nereusd.cost.formulas import p2p_parts

    local = load_site("local")
    cm = CostModel(local)
    spec = preset("counting-tiny")
    link, bw, alpha = cm.link(False)
    nbytes = 4 * 64 * spec.hidden_size * cm.bytes_per_element
    per_call = p2p_parts(nbytes, bw, alpha)[1]
    for pp, training, calls in ((2, True, 2), (4, True, 4), (2, False, 1), (4, False, 2)):
        mb = cm._micro_batch(spec, True, 64, 1, pp, 4, training, False)
        assert mb.ideal[f"latency_{link}"] == pytest.approx(calls * per_call, rel=1e-12)
    assert "latency_intra" not in cm._micro_batch(spec, True, 64, 1, 1, 4, True, False).ideal
    gpu = CostModel(H200)
    _, bw, alpha = gpu.link(False)
    per_call = p2p_parts(nbytes, bw, alpha)[1]
    for pp in (2, 4):
        assert gpu._micro_batch(spec, True, 64, 1, pp, 4, True, False).ideal["latency_intra"] == pytest.approx(
            2 * per_call, rel=1e-12)
    # forward only: nothing to pair a middle stage's receive and send with, on any backend
    assert gpu._micro_batch(spec, True, 64, 1, 4, 4, False, False).ideal["latency_intra"] == pytest.approx(
        2 * per_call, rel=1e-12)


def test_a_tp_micro_batch_pays_the_vocab_parallel_layers_calls():
    """Beside the layers' 2 (forward) or 4 (with backward) all-reduces, the engine's
    vocab-parallel embedding all-reduces forward and a language-model head adds its input's
    gradient all-reduce (training) and the log-probabilities' reductions: 4 in training (with
    the entropy), 3 in inference (``emu/engine/parallel.vocab_parallel_logprobs_entropy``). A
    value head (critic) has neither; a later pipeline stage has no embedding; a prefill (vLLM)
    none of them. 4 layers at ``tp = 4``: 22 calls a training micro-batch, as gloo makes."""
    from nereusd.cost.formulas import ring_collective_parts

    cm = CostModel(load_site("local"))
    spec = preset("counting-tiny")
    layers = spec.num_layers
    per_call = ring_collective_parts("all_reduce", 1.0, 4, 1e9, cm.link(False)[2], cm.latency_growth("intra"))[1]

    def calls(lm_head, pp, training, prefill=False):
        mb = cm._micro_batch(spec, lm_head, 64, 4, pp, 2, training, False, prefill=prefill)
        return mb.ideal["latency_intra"] / per_call

    assert calls(True, 1, True) == pytest.approx(4 * layers + 1 + 1 + 4)   # 22
    assert calls(True, 1, False) == pytest.approx(2 * layers + 1 + 3)
    assert calls(False, 1, True) == pytest.approx(4 * layers + 1)
    assert calls(False, 1, False) == pytest.approx(2 * layers + 1)
    p2p = cm._micro_batch(spec, True, 64, 1, 2, 2, True, False).ideal["latency_intra"]   # tp 1: the p2p calls only
    per_call_2 = ring_collective_parts("all_reduce", 1.0, 2, 1e9, cm.link(False)[2], cm.latency_growth("intra"))[1]
    assert cm._micro_batch(spec, True, 64, 2, 2, 2, True, False).ideal["latency_intra"] == pytest.approx(
        p2p + (4 * (layers // 2) + 1 + 4) * per_call_2)   # pp 2: no embedding on the last stage
    assert calls(True, 1, False, prefill=True) == pytest.approx(2 * layers)
    assert "latency_intra" not in cm._micro_batch(spec, True, 64, 1, 1, 2, True, False).ideal


def test_per_call_classes_may_learn_more_than_the_hardware_peak_classes():
    """A site's α or dispatch figure is an estimate, not a peak: their classes may learn an
    engine 10x faster than it, and a generation engine's own communicator 1,000x (vLLM's
    shared-memory all-reduce on CPU against gloo's α); compute stays within 1.5x of its peak."""
    from nereusd.cost.calibration import (MAX_EFFICIENCY, MAX_EFFICIENCY_ENGINE_CALL, MAX_EFFICIENCY_PER_CALL,
                                          max_efficiency)

    assert max_efficiency("generation_launch") == max_efficiency("launch") == MAX_EFFICIENCY_PER_CALL
    assert max_efficiency("latency_inter") == MAX_EFFICIENCY_PER_CALL
    assert max_efficiency("generation_latency_intra") == MAX_EFFICIENCY_ENGINE_CALL == 1000.0
    cal = Calibration()
    for _ in range(3):
        cal.observe_stage({"generation_latency_inter": 1.0}, 0.002)   # 500x the site's α
        cal.observe_stage({"latency_inter": 1.0}, 0.002)
    assert cal.efficiency("generation_latency_inter") == pytest.approx(500.0, rel=1e-6)
    assert cal.efficiency("latency_inter") == pytest.approx(MAX_EFFICIENCY_PER_CALL)
    assert max_efficiency(GEMM) == max_efficiency("generation_all_reduce_intra") == MAX_EFFICIENCY
    cal = Calibration()
    for _ in range(3):
        cal.observe_stage({"generation_latency_intra": 1.0}, 0.2)    # 5x the site's α
        cal.observe_stage({GEMM: 1.0}, 0.2)
    assert cal.efficiency("generation_latency_intra") == pytest.approx(5.0, rel=1e-6)
    assert cal.efficiency(GEMM) == pytest.approx(MAX_EFFICIENCY)
    restored = Calibration.from_json(json.loads(json.dumps(cal.to_json())))
    assert restored.efficiency("generation_latency_intra") == pytest.approx(5.0, rel=1e-6)


def test_a_pipeline_on_cores_it_holds_alone_reclaims_its_bubble():
    """Local mode's four virtual devices share two cores (``host_cores: 2``): a pipeline over all
    four runs its fill and drain on freed cores, so ``m`` micro-batches through ``pp`` stages
    take ``max(m, (m + pp − 1)/2)`` slots, not ``m + pp − 1`` (``bench_costmodel.py`` measured
    pp 4 45 % under the old count). TP/DP layouts keep every device busy and are unchanged, as
    is a stage on part of the node and every GPU site. Scalar, fast and vectorised paths agree."""
    import dataclasses

    import numpy as np

    from nereusd.cost import vector as costvec
    from nereusd.cost.formulas import pipeline_slots

    assert pipeline_slots(4, 4) == 7 and pipeline_slots(4, 4, 2.0) == 4 and pipeline_slots(1, 4, 2.0) == 2
    assert list(pipeline_slots(np.array([1, 4, 8]), 2, np.array([2.0, 2.0, 1.0]))) == [1, 4, 9]
    local = load_site("local")
    assert local.device.host_cores == 2
    assert (local.lone_speedup(4), local.lone_speedup(2), local.lone_speedup(8)) == (2.0, 1.0, 2.0)
    assert H200.lone_speedup(8) == 1.0
    assert (local.busy_speedup(4), local.busy_speedup(3), local.busy_speedup(2), local.busy_speedup(1)) == (
        1.0, 4 / 3, 2.0, 2.0)
    two = local.with_busy_devices(2)   # two engines on the four-device, two-core node: a core each
    assert two.peak_flops() == 2 * local.peak_flops() and two.hbm_bytes_per_s == 2 * local.hbm_bytes_per_s
    assert two.layer_launch_s == local.layer_launch_s / 2 and H200.with_busy_devices(1) is H200
    alone = dataclasses.replace(local, device=dataclasses.replace(local.device, host_cores=0))
    spec = preset("counting-tiny")
    kw = dict(sequences=16, prompt_length=8, response_length=16, micro_batch=4)
    cm, cm_alone = CostModel(local), CostModel(alone)
    for tp, pp, dp in ((1, 4, 1), (1, 2, 2), (2, 2, 1), (1, 1, 4), (2, 1, 2), (1, 2, 1)):
        shared = cm.stage_cost(spec, TRAIN, tp=tp, pp=pp, dp=dp, **kw)
        own = cm_alone.stage_cost(spec, TRAIN, tp=tp, pp=pp, dp=dp, **kw)
        if pp == 1 or tp * pp * dp < local.devices_per_node:
            assert shared.latency_s == own.latency_s, (tp, pp, dp)
        else:
            assert shared.latency_s < own.latency_s, (tp, pp, dp)
        assert cm.stage_latency(spec, TRAIN, tp=tp, pp=pp, dp=dp, **kw)[0] == pytest.approx(shared.latency_s, rel=1e-12)
        fast = costvec.latencies(cm, spec, TRAIN, sequences=16, prompt_length=8, response_length=16, tp=tp, pp=pp,
                                 dp=np.array([dp]), micro_batch=np.array([4]), recompute=np.array([False]))
        assert fast[0] == pytest.approx(shared.latency_s, rel=1e-12)
    # pp 4, 4 micro-batches of 4 per replica: 4 slots instead of 7 for every per-micro-batch class
    pp4 = cm.stage_cost(spec, TRAIN, tp=1, pp=4, dp=1, **kw).ideal_s_by_class
    pp4_alone = cm_alone.stage_cost(spec, TRAIN, tp=1, pp=4, dp=1, **kw).ideal_s_by_class
    assert pp4["gemm"] == pytest.approx(pp4_alone["gemm"] * 4 / 7, rel=1e-12)


def test_a_fit_singular_in_floating_point_keeps_the_anchors():
    """A measured stage of 1e-9 s beside one of 529 s made the normal equations singular:
    ``np.linalg.solve`` raised, and a live controller's ``observe`` with it (a bad-input search,
    2026-12-05; ``simulate --noise 20`` too). The fit now answers ``{}``, as for any
    ill-conditioned one, and the callers keep the anchors."""
    samples = [({"gemm": 1.0, "attention": 0.5}, 1e-9), ({"gemm": 2.0, "attention": 0.1}, 529.0)]
    assert fit_efficiencies(samples, PRIORS, 0.01) == {}


def test_a_decode_step_is_priced_in_its_own_class_whichever_bound_it():
    """A decode step costs its roofline time in class ``decode``, HBM-bound (one sequence: the
    weights dominate) or compute-bound (64: ~9× the bytes' time here); the prefill's GEMMs stay
    ``gemm``. So a longer response adds decode time (a little more than its steps: they attend
    to a longer context) and leaves ``gemm`` as it was: when a compute-bound step was priced as
    ``gemm``, one efficiency served prefill and decode alike."""
    cm = CostModel(load_site("local"))
    spec = preset("counting-tiny")
    gen = ModelStage.parse("actor/generation")
    by_batch = {}
    for b in (1, 64):
        short, long = (cm.stage_cost(spec, gen, sequences=b, prompt_length=8, response_length=r, tp=1, pp=1, dp=1,
                                     micro_batch=b).ideal_s_by_class for r in (32, 64))
        assert long["gemm"] == pytest.approx(short["gemm"], rel=1e-12)     # the prompts' prefill only
        assert 2 * short["decode"] <= long["decode"] <= 2.2 * short["decode"]
        by_batch[b] = short["decode"]
    assert by_batch[64] > 5 * by_batch[1]   # 64 sequences' step is compute-bound: it grows with the batch


def test_a_decode_steps_attention_adds_to_its_gemms_and_hbm_bound_steps_add_their_bytes():
    """The decode step's GEMMs and its attention are separate kernels with rooflines of their own
    whose times add (PagedAttention reads the KV cache in a kernel of its own; Kwon et al. 2023).
    Both HBM-bound (an 8B model, one sequence, H200): a longer prompt adds exactly its KV-cache
    bytes over HBM bandwidth per step, as one roofline over all the bytes gave. GEMMs
    compute-bound (64 sequences on a local CPU device): the KV reads still add their time; one
    roofline over both hid them behind the GEMMs (vLLM on CPU: ~0.4 µs per sequence, step and
    context token, scripts/bench_costmodel.py, 2026-12-05)."""
    gen = ModelStage.parse("actor/generation")
    h200 = CostModel(load_site("h200-ib"))
    spec = preset("llama-3.1-8b")
    kw = dict(sequences=1, response_length=64, tp=1, pp=1, dp=1, micro_batch=1)
    short, long = (h200.stage_cost(spec, gen, prompt_length=p, **kw).ideal_s_by_class["decode"] for p in (512, 1536))
    kv_bytes_per_token = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * h200.bytes_per_element
    assert long - short == pytest.approx(64 * 1024 * kv_bytes_per_token / h200.site.hbm_bytes_per_s, rel=1e-9)
    local = CostModel(load_site("local"))
    tiny = preset("counting-tiny")
    kw = dict(sequences=64, response_length=16, tp=1, pp=1, dp=1, micro_batch=64)
    short, long = (local.stage_cost(tiny, gen, prompt_length=p, **kw).ideal_s_by_class["decode"] for p in (8, 72))
    kv_bytes_per_token = 2 * tiny.num_layers * tiny.num_kv_heads * tiny.head_dim * local.bytes_per_element
    assert long - short >= 16 * 64 * 64 * kv_bytes_per_token / local.site.hbm_bytes_per_s * (1 - 1e-9)
