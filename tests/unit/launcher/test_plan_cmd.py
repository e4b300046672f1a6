"""``nereus-launch plan``: table, JSON and infeasible output."""

from __future__ import annotations

import json

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
    assert "actor/training cannot fit on 8 devices" in err and "GiB short" in err


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
