"""Pure helpers of scripts/bench_costmodel.py on hand-made data (no processes, < 5 s)."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from nereusd.cost.calibration import GEMM
from nereusd.config.site import load_site
from tests.support import REPO

_PATH = REPO / "scripts" / "bench_costmodel.py"
_spec = importlib.util.spec_from_file_location("bench_costmodel", _PATH)
bench = importlib.util.module_from_spec(_spec)
sys.modules["bench_costmodel"] = bench  # dataclasses look their module up while the class is built
_spec.loader.exec_module(bench)


def test_errors_and_mape():
    assert bench.percent_errors([110.0, 90.0], [100.0, 100.0]) == pytest.approx([10.0, -10.0])
    assert bench.mape([110.0, 95.0], [100.0, 100.0]) == pytest.approx(7.5)
    assert bench.max_abs_error([110.0, 70.0], [100.0, 100.0]) == pytest.approx(30.0)
    with pytest.raises(ValueError, match="2 predictions for 1"):
        bench.mape([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="positive"):
        bench.mape([1.0], [0.0])


def test_split_alternates_and_holds_something_out():
    calib, held = bench.split_layouts(list("abcde"))
    assert calib == ["a", "c", "e"] and held == ["b", "d"]
    assert bench.split_layouts(list("abcdef"), every=3) == (["a", "d"], ["b", "c", "e", "f"])
    with pytest.raises(ValueError, match="every must be >= 2"):
        bench.split_layouts([1, 2], every=1)


def test_layouts_fill_the_four_devices():
    assert len(bench.LAYOUTS) >= 10
    assert all(x.tp * x.pp * x.dp == bench.WORLD for x in bench.LAYOUTS)
    factorisations = {(1, 1, 4), (2, 1, 2), (4, 1, 1), (1, 2, 2), (2, 2, 1), (1, 4, 1)}
    assert {(x.tp, x.pp, x.dp) for x in bench.LAYOUTS} == factorisations
    assert len({x.micro_batch for x in bench.LAYOUTS}) > 2 and len({x.seq_len for x in bench.LAYOUTS}) > 2


def test_calibrate_then_predict_on_synthetic_times():
    """Times that are exactly 2x the prior prediction: the online calibration learns it."""
    site = load_site("local")
    layouts = bench.LAYOUTS[:4]
    prior = bench.CostModel(site)
    samples = [(x, 2.0 * bench.predict(prior, bench.SPEC, x).latency_s) for x in layouts]
    cal = bench.calibrate(site, bench.SPEC, samples, rounds=3)
    assert cal.samples(GEMM) == 12
    cm = bench.CostModel(site, cal)
    pred = [bench.predict(cm, bench.SPEC, x).latency_s for x in layouts]
    assert bench.mape(pred, [m for _, m in samples]) < 1.0


def test_predicted_memory_components():
    site = load_site("local")
    x = bench.Layout(2, 1, 2, 2, 128)
    comp = bench.predicted_peak_bytes(bench.SPEC, x, site)
    assert comp["parameters"] == pytest.approx(bench.SPEC.num_parameters() * 4 / 2, rel=0.01)   # fp32, tp = 2 (norms replicated)
    assert comp["activations"] > 0 and comp["logits"] > 0 and comp["optimizer"] > 0


def test_generation_rollouts_and_their_prediction():
    """The vLLM rollouts cover both TP sizes, 1-3 waves and both concurrencies on the bench's two
    engine processes; a rollout's prediction is the generation stage without its weight sync,
    and the online calibration learns most of times that are 2x it (not all: the decode
    roofline's choice of class moves with the efficiencies)."""
    assert len(bench.GEN_LAYOUTS) >= 20 and all(x.tp * x.dp == bench.GEN_WORLD for x in bench.GEN_LAYOUTS)
    assert {x.tp for x in bench.GEN_LAYOUTS} == {1, 2} and {x.max_num_seqs for x in bench.GEN_LAYOUTS} == {8, 32}
    assert {-(-x.sequences // x.max_num_seqs) for x in bench.GEN_LAYOUTS} == {1, 2, 3}
    site = load_site("local")
    cm = bench.CostModel(site)
    x = bench.GenLayout(2, 8, 16, 32, 64)
    full = cm.stage_cost(bench.SPEC, bench.GEN, sequences=16, prompt_length=32, response_length=64, tp=2, pp=1, dp=1,
                         micro_batch=8)
    sync = cm.weight_sync_cost(bench.SPEC, 2, 1, 1)
    got = bench.predict_generation(cm, bench.SPEC, x)
    assert got.latency_s == pytest.approx(full.latency_s - sync.latency_s, rel=1e-9)
    assert "broadcast_intra" not in got.ideal_s_by_class
    layouts = bench.GEN_LAYOUTS[:6]
    samples = [(g, 2.0 * bench.predict_generation(cm, bench.SPEC, g).latency_s) for g in layouts]
    cal = bench.calibrate(site, bench.SPEC, samples, rounds=3)
    pred = [bench.predict_generation(bench.CostModel(site, cal), bench.SPEC, g).latency_s for g in layouts]
    prior = [bench.predict_generation(cm, bench.SPEC, g).latency_s for g in layouts]
    assert bench.mape(prior, [m for _, m in samples]) == pytest.approx(50.0)
    assert bench.mape(pred, [m for _, m in samples]) < 5.0


def test_held_out_table_scores_the_test_rows_only():
    rows = [{"spread": 0.0}] * 3
    lines, err, worst = bench.held_out_table(["a", "b", "c"], rows, [1.0, 2.0, 4.0], [True, False, False],
                                             [9.0, 2.2, 3.0])
    assert len(lines) == 3 and "calib" in lines[0] and "test" in lines[1]
    assert err == pytest.approx((10.0 + 25.0) / 2) and worst == pytest.approx(25.0)
