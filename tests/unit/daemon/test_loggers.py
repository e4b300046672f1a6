"""The optional experiment trackers (nereusd/loggers.py): W&B in offline mode and MLflow on a
local file store, fed through the journal as nereusd feeds them, and read back from what they
persisted (W&B's run file, MLflow's store) — including a resumed nereusd continuing the same runs.
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import pytest

from nereusd.config.job import LoggersConfig
from nereusd.config.resolve import load_and_resolve
from nereusd.daemon.observe import Observer
from nereusd.errors import ConfigError
from nereusd.journal import Journal
from nereusd.loggers import LOGGERS_FILE, open_trackers

wandb = pytest.importorskip("wandb", reason="`make install` installs the loggers extra")
mlflow = pytest.importorskip("mlflow", reason="`make install` installs the loggers extra")

RECORD = {"step": 3, "step_latency_s": 1.5, "stage_latency_s": {"generation": 1.0}, "reward_mean": 2.5,
          "train/actor/loss": -0.25, "plan": {"actor/training": {"tp": 1, "dp": 2}}}
JOB = """steps: 2
models: {actor_config: {vocab_size: 16, hidden_size: 32, intermediate_size: 64, num_layers: 2, num_heads: 4,
                        num_kv_heads: 2, max_position: 64}}
rollout: {prompts_per_step: 2, group_size: 2, max_new_tokens: 8}
train: {global_batch: 4, micro_batch: 2}
"""
JOB_CONFIG = {"name": "track", "train": {"actor_lr": 1e-6, "global_batch": 8}, "steps": 5}


@pytest.fixture
def config(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")   # MLflow 3 wants a database; its file store suffices here
    monkeypatch.setenv("WANDB_SILENT", "true")
    return LoggersConfig.model_validate({"wandb": {"project": "nereus-test", "mode": "offline"},
                                         "mlflow": {"tracking_uri": (tmp_path / "mlruns").as_uri()}})


def _run(run_dir: Path, config: LoggersConfig, records: list[dict], ok: bool) -> dict[str, str]:
    """One nereusd's life for its trackers: open (or resume), journal ``records``, close."""
    trackers = open_trackers(config, run_dir, "track", JOB_CONFIG)
    journal = Journal(run_dir)
    observer = Observer(run_dir, None, metrics_port=None, tensorboard=False, trackers=trackers)
    journal.listeners.append(observer.on_record)
    try:
        for record in records:
            journal.metric(record)
    finally:
        observer.close(ok=ok)
        journal.close()
    return {t.name: t.run_id for t in trackers}


def test_every_scalar_reaches_both_trackers_and_a_resume_continues_their_runs(tmp_path, config):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    first = _run(run_dir, config, [RECORD], ok=True)
    assert json.loads((run_dir / LOGGERS_FILE).read_text()) == first

    client = mlflow.tracking.MlflowClient(tracking_uri=config.mlflow.tracking_uri)
    run = client.get_run(first["mlflow"])
    assert run.info.status == "FINISHED" and run.info.run_name == "track"
    assert run.data.params["train.actor_lr"] == "1e-06" and run.data.params["steps"] == "5"
    assert [(m.step, m.value) for m in client.get_metric_history(first["mlflow"], "train/actor/loss")] == [(3, -0.25)]
    assert not any(k.startswith("plan") for k in run.data.metrics)
    history = [{k: v for k, v in row.items() if k != "_step"} for row in _wandb_history(run_dir, first["wandb"])]
    assert history == [{"step": 3, "step_latency_s": 1.5, "stage_latency_s/generation": 1.0,
                        "reward_mean": 2.5, "train/actor/loss": -0.25}]

    # nereusd resumed on the same run directory: same runs; step 3 runs again (after the
    # checkpoint), then step 4, and this time the job fails
    again = _run(run_dir, config, [dict(RECORD, reward_mean=2.75), dict(RECORD, step=4, reward_mean=3.0)], ok=False)
    assert again == first
    assert client.get_run(first["mlflow"]).info.status == "FAILED"
    assert [(m.step, m.value) for m in client.get_metric_history(first["mlflow"], "reward_mean")] == [
        (3, 2.5), (3, 2.75), (4, 3.0)]
    assert [(h["step"], h["reward_mean"]) for h in _wandb_history(run_dir, first["wandb"])] == [
        (3, 2.5), (3, 2.75), (4, 3.0)]   # the re-run step is kept, not dropped as going back
    # W&B drops a step below its own counter (online, the server's); the job's step is the x axis instead
    assert {"*": "step"} in _wandb_history(run_dir, first["wandb"], record_type="metric")


def test_a_tracker_that_fails_mid_run_is_dropped_and_the_rest_go_on(tmp_path, config, caplog):
    class Outage:   # a tracker whose server went away after it started
        name, run_id, closed = "mlflow", "r1", None

        def log(self, step, values):
            raise ConnectionError("server unreachable")

        def close(self, ok):
            self.closed = ok

    outage = Outage()
    trackers = [outage] + open_trackers(LoggersConfig.model_validate({"mlflow": config.mlflow.model_dump()}),
                                        tmp_path, "track", JOB_CONFIG)
    observer = Observer(tmp_path, None, metrics_port=None, tensorboard=False, trackers=trackers)
    feed = observer.feed
    observer.on_step(RECORD)
    observer.on_step(dict(RECORD, step=4))
    run_id = trackers[1].run_id
    observer.close(ok=True)
    assert feed.trackers == trackers[1:]
    assert sum("loggers.mlflow failed at step 3" in r.message for r in caplog.records) == 1
    client = mlflow.tracking.MlflowClient(tracking_uri=config.mlflow.tracking_uri)
    assert [m.step for m in client.get_metric_history(run_id, "reward_mean")] == [3, 4]
    assert outage.closed is None   # dropped: not asked again


def test_a_tracker_that_cannot_start_is_a_config_error_naming_it(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    config = LoggersConfig.model_validate({"mlflow": {"tracking_uri": "http://127.0.0.1:9"}})   # nothing listens
    with pytest.raises(ConfigError, match=r"loggers\.mlflow: cannot start a run"):
        open_trackers(config, tmp_path, "track", JOB_CONFIG)
    assert not (tmp_path / LOGGERS_FILE).exists()


def test_a_job_naming_a_tracker_that_is_not_installed_is_refused(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    job = tmp_path / "job.yaml"
    job.write_text(JOB + "loggers: {wandb: {project: p}}\n")
    with pytest.raises(ConfigError, match=r"job.yaml: loggers\.wandb: the wandb package is not installed here"):
        load_and_resolve(job)
    job.write_text(JOB + "loggers: {wandb: {mode: offline}}\n")
    with pytest.raises(ConfigError, match=r"loggers\.wandb\.project"):
        load_and_resolve(job)


def _wandb_history(run_dir: Path, run_id: str, record_type: str = "history") -> list[dict]:
    """Every history row (``record_type="history"``; ``"metric"``: every metric definition, as
    ``{glob_name or name: step_metric}``) of W&B's offline run files of ``run_id``, in order. The
    ``.wandb`` file is a LevelDB log (after a 7-byte header): 32 KiB blocks of records
    ``crc32c u32, length u16, type u8`` (1 full, 2 first, 3 middle, 4 last), each a
    ``wandb_internal_pb2.Record``."""
    from wandb.proto import wandb_internal_pb2 as pb

    rows = []
    # a run resumed in the same second as it started gets the directory name with "-1" appended
    # (W&B 0.31): that one is later, and sorts after it
    paths = [p for p in run_dir.glob(f"wandb/offline-run-*-{run_id}*/run-{run_id}.wandb")
             if re.fullmatch(rf"offline-run-\d{{8}}_\d{{6}}-{run_id}(-\d+)?", p.parent.name)]
    for path in sorted(paths):
        data, pos, block, pending = path.read_bytes(), 7, 32768, b""
        assert data[:4] == b":W&B"
        while pos + 7 <= len(data):
            if block - pos % block < 7:   # a block's tail too short for a header is padding
                pos += block - pos % block
                continue
            _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
            if kind == 0:
                break
            chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
            pending = chunk if kind in (1, 2) else pending + chunk
            if kind in (1, 4):
                record = pb.Record()
                record.ParseFromString(pending)
                if record_type == "metric" and record.WhichOneof("record_type") == "metric":
                    rows.append({record.metric.glob_name or record.metric.name: record.metric.step_metric})
                elif record_type == "history" and record.WhichOneof("record_type") == "history":
                    row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
                    rows.append({k: v for k, v in row.items() if k not in ("_timestamp", "_runtime")})
    return rows


def test_a_hanging_tracker_holds_up_nothing_and_a_full_queue_drops_steps_for_the_trackers_only(tmp_path, caplog):
    """The trackers run on a thread of their own: a server that hangs (here for 2 s per call) does
    not delay the step that the control plane's thread publishes; past the queue's bound, steps are
    dropped for the trackers (counted, logged once), and closing waits a bounded time."""
    import threading
    import time

    from nereusd.loggers import TrackerFeed

    release = threading.Event()

    class Hanging:
        name, run_id = "mlflow", "r2"
        logged: list[int] = []

        def log(self, step, values):
            release.wait(2.0)
            self.logged.append(step)

        def close(self, ok):
            pass

    hanging = Hanging()
    feed = TrackerFeed([hanging], max_steps=2)
    start = time.monotonic()
    for step in range(6):
        feed.log(step, {"reward_mean": 1.0})
    assert time.monotonic() - start < 0.5   # the caller never waits on the server
    assert feed.dropped_steps >= 3 and sum("fall behind" in r.message for r in caplog.records) == 1
    release.set()
    feed.close(ok=True, timeout_s=10)
    assert hanging.logged[0] == 0 and len(hanging.logged) == 6 - feed.dropped_steps
