"""``nereus-launch plan``: table, JSON and infeasible output."""

from __future__ import annotations

import json

import pytest

from launcher.cli import main


def test_plan_json(capsys):
    rc = main(["plan", "--model", "llama-3.1-8b", "--algorithm", "ppo", "--site", "site_configs/h200-ib.yaml",
               "--gpus", "64", "--prompt-length", "512", "--response-length", "8192", "--global-batch", "1024",
               "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert {"plan", "predicted_step_latency_s", "search_time_ms"} <= set(out)
    assert len(out["plan"]) == 7 and out["predicted_step_latency_s"] > 0
    for row in out["plan"]:
        assert row["peak_memory_gib"] <= row["capacity_gib"]
        assert len(row["devices"]) == row["tp"] * row["pp"] * row["dp"]


def test_plan_table(capsys):
    rc = main(["plan", "--model", "counting-tiny", "--algorithm", "grpo", "--site", "local", "--gpus", "4",
               "--prompt-length", "16", "--response-length", "32", "--global-batch", "16"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "actor/generation" in out and "predicted step latency:" in out and "search time:" in out


def test_plan_infeasible(capsys):
    rc = main(["plan", "--model", "llama-3.3-70b", "--site", "h200-ib", "--gpus", "8", "--global-batch", "64"])
    err = capsys.readouterr().err
    assert rc == 1
    assert "actor/training (training phase) cannot fit on 8 devices" in err and "GiB short" in err
    assert "would fit with 32 devices" in err


def test_plan_names_the_flag_workloads_checks_refuse(capsys):
    """The workload's own checks (positive sizes, mini-batches dividing the global batch) speak
    in the flags' names."""
    args = ["plan", "--model", "counting-tiny", "--algorithm", "grpo", "--site", "local", "--gpus", "4",
            "--prompt-length", "16", "--response-length", "32"]
    assert main(args + ["--global-batch", "100", "--mini-batches", "3"]) == 2
    assert "error: --mini-batches: 3 does not divide --global-batch 100" in capsys.readouterr().err


def test_plan_warns_when_a_sequence_is_longer_than_the_models_context(capsys):
    """counting-tiny holds 160 positions; 100 + 100 tokens do not fit (the plan is still shown), 16 + 32 do."""
    args = ["plan", "--model", "counting-tiny", "--algorithm", "grpo", "--site", "local", "--gpus", "4",
            "--global-batch", "16"]
    assert main(args + ["--prompt-length", "100", "--response-length", "100"]) == 0
    err = capsys.readouterr().err
    assert "warning: --prompt-length 100 plus --response-length 100 exceeds" in err
    assert "max_position=160" in err
    assert main(args + ["--prompt-length", "100", "--response-length", "100", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["warnings"]) == 1 and "max_position=160" in out["warnings"][0]
    assert main(args + ["--prompt-length", "16", "--response-length", "32", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["warnings"] == []
    # a micro-batch past the step's sequences was clamped without a word (2026-12-06)
    assert main(args + ["--prompt-length", "16", "--response-length", "32", "--micro-batch", "999", "--json"]) == 0
    [warning] = json.loads(capsys.readouterr().out)["warnings"]
    assert warning.startswith("--micro-batch 999 exceeds the 16 sequences of an optimizer step")


def test_plan_zero_lets_training_use_zero_at_tp_pp_1(capsys):
    """The README's ZeRO case: with --zero the planner moves actor training to tp 1 ZeRO and the
    step gets faster; without it every stage is ZeRO-0."""
    args = ["plan", "--model", "qwen2.5-3b", "--algorithm", "ppo", "--site", "site_configs/a100-ib.yaml",
            "--gpus", "8", "--prompt-length", "512", "--response-length", "512", "--global-batch", "256", "--json"]
    assert main(args) == 0
    base = json.loads(capsys.readouterr().out)
    assert main(args + ["--zero"]) == 0
    zero = json.loads(capsys.readouterr().out)
    assert all(r["zero_stage"] == 0 for r in base["plan"])
    rows = {r["model_stage"]: r for r in zero["plan"]}
    assert rows["actor/training"]["zero_stage"] in (1, 2)
    assert (rows["actor/training"]["tp"], rows["actor/training"]["pp"]) == (1, 1)
    assert all(r["zero_stage"] == 0 for r in zero["plan"] if not r["model_stage"].endswith("training"))
    assert zero["predicted_step_latency_s"] < base["predicted_step_latency_s"]
    assert main(args[:-1] + ["--zero"]) == 0
    assert " zero " in capsys.readouterr().out.splitlines()[0]


def test_compact_plan_marks_zero():
    from launcher.progress import compact_plan

    assert compact_plan({"actor/training": {"tp": 1, "pp": 1, "dp": 4, "zero_stage": 1},
                         "actor/generation": {"tp": 2, "pp": 1, "dp": 2}}) == "aT1·1·4z1 aG2·1·2"


@pytest.mark.parametrize("model, algorithm, prompt, response, batch", [("qwen2.5-3b", "ppo", 512, 512, 256),
                                                                        ("qwen2.5-1.5b", "grpo", 1024, 2048, 1024)])
def test_plan_zero_1_on_a_pcie_site_is_the_readme_case(capsys, model, algorithm, prompt, response, batch):
    """README's ZeRO planner table, PCIe rows: on 8 L40S without NVLink, ZeRO-1 alone (``--zero 1``)
    lets a training model-stage drop tensor parallelism, and the predicted step is ≥ 20 % faster."""
    args = ["plan", "--model", model, "--algorithm", algorithm, "--site", "l40s-pcie", "--gpus", "8",
            "--prompt-length", str(prompt), "--response-length", str(response), "--global-batch", str(batch),
            "--json"]
    assert main(args) == 0
    base = json.loads(capsys.readouterr().out)
    assert main(args + ["--zero", "1"]) == 0
    zero = json.loads(capsys.readouterr().out)
    assert {r["zero_stage"] for r in zero["plan"]} == {0, 1} and zero["zero_stages"] == [1] and base["zero_stages"] == []
    assert all(r["tp"] == r["pp"] == 1 for r in zero["plan"] if r["zero_stage"])
    assert base["predicted_step_latency_s"] >= 1.2 * zero["predicted_step_latency_s"]


@pytest.mark.parametrize("value", ["3", "0", ""])
def test_plan_zero_names_bad_stages(capsys, value):
    with pytest.raises(SystemExit) as exit_:
        main(["plan", "--model", "qwen2.5-3b", "--site", "l40s-pcie", "--gpus", "8", "--zero", value])
    assert exit_.value.code == 2
    assert f"ZeRO stages are 1 and 2, got {value!r}" in capsys.readouterr().err


@pytest.mark.parametrize("delta_l_s, says", [(1.3, "predicted 1.30 s/step faster"), (-2.29, "predicted 2.29 s/step slower"),
                                             ("inf", "predicted the current plan cannot run")])
def test_an_admitted_switch_says_which_way_the_step_moves(delta_l_s, says):
    """The progress line of an admitted switch says faster or slower in words (it printed a signed
    ΔL, and a new user could not tell which sign was faster)."""
    from launcher.progress import describe_event

    line = describe_event({"event": "admission", "verdict": "admit", "step": 1, "delta_l_s": delta_l_s,
                           "l_tran_s": 0.11, "triggers": [{"signal": "peak_memory", "urgent": True}],
                           "current_plan": {}, "target_plan": {}})
    assert line == f"nereus: step 1: switch admitted [peak_memory (urgent)]: placement ({says}, L_tran 0.11 s)"


def test_a_missing_calibration_file_is_an_error_not_the_priors(tmp_path, capsys):
    """``--calibration`` naming no file once fell back to the priors silently (a misspelt path)."""
    args = ["plan", "--model", "qwen2.5-1.5b", "--site", "l40s-pcie", "--gpus", "8"]
    assert main(args + ["--calibration", str(tmp_path / "nope.json")]) == 2
    assert "no such file" in capsys.readouterr().err
    assert main(args + ["--calibration", str(tmp_path)]) == 2


def test_report_on_a_file_says_it_is_not_a_run_directory(tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    assert main(["report", str(tmp_path / "afile")]) == 2
    assert "not a run directory" in capsys.readouterr().err


def test_report_out_that_is_a_file_or_cannot_be_made_is_one_line(tmp_path, capsys):
    """Both were FileExistsError / FileNotFoundError tracebacks (an adversarial helper, 2026-12-05);
    ``simulate --out`` said it in one line, and now both say it with one function."""
    (tmp_path / "metrics.jsonl").write_text("")
    (tmp_path / "afile").write_text("x")
    assert main(["report", str(tmp_path), "--out", str(tmp_path / "afile")]) == 2
    assert "afile: exists and is not a directory" in capsys.readouterr().err
    assert main(["report", str(tmp_path), "--out", str(tmp_path / "afile" / "sub")]) == 2
    assert "cannot create it" in capsys.readouterr().err


@pytest.mark.parametrize("record", ['{"reward_mean": 1.0}', '{"step": 0, "stage_latency_s": "x"}'])
def test_report_on_a_journal_nereusd_did_not_write_is_one_clear_line(tmp_path, capsys, record):
    """JSON records of another shape (an edited journal) got tracebacks from the plotting
    (KeyError, AttributeError; an adversarial helper, 2026-12-05)."""
    (tmp_path / "metrics.jsonl").write_text(record + "\n")
    assert main(["report", str(tmp_path), "--out", str(tmp_path / "plots")]) == 2
    err = capsys.readouterr().err
    assert "is not one nereusd writes" in err and "Traceback" not in err


def test_a_rule_based_reward_plans_no_reward_model_stage(capsys):
    """GRPO on a verifier (the counting and gsm8k tasks) has no reward model: ``--reward-model
    none`` plans what such a job launches, where the default plans a reward model-stage too."""
    args = ["plan", "--model", "counting-tiny", "--algorithm", "grpo", "--site", "local", "--gpus", "4",
            "--prompt-length", "8", "--response-length", "32", "--global-batch", "16", "--json"]
    assert main(args) == 0
    stages = {r["model_stage"] for r in json.loads(capsys.readouterr().out)["plan"]}
    assert "reward/inference" in stages
    assert main(args + ["--reward-model", "none"]) == 0
    stages = {r["model_stage"] for r in json.loads(capsys.readouterr().out)["plan"]}
    assert stages == {"actor/generation", "actor/inference", "reference/inference", "actor/training"}


def test_a_job_file_given_as_the_model_is_named_as_such(capsys):
    assert main(["plan", "--model", "examples/counting_grpo.yaml", "--site", "local", "--gpus", "4"]) == 2
    err = capsys.readouterr().err
    assert "a YAML file" in err and "does not read job files" in err


def test_generation_vllm_plans_the_engines_memory(capsys):
    """``--generation vllm`` holds each replica's engine weight copy and preallocated KV cache,
    as a job on vLLM does; on this memory-tight case it changes the predicted step."""
    args = ["plan", "--model", "qwen2.5-7b", "--site", "a100-ib", "--gpus", "8", "--algorithm", "grpo",
            "--reward-model", "none", "--prompt-length", "1024", "--response-length", "4096", "--json"]
    out = {}
    for engine in ("native", "vllm"):
        assert main(args + ["--generation", engine]) == 0
        out[engine] = json.loads(capsys.readouterr().out)
        assert out[engine]["generation"] == engine
    assert out["vllm"]["predicted_step_latency_s"] != out["native"]["predicted_step_latency_s"]


@pytest.mark.parametrize("gpus", ["0", "1000000000"])
def test_plan_refuses_a_pool_out_of_range(gpus, capsys):
    """``--gpus 10**9`` was killed for its memory (a bad-input search, 2026-12-05)."""
    assert main(["plan", "--model", "counting-tiny", "--site", "local", "--gpus", gpus]) == 2
    assert "--gpus must be between 1 and 65,536" in capsys.readouterr().err


def test_long_names_and_binary_files_get_one_line_errors(tmp_path, capsys):
    """A name too long for the file system (``OSError``) or a file that is not UTF-8
    (``UnicodeDecodeError``) ended in a traceback (a bad-input search, 2026-12-05)."""
    long = "x" * 300
    binary = tmp_path / "bin.json"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_bytes(b"\xff\xfe\x00")
    base = ["plan", "--model", "counting-tiny", "--site", "local", "--gpus", "4"]
    for argv, says in ((["--site", long], "File name too long"), (["--model", long], "File name too long"),
                       (["--calibration", str(tmp_path / long)], "File name too long"),
                       (["--calibration", str(binary)], "not UTF-8 text"),
                       (["--model", str(binary)], "not UTF-8 text"), (["--model", str(model_dir)], "not UTF-8 text")):
        assert main(base + argv) == 2, argv
        err = capsys.readouterr().err
        assert says in err and "Traceback" not in err, (argv, err)


def test_plan_takes_a_jobs_device_memory_and_shows_small_devices_in_mib(capsys):
    """The demo's devices have 58 MiB (its job's ``memory_gib``); ``plan`` could not set it, and
    printed every peak on the local site as 0.0 GiB (a new user's trial, 2026-12-05). With
    ``--memory-gib`` it plans the demo's final layout: actor training ``pp2·dp2`` at micro-batch 4
    (README "Live adaptation")."""
    argv = ["plan", "--model", "examples/models/counting-warmstart", "--site", "local", "--gpus", "4",
            "--algorithm", "grpo", "--reward-model", "none", "--global-batch", "64", "--micro-batch", "16",
            "--prompt-length", "5", "--response-length", "96", "--memory-gib", "0.0566"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "device peak / capacity MiB" in out and "/ 58.0" in out
    training = next(line for line in out.splitlines() if line.startswith("actor/training"))
    assert training.split()[1:5] == ["1", "2", "2", "4"]
    assert main(argv[:-1] + ["-1"]) == 2
    assert "--memory-gib must be a number of GiB" in capsys.readouterr().err


def test_a_pool_too_small_for_concurrent_model_stages_names_a_lower_bound(capsys):
    """The bound is necessary, not sufficient: a user read "need at least 8 devices" as enough,
    and 8 did not fit (a new user's trial, 2026-12-05)."""
    assert main(["plan", "--model", "counting-tiny", "--site", "local", "--gpus", "1", "--async",
                 "--prompt-length", "8", "--response-length", "32", "--global-batch", "16"]) == 1
    err = capsys.readouterr().err
    assert "run concurrently on disjoint devices" in err and "(a lower bound: more may be needed)" in err
    assert "the pool has 1" in err and "would fit with 8 devices" in err


def test_more_devices_are_suggested_from_the_next_whole_node(capsys):
    """On 3 of the local site's 4-device node, 4 devices fit; the suggestion said 8 (a bad-input
    search, 2026-12-05)."""
    assert main(["plan", "--model", "counting-tiny", "--site", "local", "--gpus", "3"]) == 1
    assert "would fit with 4 devices" in capsys.readouterr().err
    assert main(["plan", "--model", "counting-tiny", "--site", "local", "--gpus", "4"]) == 0


def test_plan_given_a_job_file_says_it_reads_none(capsys, tmp_path):
    """``plan JOB.yaml`` said only that --model, --site and --gpus are required; it now names the
    file and what to give instead. A site YAML as --site's value is still a site."""
    with pytest.raises(SystemExit) as exit_:
        main(["plan", "examples/counting_grpo.yaml"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "examples/counting_grpo.yaml: plan reads no job file; give the job's --model, --site and --gpus" in err
    assert main(["plan", "--site", "site_configs/local.yaml", "--model", "counting-tiny", "--gpus", "4",
                 "--algorithm", "grpo", "--prompt-length", "5", "--response-length", "32", "--global-batch", "16"]) == 0
    assert "predicted step latency:" in capsys.readouterr().out


def test_the_cli_prints_its_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith("nereus-launch 0.")


def test_report_draws_a_long_runs_stage_latencies_as_areas(tmp_path, monkeypatch):
    """A bar per step and stage took 145 s and 1.4 GB for a 20,000-step run (an adversarial
    trial, 2026-12-07): past ``MAX_BARS`` steps the stages are stacked areas, one patch each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.axes

    from launcher import report

    monkeypatch.setattr(report, "MAX_BARS", 5)
    line = {"reward_mean": 1.0, "response_length_mean": 4.0, "step_latency_s": 1.0, "plan": {},
            "stage_latency_s": {"generation": 0.5, "training": 0.4}, "peak_memory_bytes": {"0": 1}}
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({**line, "step": s}) + "\n" for s in range(8)))
    drawn = []
    for kind in ("bar", "stackplot"):
        real = getattr(matplotlib.axes.Axes, kind)
        monkeypatch.setattr(matplotlib.axes.Axes, kind,
                            lambda self, *a, _real=real, _kind=kind, **kw: drawn.append(_kind) or _real(self, *a, **kw))
    written = report.write_plots(tmp_path, tmp_path / "plots")
    assert drawn == ["stackplot"] and (tmp_path / "plots" / "stage_latency.png") in written
    drawn.clear()
    monkeypatch.setattr(report, "MAX_BARS", 500)
    report.write_plots(tmp_path, tmp_path / "plots")
    assert drawn == ["bar", "bar"]   # a short run keeps a bar per step and stage


def test_the_plan_timeline_marks_the_switches_that_ran_not_the_admissions():
    """``report`` marked every admitted switch: one whose step was interrupted showed, one
    admitted again after the resume showed twice, and a checkpoint restart not at all (a new
    user's trial, 2026-12-07). A rebuild on the same plan is no switch; a resume from a checkpoint
    is marked as the restart ``summary.json`` counts, one that re-ran nothing is not."""
    from launcher.report import switches_ran

    admit = {"event": "admission", "verdict": "admit", "triggers": [{"signal": "sequence_length"}]}
    events = [{**admit, "step": 3},   # interrupted: never ran
              {"event": "nereusd_resumed", "mode": "checkpoint", "step": 2, "checkpoint": "/r/checkpoints/step000002",
               "dropped_metrics": [2, 3]},
              {"event": "checkpoint_loaded", "dir": "/r/checkpoints/step000002", "step": 2, "dropped_metrics": [2, 3]},
              {"event": "nereusd_started"},   # interrupted before its checkpoint loaded: re-ran nothing
              {"event": "nereusd_resumed", "mode": "checkpoint", "step": 2, "checkpoint": "/r/checkpoints/step000002",
               "dropped_metrics": [2, 3]},
              {"event": "nereusd_started"},
              {"event": "nereusd_resumed", "mode": "checkpoint", "step": 0, "checkpoint": None, "dropped_metrics": []},
              {**admit, "step": 3, "triggers": [{"signal": "memory"}]},
              {"event": "transition", "step": 3, "from_plan": {"a": 1}, "to_plan": {"a": 2}},
              {"event": "transition", "step": 5, "from_plan": {"a": 2}, "to_plan": {"a": 2}, "why": "rebuild"},
              {"event": "fallback", "action": "checkpoint_restart", "step": 8, "reason": "lost device 1"},
              {"event": "fallback", "action": "none", "step": 9, "reason": "x"}]
    assert switches_ran(events) == [(1.5, "restart", "step 2: resumed from step000002"),
                                    (3.5, "transition", "after step 3 (memory)"),
                                    (7.5, "restart", "step 8: checkpoint restart (lost device 1)")]


def test_plan_refuses_a_critic_its_algorithm_lacks_and_simulate_plans_without_a_reward_model(capsys, tmp_path):
    """``plan --algorithm grpo --critic-model`` was silently ignored, where a job file refuses
    ``models.critic``; ``simulate`` planned a reward model-stage the counting and gsm8k jobs do not
    have, with no ``--reward-model none`` (an adversarial trial, 2026-12-07)."""
    rc = main(["plan", "--model", "counting-tiny", "--site", "local", "--gpus", "4", "--algorithm", "grpo",
               "--critic-model", "counting-tiny"])
    assert rc != 0 and "--critic-model: grpo has no critic; leave it out" in capsys.readouterr().err
    out = tmp_path / "sim"
    rc = main(["simulate", "--model", "counting-tiny", "--site", "local", "--gpus", "4", "--steps", "3",
               "--policies", "frozen,nereus", "--algorithm", "grpo", "--reward-model", "none", "--truth", "efficiency",
               "--out", str(out)])
    run = json.loads((out / "run.json").read_text())
    assert rc == 0 and "reward/inference" not in json.dumps(run["launch_plan"]) and run["reward_model"] is False
    assert "actor/generation" in json.dumps(run["launch_plan"])
