"""Pool changes of a local job at given steps or times and from a spot-availability trace scaled to
the local pool (``nereusd.config.pool_schedule``, ``pool:`` in the job YAML, ``nereus-launch local
--pool-trace``): the conversion, the validation, and one short local job driven by a compressed
trace that loses a device and gets one back.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import pytest

from launcher.cli import build_parser
from launcher.pool_trace import pool_trace_override
from launcher.progress import describe_event
from nereusd.config.job import parse_job
from nereusd.config.pool import PoolConfig
from nereusd.errors import ConfigError, NereusError
from nereusd.journal import read_jsonl
from nereusd.config.pool_schedule import PoolSchedule, ScaledTrace, net_change
from nereusd.traces import SPOT_DIR

from tests.support import REPO
from tests.support.e2e import assert_join_decided
WARMSTART = REPO / "examples" / "models" / "counting-warmstart"


def pool(**data) -> PoolConfig:
    return parse_job({"pool": data}, "j.yaml").pool


def raw_counts(name: str) -> list[int]:
    """The shipped file's samples, rotated like the loader: hour 0 is the first full sample."""
    counts = json.loads((SPOT_DIR / f"{name}_v100_1.json").read_text())["data"]
    first = counts.index(max(counts))
    return counts[first:] + counts[:first]


# ---------------------------------------------------------------------------- validation
def test_schedule_entries_need_exactly_one_of_at_step_and_at_s():
    p = pool(schedule=[{"at_s": 12.5, "remove": 1}, {"at_step": 3, "add": 1}])
    assert p.schedule[0].at_s == 12.5 and p.schedule[0].at_step is None and p.schedule[1].at_step == 3
    for entry in ({"remove": 1}, {"at_step": 2, "at_s": 3, "remove": 1}):
        with pytest.raises(ConfigError, match=r"j.yaml: pool.schedule\[0\]: give exactly one of at_step .* or at_s"):
            pool(schedule=[entry])
    with pytest.raises(ConfigError, match=r"j.yaml: pool.schedule\[0\].at_s: .*greater than or equal to 0"):
        pool(schedule=[{"at_s": -1, "add": 1}])
    with pytest.raises(ConfigError, match=r"pool.schedule\[0\]: .*exactly one of remove or add"):
        pool(schedule=[{"at_s": 1}])


def test_trace_section_is_strict():
    p = pool(trace={"name": "us-east-2b", "seconds_per_trace_hour": 30, "start_hour": 2, "min_devices": 2})
    assert p.trace.seconds_per_trace_hour == 30 and p.trace.steps_per_trace_hour is None
    assert pool(trace={"name": "us-west-2a", "steps_per_trace_hour": 12}).trace.min_devices is None
    for trace in ({"name": "us-east-2b"}, {"name": "us-east-2b", "steps_per_trace_hour": 1,
                                           "seconds_per_trace_hour": 1}):
        with pytest.raises(ConfigError, match=r"j.yaml: pool.trace: .*exactly one time base: "
                                              r"seconds_per_trace_hour .* or steps_per_trace_hour"):
            pool(trace=trace)
    with pytest.raises(ConfigError, match=r"j.yaml: pool.trace.name: .*'eu-mars-1a': not a shipped trace"):
        pool(trace={"name": "eu-mars-1a", "steps_per_trace_hour": 1})
    with pytest.raises(ConfigError, match=r"j.yaml: pool.trace.seconds_per_hour: unknown key"):
        pool(trace={"name": "us-east-2b", "seconds_per_hour": 1})
    with pytest.raises(ConfigError, match=r"j.yaml: pool.trace.min_devices"):
        pool(trace={"name": "us-east-2b", "steps_per_trace_hour": 1, "min_devices": 0})
    with pytest.raises(ConfigError, match=r"pool.trace.min_devices: 5 is more than the job's 4 devices"):
        PoolSchedule(pool(trace={"name": "us-east-2b", "steps_per_trace_hour": 1, "min_devices": 5}), 4)


# ---------------------------------------------------------------------------- conversion
@pytest.mark.parametrize("name", ["us-east-2b", "us-west-2a"])
@pytest.mark.parametrize("devices,min_devices", [(2, 1), (3, 1), (4, 2), (16, 1)])
def test_trace_is_scaled_to_the_local_pool(name, devices, min_devices):
    counts = raw_counts(name)
    trace = ScaledTrace(pool(trace={"name": name, "steps_per_trace_hour": 12, "min_devices": min_devices}).trace,
                        devices)
    for i in range(0, len(counts), 7):  # n = clamp(floor(D · a / a_max + 1/2), min_devices, D) per 5-minute sample
        assert trace.devices_at(i / 12) == min(devices, max(min_devices, (2 * devices * counts[i] + 16) // 32)), i
    assert trace.devices_at(len(counts) / 12 + 0.25) == trace.devices_at(0.25)   # repeats past its end
    if devices == 16:   # full size: the trace itself, floored at one device
        assert [trace.devices_at(i / 12) for i in range(100)] == [max(1, c) for c in counts[:100]]


def test_trace_steps_base_gives_events_at_boundaries():
    # us-east-2b from hour 0: 16, 16, 16, 6 (hour 0.25), 6, 6, 6, 16 (hour 0.58), ... of 16 instances
    assert raw_counts("us-east-2b")[:8] == [16, 16, 16, 6, 6, 6, 6, 16]
    schedule = PoolSchedule(pool(trace={"name": "us-east-2b", "steps_per_trace_hour": 4}), 2)
    due = {step: schedule.due(step, 0.0) for step in range(1, 5)}   # boundary before step s: hour s/4
    assert [net_change(d) for d in due.values()] == [(1, 0), (0, 0), (0, 1), (0, 0)]
    assert due[1][0].trace_hour == 0.25 and due[1][0].available_fraction == 0.375 and due[1][0].at_step == 1
    assert due[3][0].trace_hour == 0.5833, "the hour the trace came back, not the boundary's"
    assert "trace us-east-2b hour 0.25: 38% of the spot request available -> 1 of 2 devices" in due[1][0].source
    # start_hour shifts the trace; the pool starts full, so a low start is a removal at the first boundary
    late = PoolSchedule(pool(trace={"name": "us-east-2b", "steps_per_trace_hour": 4, "start_hour": 0.25}), 2)
    first = late.due(1, 0.0)
    assert net_change(first) == (1, 0) and first[0].trace_hour == 0.25


def test_trace_time_base_and_changes_preview():
    trace_cfg = {"name": "us-east-2b", "seconds_per_trace_hour": 60}
    preview = ScaledTrace(pool(trace=trace_cfg).trace, 2).changes(1.0)
    assert [(round(h * 12), n) for h, n in preview] == [(3, 1), (7, 2)]
    schedule = PoolSchedule(pool(trace=trace_cfg), 2)
    assert schedule.due(1, 14.9) == []               # hour 0.248: still full
    removal = schedule.due(2, 20.0)                   # the change came at 15 s; applied at this boundary
    assert net_change(removal) == (1, 0) and removal[0].at_s == 15.0 and "applied at 20.0 s" in removal[0].source
    assert schedule.due(3, 30.0) == []                # no repeat while the trace stays low
    back = schedule.due(4, 80.0)                      # came back at 35 s (hour 0.58)
    assert net_change(back) == (0, 1) and back[0].at_s == 35.0
    # changes that cancel between two boundaries are no event: 16 -> 6 -> 16 within one boundary gap
    quick = PoolSchedule(pool(trace=trace_cfg), 2)
    assert quick.due(1, 40.0) == []


def test_schedule_events_are_due_once_at_or_after_their_time():
    schedule = PoolSchedule(pool(schedule=[{"at_s": 10, "remove": 1}, {"at_step": 3, "add": 2},
                                           {"at_s": 10.5, "add": 1}]), 4)
    assert bool(schedule) and schedule.due(1, 9.99) == []
    first = schedule.due(2, 10.2)
    assert [e.source for e in first] == ["pool.schedule[0] (at_s 10: remove 1)"] and net_change(first) == (1, 0)
    both = schedule.due(3, 11.0)
    assert [e.source for e in both] == ["pool.schedule[1] (at_step 3: add 2)", "pool.schedule[2] (at_s 10.5: add 1)"]
    assert net_change(both) == (0, 3)
    assert schedule.due(3, 99.0) == [] and schedule.due(2, 99.0) == []   # a rewound run does not replay them
    assert not PoolSchedule(PoolConfig(), 4)


# ---------------------------------------------------------------------------- command line
def local_args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["local", "job.yaml", *argv])


def test_command_line_trace_overrides_the_job(tmp_path):
    job = {"name": "j", "models": {"actor": "models/warm", "critic": "/abs/critic"},
           "pool": {"schedule": [{"at_step": 2, "add": 1}],
                    "trace": {"name": "us-west-2a", "seconds_per_trace_hour": 5, "min_devices": 2}}}
    args = local_args("--pool-trace", "us-east-2b", "--trace-hour-steps", "6")
    args.job = str(tmp_path / "job.yaml")
    out = pool_trace_override(args, job)
    assert out["pool"]["trace"] == {"name": "us-east-2b", "min_devices": 2, "steps_per_trace_hour": 6.0}
    assert out["pool"]["schedule"] == job["pool"]["schedule"]
    assert out["models"] == {"actor": str(tmp_path / "models" / "warm"), "critic": "/abs/critic"}
    assert parse_job(out).pool.trace.steps_per_trace_hour == 6
    assert pool_trace_override(local_args(), job) is None
    with pytest.raises(NereusError, match="--pool-trace needs a time base: --trace-hour-s"):
        pool_trace_override(local_args("--pool-trace", "us-east-2b"), {"name": "j"})
    with pytest.raises(NereusError, match="need --pool-trace NAME"):
        pool_trace_override(local_args("--trace-hour-s", "3"), {"name": "j"})
    with pytest.raises(SystemExit):   # one time base only
        local_args("--pool-trace", "us-east-2b", "--trace-hour-s", "3", "--trace-hour-steps", "2")
    line = describe_event({"event": "pool_changed", "step": 3, "joined": [], "leaving": [1], "pool_devices": [0],
                           "sources": ["trace us-east-2b hour 0.25: ..."]})
    assert line.endswith("-> 1 devices [trace us-east-2b hour 0.25: ...]")


# ---------------------------------------------------------------------------- end to end
TRACE_JOB = """
name: e2e-pool-trace
algorithm: grpo
seed: 5
steps: 5
devices: 3
models: {actor: "@WARMSTART@"}
rollout: {prompts_per_step: 3, group_size: 4, max_new_tokens: 12}
train: {global_batch: 12, micro_batch: 2, kl_coef: 0.0}
plan: {default: {tp: 1, pp: 1}}
pool:     # the command line replaces the trace and its time base; min_devices stays
  trace: {name: us-west-2a, seconds_per_trace_hour: 600, min_devices: 2}
  join: immediate   # device 3 joins at the boundary the trace brings it (5 steps leave no time for a background join)
"""


@pytest.mark.slow
def test_local_job_follows_a_compressed_spot_trace(tmp_path):
    """us-east-2b at 6 steps per trace hour on 3 devices, at least 2 (GRPO's concurrent actor and
    reference inference need two): 6 of 16 instances from hour 0.25 (the boundary before step 2,
    hour 0.33: round(3 · 6/16) = 1, floored at 2: device 2 leaves), all 16 again from hour 0.58
    (before step 4, hour 0.67: a new agent's device 3 joins the world; the job uses it when payback
    admission finds that repays the transition over the pool's horizon)."""
    job = tmp_path / "job.yaml"
    job.write_text(TRACE_JOB.replace("@WARMSTART@", str(WARMSTART)))
    run_dir = tmp_path / "run"
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "launcher.cli", "local", str(job), "--run-dir", str(run_dir),
                           "--quiet", "--pool-trace", "us-east-2b", "--trace-hour-steps", "6"],
                          capture_output=True, text=True, timeout=240, cwd=REPO)
    log = run_dir / "logs" / "nereusd.log"
    assert proc.returncode == 0, proc.stdout + proc.stderr + (log.read_text()[-4000:] if log.exists() else "")
    assert "pool trace us-east-2b from hour 0 (6 steps per trace hour), scaled to 3 devices (min 2): " \
           "devices 2 at step 2, 3 at step 4" in proc.stdout
    effective = parse_job(__import__("yaml").safe_load((run_dir / "job.yaml").read_text()))
    assert effective.pool.trace.name == "us-east-2b" and effective.pool.trace.steps_per_trace_hour == 6
    assert effective.pool.trace.min_devices == 2 and effective.pool.trace.seconds_per_trace_hour is None
    events = read_jsonl(run_dir / "events.jsonl")
    changes = [e for e in events if e["event"] == "pool_changed" and "step" in e]
    assert [(c["step"], c["leaving"], c["joined"], c["pool_devices"]) for c in changes] == [
        (1, [2], [], [0, 1]), (3, [], [3], [0, 1, 3])]
    assert "trace us-east-2b hour 0.25" in changes[0]["sources"][0]
    assert "trace us-east-2b hour 0.58" in changes[1]["sources"][0]
    due = [e for e in events if e["event"] == "pool_schedule_due"]
    assert [e["events"][0]["trace_hour"] for e in due] == [0.25, 0.5833] and due[1]["elapsed_s"] > 0
    assert any(e["event"] == "worker_exited" and e["device"] == 2 for e in events)
    records = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4]
    assert sorted(records[2]["peak_memory_bytes"]) == ["0", "1"]
    assert_join_decided(events, records, 3)
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "succeeded"
    print(f"e2e pool trace: {time.monotonic() - start:.1f} s")


def test_pool_command_refuses_a_run_that_is_not_running(tmp_path):
    from launcher import pool_cmd

    with pytest.raises(NereusError, match="no running nereusd"):
        pool_cmd._endpoint(tmp_path)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / "nereusd.json").write_text(json.dumps({"endpoint": "tcp://127.0.0.1:1", "pid": dead.pid}))
    with pytest.raises(NereusError, match=f"nereusd \\(pid {dead.pid}\\) is not running"):
        pool_cmd._endpoint(tmp_path)
    (tmp_path / "summary.json").write_text(json.dumps({"status": "succeeded"}))
    with pytest.raises(NereusError, match="the job has ended \\(status succeeded\\)"):
        pool_cmd._endpoint(tmp_path)


def test_trace_floor_defaults_to_the_fewest_devices_the_job_runs_on():
    from nereusd.config.pool_schedule import job_min_devices

    assert job_min_devices("grpo", reward_model=False, asynchronous=False) == 2   # actor + reference inference
    assert job_min_devices("ppo", reward_model=True, asynchronous=False) == 4     # actor, ref, critic, reward
    assert job_min_devices("grpo", reward_model=False, asynchronous=True) == 3    # + generation alongside
    trace = pool(trace={"name": "us-west-2a", "steps_per_trace_hour": 2}).trace
    assert ScaledTrace(trace, 4, job_min_devices=2).min_devices == 2
    assert min(n for _, n in ScaledTrace(trace, 4, job_min_devices=2).changes(48.0)) >= 2
    explicit = pool(trace={"name": "us-west-2a", "steps_per_trace_hour": 2, "min_devices": 1}).trace
    assert ScaledTrace(explicit, 4, job_min_devices=2).min_devices == 1


def test_an_added_agent_holds_at_most_one_node_of_the_site(tmp_path):
    """``add: 10000`` once spawned 246 workers before the machine gave up; it is refused before
    any process starts, and ``nereus-launch pool --add`` is bounded by the running job's node size."""
    import os

    from launcher.pool_cmd import run as pool_run
    from nereusd.config.pool_schedule import schedule_for
    from nereusd.config.resolve import load_and_resolve

    job = tmp_path / "job.yaml"
    job.write_text(f"models: {{actor: {REPO / 'examples' / 'models' / 'counting-warmstart'}}}\n"
                   "pool: {schedule: [{at_step: 2, add: 4}, {at_step: 3, add: 10000}]}\n")
    with pytest.raises(ConfigError, match=r"pool.schedule\[1\].add: 10000 devices, but a node of site 'local' has 4"):
        schedule_for(load_and_resolve(job))
    run = tmp_path / "run"
    run.mkdir()
    (run / "nereusd.json").write_text(json.dumps({"endpoint": "tcp://127.0.0.1:1", "pid": os.getpid(), "curve": False,
                                                  "max_devices_per_agent": 4}))
    with pytest.raises(NereusError, match=r"--add: 10000 devices, but an agent may register at most 4"):
        pool_run(argparse.Namespace(run_dir=str(run), remove=None, add=10000, timeout_s=1.0))


def test_pool_max_devices_defaults_to_four_times_the_job_or_its_allocation_and_is_not_below_it(tmp_path):
    from nereusd.config.resolve import load_and_resolve

    job = tmp_path / "job.yaml"
    model = REPO / "examples" / "models" / "counting-warmstart"
    job.write_text(f"models: {{actor: {model}}}\ndevices: 3\n")
    assert load_and_resolve(job).pool_limit() == 12
    # two Slurm nodes of 4 GPUs register 8 devices although the job uses 3: the default scales with them
    assert load_and_resolve(job).pool_limit(launch_devices=8) == 32
    job.write_text(f"models: {{actor: {model}}}\ndevices: 3\npool: {{max_devices: 5}}\n")
    assert load_and_resolve(job).pool_limit() == 5
    assert load_and_resolve(job).pool_limit(launch_devices=8) == 5
    job.write_text(f"models: {{actor: {model}}}\ndevices: 3\npool: {{max_devices: 2}}\n")
    with pytest.raises(ConfigError, match=r"pool.max_devices: 2 is below the job's 3 devices"):
        load_and_resolve(job)
