"""Simulator: the replay's bookkeeping on small hand-made traces whose answers are known, traces,
policies, and that the simulated controller is the project's controller code."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

from nereusd.errors import ConfigError
from nereusd.plan import Role
from nereusd.planner.space import PlanProblem
from nereusd.sim.policies import parse_policies, parse_policy
from nereusd.sim.replay import Simulation
from nereusd.traces import LengthTrace, PoolTrace, load_length_trace, load_pool_trace
from nereusd.sim.truth import TruthConfig
from nereusd.config.site import load_site
from nereusd.workflow import Workload, build_workflow
from tests.support.specs import SMALL_1B as SMALL

CONSTANT = PoolTrace("constant", math.inf, (1.0,))
QUIET = TruthConfig(noise_sigma=0.0, contention_per_h=0.0, spread_sd=0.0, spread_mean=1.0, checkpoint_interval=4)


def small_problem(nodes=2, memory_gib=140, batch=64):
    site = load_site("h200-ib")
    site = dataclasses.replace(site, device=dataclasses.replace(site.device, memory_gib=memory_gib)).with_nodes(nodes)
    wl = Workload(prompt_length=256, response_length=256, global_batch=batch)
    return PlanProblem(build_workflow("ppo"), {r: SMALL for r in Role}, wl, site, tuple(range(nodes * 8)))


def check_books(res):
    """Time sums: total = executed steps + lost + transitions + restarts + stalls."""
    parts = sum(r.step_s + r.lost_s + r.transition_s + r.restart_s + r.stall_s for r in res.records)
    assert res.total_s == pytest.approx(parts)
    assert res.mean_step_s == pytest.approx((res.total_s - res.stall_s) / res.steps)
    completed = [r for r in res.records if not r.oom and not r.rerun]
    assert sorted(r.step for r in completed) == list(range(res.steps))
    assert res.switches == sum(r.switched for r in res.records)
    starts = [r.start_s for r in res.records]
    assert starts == sorted(starts)


def test_constant_conditions_have_known_totals():
    lengths = LengthTrace("hand-made flat", (512.0,))
    sim = Simulation(small_problem(), lengths, CONSTANT, 12, QUIET)
    frozen = sim.run(parse_policy("frozen"))
    check_books(frozen)
    step = frozen.records[0].step_s
    assert all(r.step_s == pytest.approx(step) for r in frozen.records)
    assert frozen.total_s == pytest.approx(12 * step)
    assert (frozen.switches, frozen.oom_events, frozen.restarts, frozen.stall_s) == (0, 0, 0, 0.0)
    oracle = sim.run(parse_policy("oracle"))
    check_books(oracle)
    assert oracle.total_s == pytest.approx(frozen.total_s)   # same launch plan, nothing moves
    assert oracle.transition_s == 0.0


def test_periodic_replans_every_k_steps_and_switches_only_on_gain():
    lengths = LengthTrace("hand-made flat", (512.0,))
    sim = Simulation(small_problem(), lengths, CONSTANT, 10, QUIET)
    res = sim.run(parse_policy("periodic-3"))
    check_books(res)
    periodic = [d for d in res.decisions if any(t["signal"] == "period" for t in d["triggers"])]
    assert [d["step"] for d in periodic] == [0, 3, 6, 9]
    admitted = [d for d in res.decisions if d["verdict"] == "admit"]
    assert res.switches == len(admitted)
    assert all(d["delta_l_s"] > 0 for d in admitted)


def test_oom_costs_lost_step_restart_and_rerun_since_checkpoint():
    # 16 GiB devices; the launch plan fits 256-token responses, not 16,384 from step 10 on
    lengths = LengthTrace("hand-made jump", tuple([256.0] * 10 + [16384.0] * 10))
    sim = Simulation(small_problem(memory_gib=16), lengths, CONSTANT, 20, QUIET)
    res = sim.run(parse_policy("frozen"))
    check_books(res)
    failed = [r for r in res.records if r.oom]
    assert [r.step for r in failed] == [10] and res.oom_events == 1
    assert failed[0].step_s == 0.0 and failed[0].restart_s > QUIET.restart_s
    pre = [r for r in res.records if r.step == 9 and not r.rerun][0]
    assert failed[0].lost_s > 0
    # checkpoint every 4 steps: the last before step 10 is at 8, so steps 8 and 9 run again
    assert sorted(r.step for r in res.records if r.rerun) == [8, 9]
    assert len(res.records) == 20 + 1 + 2 and pre.step_s > 0
    oracle = sim.run(parse_policy("oracle"))
    assert oracle.oom_events == 0 and oracle.total_s < res.total_s
    # a replan during the re-run must not go back to the layout that failed (it once looped)
    periodic = sim.run(parse_policy("periodic-1"))
    check_books(periodic)
    assert periodic.oom_events == 1


def test_pool_changes_rescale_frozen_and_trigger_the_controller():
    # the pool halves after 20 s and comes back after 40 s, and so on (a hand-made trace)
    pool = PoolTrace("hand-made halving", 20.0, (1.0, 0.5))
    lengths = LengthTrace("hand-made flat", (1024.0,))
    sim = Simulation(small_problem(nodes=4), lengths, pool, 60, QUIET)
    for name in ("frozen", "nereus"):
        res = sim.run(parse_policy(name))
        check_books(res)
        assert {r.pool for r in res.records} == {16, 32}
        changes = sum(1 for a, b in zip(res.records, res.records[1:]) if a.pool != b.pool)
        assert changes >= 2
        # every pool change is handled at its boundary: a switch, a restart or (devices joined,
        # nereus) a decision to keep the running plan
        decided = {d["step"] for d in res.decisions}
        handled = [r for r in res.records if r.switched or r.restart_s > 0 or r.step in decided]
        assert len(handled) >= changes
        # the transitions at those boundaries are the pool's; the frozen policy makes no others
        at_changes = sum(a.transition_s for a, b in zip(res.records, res.records[1:]) if a.pool != b.pool)
        assert res.pool_transition_s >= at_changes   # (and the last boundary's, which no record follows)
        if name == "frozen":   # it always rescales; nereus may keep its plan when devices join (admission)
            assert at_changes > 0 and res.pool_transition_s == pytest.approx(res.transition_s)
    assert any(t["signal"] == "gpu_pool" and t["urgent"] for d in res.decisions for t in d["triggers"])


def test_frozen_rescales_its_launch_plan_not_the_plan_a_shrunken_pool_left():
    """The pool falls to a quarter (every replica of some model-stage is lost: a restart) and
    comes back. A static framework relaunches its launch layout with DP scaled to the GPUs it
    has; when they return it runs the launch layouts again — not a rescale of the small pool's
    restart plan (which once ran actor training on 8 of 64 GPUs, issue 16)."""
    pool = PoolTrace("hand-made dip", 30.0, (1.0, 0.25, 1.0, 1.0))
    sim = Simulation(small_problem(nodes=4), LengthTrace("flat", (1024.0,)), pool, 80, QUIET)
    res = sim.run(parse_policy("frozen-start"))
    check_books(res)
    assert res.restarts >= 1 and {r.pool for r in res.records} == {8, 32}

    def layouts(desc: str) -> str:   # the layouts of a plan description, without its devices
        return " ".join(part.split("@")[0] for part in desc.split("; "))

    launch = layouts(sim.launch.describe())
    back = [r for r in res.records if r.pool == 32 and r.start_s > 60.0]
    assert back and all(layouts(res.plans[r.plan_id]) == launch for r in back), \
        {layouts(res.plans[r.plan_id]) for r in back} - {launch}


def test_frozen_final_launches_on_a_plan_that_holds_the_longest_responses():
    """The OOM case above with ``frozen-final``: launched for the run's longest responses, it
    never runs out of memory, and is slower than ``frozen-start`` while responses are short."""
    lengths = LengthTrace("hand-made jump", tuple([256.0] * 10 + [16384.0] * 10))
    sim = Simulation(small_problem(memory_gib=16), lengths, CONSTANT, 20, QUIET)
    final = sim.run(parse_policy("frozen-final"))
    start = sim.run(parse_policy("frozen-start"))
    check_books(final)
    assert final.oom_events == 0 and start.oom_events == 1
    assert final.records[0].step_s > start.records[0].step_s
    assert sim.launch_final != sim.launch


def test_stall_when_pool_is_empty_is_not_step_latency():
    pool = PoolTrace("hand-made outage", 5.0, (1.0, 0.0, 0.0, 1.0))
    sim = Simulation(small_problem(), LengthTrace("flat", (512.0,)), pool, 40, QUIET)
    res = sim.run(parse_policy("frozen"))
    check_books(res)
    assert res.stall_s > 0
    assert res.mean_step_s == pytest.approx((res.total_s - res.stall_s) / 40)
    assert res.restarts >= 1   # every replica was lost with the pool


def test_the_oracle_pays_the_restart_a_lost_pool_forces_on_every_policy():
    """Its moves are free, but a pool that takes every replica costs it a checkpoint restart as
    it costs the others (it once skipped those, and its headroom on spot pools was restarts)."""
    pool = PoolTrace("hand-made outage", 5.0, (1.0, 0.0, 0.0, 1.0))
    sim = Simulation(small_problem(), LengthTrace("flat", (512.0,)), pool, 40, QUIET)
    oracle, frozen = sim.run(parse_policy("oracle")), sim.run(parse_policy("frozen"))
    check_books(oracle)
    assert oracle.restarts == frozen.restarts >= 1 and oracle.transition_s == 0.0
    assert oracle.total_s == pytest.approx(frozen.total_s)   # same plans, same restarts


def test_an_oracle_keeping_memory_headroom_never_runs_past_it():
    """``oracle@H`` takes the oracle's best plan among those whose true peak leaves ``H`` of every
    device free at each step where one does: here the plain oracle runs at 99 % of memory on the
    long responses, ``oracle@0.3`` within 70 %, and the margin costs it time (the difference is
    what the plain oracle's knowing each step's memory is worth). Where no plan leaves the margin
    (responses of 16,384 tokens here) it takes the best that fits."""
    from nereusd.sim.measured import ground_truth
    from nereusd.sim.report import format_table, summary

    lengths = LengthTrace("hand-made jump", tuple([256.0] * 10 + [4096.0] * 10))
    sim = Simulation(small_problem(memory_gib=16), lengths, CONSTANT, 20, QUIET)
    truth = ground_truth(sim.problem, QUIET)
    free, kept = sim.run(parse_policy("oracle")), sim.run(parse_policy("oracle@0.3"))
    check_books(kept)
    capacity = sim.problem.site.device_memory_bytes

    def peak(res, rec):
        return max(truth.device_peaks(res.layouts[res.plans[rec.plan_id]], rec.length, rec.step).values())

    assert all(peak(kept, r) <= 0.7 * capacity for r in kept.records)
    assert any(peak(free, r) > 0.7 * capacity for r in free.records)
    assert kept.oom_events == free.oom_events == 0 and kept.transition_s == 0.0
    assert kept.mean_step_s > free.mean_step_s and kept.margin_missed_steps == 0
    tall = Simulation(small_problem(memory_gib=16), LengthTrace("jump", tuple([256.0] * 5 + [16384.0] * 5)),
                      CONSTANT, 10, QUIET).run(parse_policy("oracle@0.3"))
    assert tall.oom_events == 0 and tall.margin_missed_steps == 5   # over 70 % at 16,384: the best that fits
    assert "oracle@0.3: no plan left that share of memory free at 5 steps" in format_table(summary([tall]))


def test_traces_resolve_to_shipped_copies_and_generated_is_labelled():
    real = load_length_trace("verl-amd-7b-grpo")
    assert len(real.response_lengths) == 1119 and not real.generated
    # each step's longest response (the verl logs' max column: 319-1,024 tokens, the cap 1,024
    # in 316 steps), not the mean (134-192 tokens at the ends) the table once took for it
    assert min(real.response_lengths) == 319 and max(real.response_lengths) == 1024
    assert sum(x == 1024 for x in real.response_lengths) == 316
    tree = load_length_trace("deepgrpo-tree")
    assert len(tree.response_lengths) == 2958
    ramp = load_length_trace("generated-ramp", steps=100)
    assert ramp.generated and "generated" in ramp.label
    assert 300 < ramp.at(0) < 800 and 5000 < ramp.at(99) < 13000
    spot = load_pool_trace("us-east-2b")
    assert spot.gap_s == 300 and spot.fractions[0] == 1.0
    assert spot.devices_at(0.0, 64, 8) == 64
    assert all(spot.devices_at(i * 300.0, 64, 8) % 8 == 0 for i in range(200))
    with pytest.raises(ConfigError, match="not a shipped trace"):
        load_length_trace("no-such-trace")
    with pytest.raises(ConfigError, match="not a shipped trace"):
        load_pool_trace("eu-nowhere-1")


def test_pool_trace_rounds_a_half_node_upward():
    # 5/16 and 7/16 of 8 nodes are 2.5 and 3.5 nodes: the nearest count, a half upward (round()
    # would give 2 and 4, its even neighbours), and half of a 1-node cluster is that node
    trace = PoolTrace("hand-made halves", 10.0, (5 / 16, 7 / 16, 0.5, 0.49))
    assert [trace.devices_at(t, 64, 8) for t in (0.0, 10.0)] == [24, 32]
    assert trace.devices_at(20.0, 8, 8) == 8 and trace.devices_at(30.0, 8, 8) == 0


def test_policy_names():
    assert [p.name for p in parse_policies("frozen,frozen-final,nereus,greedy,periodic-3,oracle,nereus@0.25")] == \
        ["frozen-start", "frozen-final", "nereus", "greedy", "periodic-3", "oracle", "nereus@0.25"]
    assert parse_policy("frozen-final").launch_at_longest and not parse_policy("frozen-start").launch_at_longest
    assert parse_policy("nereus@0").payback_margin == 0 and parse_policy("greedy").payback_margin == math.inf
    assert parse_policy("periodic-5").period == 5
    with pytest.raises(ConfigError, match="periodic-3"):
        parse_policy("periodic-x")
    with pytest.raises(ConfigError, match="twice"):
        parse_policies("frozen,frozen")
    with pytest.raises(ConfigError, match="twice"):
        parse_policies("frozen,frozen-start")
    assert parse_policy("oracle@0.1").memory_headroom == 0.1 and parse_policy("oracle").memory_headroom == 0.0
    assert parse_policy("oracle@.10").name == "oracle@0.1" and parse_policy("oracle@0").name == "oracle"
    for same in ("oracle@0.1,oracle@0.10", "oracle,oracle@0"):
        with pytest.raises(ConfigError, match="twice"):
            parse_policies(same)
    for odd in ("periodic-03", "periodic-+3", "periodic-0", "nereus@1e309", "nereus@1_0", "nereus@-1", "nereus@nan",
                "periodic-1\u0661", "oracle@0.9", "oracle@1", "oracle@-0.1", "oracle@nan", "oracle@0.1\u0661"):
        with pytest.raises(ConfigError, match="bad parameter"):
            parse_policy(odd)




def test_cli_json_and_plots(tmp_path, capsys):
    import json

    import argparse

    from launcher import cli, simulate_cmd
    assert "launcher.simulate_cmd" in cli.SUBCOMMAND_MODULES
    parser = argparse.ArgumentParser()
    simulate_cmd.register(parser.add_subparsers())

    def main(argv):
        args = parser.parse_args(argv)
        try:
            return args.func(args)
        except ConfigError:
            return 2
    assert main(["simulate", "--model", "counting-tiny", "--gpus", "16", "--steps", "12", "--global-batch", "64", "--policies",
                 "frozen,nereus,oracle", "--out", str(tmp_path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["length_generated"] is True and "generated" in out["length_trace"]
    assert [r["policy"] for r in out["summary"]] == ["frozen-start", "nereus", "oracle"]
    assert out["summary"][0]["vs_best_frozen_pct"] == 0.0
    assert out["summary"][0]["captured_pct"] in (0.0, None)
    for name in ("step_latency.png", "plan_timeline.png", "pool.png", "sequence_length.png", "summary.json"):
        assert (tmp_path / name).stat().st_size > 0
    assert main(["simulate", "--gpus", "12", "--steps", "5"]) == 2


@pytest.mark.parametrize("argv, says", [
    (["--length-trace", "generated-ramp:a:b"], "START and END must be numbers"),
    (["--length-trace", "generated-ramp:1"], "expected generated-ramp or generated-ramp:START:END"),
    (["--length-trace", "generated-ramp:-5:0"], "START and END must be numbers of tokens from 1 to 16,777,216"),
    # 1e400 (inf) was called "less than 1 token"; 1e15 ran until a restart found no plan (2026-12-06)
    (["--length-trace", "generated-ramp:100:1e400"], "START and END must be numbers of tokens from 1 to"),
    (["--length-trace", "generated-ramp:100:1e15"], "START and END must be numbers of tokens from 1 to"),
    (["--length-trace", "."], "not a shipped trace"),
    (["--pool-trace", "."], "not a shipped trace"),
    # the flag's own name and range (the ground truth's field names were quoted before)
    (["--noise", "-1"], "argument --noise: expected a number in [0, 2], got -1"),
    (["--noise", "nan"], "argument --noise: expected a number in [0, 2], got nan"),
    (["--noise", "100"], "argument --noise: expected a number in [0, 2]"),   # ran the machine out of memory (2026-12-05)
    (["--contention-per-h", "1e9"], "argument --contention-per-h: expected a number in [0, 3600]"),
    (["--engine-rebuild-s", "-10"], "argument --engine-rebuild-s: expected a number in [0, 86400]"),
    # 10^7 sequences ran for minutes with no output; 1e30 ended in numpy's traceback (2026-12-06)
    (["--global-batch", "10000000"], "argument --global-batch: expected an integer from 1 to 1,048,576"),
    (["--global-batch", "1e30"], "argument --global-batch: expected an integer, got '1e30'"),
    (["--prompt-length", "0"], "argument --prompt-length: expected an integer from 1"),
    (["--jobs", "0"], "--jobs: expected a positive number"),
    (["--engine-rebuild-s", "30"], "add --generation vllm"),
    (["--gpus", "1048576"], "at most 65,536"),
    (["--max-new-tokens-schedule", "0:100,200"], "expected STEP:CAP stages"),
    (["--max-new-tokens-schedule", "5:100"], "--max-new-tokens-schedule[0].at_step: the first stage starts at step 0"),
    (["--max-new-tokens-schedule", "0:400,1:100"], "a curriculum only raises the cap"),
    (["--max-new-tokens-schedule", "0:400,2:800"], "[1].at_step: 2 is not below steps=2"),
])
def test_simulate_refuses_bad_input_with_one_line(argv, says, capsys):
    """Each once ended in a traceback or ran on nonsense (a new user's trial, 2026-12-03)."""
    from launcher.cli import main

    try:
        rc = main(["simulate", "--model", "counting-tiny", "--gpus", "16", "--steps", "2", "--global-batch", "64",
                   *argv])
    except SystemExit as stop:   # argparse's own refusals
        rc = stop.code
    assert rc == 2
    assert says in capsys.readouterr().err


def test_simulate_out_must_be_a_directory(tmp_path, capsys):
    from launcher.cli import main

    (tmp_path / "file").write_text("x")
    assert main(["simulate", "--model", "counting-tiny", "--gpus", "16", "--steps", "2", "--global-batch", "64",
                 "--out", str(tmp_path / "file")]) == 2
    assert "exists and is not a directory" in capsys.readouterr().err


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_simulate_refuses_an_out_it_cannot_write_before_it_runs(tmp_path, capsys):
    """``--out /proc`` exists and is a directory, but no file can be made there: refused at once.
    A run whose files cannot be written still prints its table first (it ran to the end and
    lost everything with a traceback, 2026-12-06)."""
    from launcher.cli import main

    base = ["simulate", "--model", "counting-tiny", "--gpus", "16", "--steps", "2", "--global-batch", "64",
            "--policies", "frozen"]
    assert main(base + ["--out", "/proc"]) == 2
    assert "--out /proc: cannot write files in it" in capsys.readouterr().err
    (tmp_path / "run.json").mkdir()   # a name the run writes is taken by a directory
    assert main(base + ["--out", str(tmp_path)]) == 2
    captured = capsys.readouterr()
    assert "frozen-start" in captured.out and f"cannot write {tmp_path / 'run.json'} (Is a directory)" in captured.err


def test_a_restart_no_plan_holds_names_the_policy_step_and_length(capsys):
    """A ramp to 10^6 tokens: frozen-start's restart after its first out-of-memory step plans
    for the run's longest response, which nothing holds. The message said the current step's
    length (5,981 tokens, which fits) and no policy (a bad-input search, 2026-12-06)."""
    from launcher.cli import main

    assert main(["simulate", "--gpus", "16", "--steps", "10", "--policies", "frozen",
                 "--length-trace", "generated-ramp:100:1e6"]) == 2
    err = capsys.readouterr().err
    assert "frozen-start: step " in err and "no plan holds responses of 1010172 tokens" in err
    assert "cannot fit on 16 devices" in err   # the planner's: which model-stage and phase


def test_adaptive_policies_launch_on_the_frozen_plan_unless_their_memory_model_refuses_it():
    """The frozen baselines launch on the truth's best plan for the first step; the adaptive ones
    on it too when the controller's memory model holds it at the length its first boundary
    judges it at (the first step's with the lookahead's margin ``δ_len``), else on the
    controller's own launch plan for that length, which it holds."""
    from nereusd.control.problem import launch_for
    from nereusd.cost.memory import usable_bytes
    from nereusd.cost.model import CostModel
    from nereusd.planner.space import evaluate

    delta = parse_policy("nereus").control.delta_length
    refused = set()
    for memory_gib, lengths in ((140, (400.0, 800.0)), (20, (1200.0, 1300.0))):
        sim = Simulation(small_problem(memory_gib=memory_gib), LengthTrace("hand-made", lengths), CONSTANT, 2, QUIET)
        first = min(sim.max_response_length, math.ceil(lengths[0] * (1 + delta)))   # capped at max_new_tokens
        problem = dataclasses.replace(sim.problem, workload=dataclasses.replace(sim.problem.workload,
                                                                                response_length=first))
        usable = usable_bytes(problem.site.device_memory_bytes)
        fits = not evaluate(problem, sim.launch, CostModel(problem.site)).over_capacity(usable)
        adaptive = sim.launch_adaptive(delta)
        assert adaptive == (sim.launch if fits else launch_for(problem).plan)
        assert not evaluate(problem, adaptive, CostModel(problem.site)).over_capacity(usable)
        refused.add(not fits)
        nereus, frozen = sim.run(parse_policy("nereus")), sim.run(parse_policy("frozen-start"))
        assert nereus.layouts[nereus.plans[0]] == adaptive and frozen.layouts[frozen.plans[0]] == sim.launch
    assert refused == {False, True}   # both cases are exercised


def test_simulate_help_names_the_defaults_and_the_shipped_traces(monkeypatch):
    """A new user read no defaults and no trace names in ``simulate --help`` (2026-12-05)."""
    import argparse

    monkeypatch.setenv("COLUMNS", "400")   # argparse wraps at hyphens on a narrow terminal

    from launcher import simulate_cmd
    from nereusd.traces import LENGTH_TRACES

    parser = argparse.ArgumentParser()
    subparsers = parser.add_subparsers()
    simulate_cmd.register(subparsers)
    text = " ".join(subparsers.choices["simulate"].format_help().split())
    assert "(default: measured)" in text and "(default: llama-3.1-8b)" in text and "``" not in text
    assert all(name in text for name in LENGTH_TRACES), text


def test_simulate_warns_when_prompt_and_longest_response_exceed_the_model_context(capsys):
    """``plan`` warned that a shape exceeds the model's ``max_position`` (a job of it is refused
    at launch) and ``simulate`` ran it silently (a new user's trial, 2026-12-05)."""
    from launcher.cli import main

    base = ["simulate", "--model", "counting-tiny", "--gpus", "16", "--steps", "2", "--global-batch", "64",
            "--policies", "nereus", "--truth", "efficiency", "--site", "local"]
    assert main(base) == 0
    err = capsys.readouterr().err
    assert "exceed the actor model's max_position=160" in err and "refused at launch; the simulation runs it anyway" in err
    assert main(base + ["--prompt-length", "16", "--length-trace", "generated-ramp:20:60"]) == 0
    assert "max_position" not in capsys.readouterr().err


@pytest.mark.parametrize("kind, content, says", [
    ("length", "response_length_max\n12\nabc\n", "line 3: response_length_max 'abc' is not a number of tokens"),
    ("length", "response_length_max\n12\nnan\n", "'nan' is not a number of tokens from 1 to 16,777,216"),
    ("length", "response_length_max\n12\n-50\n", "'-50' is not a number of tokens from 1 to 16,777,216"),
    ("length", "response_length_max\n12\n1e-300\n", "'1e-300' is not a number of tokens from 1 to 16,777,216"),
    # accepted, then the simulation failed partway (an adversarial trial, 2026-12-07)
    ("length", "response_length_max\n12\n1e12\n", "'1e12' is not a number of tokens from 1 to 16,777,216"),
    # the default column is the step's longest response; a file of means says which to name
    ("length", "step,response_length_mean\n0,12\n", "no column 'response_length_max' (columns: ['step', "
                                                     "'response_length_mean']); name one with FILE.csv:COLUMN"),
    # an empty file read "no column … (columns: None)"; a repeated header took the last column (2026-12-06)
    ("length", "", "the file is empty (expected a header row"),
    ("length", "response_length_max,response_length_max\n12,500\n", "names column 'response_length_max' 2 times"),
    ("pool", '{"metadata": {"gap_seconds": 0}, "data": [1, 2]}', "gap_seconds must be a number of seconds from 1 to"),
    ("pool", '{"metadata": {"gap_seconds": "nan"}, "data": [1, 2]}', "gap_seconds must be a number of seconds"),
    ("pool", '{"metadata": {"gap_seconds": 5e-324}, "data": [1, 2]}', "gap_seconds must be a number of seconds"),
    ("pool", '{"metadata": {"gap_seconds": true}, "data": [1, 2]}', "gap_seconds must be a number of seconds"),
    ("pool", '{"metadata": {"gap_seconds": 60}, "data": []}', "data must be a non-empty list"),
    # integers past a float's range raised OverflowError in the finiteness check (2026-12-06)
    ("pool", '{"metadata": {"gap_seconds": 1' + "0" * 400 + '}, "data": [1, 2]}', "gap_seconds must be a number"),
    ("pool", '{"metadata": {"gap_seconds": 60}, "data": [1' + "0" * 400 + ', 1]}', "data must be a non-empty list"),
    ("pool", '{"metadata": {"gap_seconds": 60}, "data": [3, -1]}', "data must be a non-empty list of instance counts"),
    ("pool", '{"metadata": {"gap_seconds": 60}, "data": "1680"}', "data must be a non-empty list of instance counts"),
    ("pool", '{"metadata": {"gap_seconds": 60}, "data": [true, 8.7]}', "data must be a non-empty list of instance counts"),
    ("pool", '{"metadata": {"gap_seconds": 60}, "data": ' + "[" * 100000 + "]" * 100000 + "}",
     "expected {'metadata'"),
    # these quoted Python's exception text: "TypeError: list indices must be integers …" (2026-12-06)
    ("pool", '[1, 2]', "expected {'metadata': {'gap_seconds': S}, 'data': [instance counts]}, got a list"),
    ("pool", '{"metadata": {}, "data": [1]}', "no metadata.gap_seconds"),
    ("pool", '{bad', "not valid JSON"),
])
def test_a_malformed_trace_file_is_refused_naming_it(tmp_path, kind, content, says, capsys):
    """Trace files were read unchecked: a value ``abc`` or ``nan`` in a length trace, and a pool
    trace's zero gap or empty data, ended in tracebacks; negative values ran (a bad-input search,
    2026-12-05)."""
    from launcher.cli import main

    path = tmp_path / ("trace.csv" if kind == "length" else "trace.json")
    path.write_text(content)
    assert main(["simulate", "--model", "counting-tiny", "--site", "local", "--truth", "efficiency", "--gpus", "4",
                 "--steps", "3", f"--{kind}-trace", str(path)]) == 2
    err = capsys.readouterr().err
    assert says in err and path.name in err


def test_a_trace_file_written_with_a_byte_order_mark_reads(tmp_path):
    """A spreadsheet's UTF-8 BOM made the first column's name '\\ufeffresponse_length_mean' (a
    bad-input search, 2026-12-05)."""
    from nereusd.traces import load_length_trace, load_pool_trace

    csv_path = tmp_path / "lengths.csv"
    csv_path.write_bytes("response_length_max,step\r\n100,0\r\n120,1\r\n".encode("utf-8-sig"))
    assert load_length_trace(str(csv_path)).response_lengths == (100.0, 120.0)
    # a colon in a directory's name: the column follows the last one (a verification trial)
    colon = tmp_path / "a:b"
    colon.mkdir()
    (colon / "m.csv").write_text("step,response_length_mean\n0,7\n")
    assert load_length_trace(f"{colon / 'm.csv'}:response_length_mean").response_lengths == (7.0,)
    pool_path = tmp_path / "pool.json"
    pool_path.write_bytes('{"metadata": {"gap_seconds": 300}, "data": [16, 8.0]}'.encode("utf-8-sig"))
    assert load_pool_trace(str(pool_path)).fractions == (1.0, 0.5)


def test_the_table_says_what_its_comparison_columns_need_and_when_they_mean_little():
    """A new user's ``--policies nereus,greedy,oracle`` printed empty comparison columns without a
    word, and a 0.2 % headroom read ``captured -7440`` (a new-user trial, 2026-12-05)."""
    from nereusd.sim.report import NOISY_HEADROOM_PCT, format_table

    def row(policy, mean, headroom, captured):
        return {"policy": policy, "mean_step_s": mean, "total_s": 100 * mean, "switches": 0, "transition_s": 0.0,
                "transition_share_pct": 0.0, "oom_events": 0, "restarts": 0, "stall_s": 0.0,
                "vs_best_frozen_pct": None if headroom is None else 0.0, "oracle_headroom_pct": headroom,
                "captured_pct": captured}

    without = format_table([row("nereus", 10.0, None, None), row("oracle", 9.9, None, None)])
    assert "needs a frozen baseline in --policies" in without
    frozen_only = format_table([{**row("frozen-start", 10.0, None, None), "vs_best_frozen_pct": 0.0}])
    assert "captured % needs the oracle" in frozen_only and "needs a frozen" not in frozen_only
    noisy = format_table([row("frozen-start", 10.0, 0.2, 0.0), row("oracle", 9.98, 0.2, 100.0)])
    assert "oracle headroom over the better frozen baseline: 0.2 %" in noisy and "means little" in noisy
    clear = format_table([row("frozen-start", 10.0, 2 * NOISY_HEADROOM_PCT, 0.0), row("oracle", 9.8, 2.0, 100.0)])
    assert "means little" not in clear and "needs a frozen" not in clear and "faster than the oracle" not in clear
    # on a pool that flaps every step the oracle pays restarts it did not plan against: a policy
    # beat it and read "captured 164 %" without a word (a bad-input search, 2026-12-06)
    beaten = format_table([row("frozen-start", 10.0, 2.0, 0.0), row("nereus", 9.6, 2.0, 164.0),
                           row("oracle", 9.8, 2.0, 100.0)])
    assert "(nereus ran faster than the oracle" in beaten and "no bound" in beaten


def test_simulate_warns_on_stderr_when_the_length_trace_repeats(tmp_path, capsys):
    """A 5-row trace under ``--steps 8`` ran on repeats without a word; with ``--json`` the
    warnings go to stderr, so stdout stays one JSON object (a new-user trial, 2026-12-05)."""
    import json

    from launcher.cli import main

    trace = tmp_path / "short.csv"
    trace.write_text("step,response_length_max\n" + "".join(f"{i},{40 + 10 * i}\n" for i in range(5)))
    assert main(["simulate", "--model", "counting-tiny", "--gpus", "16", "--steps", "8", "--global-batch", "64",
                 "--length-trace", str(trace), "--policies", "frozen,nereus", "--json"]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["summary"]
    assert "the length trace has 5 steps, fewer than --steps 8" in out.err


def test_a_simulated_clock_that_runs_away_is_an_error_not_a_full_memory():
    """Contention episodes are drawn up to each step's simulated time; a clock at 10¹⁵ s (``simulate
    --noise 100`` did that) drew them until the kernel killed the process at 24 GB."""
    from nereusd.errors import ConfigError
    from nereusd.sim.truth import GroundTruth

    truth = GroundTruth(small_problem(), TruthConfig(contention_per_h=3600.0, contention_mean_h=1 / 3600))
    assert truth.contended(3600.0) in (True, False)
    with pytest.raises(ConfigError, match="the clock has run away"):
        truth.contended(1e15)


def test_a_length_curriculum_cuts_the_trace_and_the_controller_plans_for_each_stage_cap():
    """``--max-new-tokens-schedule``: the ramp (how long the responses want to be) is cut at each
    step's stage cap; the controller is told the caps, as a live job's is: after a step cut at
    its cap it plans the next stage's first step for the new cap, so no policy that adapts runs
    out of memory at the stage boundary, and the frozen-final baseline holds the last cap."""
    from nereusd.sim.scenario import Scenario, build

    sim, meta = build(Scenario(model="counting-tiny", gpus=16, steps=40, global_batch=64,
                               length_trace="generated-ramp:200:2000", max_new_tokens_schedule=((0, 300), (20, 1200))),
                      QUIET)
    lengths = [sim.lengths.at(i) for i in range(40)]
    assert max(lengths[:20]) == 300 and lengths[19] == 300 and 300 < max(lengths[20:]) <= 1200
    assert sim.max_response_length == 1200 and meta["length_trace_steps"] == 40
    assert "cut by the curriculum 300 from step 0, 1200 from step 20" in meta["length_trace"]
    res = sim.run(parse_policy("nereus"))
    check_books(res)
    assert res.oom_events == 0
    assert sim.response_cap(19) == 300 and sim.response_cap(20) == 1200


def test_runs_of_one_policy_under_several_seeds_pool_into_one():
    """``PolicyResult.pooled`` (``bench_sim.py --seeds``): the pooled mean step is the mean of the
    runs' mean steps, seconds and switches add up, and every record still names its own plan."""
    from nereusd.sim.results import PolicyResult
    from nereusd.sim.report import summary

    lengths = load_length_trace("generated-ramp:256:1024", 12)
    runs = {name: [Simulation(small_problem(), lengths, CONSTANT, 12,
                              dataclasses.replace(QUIET, seed=seed, noise_sigma=0.05)).run(parse_policy(name))
                   for seed in (0, 1)] for name in ("frozen-final", "nereus", "oracle")}
    pooled = {name: PolicyResult.pooled(rs) for name, rs in runs.items()}
    for name, rs in runs.items():
        p = pooled[name]
        assert p.steps == 24 and len(p.records) == sum(len(r.records) for r in rs)
        assert p.mean_step_s == pytest.approx(sum(r.mean_step_s for r in rs) / 2)
        assert p.total_s == pytest.approx(sum(r.total_s for r in rs))
        assert p.switches == sum(r.switches for r in rs)
        assert [p.plans[x.plan_id] for x in p.records] == [r.plans[x.plan_id] for r in rs for x in r.records]
    assert runs["nereus"][0].mean_step_s != runs["nereus"][1].mean_step_s   # the seed matters
    rows = {r["policy"]: r for r in summary(list(pooled.values()))}
    best = pooled["frozen-final"].mean_step_s
    assert rows["nereus"]["vs_best_frozen_pct"] == pytest.approx(100 * (pooled["nereus"].mean_step_s / best - 1))
    with pytest.raises(ValueError, match="runs of one policy"):
        PolicyResult.pooled([runs["nereus"][0], runs["oracle"][0]])
    with pytest.raises(ValueError, match="runs of one policy"):
        PolicyResult.pooled([])


@pytest.mark.parametrize("jobs", [1, 2])
def test_run_policies_reports_each_policy_as_it_completes(jobs):
    """``simulate``'s progress: ``on_done`` gets every policy's result once (the oracle's last: it
    ranks the others' plans), and the results still come back in the order asked."""
    from nereusd.sim.scenario import Scenario, build, run_policies

    sim, _ = build(Scenario(model="counting-tiny", gpus=4, site="local", steps=6, global_batch=16,
                            length_trace="generated-ramp:20:60"), QUIET)
    policies = parse_policies("oracle,frozen,nereus")
    seen = []
    results = run_policies(sim, policies, jobs=jobs, on_done=lambda r: seen.append(r.policy.name))
    assert [r.policy.name for r in results] == ["oracle", "frozen-start", "nereus"]
    assert sorted(seen[:2]) == ["frozen-start", "nereus"] and seen[2] == "oracle"


def test_weight_sync_groups_of_plans_assessed_scaled_are_not_planned_and_nothing_changes(monkeypatch, capsys):
    """The simulator's transition estimator skips the weight-sync groups of a plan over its
    ``max_devices`` (they are never read: every transition from or to it is assessed scaled);
    planning them took 22 s of a one-step simulation at 4,096 GPUs. A replay over a pool trace at
    64 GPUs (scale limit 32: switches and pool changes on plans above it) decides the same with
    and without the groups planned."""
    import json

    from launcher.cli import main
    from nereusd.transition import sync_communicator_plan
    from nereusd.transition.estimate import TransitionEstimator

    argv = ["simulate", "--gpus", "64", "--steps", "40", "--pool-trace", "us-east-2b", "--policies",
            "frozen,nereus,greedy", "--json"]
    assert main(argv) == 0
    skipped = json.loads(capsys.readouterr().out)
    planned = []

    def every_plan(self, plan):
        planned.append(len(plan.devices()))
        return sync_communicator_plan(plan, self.specs, devices_per_node=self.site.devices_per_node)

    monkeypatch.setattr(TransitionEstimator, "sync_plan", every_plan)
    assert main(argv) == 0
    full = json.loads(capsys.readouterr().out)
    assert any(n > 32 for n in planned)   # the run had plans over the limit
    for out in (skipped, full):
        out.pop("wall_s", None)
    assert skipped == full
