"""nereusd's metrics for people and their dashboards: a Prometheus endpoint and TensorBoard scalars.

- **Prometheus** (``prometheus_client``): nereusd serves ``http://<host>:<port>/metrics``
  (``--metrics-host``, default the loopback address; ``--metrics-port``, default a free port;
  ``nereusd.json`` says which). No authentication, as is usual for scrape targets: bind it
  only where your Prometheus can reach it. Series (all prefixed ``nereus_``):

  ==============================================  ===============================================
  ``step``                                         last step completed
  ``step_latency_seconds`` (histogram)             wall time per step
  ``stage_latency_seconds{stage}``                 generation, inference, training … of the last step
  ``model_stage_seconds{model_stage}``             per model-stage, last step
  ``tokens_per_second``, ``reward_mean``,          of the last step
  ``response_length_mean``
  ``plan_info{model_stage,tp,pp,dp,devices,…}``    1 for the plan running now
  ``pool_devices``, ``agents``                     the registry now
  ``pending_tasks``                                tasks dispatched and not yet answered (queue depth)
  ``refused_messages``, ``refused_connections``    totals since start
  ``events_total{event}``                          every journal event by kind: ``admission``,
                                                   ``transition`` (switches), ``fallback``
                                                   (restarts), ``device_lost`` …
  ==============================================  ===============================================

- **TensorBoard** (``tensorboardX``, no TensorFlow or torch in nereusd): every number of a
  ``metrics.jsonl`` line, nested keys joined with ``/`` (``stage_latency_s/generation``,
  ``train/actor/loss``), at the step's index, in ``RUN_DIR/tensorboard/``.
- **Weights & Biases, MLflow**, when the job's ``loggers:`` names them: the same scalars at the
  same steps, from a thread of their own (:mod:`nereusd.loggers`). A tracker that fails mid-run
  is logged once and dropped.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from nereusd.loggers import TrackerFeed

log = logging.getLogger(__name__)

TENSORBOARD_DIR = "tensorboard"
STEP_BUCKETS_S = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 50, 100, 250, 500, 1000)


def scalars(record: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, float]]:
    """``(tag, value)`` for every finite-or-not number in a ``metrics.jsonl`` line, nested dicts
    flattened with ``/``; the plan, strings and booleans are left out."""
    for key, value in record.items():
        tag = f"{prefix}{key}"
        if key == "plan":
            continue
        if isinstance(value, dict):
            yield from scalars(value, f"{tag}/")
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            yield tag, float(value)


class Observer:
    """The Prometheus series and the TensorBoard writer of one nereusd.

    Args:
        run_dir: the run directory (TensorBoard files go to ``RUN_DIR/tensorboard``).
        control: the control plane, read for the registry gauges (``None`` in tests).
        metrics_host, metrics_port: where to serve ``/metrics``; port 0 picks a free one,
            ``None`` serves nothing.
        tensorboard: write TensorBoard scalars.
        trackers: started W&B / MLflow runs (:func:`nereusd.loggers.open_trackers`), closed by
            :meth:`close`.

    Raises:
        OSError: the metrics address cannot be bound.
    """

    def __init__(self, run_dir: str | Path, control=None, *, metrics_host: str = "127.0.0.1",
                 metrics_port: int | None = 0, tensorboard: bool = True, trackers: list | None = None) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.step = Gauge("nereus_step", "Last step completed", registry=r)
        self.step_latency = Histogram("nereus_step_latency_seconds", "Wall time per step", buckets=STEP_BUCKETS_S,
                                      registry=r)
        self.stage_latency = Gauge("nereus_stage_latency_seconds", "Stage latency of the last step", ["stage"],
                                   registry=r)
        self.model_stage = Gauge("nereus_model_stage_seconds", "Model-stage time of the last step", ["model_stage"],
                                 registry=r)
        self.tokens_per_s = Gauge("nereus_tokens_per_second", "Generated tokens per second, last step", registry=r)
        self.reward = Gauge("nereus_reward_mean", "Mean reward of the last step", registry=r)
        self.length = Gauge("nereus_response_length_mean", "Mean response length of the last step (tokens)",
                            registry=r)
        self.plan = Gauge("nereus_plan_info", "1 for each model-stage of the plan running now",
                          ["model_stage", "tp", "pp", "dp", "micro_batch", "zero_stage", "devices"], registry=r)
        self.events = Counter("nereus_events", "Journal events by kind", ["event"], registry=r)
        self._plan: dict[str, Any] | None = None
        if control is not None:
            Gauge("nereus_pool_devices", "Devices of registered agents", registry=r).set_function(
                lambda: len(control.devices()))
            Gauge("nereus_agents", "Registered agents", registry=r).set_function(lambda: len(control.agents))
            Gauge("nereus_pending_tasks", "Tasks dispatched and not answered", registry=r).set_function(
                lambda: control.pending_tasks)
            Gauge("nereus_refused_messages", "Messages refused since start", registry=r).set_function(
                lambda: control.refused_messages)
            Gauge("nereus_refused_connections", "CURVE handshakes refused since start", registry=r).set_function(
                lambda: control.refused_connections)
        self._server = None
        self.endpoint: str | None = None
        if metrics_port is not None:
            self._server, _ = start_http_server(metrics_port, addr=metrics_host, registry=r)
            host = f"[{metrics_host}]" if ":" in metrics_host else metrics_host
            self.endpoint = f"http://{host}:{self._server.server_port}/metrics"
        self.feed = TrackerFeed(trackers) if trackers else None
        """The W&B / MLflow runs, fed from a thread of their own (:class:`~nereusd.loggers.TrackerFeed`)."""
        self._writer = None
        if tensorboard:
            from tensorboardX import SummaryWriter

            self._writer = SummaryWriter(str(Path(run_dir) / TENSORBOARD_DIR))

    def on_record(self, record: dict[str, Any]) -> None:
        """A :class:`~nereusd.journal.Journal` listener: count an event, publish a step's metrics."""
        if "event" in record:
            self.events.labels(event=str(record["event"])).inc()
        else:
            self.on_step(record)

    def on_step(self, record: dict[str, Any]) -> None:
        """Publish one step's ``metrics.jsonl`` line."""
        self.step.set(record["step"])
        self.step_latency.observe(record["step_latency_s"])
        for stage, seconds in record.get("stage_latency_s", {}).items():
            self.stage_latency.labels(stage=stage).set(seconds)
        for ms, seconds in record.get("model_stage_s", {}).items():
            self.model_stage.labels(model_stage=ms).set(seconds)
        self.tokens_per_s.set(record.get("tokens_per_s", 0.0))
        self.reward.set(record.get("reward_mean", 0.0))
        self.length.set(record.get("response_length_mean", 0.0))
        if record.get("plan") != self._plan:
            self._plan = record.get("plan")
            self.plan.clear()
            for ms, cand in (self._plan or {}).items():
                self.plan.labels(model_stage=ms, tp=cand.get("tp", 1), pp=cand.get("pp", 1), dp=cand.get("dp", 1),
                                 micro_batch=cand.get("micro_batch", ""), zero_stage=cand.get("zero_stage", 0),
                                 devices=",".join(str(d) for d in cand.get("devices", []))).set(1)
        values = dict(scalars(record))
        if self._writer is not None:
            for tag, value in values.items():
                self._writer.add_scalar(tag, value, global_step=record["step"])
            self._writer.flush()
        if self.feed is not None:
            self.feed.log(record["step"], values)

    def close(self, ok: bool = True) -> None:
        """Stop serving, close the TensorBoard files, end the trackers' runs (finished when
        ``ok``, else failed)."""
        if self.feed is not None:
            self.feed.close(ok)
            self.feed = None
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None
