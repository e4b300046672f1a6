"""End to end, a ZeRO training model-stage on DeepSpeed adapts live and trains like ZeRO-0.

Two jobs run side by side with the same seed, the same forced switches and the same pool
schedule: actor training on the native engine (ZeRO-0) and on DeepSpeed ZeRO-1. The switches
take the ZeRO model-stage from dp 2 to dp 1 (the leaving replica's optimizer partition is
sent to the remaining one before it is released), back to dp 2 on the reversed devices (a
joining replica receives parameters and its partition, straight from the old replica:
``emu.engine.zero_repartition``), to ZeRO-2 with a smaller micro-batch (an engine
change without a layout change), then dp 1 → 2 → 1 (ZeRO engines built and released in turn:
their one-rank process groups once collided by name after such a sequence). Per step the two jobs draw the same samples and rewards, and their losses
and gradient norms agree within reduction tolerance over 20 steps.
"""

from __future__ import annotations

import json

import pytest

from nereusd.journal import read_jsonl
from tests.support.deepspeed import requires_deepspeed
from tests.support.e2e import assert_trains_alike, finish, processes_mentioning, start, write_job

pytestmark = [pytest.mark.slow, requires_deepspeed]

JOB = """
name: e2e-zero-@NAME@
algorithm: grpo
seed: 11
steps: 20
devices: 2
models: {actor: "@WARMSTART@"}
rollout: {prompts_per_step: 2, group_size: 4, max_new_tokens: 12}
train: {global_batch: 8, micro_batch: 4, kl_coef: 0.05}
backends: {actor/training: @BACKEND@}
plan: {default: {tp: 1, pp: 1}}
adaptation:
  enabled: true
  payback_margin: 0.0
  forced:
    - {at_step: 4, model_stages: {actor/training: {devices: [0]}}}
    - {at_step: 8, model_stages: {actor/training: {devices: [1, 0]}}}
    - {at_step: 12, model_stages: {actor/training: {micro_batch: 2@ZERO2@}}}
    - {at_step: 15, model_stages: {actor/training: {devices: [0]}}}
    - {at_step: 17, model_stages: {actor/training: {devices: [0, 1]}}}
    - {at_step: 19, model_stages: {actor/training: {devices: [0]}}}
"""


def test_zero1_job_adapts_and_trains_like_zero0(tmp_path):
    jobs = {
        "zero0": write_job(tmp_path, "zero0", JOB.replace("@NAME@", "0").replace("@BACKEND@", "native")
                           .replace("@ZERO2@", "")),
        "zero1": write_job(tmp_path, "zero1", JOB.replace("@NAME@", "1").replace("@BACKEND@", "deepspeed")
                           .replace("@ZERO2@", ", zero_stage: 2")),
    }
    procs = {name: start(path, tmp_path / name) for name, path in jobs.items()}
    for name, proc in procs.items():
        finish(proc, tmp_path / name, timeout_s=600)
    a, b = (read_jsonl(tmp_path / n / "metrics.jsonl") for n in ("zero0", "zero1"))
    assert len(a) == len(b) == 20
    assert_trains_alike(a, b)
    plans = [r["plan"]["actor/training"] for r in b]
    assert plans[0].get("zero_stage") == 1 and plans[-1].get("zero_stage") == 2, (plans[0], plans[-1])
    assert {p["dp"] for p in plans} == {1, 2}
    summary = json.loads((tmp_path / "zero1" / "summary.json").read_text())
    assert summary["status"] == "succeeded" and summary["backends"]["actor/training"] == "deepspeed"
    events = read_jsonl(tmp_path / "zero1" / "events.jsonl")
    moves = [e for e in events if e["event"] == "transition"]
    assert len(moves) >= 6
    # ZeRO to ZeRO: the optimizer partitions moved between the replica sets (emu.engine.zero_repartition)
    assert all(e["phases_s"]["repartition"] > 0 for e in moves), [e["phases_s"] for e in moves]
    assert processes_mentioning(str(tmp_path / "zero1")) == []
