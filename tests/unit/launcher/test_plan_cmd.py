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
