"""``scripts/bench_adaptive.py``: ``--rounds``' rotated order and median runs, and its argument
checks (its jobs replaced by a recording stub; no processes)."""

from __future__ import annotations

import argparse
import importlib.util
import sys

import pytest

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


@pytest.mark.parametrize("args, says", [
    (["--policies", ""], "--policies: expected at least one of"),
    (["--policies", ","], "--policies: expected at least one of"),
    (["--steps", "0"], "--steps: expected at least 1"),
    (["--pool-step", "30"], "--pool-step: expected 1..29 (below --steps)"),
    (["--launch-length", "0"], "--launch-length: expected 1..96 tokens (the demo's max_new_tokens), got 0"),
    (["--launch-length", "97"], "--launch-length: expected 1..96 tokens"),   # the job would refuse it
    (["--checkpoint-every", "-1"], "--checkpoint-every: expected 0 or more"),
])
def test_bad_arguments_are_refused_before_any_job_or_directory(tmp_path, capsys, args, says):
    """``--policies ''`` crashed in the rotation (modulo by zero) and the other values ran five
    jobs the launcher refused, exiting 0; none of them may create ``--out``."""
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exc:
        bench.main(args + ["--out", str(out)])
    assert exc.value.code == 2 and says in capsys.readouterr().err
    assert not out.exists()


def test_a_job_the_launcher_refuses_is_shown_and_fails_the_run(tmp_path, monkeypatch, capsys):
    def refused(policy, args, round_=0):
        return {"status": "missing (exit 2)", "mean_step_s": 0.0, "total_s": 0.0, "switches": 0,
                "transition_share": 0.0, "ooms": 0, "lost_steps": 0}

    monkeypatch.setattr(bench, "run_policy", refused)
    assert bench.main(["--policies", "nereus", "--out", str(tmp_path)]) == 1
    assert "no run of nereus started" in capsys.readouterr().err


def test_a_run_counts_its_switches_as_its_summary_does(tmp_path):
    """An admission is a decision (an interrupted one never ran; a resume admits it again) and a
    rebuild on the same plan is no switch: the count is ``journal.switch_kind``'s, ``summary.json``'s."""
    import json

    events = [{"event": "build", "time_s": 1.0},
              {"event": "admission", "verdict": "admit"},   # interrupted: never ran
              {"event": "admission", "verdict": "admit"},
              {"event": "transition", "from_plan": "p0", "to_plan": "p1", "elapsed_s": 0.5},
              {"event": "transition", "from_plan": "p1", "to_plan": "p1", "elapsed_s": 0.2},   # world re-formed
              {"event": "fallback", "action": "checkpoint_restart", "elapsed_s": 3.0, "lost_steps": 2},
              {"event": "step_prediction", "time_s": 11.0}]
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(5)))
    (tmp_path / "summary.json").write_text(json.dumps({"status": "succeeded", "wall_time_s": 20.0}))
    got = bench.measure(tmp_path)
    assert got["switches"] == 2 and got["lost_steps"] == 2 and got["mean_step_s"] == 2.0
    assert got["transition_share"] == pytest.approx(3.7 / 20.0)
