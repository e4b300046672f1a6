"""``scripts/bench_adaptive.py --rounds``: rotated order and median runs (its jobs replaced by a
recording stub; no processes)."""

from __future__ import annotations

import argparse
import importlib.util
import sys

from tests.support import REPO

_PATH = REPO / "scripts" / "bench_adaptive.py"
_spec = importlib.util.spec_from_file_location("bench_adaptive", _PATH)
bench = importlib.util.module_from_spec(_spec)
sys.modules["bench_adaptive"] = bench
_spec.loader.exec_module(bench)


def test_rounds_rotate_the_first_policy_and_report_each_ones_median_run(monkeypatch):
    order, times = [], {"a": [3.0, 1.0, 2.0], "b": [5.0, 4.0, 6.0], "c": [7.0, 9.0, 8.0]}

    def fake_run(policy, args, round_=0):
        order.append((round_, policy))
        return {"mean_step_s": times[policy][round_], "round": round_}

    monkeypatch.setattr(bench, "run_policy", fake_run)
    picked = bench.run_rounds(["a", "b", "c"], argparse.Namespace(rounds=3))
    assert [p for r, p in order if r == 0] == ["a", "b", "c"]
    assert [p for r, p in order if r == 1] == ["b", "c", "a"]
    assert [p for r, p in order if r == 2] == ["c", "a", "b"]
    assert {p: r["mean_step_s"] for p, r in picked.items()} == {"a": 2.0, "b": 5.0, "c": 8.0}
    assert picked["a"]["rounds"] == [3.0, 1.0, 2.0] and picked["a"]["round"] == 2
    order.clear()
    two = bench.run_rounds(["a", "b"], argparse.Namespace(rounds=2))   # even: the lower middle run
    assert order == [(0, "a"), (0, "b"), (1, "b"), (1, "a")]
    assert two["a"]["mean_step_s"] == 1.0 and two["b"]["mean_step_s"] == 4.0
