"""nereusd's Prometheus endpoint and TensorBoard scalars (nereusd/daemon/observe.py), fed
through the journal as nereusd feeds them, read back over HTTP and from the event file."""

from __future__ import annotations

import struct
import urllib.request

import pytest

from nereusd.daemon.control_plane import ControlPlane
from nereusd.daemon.observe import TENSORBOARD_DIR, Observer, scalars
from nereusd.journal import Event, Journal
from tests.support.agents import fake_agent

RECORD = {"step": 3, "step_latency_s": 1.5, "stage_latency_s": {"generation": 1.0, "training": 0.4},
          "model_stage_s": {"actor/training": 0.4}, "reward_mean": 2.5, "response_length_mean": 11.0,
          "tokens_per_s": 120.0, "peak_memory_bytes": {"0": 1000}, "train/actor/loss": -0.25,
          "plan": {"actor/training": {"tp": 1, "pp": 1, "dp": 2, "devices": [0, 1], "micro_batch": 2,
                                      "recompute": False, "zero_stage": 1}}}


def test_scalars_flatten_a_metrics_line():
    tags = dict(scalars(RECORD))
    assert tags["stage_latency_s/generation"] == 1.0 and tags["train/actor/loss"] == -0.25
    assert tags["peak_memory_bytes/0"] == 1000.0 and not any(t.startswith("plan") for t in tags)


def test_prometheus_endpoint_and_tensorboard_scalars(tmp_path):
    control = ControlPlane()
    agent = fake_agent(control, "n0", 2)
    journal = Journal(tmp_path)
    observer = Observer(tmp_path, control)
    journal.listeners.append(observer.on_record)
    try:
        journal.metric(RECORD)
        journal.event(Event.TRANSITION, {"ops": 3})
        journal.event(Event.TRANSITION, {"ops": 1})
        assert observer.endpoint.startswith("http://127.0.0.1:")
        text = urllib.request.urlopen(observer.endpoint, timeout=5).read().decode()
    finally:
        observer.close()
        journal.close()
        agent.close()
        control.close()
    series = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line and not line.startswith("#")}
    assert series["nereus_step"] == 3 and series["nereus_tokens_per_second"] == 120.0
    assert series['nereus_stage_latency_seconds{stage="generation"}'] == 1.0
    assert series["nereus_step_latency_seconds_count"] == 1 and series["nereus_step_latency_seconds_sum"] == 1.5
    assert series['nereus_events_total{event="transition"}'] == 2
    assert series["nereus_pool_devices"] == 2 and series["nereus_agents"] == 1 and series["nereus_pending_tasks"] == 0
    assert series['nereus_plan_info{devices="0,1",dp="2",micro_batch="2",model_stage="actor/training",pp="1",'
                  'tp="1",zero_stage="1"}'] == 1
    events = _tensorboard_scalars(tmp_path / TENSORBOARD_DIR)
    assert events[("train/actor/loss", 3)] == -0.25 and events[("stage_latency_s/training", 3)] == pytest.approx(0.4)   # float32


def _tensorboard_scalars(directory) -> dict[tuple[str, int], float]:
    """``{(tag, step): value}`` from the TFRecord event files tensorboardX wrote (length, CRC,
    ``Event`` proto, CRC per record)."""
    from tensorboardX.proto.event_pb2 import Event as EventProto

    out = {}
    for path in directory.iterdir():
        data = path.read_bytes()
        pos = 0
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos:pos + 8])
            event = EventProto.FromString(data[pos + 12:pos + 12 + length])
            pos += 12 + length + 4
            for value in event.summary.value:
                out[(value.tag, event.step)] = value.simple_value
    return out
